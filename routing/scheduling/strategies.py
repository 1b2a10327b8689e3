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
from routing.pods import Pod
from routing.scheduling.approx import ApproxPrefixTable
from routing.scheduling.cost import PromptCache, TTFTScorer
from routing.state.engine_metrics import EngineMetrics, Saturation
from routing.state.prompts import RunningPrompts
from routing.scheduling.fairness import TokenFairnessScorer
from routing.scheduling.scorers import (AdmissionWait, ApproxPrefixScorer, CacheRoom, EngineBusyScorer,
                                        FamilyAffinityScorer, KVFreeScorer, KVUtilizationScorer, LatencyScorer,
                                        LoadScorer, PrecisePrefixScorer, PrefillBacklog, PrefixSource, QueueScorer,
                                        ThroughputScorer)
from routing.scheduling.sessions import SessionAffinityScorer, SessionStore
from routing.scheduling.slo import Capacity, SLOScorer
from routing.scheduling.scoring import (Filter, LoadGuard, MaxScorePicker, Picker, PowerOfTwoPicker, RandomPicker,
                             RoundRobinPicker, Scorer, Strategy)


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
    # When an engine is saturated (KVGATE_SATURATION_QUEUE / _KV_USAGE): the session scorer prefers none
    saturation: Saturation = field(default_factory=Saturation)


@dataclass(frozen=True)
class Resources:
    """What scorer factories may use; `index` and `engines` are None where the process has none."""

    config: StrategyConfig
    index: PrefixSource | None = None
    engines: EngineMetrics | None = None
    capacity: Capacity | None = None  # engine profiles, output prediction, SLO targets
    sessions: SessionStore | None = None  # session -> pod (the session scorer; a local one when None)
    prompts: RunningPrompts | None = None  # this gateway's running requests' prompts (routing.state.prompts)


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
    aibrix: str = ""  # where it differs from AIBrix's strategy of the same name ("" : not an AIBrix name)
    mixed_as: Mapping[str, float] | None = None  # its scorers in a weighted mix, where its picker ignores weights
    optional: frozenset[str] = frozenset()  # scorers left out where what they need is missing (not the strategy)
    # A strategy whose choice this one makes where its own scorer is indifferent: the weights configured for it
    # (KVGATE_ROUTING_WEIGHTS) are laid over these defaults too, before this strategy's own.
    choice_of: str = ""

    @property
    def weighted(self) -> bool:
        return bool(self.weights)


def _prefix(r: Resources) -> Scorer:
    c = r.config
    assert r.index is not None
    admission = None
    if r.engines is not None and r.capacity is not None:
        admission = AdmissionWait(r.engines, r.capacity.profiles.step_time, r.capacity.predictor.mean_output)
    # the backlog every replica made, where the replicas share prefill counts (plugin.app: observing responses)
    shared = r.capacity.prefill if r.capacity is not None else None
    backlog = PrefillBacklog(c.prefill_tokens_per_s, c.clock, shared=shared)
    cache = getattr(r.index, "pod_cache", None)  # optional in PrefixSource
    return PrecisePrefixScorer(r.index, c.medium_weights, backlog=backlog,
                               admission=admission, tokens_per_s=c.prefill_tokens_per_s, prompts=r.prompts,
                               room=CacheRoom(cache) if cache is not None else None)


def _ttft(r: Resources) -> Scorer:
    c = r.config
    # without the gateway's profiles (a Router built without them), the priors answer
    profiles = r.capacity.profiles if r.capacity is not None else EngineProfiles(
        prefill_tokens_per_s=c.prefill_tokens_per_s)
    # the backlog drains at each engine's learned rate (a data-parallel rank's is its pod's)
    backlog = PrefillBacklog(lambda target: profiles.prefill_rate(target.partition("#")[0]), c.clock)
    return TTFTScorer(PromptCache(_given(r.index), c.medium_weights, prompts=r.prompts), profiles, backlog)


SCORERS: dict[str, ScorerSpec] = {s.name: s for s in (
    ScorerSpec("load", lambda r: LoadScorer(r.config.load_scale), (),
               "running requests over every gateway: 1 for the least loaded, minus 1/8 per extra request "
               "(or per the spread, if larger)"),
    ScorerSpec("prefix", _prefix, ("index",),
               "estimated prefill wait from the event-fed index: the prompt tokens the pod does not hold "
               "(GPU blocks 1.0, CPU 0.8; counted twice: this request and whoever queues behind it) plus "
               "the pod's prefill backlog (`KVGATE_ROUTING_PREFILL_TOKENS_PER_S`; every replica's picks, shared "
               "through KVGATE_REDIS_URL when responses are observed); with engine metrics and observed "
               "responses, plus the wait to be admitted where the engine reports requests waiting (waiting + 1 "
               "finishes of the running requests, a learned decode step x mean output / (running + 1) each), on a "
               "pod holding some of the prompt only beyond the prefill of what it holds. A pod also holds the "
               "prompts of this gateway's requests running there (vLLM caches a scheduled request's blocks "
               "before computing them), until its engine's cache is cleared. On a pod whose engine has evicted "
               "(its cache full) the tokens it would cache count half again: they evict as many of other "
               "prefixes (after a reset, only those beyond the most blocks it was seen holding, until it "
               "evicts again)"),
    ScorerSpec("ttft", _ttft, ("index",),
               "expected time to first token: (this gateway's prefill backlog on the pod + this request's "
               "uncached tokens from the index) / the pod's learned prefill rate + its learned TTFT overhead at "
               "its running batch, plus the prefill time of the prompt tokens the best-holding pod holds and "
               "this one does not (a copy); the cheapest 1, two prompt prefills more (or the spread) 0. Rate and "
               "overhead: learned from observed responses (KVGATE_OBSERVE_SAMPLE), decayed, drifting back to "
               "the priors while not re-observed; before any, `KVGATE_ROUTING_PREFILL_TOKENS_PER_S` and 1 ms "
               "per running request"),
    ScorerSpec("affinity", lambda r: FamilyAffinityScorer(getattr(r.index, "block_size", None)), (),
               "the prompt's family (the prompt through its first block past the opening most of the model's "
               "recent prompts share) kept together: 0.5 for the pod holding the most of the prompt where some "
               "pods (not all) hold the family's blocks (rendezvous order among equals: every replica alike); "
               "where none does, 1 for the pod this gateway last sent the family to; a family never sent: 0.25 "
               "for the pod this gateway gave the fewest families"),
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
    ScorerSpec("session", lambda r: SessionAffinityScorer(
                   r.sessions if r.sessions is not None else SessionStore(), r.engines, r.config.saturation), (),
               "1 for the pod of the request's session (`x-session-id` / `x-session-token` naming a pod, or the "
               "pod kvgate last sent that session or `x-aibrix-session-key` to: KVGATE_SESSION_TTL_S, shared "
               "through KVGATE_REDIS_URL); none while that pod is down, not ready, set aside or saturated"),
    ScorerSpec("busy", lambda r: EngineBusyScorer(_given(r.engines)), ("engines",),
               "fewer requests running and waiting in the engine by its own numbers (`vllm:num_requests_running` "
               "+ `_waiting`, scraped); min-max over the pods"),
    ScorerSpec("throughput", lambda r: ThroughputScorer(_given(r.engines)), ("engines",),
               "less token throughput since the last scrape: 2 x prompt + generation tokens/s "
               "(`vllm:prompt_tokens_total`, `vllm:generation_tokens_total`); min-max over the pods"),
    ScorerSpec("latency", lambda r: LatencyScorer(_given(r.engines)), ("engines",),
               "lower expected latency: the engine's recent mean TTFT + 100 x its recent mean TPOT (its "
               "histograms, over the last scrape interval); min-max over the pods"),
    ScorerSpec("vtc", lambda r: TokenFairnessScorer(), (),
               "per-user token fairness: the `user` header's prompt tokens over the last ~5 minutes, over the "
               "mean per user (at least 1,000), place the user among the pods in name order; 1 there, falling "
               "with the distance"),
    ScorerSpec("slo", lambda r: SLOScorer(_given(r.capacity), r.index, r.config.medium_weights,
                                                   prompts=r.prompts), ("capacity",),
               "predicted TTFT (the `ttft` model, its queue the one shared by every gateway: (queued prefill + "
               "this request's uncached tokens from the index) / the pod's prefill rate + its overhead) and TPOT (decode step at the running batch, weighted by predicted outputs) against the "
               "request's targets: 1 within half of both (no SLO at risk), else 0.5..1 with headroom, below 0.5 by "
               "violation"),
)}

_MAX = "max score, random tie-break"
# kv-sync's scorers, also slo's choice among the pods safely within the targets (under the slo scorer's weight)
_KV_SYNC = {"prefix": 3.0, "load": 1.0, "affinity": 1.0}

STRATEGIES: dict[str, StrategySpec] = {s.name: s for s in (
    StrategySpec("random", RandomPicker, "uniform", "uniform among ready pods",
                 aibrix="same; in a mix it weighs nothing"),
    StrategySpec("round-robin", lambda rng: RoundRobinPicker(), "name order", "ready pods in turn"),
    StrategySpec("least-request", MaxScorePicker, _MAX,
                 "fewest running requests over every gateway", {"load": 1.0},
                 aibrix="AIBrix reads the engines' running count; kvgate its own count, taken at pick time and "
                        "shared by every gateway (no lag behind a burst)"),
    StrategySpec("power-of-two", PowerOfTwoPicker, "two drawn at random, fewer running",
                 "of two pods drawn at random, the one running fewer requests over every gateway",
                 aibrix="AIBrix counts per model in Redis keys of its own; kvgate uses its shared running "
                        "counts. In a mix: its load score", mixed_as={"load": 1.0}),
    StrategySpec("throughput", MaxScorePicker, _MAX, "the least token throughput lately", {"throughput": 1.0},
                 aibrix="AIBrix weighs each pod's average prompt and generation tokens per request over a day "
                        "(Prometheus queries); kvgate the tokens/s since the last scrape, prompt tokens twice"),
    StrategySpec("least-kv-cache", MaxScorePicker, _MAX, "the least KV cache used", {"kv-util": 1.0},
                 aibrix="AIBrix adds GPU and CPU cache usage; vLLM 0.33 exports no CPU cache usage, so both "
                        "read `vllm:kv_cache_usage_perc`"),
    StrategySpec("least-gpu-cache", MaxScorePicker, _MAX, "the least GPU KV cache used", {"kv-util": 1.0},
                 aibrix="same metric (`vllm:gpu_cache_usage_perc` is `vllm:kv_cache_usage_perc` since vLLM 0.10)"),
    StrategySpec("least-busy-time", MaxScorePicker, _MAX, "the engine busy with the fewest requests",
                 {"busy": 1.0},
                 aibrix="AIBrix reads a GPU busy-time ratio no vLLM exports (so it picks at random on vLLM); "
                        "kvgate the engine's own running + waiting requests"),
    StrategySpec("least-utilization", MaxScorePicker, _MAX,
                 "the engine least used: requests in it and KV cache used, equally", {"busy": 1.0, "kv-util": 1.0},
                 aibrix="AIBrix reads `engine_utilization`, exported by xLLM only (random on vLLM); kvgate its "
                        "requests and KV cache usage"),
    StrategySpec("least-latency", MaxScorePicker, _MAX, "the lowest expected latency by the engine's histograms",
                 {"latency": 1.0},
                 aibrix="AIBrix adds queue, prefill and decode time means scaled to guessed lengths; kvgate the "
                        "recent TTFT mean + 100 x the recent TPOT mean (vLLM 0.33's histograms)"),
    StrategySpec("session-affinity", MaxScorePicker, _MAX,
                 "the session's pod (never a down or saturated one); a new session: the least loaded",
                 {"session": 1.0, "load": 0.25},
                 aibrix="AIBrix reads only `x-session-id` (the pod's address, which it returns) and a caller key "
                        "hashed to a pod; kvgate also llm-d's `x-session-token` and remembers opaque sessions "
                        "(TTL, shared through Redis), and sends a new session to the least loaded pod, not a "
                        "random one"),
    StrategySpec("vtc-basic", MaxScorePicker, _MAX, "per-user token fairness, with load", {"vtc": 1.0, "load": 1.0},
                 aibrix="AIBrix's bucket is the mean of the smallest and largest user's count, counts input and "
                        "estimated output tokens, and adds a random 0..0.1; kvgate the mean per user, prompt "
                        "tokens, ties at random"),
    StrategySpec("prefix-cache", MaxScorePicker, _MAX,
                 "router-side guess from this gateway's own past decisions (no events)",
                 {"approx-prefix": 3.0, "load": 2.0}, guard=True,
                 aibrix="AIBrix also guesses from its own decisions, with its own imbalance rule; kvgate's load "
                        "guard and load weight"),
    StrategySpec("kv-sync", MaxScorePicker, "max score, random tie-break",
                 "the event-fed index's estimated prefill wait, combined with load (the default)",
                 _KV_SYNC, guard=True),
    StrategySpec("slo", MaxScorePicker, "max score, random tie-break",
                 "meets the request's TTFT and TPOT targets (`x-slo-ttft-ms`, `x-slo-tpot-ms` or the model's "
                 "defaults): among the pods predicted safely within both (half of each or less) kv-sync's choice "
                 "(its scorers, far below the slo scorer's weight), else the most headroom, else the least "
                 "violation", {"slo": 1000.0, **_KV_SYNC},
                 optional=frozenset({"prefix"}), choice_of="kv-sync",
                 aibrix="AIBrix's slo family plans against profiled GPU capacity; kvgate predicts TTFT and TPOT "
                        "from learned engine profiles. In a mix it stands alone, as in AIBrix"),
    # Prefill/decode disaggregation (routing.pd): `pd` plans the pair; its weights choose the prefill engine.
    StrategySpec("pd", MaxScorePicker, "max score, random tie-break",
                 "prefill/decode disaggregation: the decode engine by `pd-decode`, then, unless it lacks fewer than "
                 "`KVGATE_PD_THRESHOLD_TOKENS` of the prompt (served there whole), the prefill engine by these "
                 "scores among the `role: prefill` pods (kvgate runs the prefill leg itself)",
                 {"ttft": 3.0, "load": 1.0, "affinity": 1.0}, guard=True,
                 aibrix="AIBrix's pd always splits and picks the prefill engine first by its prefix guess and load; "
                        "kvgate picks the decode engine first, splits only where it pays, and prices the prefill "
                        "engines on the event-fed index. In a mix: its scores, no split"),
    StrategySpec("pd-decode", MaxScorePicker, "max score, random tie-break",
                 "the decode engine of a `pd` request, among the decoding pods: running requests, free KV cache "
                 "and what it holds of the prompt", {"load": 2.0, "kv-free": 1.0, "prefix": 1.0}),
)}

NAMES = tuple(STRATEGIES)
MAX_COEFFICIENT = 1_000_000


def parse_mix(text: str) -> tuple[tuple[str, int], ...] | None:
    """AIBrix's weighted mix, `name[:coefficient],...` (an integer 0..1,000,000, 1 when left out; 0 drops the
    name): the named strategies with their coefficients; None when `text` is a single plain name. A mix naming
    `slo` is `slo` alone (AIBrix: the slo strategies are exclusive). Raises ValueError saying what is wrong."""
    if "," not in text and ":" not in text:
        return None
    items: list[tuple[str, int]] = []
    for part in (p.strip() for p in text.split(",")):
        name, sep, coef = part.partition(":")
        name = name.strip()
        if not name:
            raise ValueError(f"{part!r}: expected <strategy>[:<weight>]")
        if name not in STRATEGIES:
            raise ValueError(f"{name!r}: unknown strategy (known: {', '.join(STRATEGIES)})")
        weight = 1
        if sep:
            try:
                weight = int(coef.strip())
            except ValueError:
                raise ValueError(f"{part!r}: the weight must be an integer") from None
            if not 0 <= weight <= MAX_COEFFICIENT:
                raise ValueError(f"{part!r}: the weight must be from 0 to {MAX_COEFFICIENT}")
        if weight > 0:
            items.append((name, weight))
    if not items:
        raise ValueError("no strategy with a weight above 0")
    if any(name == "slo" for name, _ in items):
        return (("slo", 1),)
    return tuple(items)


def mix_name(items: tuple[tuple[str, int], ...]) -> str:
    """The mix's canonical name (its metrics label): `a:2,b:1`; a single strategy its own name."""
    return items[0][0] if len(items) == 1 else ",".join(f"{n}:{c}" for n, c in items)


def build_mix(items: tuple[tuple[str, int], ...], strategies: Mapping[str, Strategy], rng: random.Random) -> Strategy:
    """A weighted mix as AIBrix combines one: each strategy's score (the weighted mean of its scorers, 0..1)
    counts its coefficient's share; the highest total wins. Built from `strategies`' own scorer instances (what
    they learn, they learn once). Filters: each member's. Raises ValueError for a strategy not built here."""
    total = sum(c for _, c in items)
    weights: dict[int, tuple[Scorer, float]] = {}
    filters: dict[str, Filter] = {}
    for name, coef in items:
        st = strategies.get(name)
        if st is None:
            raise ValueError(f"strategy {name!r} is not available here")
        spec = STRATEGIES[name]
        scorers = [(sc, w) for sc, w in st.scorers if w > 0]
        if spec.mixed_as is not None:
            # a picker-only strategy: the scorers standing for it, as other strategies built them
            built = {sc.name: sc for other in strategies.values() for sc, _ in other.scorers}
            scorers = [(built[s], w) for s, w in spec.mixed_as.items() if s in built]
        sw = sum(w for _, w in scorers)
        for sc, w in scorers:
            prev = weights.get(id(sc), (sc, 0.0))[1]
            weights[id(sc)] = (sc, prev + coef / total * w / sw)
        for f in st.filters:
            filters[f.name] = f
    return Strategy(mix_name(items), MaxScorePicker(rng), tuple(weights.values()), tuple(filters.values()))


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


def engine_queued(engines: EngineMetrics) -> Callable[[Pod], bool | None]:
    """The load guard's view of whether load costs on a pod: its engine (a data-parallel rank: that rank) has
    requests waiting for a batch slot or KV blocks, per its last scrape; None without a fresh one."""
    def queued(pod: Pod) -> bool | None:
        load = engines.get(pod.pod_name, pod.rank)
        return None if load is None else load.waiting > 0
    return queued


def build_strategies(config: StrategyConfig, rng: random.Random, *, index: PrefixSource | None = None,
                     engines: EngineMetrics | None = None, capacity: Capacity | None = None,
                     sessions: SessionStore | None = None,
                     prompts: RunningPrompts | None = None) -> dict[str, Strategy]:
    """Every strategy that can run with what is given: one whose default scorers need a missing
    resource (`kv-sync` without the index) is left out; a configured scorer that does raises
    ValueError. Each scorer is built once and shared by the strategies weighing it."""
    res = Resources(config, index, engines, capacity, sessions, prompts)
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

    guard = LoadGuard(config.guard_abs_slack, config.guard_rel_slack,
                      queued=None if engines is None else engine_queued(engines))
    out = {}
    for name, spec in STRATEGIES.items():
        if any(missing(s) for s, w in spec.weights.items() if w > 0 and s not in spec.optional):
            continue
        inherited = {}
        if spec.choice_of:  # not this strategy's own scorers (slo's), which the other does not weigh by default
            other = STRATEGIES[spec.choice_of].weights
            inherited = {s: w for s, w in config.weights.get(spec.choice_of, {}).items()
                         if s in other or s not in spec.weights}
        weights = {s: w for s, w in {**spec.weights, **inherited, **config.weights.get(name, {})}.items()
                   if not (s in spec.optional and missing(s))}
        scorers = tuple((scorer(s, name), w) for s, w in weights.items() if w > 0)
        filters: tuple[Filter, ...] = (guard,) if spec.guard else ()
        out[name] = Strategy(name, spec.picker(rng), scorers, filters)
    return out


def markdown_tables() -> str:
    """The README's strategy and scorer tables, from STRATEGIES and SCORERS."""
    rows = ["| Strategy | Filters | Scorers x weight | Picker | What it does | Against AIBrix's |",
            "|---|---|---|---|---|---|"]
    for s in STRATEGIES.values():
        weights = ", ".join(f"`{n}` x {w:g}" for n, w in s.weights.items())
        rows.append(f"| `{s.name}` | {'load guard' if s.guard else ''} | {weights} | {s.picker_doc} | {s.doc} | "
                    f"{s.aibrix or 'kvgate only'} |")
    rows += ["", "| Scorer | Needs | Gives each pod 0..1 for |", "|---|---|---|"]
    for sc in SCORERS.values():
        needs = ", ".join(NEEDS[n] for n in sc.needs)
        rows.append(f"| `{sc.name}` | {needs} | {sc.doc} |")
    return "\n".join(rows)
