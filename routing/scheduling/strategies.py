"""The named strategies and scorers: one table of each, read by the Router (what to build),
the configuration (which names KVGATE_ROUTING_STRATEGY and KVGATE_ROUTING_WEIGHTS accept)
and the README (`python -m plugin.config README.md` writes `markdown_tables()` there).

A strategy is a picker, default scorer weights and filters; a scorer is a name, a factory and
what the factory needs. A new policy is a new scorer in SCORERS plus weights: in STRATEGIES, or
laid over the defaults by KVGATE_ROUTING_WEIGHTS (e.g. `kv-sync:prefix=3,load=2,queue=1,kv-util=1`).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, TypeVar

from routing.learning.profiles import EngineProfiles
from routing.scheduling.approx import ApproxPrefixTable
from routing.scheduling.cost import PromptCache, TTFTScorer
from routing.state.engine_metrics import EngineMetrics
from routing.scheduling.scorers import (ApproxPrefixScorer, FamilyAffinityScorer, KVFreeScorer, KVUtilizationScorer,
                                        LoadScorer, PrecisePrefixScorer, PrefillBacklog, PrefixSource, QueueScorer)
from routing.scheduling.slo import Capacity, SLOScorer
from routing.scheduling.scoring import (Filter, LoadGuard, MaxScorePicker, Picker, RandomPicker, RoundRobinPicker, Scorer,
                             Strategy)


@dataclass(frozen=True)
class StrategyConfig:
    guard_abs_slack: int = 16  # KVGATE_ROUTING_GUARD_SLACK
    guard_rel_slack: float = 0.7  # KVGATE_ROUTING_GUARD_RATIO
    load_scale: float = 8.0  # running-count gap that costs a full load point
    approx_block_size: int = 16  # KVGATE_PREFIX_CACHE_BLOCK_SIZE
    approx_capacity: int = 200_000  # KVGATE_PREFIX_CACHE_BLOCKS
    medium_weights: Mapping[str, float] = field(default_factory=lambda: {"GPU": 1.0, "CPU": 0.8})
    weights: Mapping[str, Mapping[str, float]] = field(default_factory=dict)  # KVGATE_ROUTING_WEIGHTS
    # kv-sync's prefill backlog estimate drains at this nominal engine prefill speed, tokens/s (the
    # `kvgate sim` engine's; bench routing gave the same W1/W2 results with half or twice the rate)
    prefill_tokens_per_s: float = 10_000.0
    clock: Callable[[], float] = time.monotonic  # the backlog's clock (the routing benchmark's is virtual)


@dataclass(frozen=True)
class Resources:
    """What scorer factories may use; `index` and `engines` are None where the process has none."""

    config: StrategyConfig
    index: PrefixSource | None = None
    engines: EngineMetrics | None = None
    capacity: Capacity | None = None  # engine profiles, output prediction, SLO targets


_R = TypeVar("_R")


def _given(resource: _R | None) -> _R:
    """A resource named in the scorer's `needs`: build_strategies builds the scorer only when it is there."""
    assert resource is not None
    return resource


# What a scorer may need, and how a missing one is explained.
NEEDS = {
    "index": "the prefix index",
    "engines": "engine metrics scraping (interval > 0)",
    "capacity": "engine profiles and output prediction (KVGATE_OBSERVE_RESPONSES)",
}


@dataclass(frozen=True)
class ScorerSpec:
    name: str
    build: Callable[[Resources], Scorer]
    needs: tuple[str, ...]  # attributes of Resources that must not be None (keys of NEEDS)
    doc: str


@dataclass(frozen=True)
class StrategySpec:
    name: str
    picker: Callable[[random.Random], Picker]
    picker_doc: str
    doc: str
    weights: Mapping[str, float] = field(default_factory=dict)  # default scorer weights; configurable if any
    guard: bool = False  # the load guard filter (KVGATE_ROUTING_GUARD_SLACK / _RATIO) runs first

    @property
    def weighted(self) -> bool:
        return bool(self.weights)


def _prefix(r: Resources) -> Scorer:
    c = r.config
    assert r.index is not None
    return PrecisePrefixScorer(r.index, c.medium_weights, backlog=PrefillBacklog(c.prefill_tokens_per_s, c.clock))


def _ttft(r: Resources) -> Scorer:
    c = r.config
    # without the gateway's profiles (a Router built without them), the priors answer
    profiles = r.capacity.profiles if r.capacity is not None else EngineProfiles(
        prefill_tokens_per_s=c.prefill_tokens_per_s)
    # the backlog drains at each engine's learned rate (a data-parallel rank's is its pod's)
    backlog = PrefillBacklog(lambda target: profiles.prefill_rate(target.partition("#")[0]), c.clock)
    return TTFTScorer(PromptCache(_given(r.index), c.medium_weights), profiles, backlog)


SCORERS: dict[str, ScorerSpec] = {s.name: s for s in (
    ScorerSpec("load", lambda r: LoadScorer(r.config.load_scale), (),
               "running requests over every gateway: 1 for the least loaded, minus 1/8 per extra request "
               "(or per the spread, if larger)"),
    ScorerSpec("prefix", _prefix, ("index",),
               "estimated prefill wait from the event-fed index: the prompt tokens the pod does not hold "
               "(GPU blocks 1.0, CPU 0.8; counted twice: this request and whoever queues behind it) plus "
               "the pod's prefill backlog (`KVGATE_ROUTING_PREFILL_TOKENS_PER_S`)"),
    ScorerSpec("ttft", _ttft, ("index",),
               "expected time to first token: (this gateway's prefill backlog on the pod + this request's "
               "uncached tokens from the index) / the pod's learned prefill rate + its learned TTFT overhead at "
               "its running batch, plus the prefill time of the prompt tokens the best-holding pod holds and "
               "this one does not (a copy); the cheapest 1, two prompt prefills more (or the spread) 0. Rate and "
               "overhead: learned from observed responses (KVGATE_OBSERVE_SAMPLE), decayed, drifting back to "
               "the priors while not re-observed; before any, `KVGATE_ROUTING_PREFILL_TOKENS_PER_S` and 1 ms "
               "per running request"),
    ScorerSpec("affinity", lambda r: FamilyAffinityScorer(getattr(r.index, "block_size", None)), (),
               "while the index shows no pod holding any of the prompt: 1 for the pod this gateway last "
               "sent the prompt's family (first block) to; a family never sent: 0.5 for the pod this gateway "
               "gave the fewest families (rendezvous order among equals)"),
    ScorerSpec("approx-prefix",
               lambda r: ApproxPrefixScorer(ApproxPrefixTable(r.config.approx_block_size, r.config.approx_capacity)),
               (), "leading prompt blocks this gateway sent the pod before (an LRU of chained block keys, "
                   "no events) over the prompt's blocks"),
    ScorerSpec("queue", lambda r: QueueScorer(_given(r.engines)), ("engines",),
               "fewer waiting requests (`vllm:num_requests_waiting`, scraped)"),
    ScorerSpec("kv-util", lambda r: KVUtilizationScorer(_given(r.engines)), ("engines",),
               "more free KV cache (1 - `vllm:kv_cache_usage_perc` or `gpu_cache_usage_perc`, scraped)"),
    ScorerSpec("kv-free", lambda r: KVFreeScorer(r.engines), (),
               "`kv-util` where scraping may be off (then 0.5 for every pod): the decode engine's free KV cache"),
    ScorerSpec("slo", lambda r: SLOScorer(_given(r.capacity), r.index, r.config.medium_weights), ("capacity",),
               "predicted TTFT (the `ttft` model, its queue the one shared by every gateway: (queued prefill + "
               "this request's uncached tokens from the index) / the pod's prefill rate + its overhead) and TPOT (decode step at the running batch, weighted by predicted outputs) against the "
               "request's targets: 0.5..1 with headroom, below 0.5 by violation"),
)}

STRATEGIES: dict[str, StrategySpec] = {s.name: s for s in (
    StrategySpec("random", RandomPicker, "uniform", "uniform among ready pods"),
    StrategySpec("round-robin", lambda rng: RoundRobinPicker(), "name order", "ready pods in turn"),
    StrategySpec("least-request", MaxScorePicker, "max score, random tie-break",
                 "fewest running requests over every gateway", {"load": 1.0}),
    StrategySpec("prefix-cache", MaxScorePicker, "max score, random tie-break",
                 "router-side guess from this gateway's own past decisions (no events)",
                 {"approx-prefix": 3.0, "load": 2.0}, guard=True),
    StrategySpec("kv-sync", MaxScorePicker, "max score, random tie-break",
                 "the event-fed index's estimated prefill wait, combined with load (the default)",
                 {"prefix": 3.0, "load": 1.0, "affinity": 0.5}, guard=True),
    StrategySpec("slo", MaxScorePicker, "max score, random tie-break",
                 "meets the request's TTFT and TPOT targets (`x-slo-ttft-ms`, `x-slo-tpot-ms` or the model's "
                 "defaults) with the most headroom, else the least violation", {"slo": 1.0}),
    # Prefill/decode disaggregation (routing.pd): `pd` plans the pair; its weights choose the prefill engine.
    StrategySpec("pd", MaxScorePicker, "max score, random tie-break",
                 "prefill/decode disaggregation: the decode engine by `pd-decode`, then, unless it lacks fewer than "
                 "`KVGATE_PD_THRESHOLD_TOKENS` of the prompt (served there whole), the prefill engine by these "
                 "scores among the `role: prefill` pods (kvgate runs the prefill leg itself)",
                 {"ttft": 3.0, "load": 1.0, "affinity": 0.5}, guard=True),
    StrategySpec("pd-decode", MaxScorePicker, "max score, random tie-break",
                 "the decode engine of a `pd` request, among the decoding pods: running requests, free KV cache "
                 "and what it holds of the prompt", {"load": 2.0, "kv-free": 1.0, "prefix": 1.0}),
)}

NAMES = tuple(STRATEGIES)


def parse_weights(text: str, source: str = "KVGATE_ROUTING_WEIGHTS") -> dict[str, dict[str, float]]:
    """`strategy:scorer=w,scorer=w;strategy:...` -> per strategy, weights laid over its defaults (0 removes a scorer)."""
    weighted = [name for name, spec in STRATEGIES.items() if spec.weighted]
    out: dict[str, dict[str, float]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, sep, body = part.partition(":")
        name = name.strip()
        if not sep or name not in weighted:
            raise ValueError(f"{source}: {part!r}: expected <strategy>:<scorer>=<weight>,... "
                             f"with strategy one of {', '.join(weighted)}")
        weights: dict[str, float] = {}
        for item in filter(None, (i.strip() for i in body.split(","))):
            scorer, eq, value = item.partition("=")
            scorer = scorer.strip()
            if not eq or scorer not in SCORERS:
                raise ValueError(f"{source}: {item!r}: expected <scorer>=<weight>, scorer one of "
                                 f"{', '.join(SCORERS)}")
            try:
                w = float(value)
            except ValueError:
                raise ValueError(f"{source}: {item!r}: weight is not a number") from None
            if not 0 <= w < float("inf"):
                raise ValueError(f"{source}: {item!r}: weight must be >= 0")
            weights[scorer] = w
        out[name] = weights
    return out


def build_strategies(config: StrategyConfig, rng: random.Random, *, index: PrefixSource | None = None,
                     engines: EngineMetrics | None = None, capacity: Capacity | None = None) -> dict[str, Strategy]:
    """Every strategy that can run with what is given: one whose default scorers need a missing
    resource (`kv-sync` without the index) is left out; a configured scorer that does raises
    ValueError. Each scorer is built once and shared by the strategies weighing it."""
    res = Resources(config, index, engines, capacity)
    built: dict[str, Scorer] = {}

    def missing(scorer: str) -> str | None:
        return next((need for need in SCORERS[scorer].needs if getattr(res, need) is None), None)

    def scorer(name: str, strategy: str) -> Scorer:
        found = built.get(name)
        if found is None:
            need = missing(name)
            if need is not None:
                raise ValueError(f"{strategy}: scorer {name!r} needs {NEEDS[need]}")
            found = built[name] = SCORERS[name].build(res)
        return found

    guard = LoadGuard(config.guard_abs_slack, config.guard_rel_slack)
    out = {}
    for name, spec in STRATEGIES.items():
        if any(missing(s) for s, w in spec.weights.items() if w > 0):
            continue
        weights = {**spec.weights, **config.weights.get(name, {})}
        scorers = tuple((scorer(s, name), w) for s, w in weights.items() if w > 0)
        filters: tuple[Filter, ...] = (guard,) if spec.guard else ()
        out[name] = Strategy(name, spec.picker(rng), scorers, filters)
    return out


def markdown_tables() -> str:
    """The README's strategy and scorer tables, from STRATEGIES and SCORERS."""
    rows = ["| Strategy | Filters | Scorers x weight | Picker | What it does |", "|---|---|---|---|---|"]
    for s in STRATEGIES.values():
        weights = ", ".join(f"`{n}` x {w:g}" for n, w in s.weights.items())
        rows.append(f"| `{s.name}` | {'load guard' if s.guard else ''} | {weights} | {s.picker_doc} | {s.doc} |")
    rows += ["", "| Scorer | Needs | Gives each pod 0..1 for |", "|---|---|---|"]
    for sc in SCORERS.values():
        needs = ", ".join(NEEDS[n] for n in sc.needs)
        rows.append(f"| `{sc.name}` | {needs} | {sc.doc} |")
    return "\n".join(rows)
