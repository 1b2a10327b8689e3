"""The `slo` scorer: per pod, this request's predicted time to first token and time per output token
against its targets (headers `x-slo-ttft-ms` / `x-slo-tpot-ms`, else the model's defaults).

- TTFT, the one cost model (routing.scheduling.cost, as kv-sync's `ttft` scorer): (the pod's queued prefill + this request's uncached prompt tokens, exactly, from the prefix
  index) / the pod's prefill rate (routing.learning.profiles), plus the pod's learned TTFT overhead at its
  running batch (routing.learning.profiles: what observed TTFTs of earlier slo picks showed beyond that). The queue, when responses are observed
  (`Capacity.prefill` set), is exact and shared: every gateway adds a request's uncached tokens to
  the pod's count (RunningCounts: through Redis between replicas) when it routes it and takes them
  off when its first token arrives (`Capacity.first_token`). Without it, the queue is what this
  gateway sent the pod uncached, draining at the prefill rate.
- TPOT = the pod's decode step time at its effective batch: the requests running there (every
  gateway's count), each weighted by how much of this request's decode it is predicted to overlap,
  from its predicted output length (routing.learning.predictor); this request's own output is predicted too.
A pod predicted safely within both targets (each prediction, the TTFT's with the copy below, at most
`safe` of its target: no SLO at risk there) scores 1: among those the `slo` strategy's other scorers,
kv-sync's, choose, so where no SLO is at risk slo keeps kv-sync's hit rate (bench routing, issue 26:
most headroom alone took the least loaded pod by TPOT headroom, 82.7% against kv-sync's 91.8% on W1
behind two replicas, 1.1-1.6 points below it on five other cells). A pod meeting both otherwise scores
0.5 + 0.5 x its headroom (the smaller of 1 - predicted/target, the TTFT's charged a copy: the prefill
time of the prompt tokens the best-matched pod holds and this one does not, which cost cache and the
lane of whoever follows; at least 0.001); one missing either scores 0.5 / (1 + its worst relative
violation): the max-score picker takes the pod with the most headroom, else the least violation.

One fast lane: an engine prefills one prompt at a time, first come first served, so a long prompt
holds its pod's lane for its whole prefill and every request queued behind it waits that long. A
request whose own prefill would take at least half the tightest TTFT target the model's traffic
carried lately (`Capacity.tightest`, over `tight_window_s`), and whose own target is looser than
that, leaves the pod with the least queued prefill (the fleet's fastest lane) to the tight
requests when another pod meets its targets: that pod scores 0.5, below every pod meeting them
with headroom, above every pod missing them. Greedy most-headroom sent each long document to the
emptiest lane, the one the next short chat needed; on W6 (bench routing, 3 seeds) keeping that
lane took slo's attainment from 75.8% to 86.0% (chats 71.3 -> 84.5%, documents 93.9 -> 92.3%).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from routing.pods import Pod
from routing.learning.predictor import OutputPredictor
from routing.learning.profiles import EngineProfiles
from routing.scheduling.cost import PromptCache, estimate
from routing.state.prompts import RunningPrompts
from routing.scheduling.scorers import PrefixSource
from routing.scheduling.scoring import PickContext, Scorer


DONE = "\x00prefilled"  # the prefill counts' key suffix for a pod's tokens prefilled so far


def parse_targets(text: str, source: str = "KVGATE_SLO_TARGETS") -> dict[str, tuple[float, float]]:
    """`model=ttft_ms/tpot_ms,...` (`*` for every other model) -> model -> (ttft s, tpot s)."""
    out: dict[str, tuple[float, float]] = {}
    for item in filter(None, (i.strip() for i in text.split(","))):
        model, eq, rest = item.partition("=")
        ttft, slash, tpot = rest.partition("/")
        try:
            t1, t2 = float(ttft), float(tpot)
        except ValueError:
            t1 = t2 = -1.0
        if not eq or not slash or not model.strip() or not (t1 > 0 and t2 > 0):
            raise ValueError(f"{source}: {item!r}: expected <model or *>=<ttft ms>/<tpot ms>, both positive")
        out[model.strip()] = (t1 / 1000.0, t2 / 1000.0)
    return out


@dataclass
class Capacity:
    """What the slo scorer reads: engine profiles, output prediction and default targets."""

    profiles: EngineProfiles
    predictor: OutputPredictor
    targets: Mapping[str, tuple[float, float]] = field(default_factory=dict)  # model (or *) -> (ttft s, tpot s)
    default_targets: tuple[float, float] = (1.0, 0.1)
    clock: Callable[[], float] = time.monotonic
    prefill: Any = None  # RunningCounts of uncached tokens routed and not yet at their first token, per pod
    pending: dict[str, tuple[str, int]] = field(default_factory=dict)  # request id -> (pod, tokens added)
    # per pod: when its prefill lane last started on a prompt as far as this gateway can tell (some
    # gateway saw a first token there: the pod's shared count of prefilled tokens moved; or the queue
    # grew from empty); the head is that far into its prefill
    marks: dict[str, float] = field(default_factory=dict)
    seen: dict[str, tuple[int, int]] = field(default_factory=dict)  # per pod: (queue, prefilled) when last read
    tight_window_s: float = 60.0  # how long a request's TTFT target counts toward its model's tightest
    recent: dict[str, dict[float, float]] = field(default_factory=dict)  # model -> TTFT target -> last seen

    def replica(self) -> "Capacity":
        """Another gateway replica's view: the shared parts (profiles, prediction, the prefill counts)
        the same objects, this replica's own requests and readings new."""
        return dataclasses.replace(self, pending={}, marks={}, seen={}, recent={})

    def tightest(self, model: str, ttft_s: float, now: float) -> float:
        """The tightest TTFT target among the model's requests of the last `tight_window_s` (this one's counted)."""
        seen = self.recent.setdefault(model, {})
        seen[ttft_s] = now
        if len(seen) > 64:  # targets from headers may vary freely: keep the latest few
            for t in sorted(seen, key=seen.__getitem__)[:len(seen) - 64]:
                del seen[t]
        horizon = now - self.tight_window_s
        return min(t for t, at in seen.items() if at >= horizon)

    def queue(self, pod: str, tokens: int, request_id: str) -> None:
        """A routed request's uncached tokens join its pod's shared prefill queue."""
        if self.prefill is None or tokens <= 0 or not request_id:
            return
        if request_id in self.pending:  # routed again (a retried pick): the first one's tokens leave
            self.first_token(request_id)
        if len(self.pending) > 100_000:  # first tokens never reported (a bug elsewhere): do not grow
            self.pending.clear()
        self.prefill.add(pod, tokens)
        self.pending[request_id] = (pod, tokens)

    def first_token(self, request_id: str) -> None:
        """The request's first token arrived (or it ended without one): its tokens leave the queue. Idempotent."""
        entry = self.pending.pop(request_id, None)
        if entry is not None and self.prefill is not None:
            self.prefill.add(entry[0], -entry[1])
            self.prefill.add(entry[0] + DONE, entry[1])  # only grows: every gateway sees the head move on

    def queued(self, pod: str, totals: Mapping[str, int], rate: float, now: float) -> float:
        """Tokens still to prefill on `pod` before a new request: the shared queue, less the progress of
        the prompt at its head since its prefill started."""
        count, prefilled = totals.get(pod, 0), totals.get(pod + DONE, 0)
        last, last_prefilled = self.seen.get(pod, (0, 0))
        if (count, prefilled) != (last, last_prefilled):
            self.seen[pod] = (count, prefilled)
            if prefilled != last_prefilled or last <= 0:  # a prompt finished its prefill, or the lane starts
                self.marks[pod] = now
        if count <= 0:
            return 0.0
        done = (now - self.marks.get(pod, now)) * rate
        return max(0.0, count - done) if done > 0 else float(count)

    def targets_for(self, model: str, ttft_s: float | None, tpot_s: float | None) -> tuple[float, float]:
        base = self.targets.get(model) or self.targets.get("*") or self.default_targets
        return (ttft_s if ttft_s else base[0], tpot_s if tpot_s else base[1])


def default_capacity() -> Capacity:
    """Priors only: what a Router without the gateway's observed responses schedules `slo` with."""
    return Capacity(EngineProfiles(), OutputPredictor())


class SLOScorer(Scorer):
    name = "slo"
    needs_tokens = True
    reads_prefill = True

    def __init__(self, capacity: Capacity, index: PrefixSource | None = None,
                 medium_weights: Mapping[str, float] | None = None, safe: float = 0.5,
                 prompts: RunningPrompts | None = None) -> None:
        self.cap = capacity
        self.safe = safe
        self._cache = PromptCache(index, medium_weights, prompts=prompts) if index is not None else None
        self._queue: dict[str, tuple[float, float]] = {}  # pod -> (uncached tokens queued, as of time)
        self._decoding: dict[str, list[tuple[float, float]]] = {}  # pod -> [(decode start, predicted end)]
        self.last: dict[str, tuple[float, float]] = {}  # the last request's predictions per pod (for tests/debug)

    # --- pieces ----------------------------------------------------------------------------
    def queued(self, pod: str, now: float, rate: float) -> float:
        entry = self._queue.get(pod)
        if entry is None:
            return 0.0
        tokens, at = entry
        left = tokens - (now - at) * rate
        return left if left > 0 else 0.0

    def _uncached(self, ctx: PickContext, pods: Sequence[Pod]) -> dict[str, float]:
        n = float(len(ctx.request.token_ids or ()))
        known = self._cache.uncached(ctx, pods) if self._cache is not None else {}
        return {p.name: known.get(p.name, n) for p in pods}

    def _batch(self, pod: str, running: int, start: float, end: float) -> float:
        """This request plus the pod's running ones, each weighted by its predicted overlap."""
        spans = self._decoding.get(pod)
        if spans:
            spans[:] = [s for s in spans if s[1] > start]
        dur = max(end - start, 1e-6)
        tracked = spans or []
        overlap = sum(min(1.0, max(0.0, min(e, end) - max(s, start)) / dur) for s, e in tracked)
        if len(tracked) > running:  # some finished early: scale to the running count
            overlap *= running / len(tracked)
        else:
            overlap += running - len(tracked)  # other gateways' requests: assume they overlap fully
        return 1.0 + overlap

    # --- Scorer ------------------------------------------------------------------------------
    def score(self, ctx: PickContext, pods: Sequence[Pod]) -> dict[str, float]:
        cap, req = self.cap, ctx.request
        model = ctx.base_model
        t_ttft, t_tpot = cap.targets_for(req.model, req.slo_ttft_s, req.slo_tpot_s)
        n = len(req.token_ids or ())
        out_tokens = max(1, cap.predictor.predict(model, n))
        uncached = self._uncached(ctx, pods)
        now = cap.clock()
        scores, plans, lanes = {}, {}, {}
        shared = cap.prefill.totals() if cap.prefill is not None else None
        tight = cap.tightest(model, t_ttft, now)
        fewest = min(uncached.values(), default=0.0)
        for p in pods:
            rate = cap.profiles.prefill_rate(p.pod_name, model, n, out_tokens)
            queued = cap.queued(p.name, shared, rate, now) if shared is not None else self.queued(p.name, now, rate)
            running = ctx.running.get(p.name, 0)
            est = estimate(cap.profiles, p, model, queued=queued, uncached=uncached[p.name], running=running,
                           prompt_tokens=n, output_tokens=out_tokens)  # the model kv-sync's `ttft` scorer uses
            work, overhead, ttft = est.work_s, est.overhead, est.ttft_s
            lanes[p.name] = (queued / rate, uncached[p.name] / rate)
            tpot = cap.profiles.step_time(p.pod_name, running + 1, model, n, out_tokens)
            start = now + ttft
            batch = self._batch(p.name, running, start, start + out_tokens * tpot)
            tpot = cap.profiles.step_time(p.pod_name, batch, model, n, out_tokens)
            self.last[p.name] = (ttft, tpot)
            plans[p.name] = (rate, uncached[p.name], start, start + out_tokens * tpot, work, overhead)
            r1, r2 = ttft / t_ttft, tpot / t_tpot
            if r1 <= 1.0 and r2 <= 1.0:
                # headroom charges a copy: prompt tokens another pod holds and this one would prefill again
                r1 += (uncached[p.name] - fewest) / rate / t_ttft
                safe = r1 <= self.safe and r2 <= self.safe
                scores[p.name] = 1.0 if safe else 0.5 + 0.5 * max(min(1.0 - r1, 1.0 - r2), 1e-3)
            else:
                scores[p.name] = 0.5 / (1.0 + max(r1, r2) - 1.0)
        if t_ttft > tight and len(pods) > 1:
            fast = min(lanes, key=lambda name: (lanes[name][0], name))
            if lanes[fast][1] >= tight / 2 and scores[fast] >= 0.5 and any(
                    s >= 0.5 for name, s in scores.items() if name != fast):
                scores[fast] = 0.5  # leave the fastest lane to the tight requests
        ctx.state[self.name] = plans
        return scores

    def picked(self, ctx: PickContext, pod: Pod) -> None:
        plan = ctx.state.get(self.name, {}).get(pod.name)
        if plan is None:
            return
        rate, uncached, start, end, work, overhead = plan
        now = self.cap.clock()
        # what this pick predicted, for the profiles to learn the TTFT overhead from its observed TTFT
        self.cap.profiles.expect(ctx.request.request_id, pod.pod_name, work, overhead, pod.name, uncached)
        if self.cap.prefill is not None:
            self.cap.queue(pod.name, int(uncached), ctx.request.request_id)
        else:
            self._queue[pod.name] = (self.queued(pod.name, now, rate) + uncached, now)
        self._decoding.setdefault(pod.name, []).append((start, end))

    def pods_changed(self, added: Sequence[Pod], removed: Sequence[Pod]) -> None:
        for p in removed:
            self._queue.pop(p.name, None)
            self._decoding.pop(p.name, None)
