"""The scoring framework: filters narrow the candidates, scorers give each 0..1, weights
combine them, a picker chooses. A strategy is a named configuration of these pieces.
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import random
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Mapping, Protocol, Sequence

from kvcache.blockkeys import BlockExtras
from routing.pods import Pod

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    model: str
    token_ids: Sequence[int] | None = None  # None: not tokenized (tokenizer down or not needed)
    strategy: str | None = None  # None: the configured default
    request_id: str = ""
    # Latency targets (x-slo-ttft-ms / x-slo-tpot-ms), seconds; None: the model's defaults (slo strategy)
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    # What the prompt's block hashes carry besides tokens and LoRA (cache_salt, media, opaque); None: nothing.
    extras: BlockExtras | None = None
    # The client's session (x-session-id, x-session-token or x-aibrix-session-key) and user (`user` header);
    # None: none sent.
    session: str | None = None
    user: str | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    pod: Pod
    strategy: str
    matched_blocks: int = 0  # leading prompt blocks the picked pod holds (prefix strategies)
    total_blocks: int = 0  # full blocks in the prompt (0 when not computed)
    request_id: str = ""
    ticket: int = 0  # identifies the running-count increment `release` undoes
    rank: int | None = None  # the data-parallel rank of `pod` to pin it to; None: not a DP pod
    # Next-best endpoints (`ip:port`, best first, never `pod`'s own) for the data plane to retry on.
    fallbacks: tuple[str, ...] = ()
    running: int = 0  # requests running on the picked target when it was picked, this one included


@dataclass(slots=True)
class PickContext:
    """One request's pick, from filters to `picked`: what scorers see, and the request's own state.

    Prefix scorers fill `matched` and `total_blocks` (the Decision reports them). `state` is the
    request's cycle state: a scorer keeps what `picked` needs under its own name there, never in
    `self`, since one scorer instance serves every request. `ranks` is True when some candidates
    are data-parallel rank targets (Pod.rank set, named `<pod>#<rank>`; `pod_name` is the pod's):
    a scorer reading per-pod sources (the index, engine metrics) must then look them up by rank."""

    request: RouteRequest
    base_model: str
    lora: str | None
    running: Mapping[str, int]
    matched: dict[str, int] = field(default_factory=dict)
    total_blocks: int = 0
    state: dict[str, Any] = field(default_factory=dict)
    ranks: bool = False
    family: int | None = None  # the prompt's first block key, where a scorer computed it: ties follow it
    # Per candidate, the leading blocks it holds (`matched`) or is prefilling for a running request of this
    # gateway's (routing.state.prompts), where the latter adds any; None: `matched` says it all.
    placed: dict[str, int] | None = None


class Filter(Protocol):
    @property
    def name(self) -> str: ...  # read only: a frozen dataclass's field is one

    def filter(self, ctx: PickContext, pods: Sequence[Pod]) -> list[Pod]: ...


class Scorer:
    """Gives every candidate pod 0..1. One instance per Router serves every strategy weighing it
    and every request: per-request state goes to `ctx.state`, per-pod state may live in `self`."""

    name: str = ""
    needs_tokens: bool = False
    reads_prefill: bool = False  # reads the replicas' shared prefill counts (the Router refreshes them first)

    def score(self, ctx: PickContext, pods: Sequence[Pod]) -> dict[str, float]:
        """0..1 per pod name (missing names count 0); higher is better."""
        raise NotImplementedError

    def picked(self, ctx: PickContext, pod: Pod) -> None:
        """Called once the pod is chosen, with the same ctx (learning scorers remember it)."""
        return None

    def pods_changed(self, added: Sequence[Pod], removed: Sequence[Pod]) -> None:
        """Discovery changed the pods (a changed pod is in both lists): drop what a removed pod held."""
        return None


class Picker(Protocol):
    def pick(self, ctx: PickContext, pods: Sequence[Pod], scores: Mapping[str, float]) -> Pod: ...


# ---- pickers -------------------------------------------------------------------------------

_M64 = (1 << 64) - 1


@lru_cache(maxsize=4096)
def _pod_hash(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big")


def rendezvous(key: int, pod: str) -> int:
    """Rendezvous (highest random weight) rank of `pod` for `key`: the same in every process, so
    gateway replicas ordering pods by it agree without talking, and removing a pod moves only the
    keys it ranked first."""
    x = (key ^ _pod_hash(pod)) & _M64
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _M64  # splitmix64's finaliser
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _M64
    return x ^ (x >> 31)


class MaxScorePicker:
    """Highest combined score. Ties (within 1e-9) go to the rendezvous-first pod of the prompt's
    family where a scorer set `ctx.family` (replicas agree, the family stays together), else at
    random so equals share the load."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(self, ctx: PickContext, pods: Sequence[Pod], scores: Mapping[str, float]) -> Pod:
        get = scores.get
        values = [get(p.name, 0.0) for p in pods]
        floor = max(values) - 1e-9
        top = [p for p, v in zip(pods, values) if v >= floor]
        if len(top) == 1:
            return top[0]
        family = ctx.family
        if family is None:
            return self._rng.choice(top)
        return max(top, key=lambda p: rendezvous(family, p.name))


class RandomPicker:
    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(self, ctx: PickContext, pods: Sequence[Pod], scores: Mapping[str, float]) -> Pod:
        return self._rng.choice(list(pods))


class PowerOfTwoPicker:
    """Two candidates drawn at random, the one with fewer running requests over every gateway (AIBrix's
    power-of-two; a tie: the first drawn)."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def pick(self, ctx: PickContext, pods: Sequence[Pod], scores: Mapping[str, float]) -> Pod:
        if len(pods) == 1:
            return pods[0]
        a, b = self._rng.sample(list(pods), 2)
        running = ctx.running.get
        return b if running(b.name, 0) < running(a.name, 0) else a


class RoundRobinPicker:
    """Cycles through a model's ready pods in name order."""

    def __init__(self) -> None:
        self._next: dict[str, itertools.count] = {}

    def pick(self, ctx: PickContext, pods: Sequence[Pod], scores: Mapping[str, float]) -> Pod:
        ordered = sorted(pods, key=lambda p: p.name)
        n = next(self._next.setdefault(ctx.request.model, itertools.count()))
        return ordered[n % len(ordered)]


# ---- the load guard ------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class LoadGuard:
    """Imbalance rule, whatever a pod's cache holds: a pod is set aside when it runs `slack(m)` or
    more requests beyond `m`, the mean over the other candidates (a hot spot), or `far` slacks
    (`slack(least)`) beyond the least loaded candidate (an idle pod the others run away from);
    `slack(x) = max(abs_slack, rel_slack * x)`. With two pods the first reads "slack beyond the
    other one". The mean keeps one idle or just-added pod from making every warm pod look
    overloaded; the second rule is loose (4 slacks) because at high load it would otherwise force
    every request onto a just-added pod at once, a burst of cache misses on one engine (bench
    routing W5 at 100% of the starting pods' capacity, 1 replica, 2 -> 4 slacks alone: kv-sync
    81.0 -> 83.2% hit rate, TTFT p90 0.26 -> 0.07 s).

    Only where load costs (issue 26): with `queued` (engine metrics scraped), a pod its engine says has
    nothing waiting for a batch slot is kept however imbalanced: a request there starts at once, so
    moving it off its cached prefix buys no time and costs the prefill of what it leaves behind. Without a
    fresh scrape (None) the rule alone decides. Bench routing, 1 replica, 3 seeds: W5-medium kv-sync hit
    83.4 -> 84.0%, TTFT p90 43.3 -> 41.6 ms; W4 hit 61.7 -> 62.5%; W3-medium hit 69.5 -> 70.1%. (W5-medium
    seed 1: 47 requests went elsewhere than the pod holding their longest prefix, in a run where no request
    met an engine with requests waiting; the idle newcomer pulled the others' mean down. Now none.)"""

    abs_slack: int = 16
    rel_slack: float = 0.7
    far: float = 4.0
    name: str = "load-guard"
    # Whether the pod's engine has requests waiting (its scraped `num_requests_waiting` > 0); None: not known
    queued: Callable[[Pod], bool | None] | None = None

    def _slack(self, ref: float) -> float:
        return max(self.abs_slack, self.rel_slack * ref)

    def filter(self, ctx: PickContext, pods: Sequence[Pod]) -> list[Pod]:
        running = ctx.running.get
        loads = [running(p.name, 0) for p in pods]
        if len(loads) < 2:
            return list(pods)
        least = min(loads)
        if max(loads) - least < self.abs_slack and self.far >= 1.0:  # within a slack of each other: none set aside
            return list(pods)
        total, others_n = sum(loads), len(loads) - 1
        # _slack inlined in the loop (a method call per pod was most of this filter's cost)
        abs_slack, rel = self.abs_slack, self.rel_slack
        far = least + self.far * self._slack(least)
        kept = []
        queued = self.queued
        for p, load in zip(pods, loads):
            if load < far:
                others = (total - load) / others_n
                slack = rel * others
                if load - others < (slack if slack > abs_slack else abs_slack):
                    kept.append(p)
                    continue
            if queued is not None and queued(p) is False:
                kept.append(p)  # imbalanced, but nothing waits there: the load costs this request nothing
        return kept


# ---- strategies ----------------------------------------------------------------------------

@dataclass(frozen=True)
class Strategy:
    name: str
    picker: Picker
    scorers: tuple[tuple[Scorer, float], ...] = ()
    filters: tuple[Filter, ...] = ()
    _weighing: tuple[tuple[Scorer, float], ...] = field(init=False, repr=False, compare=False, default=())
    _learners: tuple[Scorer, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        # Fixed once built: the scorers that weigh (weight > 0), and those of them that learn from a pick
        # (override Scorer.picked): the per-request loops skip the rest.
        weighing = tuple((s, w) for s, w in self.scorers if w > 0)
        object.__setattr__(self, "_weighing", weighing)
        object.__setattr__(self, "_learners", tuple(s for s, _ in weighing if getattr(type(s), "picked", None) is not Scorer.picked))

    @property
    def needs_tokens(self) -> bool:
        return any(s.needs_tokens for s, w in self.scorers if w > 0)

    def choose(self, ctx: PickContext, pods: Sequence[Pod],
               on_error=None, on_filtered=None) -> tuple[Pod, dict[str, float]]:
        """The chosen pod and the combined scores; `pods` must not be empty."""
        candidates = pods
        for f in self.filters:
            kept = f.filter(ctx, candidates)
            if kept and len(kept) < len(candidates):
                if on_filtered:
                    on_filtered(len(candidates) - len(kept))
                candidates = kept
        total = dict.fromkeys([p.name for p in candidates], 0.0)
        parts: dict[str, dict[str, float]] | None = {} if log.isEnabledFor(logging.DEBUG) else None
        for scorer, weight in self._weighing:
            try:
                part = scorer.score(ctx, candidates)
            except Exception:
                # a failing scorer counts 0 for everyone: the others still decide
                log.exception("scorer %s failed for request %s", scorer.name, ctx.request.request_id)
                if on_error:
                    on_error(scorer.name)
                continue
            if parts is not None:
                parts[scorer.name] = part
            # names outside the candidates are ignored, missing ones count 0; values clamped to 0..1,
            # NaN counting 0
            for name, v in part.items():
                if name in total:
                    total[name] += weight * (v if 0.0 <= v <= 1.0 else 1.0 if v > 1.0 else 0.0)
        pod = self.picker.pick(ctx, candidates, total)
        if parts is not None:
            self._log_pick(ctx, pods, candidates, pod, total, parts)
        for scorer in self._learners:
            try:
                scorer.picked(ctx, pod)
            except Exception:
                log.exception("scorer %s failed to record a pick", scorer.name)
        return pod, total

    def _log_pick(self, ctx: PickContext, pods: Sequence[Pod], candidates: Sequence[Pod], pod: Pod,
                  total: Mapping[str, float], parts: Mapping[str, Mapping[str, float]]) -> None:
        """At debug level, one line per pick: what each scorer gave each candidate, what the index matched
        and what ran where: why a request went where it did (a request going off its prefix, a tenant
        scattering) without a patch."""
        def rounded(values: Mapping[str, float]) -> dict[str, float]:
            return {k: round(v, 3) for k, v in values.items()}
        log.debug("pick %s (%s): %s; scores %s; by scorer %s; blocks matched %s of %d; held or computing %s; "
                  "running %s; set aside %s; family %s",
                  ctx.request.request_id, self.name, pod.name, rounded(total),
                  {name: rounded(part) for name, part in parts.items()}, dict(ctx.matched), ctx.total_blocks,
                  dict(ctx.placed) if ctx.placed is not None else "as matched",
                  {p.name: ctx.running.get(p.name, 0) for p in pods},
                  sorted({p.name for p in pods} - {p.name for p in candidates}),
                  "-" if ctx.family is None else f"{ctx.family:016x}")
