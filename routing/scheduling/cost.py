"""The one cost model of the strategies that use the cache (`kv-sync`'s `ttft` scorer, `slo`): per candidate
pod, this request's expected time to first token there,

    TTFT = (prefill queued on the pod + this request's uncached prompt tokens) / the pod's prefill rate
           + the pod's TTFT overhead at its running batch, this request included,

the uncached tokens from the event-fed index (capped at the prompt's length - 1, as vLLM computes the last
token always), the rate and the overhead learned per engine from observed responses (routing.learning.profiles:
decayed, and drifting back to the priors while not re-observed, so a bad early estimate heals). Without observed
responses the priors answer: the configured prefill rate and no overhead.

Load weighs only as far as it costs: an engine prefills one prompt at a time, so what waits ahead of this
request on a pod is its queue, and what a batch costs beyond that shows in the learned overhead. A pod whose
lane is free and whose batch costs nothing measurable is as good as an idle one, so requests pack where
their prefix is; once the queue or the batch costs time, they spread.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from routing.learning.profiles import EngineProfiles
from routing.pods import Pod
from routing.scheduling.scoring import PickContext, Scorer
from routing.scheduling.scorers import (MediumWeights, PrefillBacklog, PrefixSource, _relative, index_matches,
                                        prompt_block_size, running_prompts_held, uncached_tokens)
from routing.state.prompts import RunningPrompts

UNCACHED = "\x00uncached"  # ctx.state key: the uncached tokens per candidate, looked up once per pick


class PromptCache:
    """Per candidate, this request's prompt tokens the pod does not hold per the event-fed index: blocks on
    slower media count partly (GPU 1.0, CPU 0.8 by default); with `prompts`, less what it is computing for this
    gateway's running requests (routing.state.prompts, as the `prefix` scorer counts them). Fills ctx.matched
    and ctx.total_blocks (the Decision reports them; the `affinity` scorer reads them) and keeps its answer in
    ctx.state, so the scorers of one pick ask the index once."""

    def __init__(self, index: PrefixSource, medium_weights: Mapping[str, float] | None = None,
                 other_medium_weight: float = 0.8, prompts: RunningPrompts | None = None) -> None:
        self._index = index
        self._prompts = prompts  # this gateway's running requests' prompts: held by their pods too
        self._media = MediumWeights(medium_weights, other_medium_weight)
        size = getattr(index, "block_size", None)  # optional in PrefixSource
        self._index_block_size = size if callable(size) else None

    def weighted_blocks(self, blocks: int, by_medium: Mapping[str, int]) -> float:
        return self._media.weighted_blocks(blocks, by_medium)

    def uncached(self, ctx: PickContext, pods: Sequence[Pod]) -> dict[str, float]:
        """Uncached prompt tokens per pod; {} when the request has no tokens or the index knows no block of it."""
        known = ctx.state.get(UNCACHED)
        if known is not None:
            return known
        tokens = ctx.request.token_ids
        out: dict[str, float] = {}
        ctx.state[UNCACHED] = out
        if not tokens:
            return out
        names = [p.name for p in pods]
        matches = index_matches(self._index, ctx, tokens, pods, names)
        total = max([m.total_blocks for m in matches.values()], default=0)
        if total <= 0:
            return out
        n = len(tokens)
        bs = prompt_block_size(self._index_block_size, ctx.base_model, n, total)
        out.update(running_prompts_held(self._prompts, ctx, pods, n, bs,
                                        uncached_tokens(matches, names, n, bs, self._media, ctx.matched, 1.0)))
        if total > ctx.total_blocks:
            ctx.total_blocks = total
        return out


@dataclass(frozen=True, slots=True)
class TTFTEstimate:
    """One pod's expected time to first token for one request, in its parts."""

    rate: float  # the pod's prefill rate, tokens/s
    queued: float  # prompt tokens waiting for the pod's prefill lane ahead of this request
    uncached: float  # this request's prompt tokens the pod does not hold
    overhead: float  # seconds beyond queue and prefill, at the pod's running batch with this request

    @property
    def work_s(self) -> float:
        """The wait for the lane and this request's own prefill."""
        return (self.queued + self.uncached) / self.rate

    @property
    def ttft_s(self) -> float:
        return self.work_s + self.overhead


def estimate(profiles: EngineProfiles, pod: Pod, model: str, *, queued: float, uncached: float, running: int,
             prompt_tokens: int = 0, output_tokens: float = 1.0) -> TTFTEstimate:
    """The model for one pod: `queued` tokens ahead, `uncached` of this request's, `running` requests there
    before this one. Rates and overheads are learned per engine (`pod.pod_name`: a data-parallel rank's
    engine is its pod's)."""
    rate = profiles.prefill_rate(pod.pod_name, model, prompt_tokens, output_tokens)
    return TTFTEstimate(rate, queued, uncached, profiles.ttft_overhead(pod.pod_name, running + 1))


class TTFTScorer(Scorer):
    """`kv-sync`'s cost: the expected TTFT on each pod (`estimate`), its queue this gateway's prefill backlog
    (PrefillBacklog: the uncached tokens it sent the pod, draining at the pod's learned rate), plus a copy
    charge: the prefill time of the prompt tokens the best-holding pod holds and this one does not (they would
    take the lane from whoever follows, and a second copy of the prefix takes cache from other prefixes). The
    cheapest pod scores 1; the others fall linearly with their extra cost, two of this prompt's prefills at
    the prior rate (or the spread, if larger) giving 0. Nothing for a request without tokens or when the index
    knows no block of it. Tells the profiles what it predicted (EngineProfiles.expect), so an observed
    response teaches the pod's overhead."""

    name = "ttft"
    needs_tokens = True

    def __init__(self, cache: PromptCache, profiles: EngineProfiles, backlog: PrefillBacklog) -> None:
        self.cache = cache
        self.profiles = profiles
        self.backlog = backlog
        self.last: dict[str, TTFTEstimate] = {}  # the last request's estimates per pod (tests, debugging)

    def score(self, ctx: PickContext, pods: Sequence[Pod]) -> dict[str, float]:
        uncached = self.cache.uncached(ctx, pods)
        if not uncached:
            return {}
        n = len(ctx.request.token_ids or ())
        fewest = min(uncached.values())
        now = self.backlog.now()
        running = ctx.running.get
        plans: dict[str, TTFTEstimate] = {}
        costs: dict[str, float] = {}
        for p in pods:
            u = uncached.get(p.name)
            if u is None:
                continue
            est = plans[p.name] = estimate(self.profiles, p, ctx.base_model, queued=self.backlog.get(p.name, now),
                                           uncached=u, running=running(p.name, 0), prompt_tokens=n)
            costs[p.name] = est.ttft_s + (u - fewest) / est.rate
        self.last = plans
        ctx.state[self.name] = plans
        return _relative(costs, 2.0 * n / self.profiles.prior_rate)

    def picked(self, ctx: PickContext, pod: Pod) -> None:
        plan = ctx.state.get(self.name, {}).get(pod.name)
        if plan is None:
            return
        self.backlog.add(pod.name, plan.uncached)
        self.profiles.expect(ctx.request.request_id, pod.pod_name, plan.work_s, plan.overhead, pod.name, plan.uncached)
