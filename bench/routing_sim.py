"""One run of the routing benchmark: a workload, a policy and a seed on a virtual clock.

The run drives the project's real code: `routing.router.Router` with its real strategies and
`LocalCounts`, and `kvcache.index.PrefixIndex` fed only by what the simulated engines
(`sim.engine.EngineModel`) publish, each batch encoded with `kvcache.wire.encode_batch`
(vLLM 0.33) and decoded with `kvcache.wire.decode_batch`. Nothing sleeps: the loop jumps to
the next arrival, engine event, event delivery, flush or join; at equal times engines run
first, then deliveries, then flushes and joins, then arrivals. A request counts as running from its pick to its completion.

Event delivery model: a batch reaches the index `delay_s` of virtual time after the engine
step that produced it; with `loss` > 0 each batch is independently dropped with that
probability (the index never sees it: the worst case between a gap and the subscriber's
replay repairing it; PrefixIndex skips later blocks chained on a lost one).

Gateway replicas (`gateways` > 1): one Router per replica, requests dealt to them in turn.
They share one LocalCounts (Redis-shared counts with no lag) and one PrefixIndex (every
replica subscribes to every engine, so their indexes are equal); each has its own
strategies, so `prefix-cache` only learns from its own replica's decisions.

Data-parallel pod (a workload's `dp_size` > 1): the last starting pod is that many engines behind
one pod name, each rank its own EngineModel publishing its own events (data_parallel_rank set;
the index keys them by (pod, rank)). A request goes to the rank the Decision names (kvgate sets
x-data-parallel-rank); without one, to the pod's least loaded rank (running + waiting), the
engine's own balancer. A policy with `dp_ranks` False runs kvgate as it was before it routed to
the rank: the pod is one target (its best rank's blocks) and the engine's balancer picks the rank.
Every "engine" below is one rank; runs are keyed `<pod>#<rank>` for those, as the router's targets.

`char-tree` (bench.chartree, not a Router strategy: SGLang's gateway `cache_aware`): one
CharTreePolicy per replica, requests dealt in turn, each tree learning from its own replica's picks
on the virtual clock; the loads each reads are its own replica's requests routed and not finished
(per pod), as each gateway process counts its own, nothing shared.

The fleet's scheduled changes (Workload.flushes, Workload.joins) happen on the same clock, after
the engines' events and deliveries due at that time and before arrivals:
- a flush resets that engine's prefix cache even under load (EngineModel.reset_prefix_cache with
  force=True: running requests keep their blocks as private memory); the engine publishes
  AllBlocksCleared, which reaches kv-sync's index like any batch (delay, loss) and the oracle's
  mirror at once; the guessers (prefix-cache, char-tree) are not told;
- a join makes the engine a candidate from then on: it is added to the PodRegistry (the Routers
  follow it), to every CharTreePolicy (a worker of size 0) and to the oracle's candidates. Engines
  not yet joined count in no load ratio.
Counted per run: BlockRemoved blocks (evictions) over every engine, blocks dropped by flushes,
requests routed per pod, and the share of requests that recomputed at least one prefix block
some earlier request had computed (served fewer cached tokens than reusable_tokens: sent where
the prefix was not, or where it had been evicted or flushed).

The oracle (not a Router strategy) knows each engine's cache exactly (EngineModel.prefix_hit: what the
engine would hit now, the blocks of prompts it has scheduled and not yet announced included; until
session 25 it read a mirror of the engines' events, which learns those a prefill later: W4, 3 seeds, 63.45
-> 63.85%) and the load it created itself. It does not know the flush schedule: on W4, whose flushes
rotate, the engine just flushed is the one flushed last again, so a policy that keeps a flushed engine's
tenants there (prefix-cache, char-tree) holds their prefixes longest (docs/BENCHMARKS.md, routing).
For each pod it predicts this request's TTFT with the engine's own timing model: admission
(immediate below max_num_seqs, else the wait for enough decoding requests to finish), the serial
prefill lane's backlog, the request's uncached tokens x prefill time + overhead. Greedy on that alone it spreads what it could keep
together: a burst of one prefix family, or a family no engine holds any more after a flush,
lands on whichever lanes are free and every copy is computed again, so behind one replica the
guessers (char-tree, prefix-cache) kept more hits than it in W3 and W4, and after flushes its
TTFT p90 was worse than kv-sync's (W4, one seed: hit rate 60.0% against char-tree's 62.7%, p90
0.30 s against kv-sync's 0.20 s). So it also remembers where it placed each prefix: per pod, the
prompt blocks of its requests not finished yet, and the blocks a flush dropped and no eviction
has removed since (a mirror fed by the engines' raw events keeps them). Its cost for a pod is the
predicted TTFT plus the prefill time of the leading prompt tokens that some pod holds, was sent or held before a flush,
and this pod does not (ORACLE_AFFINITY = 1: a copy is charged again what it costs now). It picks
the minimum (ties: fewer running, then name). With that memory, W3/W4 seed 1 (`--quick`): hit
rate 73.4 -> 76.2% and 60.0 -> 63.1%, p90 0.160 -> 0.138 s and 0.303 -> 0.169 s; it costs some
TTFT where spreading paid (W5 p90 0.042 -> 0.054 s, W2 0.22 -> 0.34 s). It is a greedy reference
with perfect knowledge, not a proof of optimality: a policy may still beat it (the report lists
those cases as [info]); the workload-level `compulsory_hit_rate` (every distinct block computed
once in the cluster) is the hit-rate bound no router can exceed.
On workloads with a model shape or requests with extra keys (W8-W10) the mirror, keyed by (parent,
tokens) over one group, cannot follow the engines' blocks (several groups, sparse events whose token ids
span skipped blocks, salts and media on blocks with equal tokens), so the oracle keeps no flush memory
there, and keys its placement memory with salts and media (routing_workloads.request_keys).

Each finished request reaches the Routers' engine profiles as a watched response reaches the gateway's (its
uncached tokens, TTFT, TPOT, running count at routing and request id), so the scorers that predicted its TTFT
(`slo`, `ttft`) learn each engine's overhead from it, on the virtual clock.
Requests carry their cache_salt and media to the engines and, as RouteRequest.extras, to the Routers.
For kv-sync and slo the run also sums, per pick, the tokens the index promised on the picked engine
(Decision.matched_blocks x the index's block size) and that engine's own hit at that moment
(EngineModel.prefix_hit): believed_share and at_pick_share. `ceiling` replays a workload on one engine of
the fleet's whole capacity.
"""
from __future__ import annotations

import asyncio
import dataclasses
import heapq
import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.chartree import CharTreePolicy
from bench.routing_workloads import BLOCK_SIZE, Workload, prefix_keys, request_keys
from kvcache.blockkeys import BlockExtras, MediaItem
from kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvcache.index import PrefixIndex
from kvcache.wire import WireError, decode_batch, encode_batch
from routing.state.counts import LocalCounts
from routing.state.engine_metrics import EngineLoad
from routing.pods import KVEventsEndpoint, Pod
from routing.registry import PodRegistry
from routing.scheduling.sessions import SessionStore
from routing.state.prompt_relay import LocalRelay
from routing.router import Router
from routing.learning.predictor import OutputPredictor, bucket as _predict_bucket
from routing.learning.profiles import EngineProfiles
from routing.scheduling.scoring import RouteRequest
from routing.scheduling.slo import Capacity
from routing.scheduling.strategies import StrategyConfig
from sim.engine import Completion, EngineConfig, EngineModel
from sim.shapes import shaped

MODEL = "sim-model"
GENERATION = "0.33"
ORACLE = "oracle"
CHAR_TREE = "char-tree"  # bench.chartree, not a Router strategy


@dataclass(frozen=True, slots=True)
class Policy:
    name: str  # as reported
    strategy: str  # a Router strategy name, or ORACLE
    delay_s: float = 0.0
    loss: float = 0.0
    gateways: int = 1  # gateway replicas, requests dealt in turn; see the module docstring
    dp_ranks: bool = True  # False: a data-parallel pod is one target, its engine's balancer picks the rank

    def __post_init__(self) -> None:
        if not (self.delay_s >= 0 and 0 <= self.loss < 1 and self.gateways >= 1):
            raise ValueError(f"policy {self.name}: need delay_s >= 0, 0 <= loss < 1, gateways >= 1")


@dataclass(slots=True)
class RunResult:
    policy: str
    seed: int
    hit_rate: float
    ttft_p50_s: float
    ttft_p90_s: float
    throughput_tok_s: float
    max_over_mean_running: float
    requests: int
    ttft_mean_s: float = 0.0
    ttft_p99_s: float = 0.0
    batches_published: int = 0
    batches_decoded: int = 0
    batches_lost: int = 0
    repeat_miss_share: float = 0.0  # requests that recomputed a prefix block an earlier request had computed
    evicted_blocks: int = 0  # BlockRemoved blocks over every engine (evictions; flushes not counted)
    flushed_blocks: int = 0  # cached blocks dropped by scheduled flushes
    routed: dict = field(default_factory=dict)  # engine (pod, or <pod>#<rank>) -> requests sent there
    decode_skipped: dict = field(default_factory=dict)  # reason -> count, from decode_batch (and WireError)
    index_stats: dict = field(default_factory=dict)
    slo_attainment: float | None = None  # requests with targets: the share meeting both TTFT and TPOT
    slo_by_class: dict = field(default_factory=dict)  # (ttft, tpot) targets -> attainment
    # the slo policy's output prediction once warm (requests after the first quarter): median |log2 bucket error|
    predict_bucket_error_median: float | None = None
    predict_samples: int = 0
    # kv-sync / slo: prompt tokens the index promised on the picked engine, over prompt tokens (its believed
    # hit rate), what that engine would have served at that moment (EngineModel.prefix_hit at the pick), and of
    # that what its events had announced (the blocks of prompts still prefilling are cached, not yet announced)
    believed_share: float | None = None
    at_pick_share: float | None = None
    announced_share: float | None = None
    # every policy: prompt tokens that another engine in the fleet held beyond the picked engine's hit, at the pick
    # (the pick's own loss), and that no engine held (lost before the pick: never computed, evicted, flushed)
    held_elsewhere_share: float = 0.0
    held_nowhere_share: float = 0.0


class _CacheMirror:
    """Every engine's cache, exactly, from its raw events: the oracle's view. Also, per engine, the
    blocks a flush (AllBlocksCleared) dropped and no eviction removed since: where prefixes were."""

    def __init__(self, pods: list[str]) -> None:
        self._child: dict[tuple[object, tuple[int, ...]], object] = {}  # (parent hash, block tokens) -> hash
        self.held: dict[str, set] = {p: set() for p in pods}
        self.flushed: dict[str, set] = {p: set() for p in pods}

    def add_pod(self, pod: str) -> None:
        self.held.setdefault(pod, set())
        self.flushed.setdefault(pod, set())

    def apply(self, pod: str, batch: EventBatch) -> None:
        held = self.held[pod]
        for ev in batch.events:
            if type(ev) is BlockStored:
                parent, bs, toks = ev.parent_block_hash, ev.block_size, ev.token_ids
                for i, h in enumerate(ev.block_hashes):
                    self._child[(parent, toks[i * bs:(i + 1) * bs])] = h
                    held.add(h)
                    parent = h
            elif type(ev) is BlockRemoved:
                held.difference_update(ev.block_hashes)
                self.flushed[pod].difference_update(ev.block_hashes)
            elif type(ev) is AllBlocksCleared:
                self.flushed[pod] |= held
                held.clear()

    def _chain(self, tokens: tuple[int, ...]) -> list:
        chain = []
        h = None
        for i in range((len(tokens) - 1) // BLOCK_SIZE):
            h = self._child.get((h, tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]))
            if h is None:
                break
            chain.append(h)
        return chain

    def hit_tokens(self, tokens: tuple[int, ...]) -> dict[str, int]:
        """Per pod, prompt tokens the engine would serve from cache now (vLLM's rule)."""
        return self.hits_and_flushed(tokens)[0]

    def hits_and_flushed(self, tokens: tuple[int, ...]) -> tuple[dict[str, int], dict[str, int]]:
        """Per pod: the hit tokens, and the leading tokens held or dropped by a flush since."""
        chain = self._chain(tokens)
        hits, was = {}, {}
        for pod, held in self.held.items():
            flushed = self.flushed[pod]
            n = 0
            for h in chain:
                if h not in held:
                    break
                n += 1
            m = n
            for h in chain[n:]:
                if h not in held and h not in flushed:
                    break
                m += 1
            hits[pod], was[pod] = n * BLOCK_SIZE, m * BLOCK_SIZE
        return hits, was


ORACLE_AFFINITY = 1.0  # see _Oracle


class _Oracle:
    """Exact cache + own load ledger -> minimum predicted TTFT plus the cost of copying a prefix
    another engine holds or is being sent (see the module docstring)."""

    def __init__(self, engines: dict[str, EngineModel], config: EngineConfig,
                 affinity: float = ORACLE_AFFINITY, exact: bool = False) -> None:
        self._engines = engines
        self._c = config
        self._affinity = affinity
        # exact: for models of several KV cache groups and requests with extra keys, whose blocks the token-keyed
        # mirror cannot follow: no flush memory
        self._exact = exact
        self.mirror = _CacheMirror(list(engines))
        self._lane_free = dict.fromkeys(engines, 0.0)
        self._out_tokens = dict.fromkeys(engines, 0)  # decode work (tokens) routed and not finished
        # per pod, the prompt block keys (routing_workloads.prefix_keys) of requests sent there and
        # not finished: where each prefix was sent, cached yet or not, flushed since or not
        self._placed: dict[str, Counter[int]] = {p: Counter() for p in engines}

    def add(self, pod: str, engine: EngineModel) -> None:
        """An engine joined: a candidate from now on."""
        self._engines[pod] = engine
        self.mirror.add_pod(pod)
        self._lane_free[pod] = 0.0
        self._out_tokens[pod] = 0
        self._placed[pod] = Counter()

    def pick(self, tokens: tuple[int, ...], max_tokens: int, now: float, cache_salt: str | None = None,
             media: tuple[MediaItem, ...] = ()) -> tuple[str, tuple]:
        c = self._c
        # the engine's own hit: what it holds, the blocks of prompts it has scheduled and not yet announced too
        # (the prompt hashed once for the fleet)
        engines = list(self._engines.values())
        hits = dict(zip(self._engines, engines[0].prefix_hits(engines, tokens, cache_salt=cache_salt, mm_items=media)))
        if self._exact:
            was = hits
        else:  # and the blocks a flush dropped, from the mirror
            _, flushed = self.mirror.hits_and_flushed(tokens)
            was = {pod: max(hits[pod], flushed[pod]) for pod in hits}
        extras = BlockExtras(cache_salt=cache_salt, media=media) if cache_salt is not None or media else None
        keys = prefix_keys(tokens, BLOCK_SIZE, extras)[:(len(tokens) - 1) // BLOCK_SIZE]
        have = {}
        for pod, placed in self._placed.items():
            n = 0
            for k in keys:
                if k not in placed:
                    break
                n += 1
            have[pod] = max(was[pod], n * BLOCK_SIZE)
        most = max(have.values())
        best = None
        for pod, eng in self._engines.items():
            m = eng.metrics()
            busy = m.running + m.waiting
            admit = now
            if busy >= c.max_num_seqs:
                # the decoding batch drains at max_num_seqs per (step time x mean tokens left)
                step = c.tpot_base_s + c.tpot_per_seq_s * m.running
                per_req = self._out_tokens[pod] / max(busy, 1)
                admit += (busy - c.max_num_seqs + 1) * per_req * step / c.max_num_seqs
            start = max(admit, self._lane_free[pod])
            ttft = start + c.prefill_s_per_token * (len(tokens) - hits[pod]) + c.ttft_overhead_s - now
            cost = ttft + self._affinity * c.prefill_s_per_token * (most - have[pod])
            key = (cost, busy, pod)
            if best is None or key < best[0]:
                best = (key, pod, start + c.prefill_s_per_token * (len(tokens) - hits[pod]))
        assert best is not None  # there is at least one engine
        _, pod, lane_end = best
        self._lane_free[pod] = lane_end
        self._out_tokens[pod] += max_tokens
        self._placed[pod].update(keys)
        return pod, (max_tokens, keys)

    def place(self, pod: str, max_tokens: int) -> tuple:
        """A request sent to `pod` by necessity (a conversation only it stored): its output counted there."""
        self._out_tokens[pod] += max_tokens
        return max_tokens, ()

    def finished(self, pod: str, handle: tuple) -> None:
        max_tokens, keys = handle
        self._out_tokens[pod] -= max_tokens
        self._placed[pod].subtract(keys)
        placed = self._placed[pod]
        for k in keys:
            if placed[k] <= 0:
                del placed[k]


class _EngineLoads:
    """What routing.state.engine_metrics.EngineMetrics gives the `queue` and `kv-util` scorers, read from
    the simulated engines at pick time: a scrape without delay, the best case for those scorers.
    They score only when a strategy's weights include them (`--weights`)."""

    def __init__(self, engines: dict[str, EngineModel], ranks: dict[str, list[str]] | None = None) -> None:
        self._engines = engines
        self._ranks = ranks if ranks is not None else {k: [k] for k in engines}  # pod -> its engines' keys

    def get(self, pod: str, rank: int | None = None) -> EngineLoad | None:
        keys = self._ranks.get(pod)
        if keys is None:
            return None
        if rank is not None and len(keys) > 1:  # one rank's own numbers, as vLLM's `engine` label gives
            keys = keys[rank:rank + 1]
        ms = [self._engines[k].metrics() for k in keys]  # summed over ranks, usage averaged, as scraped
        return EngineLoad(waiting=float(sum(m.waiting for m in ms)), running=float(sum(m.running for m in ms)),
                          kv_usage=sum(m.kv_usage for m in ms) / len(ms), at=self._engines[keys[0]].now)

    def unreachable(self, pod: str) -> bool:
        return False


def engine_config(workload: Workload) -> EngineConfig:
    """The `kvgate sim` defaults, with the workload's KV capacity and batch limit."""
    cfg = EngineConfig(block_size=BLOCK_SIZE, num_blocks=workload.blocks_per_pod,
                       max_num_seqs=workload.shape.max_num_seqs)
    shape = getattr(workload.shape, "model_shape", None)
    if shape is None:
        return cfg
    s = workload.shape
    return shaped(cfg, shape, getattr(s, "retention", "sparse") if shape != "dense" else None,
                  getattr(s, "sliding_window", 128))


def exact_oracle(workload: Workload) -> bool:
    """Whether the oracle keeps no flush memory: its mirror cannot follow the workload's blocks (see _Oracle)."""
    return getattr(workload.shape, "model_shape", None) is not None or any(
        r.extras is not None for r in workload.requests)


def ceiling(workload: Workload) -> float:
    """The hit rate of one engine holding the whole fleet's KV capacity (every starting engine's blocks)
    given the same requests at the same virtual times: the fleet pooled into one engine, its batch slots
    (max_num_seqs x engines) and its throughput (prefill time per token and decode time per running request
    divided by the engine count, so a full batch steps as fast as one engine's and the one prefill lane
    prefills as many tokens per second as the fleet's lanes): requests queue about as they would on the
    fleet, and every prefix is in the one cache. Hit rate from that engine's own counters."""
    cfg = engine_config(workload)
    n = workload.pods_at_start + workload.dp_size - 1
    engine = EngineModel(dataclasses.replace(
        cfg, num_blocks=cfg.num_blocks * n, max_num_seqs=cfg.max_num_seqs * n,
        prefill_s_per_token=cfg.prefill_s_per_token / n, tpot_per_seq_s=cfg.tpot_per_seq_s / n))
    for r in workload.requests:
        while (t := engine.next_event_time()) is not None and t <= r.arrival:
            engine.advance(t)
        engine.add_request(r.req_id, r.token_ids, r.max_tokens, r.arrival, cache_salt=r.cache_salt, mm_items=r.media)
        engine.drain_events()  # not read: dropped as they come
    while (t := engine.next_event_time()) is not None:
        engine.advance(t)
    m = engine.metrics()
    return m.prefix_cache_hits / m.prefix_cache_queries if m.prefix_cache_queries else 0.0


def reusable_tokens(workload: Workload) -> dict[str, int]:
    """Per request id, the prompt tokens a cache could serve if every block ever computed stayed
    cached everywhere: the longest block-aligned prefix shared with any earlier request, at most
    `len - 1` tokens (vLLM's rule). (No workload's prompts contain engine outputs (the chat
    workloads' replies are synthetic), so prompt blocks are all a cache could hold for them.)"""
    bs = BLOCK_SIZE
    seen: set[int] = set()
    out = {}
    for r in sorted(workload.requests, key=lambda r: r.arrival):
        keys = request_keys(r, bs)
        hit = 0
        for key in keys[:(len(r.token_ids) - 1) // bs]:
            if key not in seen:
                break
            hit += 1
        out[r.req_id] = hit * bs
        seen.update(keys)
    return out


def ttft_floor(workload: Workload) -> np.ndarray:
    """Per request (in arrival order), a TTFT no router can beat on these engines: overhead +
    prefill of the prompt tokens past reusable_tokens, as if every block ever computed stayed
    cached everywhere and no request ever waited, flushes ignored. Its percentiles bound every
    policy's: with TTFT >= floor request by request, each order statistic is >= the floor's."""
    cfg = engine_config(workload)
    reusable = reusable_tokens(workload)
    return np.array([cfg.ttft_overhead_s + cfg.prefill_s_per_token * (len(r.token_ids) - reusable[r.req_id])
                     for r in sorted(workload.requests, key=lambda r: r.arrival)])


def run(workload: Workload, policy: Policy, seed: int, strategy_config: StrategyConfig | None = None) -> RunResult:
    """Simulate `workload` routed by `policy`; deterministic in (workload, policy, seed)."""
    return asyncio.run(_run(workload, policy, seed, strategy_config))


async def _run(workload: Workload, policy: Policy, seed: int, strategy_config: StrategyConfig | None) -> RunResult:
    cfg = engine_config(workload)
    pod_names = [f"pod-{i}" for i in range(workload.total_pods)]
    dp = workload.dp_size
    dp_pod = pod_names[workload.pods_at_start - 1] if dp > 1 else None  # the last starting pod
    ranks = {n: [f"{n}#{r}" for r in range(dp)] if n == dp_pod else [n] for n in pod_names}  # pod -> engines
    owner = {k: (n, r if n == dp_pod else 0) for n, keys in ranks.items() for r, k in enumerate(keys)}
    names = [k for n in pod_names for k in ranks[n]]  # every engine (a DP pod's ranks one by one)
    engines = {k: EngineModel(dataclasses.replace(cfg, data_parallel_rank=owner[k][1]) if k != owner[k][0] else cfg)
               for k in names}
    active = pod_names[:workload.pods_at_start]  # in the fleet; the others join on schedule
    active_keys = [k for n in active for k in ranks[n]]
    index = PrefixIndex()
    oracle = (_Oracle({k: engines[k] for k in active_keys}, cfg, exact=exact_oracle(workload))
              if policy.strategy == ORACLE else None)
    routers: list[Router] = []
    capacity: Capacity | None = None
    capacities: list[Capacity] = []
    trees: list[CharTreePolicy] = []
    clock = [0.0]  # virtual now, for the strategies' time-based estimates (kv-sync's prefill backlog)
    config = dataclasses.replace(strategy_config or StrategyConfig(), clock=lambda: clock[0])
    all_pods = [Pod(name=n, address="127.0.0.1", port=8000 + i, model=MODEL,
                    kv_events=KVEventsEndpoint(dp_size=dp if n == dp_pod and policy.dp_ranks else 1))
                for i, n in enumerate(pod_names)]
    registry = PodRegistry(all_pods[:len(active)])
    if policy.strategy == CHAR_TREE:
        trees = [CharTreePolicy(active, f"char-tree:{seed}:{g}") for g in range(policy.gateways)]
    elif oracle is None:
        counts = LocalCounts()
        loads = _EngineLoads(engines, ranks)
        # Engine profiles, output history and the prefill queue's counts are shared by the replicas
        # (through Redis in a deployment, with no lag here, as the running counts); the queue's tokens
        # leave at the request's first token, which the replica that routed it observes in the response
        # (and only it: each replica's Capacity knows its own requests' first tokens).
        capacity = Capacity(EngineProfiles(prefill_tokens_per_s=config.prefill_tokens_per_s, clock=lambda: clock[0]),
                            OutputPredictor(rng=random.Random(f"predict:{seed}"), clock=lambda: clock[0]),
                            clock=lambda: clock[0], prefill=LocalCounts())
        capacities = [capacity.replica() for _ in range(policy.gateways)]
        # The sessions (W12's conversations) are shared by the replicas, as through Redis in a deployment.
        session_store = SessionStore(ttl_s=3600.0, clock=lambda: clock[0])
        routers = [Router(registry, default_strategy=policy.strategy, counts=counts, index=index,
                          engines=loads,  # type: ignore[arg-type]  # EngineMetrics' reads, from the sim engines
                          config=config, seed=seed if g == 0 else seed * 1000 + g, capacity=capacities[g],
                          sessions=session_store)
                   for g in range(policy.gateways)]
        relay = LocalRelay()  # the replicas' running prompts, shared as through Redis in a deployment, with no lag
        for g, router in enumerate(routers):
            if router.prompts is not None:
                relay.join(f"gw{g}", router.prompts)
    started: dict[str, tuple[int, str]] = {}  # req_id -> (running on its engine at routing, engine)
    prefilling: dict[str, set[str]] = {k: set() for k in names}  # engine -> routed, no first token yet

    def first_tokens(key: str) -> None:
        waiting = prefilling[key]
        if capacity is None or not waiting:
            return
        for rid in [rid for rid in waiting if engines[key].first_token_time(rid) is not None
                    or not engines[key].is_live(rid)]:
            waiting.discard(rid)
            capacities[int(rid[1:]) % len(capacities)].first_token(rid)  # request i went to replica i % n
    bucket_errors: list[int] = []
    warm_at = workload.requests[len(workload.requests) // 4].arrival if workload.requests else 0.0
    feed_index = policy.strategy in ("kv-sync", "slo")
    loss_rng = random.Random(f"loss:{seed}")
    # the fleet's scheduled changes, in time order: (time, kind, pod index)
    changes = sorted([(t, "flush", i) for t, i in workload.flushes] + [(t, "join", i) for t, i in workload.joins])
    ci = 0

    deliveries: list[tuple[float, int, str, bytes]] = []
    seq = 0
    published = decoded = lost = evicted = flushed = 0
    # prompt tokens the index promised on the picked engine / that engine's hit then / of it, what was announced
    believed = at_pick = announced = 0
    elsewhere = nowhere = 0  # prompt tokens at the pick: held by another engine beyond the pick's hit; by none
    skipped: Counter[str] = Counter()
    next_t = dict.fromkeys(names, math.inf)
    inflight: dict[str, tuple[str, Any]] = {}  # req_id -> (pod, (router, decision), max_tokens or None)
    running = dict.fromkeys(names, 0)  # per engine, routed and not finished
    tree_loads = [dict.fromkeys(pod_names, 0) for _ in trees]  # per char-tree replica: its own requests per pod
    routed = dict.fromkeys(names, 0)
    ratios: list[float] = []
    completions: list[Completion] = []

    def pump(key: str, now: float) -> None:
        nonlocal seq, published, lost, evicted
        t = engines[key].next_event_time()
        next_t[key] = math.inf if t is None else t
        for batch in engines[key].drain_events():
            for ev in batch.events:
                if type(ev) is BlockRemoved:
                    evicted += len(ev.block_hashes)
            if oracle is not None:
                oracle.mirror.apply(key, batch)
            if not feed_index:
                continue
            published += 1
            payload = encode_batch(batch, GENERATION)
            if policy.loss and loss_rng.random() < policy.loss:
                lost += 1
                continue
            seq += 1
            heapq.heappush(deliveries, (now + policy.delay_s, seq, owner[key][0], payload))

    async def finish(key: str, done: list[Completion]) -> None:
        for comp in done:
            completions.append(comp)
            if capacity is not None:  # what kvgate observes of a response: fed to profiles and prediction
                at_start, _ = started.pop(comp.req_id, (0, key))
                n_out = len(comp.output_token_ids)
                tpot = (comp.finish_time - comp.first_token_time) / (n_out - 1) if n_out > 1 else None
                capacity.profiles.observe(owner[key][0],
                                          uncached_tokens=comp.prompt_tokens - comp.cached_tokens,
                                          ttft=comp.ttft, tpot=tpot, running=at_start, request_id=comp.req_id)
                capacity.predictor.add(MODEL, comp.prompt_tokens, n_out, now=comp.finish_time)
            _, handle = inflight.pop(comp.req_id)
            running[key] -= 1
            if routers:
                router, decision = handle
                await router.release(decision)
            elif trees:
                tree_loads[handle][owner[key][0]] -= 1
            elif oracle is not None:
                oracle.finished(key, handle)

    stored_on: dict[str, str] = {}  # a conversation -> the engine that answered its last turn (W12)
    # W12's conversations as sessions (x-session-id) for the session-affinity policy only: the others route as
    # for clients that send no session header (agent frameworks mostly do not)
    by_session = policy.strategy == "session-affinity"

    async def continue_on(stored: str, r: Any, i: int) -> tuple[str, Any]:
        """A Responses API turn by previous_response_id, to the pod that stored the conversation: kvgate routes
        it there without tokens (a subset of that pod: its running count taken, its rank by load); char-tree and
        the oracle send it there too (it would 404 anywhere else)."""
        pod = owner[stored][0]
        if routers:
            router = routers[i % len(routers)]
            endpoint = next(p.endpoint for p in all_pods if p.name == pod)
            decision = await router.pick(RouteRequest(MODEL, None, None, r.req_id,
                                                      session=r.session if by_session else None),
                                         subset=frozenset((endpoint,)))
            key = least_loaded_rank(pod) if decision.rank is None else ranks[pod][decision.rank]
            return key, (router, decision)
        if trees:
            g = i % len(trees)
            tree_loads[g][pod] += 1
            return least_loaded_rank(pod), g
        assert oracle is not None
        return stored, oracle.place(stored, r.max_tokens)

    def least_loaded_rank(pod: str) -> str:
        """The engine's own balancer: its least loaded rank (running + waiting), the first on ties."""
        keys = ranks[pod]
        if len(keys) == 1:
            return keys[0]
        return min(keys, key=lambda k: (lambda m: m.running + m.waiting)(engines[k].metrics()))

    reqs = workload.requests
    i = 0
    while True:
        ta = reqs[i].arrival if i < len(reqs) else math.inf
        te = min(next_t.values())
        td = deliveries[0][0] if deliveries else math.inf
        tc = changes[ci][0] if ci < len(changes) else math.inf
        t = min(ta, te, td, tc)
        if t == math.inf:
            break
        clock[0] = t
        if te <= t:
            for key in names:
                if next_t[key] <= t:
                    await finish(key, engines[key].advance(t))
                    first_tokens(key)
                    pump(key, t)
        elif td <= t:
            while deliveries and deliveries[0][0] <= t:
                _, _, pod, payload = heapq.heappop(deliveries)
                try:
                    result = decode_batch(payload)
                except WireError:  # counted, like the subscriber does; the run goes on
                    skipped["undecodable_batch"] += 1
                    continue
                decoded += 1
                skipped.update(result.skipped)
                index.apply(pod, MODEL, result.batch.data_parallel_rank or 0, result.batch.events)
        elif tc <= t:
            _, kind, k = changes[ci]
            ci += 1
            pod = pod_names[k]
            if kind == "flush":  # every rank of the pod: its /reset_prefix_cache resets them all
                for key in ranks[pod]:
                    flushed += engines[key].metrics().cached_blocks
                    engines[key].reset_prefix_cache(t, force=True)
                    await finish(key, engines[key].advance(t))
            else:  # join: discovery reports the new engine; every router, tree and the oracle follow
                active.append(pod)
                active_keys.extend(ranks[pod])
                registry.replace(all_pods[:len(active)])
                for tree in trees:
                    tree.add_pod(pod, t)
                if oracle is not None:
                    for key in ranks[pod]:
                        oracle.add(key, engines[key])
            for key in ranks[pod]:
                pump(key, t)
        else:
            r = reqs[i]
            handle: Any  # what finish() needs to release the pick: (router, decision), the replica, the oracle's
            indexed_pick = False  # kv-sync's / slo's own pick: its hit at the pick counted (at_pick)
            stored = stored_on.get(r.session) if r.continues and r.session is not None else None
            if stored is not None:  # previous_response_id: the engine that stored the conversation, any policy
                key, handle = await continue_on(stored, r, i)
            elif routers:
                router = routers[i % len(routers)]
                decision = await router.pick(RouteRequest(MODEL, list(r.token_ids), None, r.req_id,
                                                          slo_ttft_s=r.slo_ttft_s or None,
                                                          slo_tpot_s=r.slo_tpot_s or None, extras=r.extras,
                                                          session=r.session if by_session else None))
                pod, handle = decision.pod.name, (router, decision)
                key = least_loaded_rank(pod) if decision.rank is None else ranks[pod][decision.rank]
                if feed_index:
                    indexed_pick = True
                    believed += decision.matched_blocks * (index.block_size(MODEL) or BLOCK_SIZE)
                    announced += engines[key].prefix_hit(r.token_ids, cache_salt=r.cache_salt, mm_items=r.media,
                                                         announced=True)
            elif trees:
                g = i % len(trees)
                pod, handle = trees[g].pick(r.token_ids, tree_loads[g], t), g
                tree_loads[g][pod] += 1
                key = least_loaded_rank(pod)
            else:
                assert oracle is not None  # routers, trees or the oracle: one of them is set
                key, handle = oracle.pick(r.token_ids, r.max_tokens, t, r.cache_salt, r.media)
            i += 1
            if r.session is not None:
                stored_on[r.session] = key
            inflight[r.req_id] = (key, handle)
            running[key] += 1
            routed[key] += 1
            hits = engines[key].prefix_hits([engines[k] for k in active_keys], r.token_ids, cache_salt=r.cache_salt,
                                            mm_items=r.media)
            best, mine = max(hits, default=0), hits[active_keys.index(key)]
            elsewhere += best - mine
            nowhere += len(r.token_ids) - best
            if indexed_pick:
                at_pick += mine
            engines[key].add_request(r.req_id, r.token_ids, r.max_tokens, t, cache_salt=r.cache_salt, mm_items=r.media)
            if capacity is not None:
                started[r.req_id] = (running[key], key)
                prefilling[key].add(r.req_id)
                if policy.strategy == "slo" and t >= warm_at:
                    guess = capacity.predictor.predict(MODEL, len(r.token_ids))
                    bucket_errors.append(abs(_bucket(guess) - _bucket(r.max_tokens)))
            pump(key, t)
            busy = [running[k] for k in active_keys]
            ratios.append(max(busy) / (sum(busy) / len(busy)))

    out = _result(workload, policy, seed, engines, completions, ratios, published, decoded, lost, index)
    if bucket_errors:
        out.predict_bucket_error_median = float(np.median(bucket_errors))
        out.predict_samples = len(bucket_errors)
    out.decode_skipped = dict(skipped)
    out.evicted_blocks = evicted
    out.flushed_blocks = flushed
    out.routed = {p: n for p, n in routed.items() if n}
    prompt = sum(len(r.token_ids) for r in reqs)
    if prompt:
        out.held_elsewhere_share = elsewhere / prompt
        out.held_nowhere_share = nowhere / prompt
    if feed_index and routers:
        out.believed_share = believed / prompt if prompt else 0.0
        out.at_pick_share = at_pick / prompt if prompt else 0.0
        out.announced_share = announced / prompt if prompt else 0.0
    return out


def _result(workload: Workload, policy: Policy, seed: int, engines: dict[str, EngineModel],
            completions: list[Completion], ratios: list[float], published: int, decoded: int, lost: int,
            index: PrefixIndex) -> RunResult:
    if len(completions) != len(workload.requests):
        raise RuntimeError(f"{policy.name}: {len(completions)} of {len(workload.requests)} requests finished")
    ms = [e.metrics() for e in engines.values()]
    queries = sum(m.prefix_cache_queries for m in ms)
    ttft = np.array([c.ttft for c in completions])
    start = min(r.arrival for r in workload.requests)
    end = max(c.finish_time for c in completions)
    out_tokens = sum(len(c.output_token_ids) for c in completions)
    reusable = reusable_tokens(workload)
    repeat = sum(c.cached_tokens < reusable[c.req_id] for c in completions)
    slo, by_class = _attainment(workload, completions)
    return RunResult(
        slo_attainment=slo, slo_by_class=by_class,
        policy=policy.name, seed=seed,
        hit_rate=sum(m.prefix_cache_hits for m in ms) / queries if queries else 0.0,
        ttft_p50_s=float(np.percentile(ttft, 50)), ttft_p90_s=float(np.percentile(ttft, 90)),
        ttft_mean_s=float(ttft.mean()), ttft_p99_s=float(np.percentile(ttft, 99)),
        throughput_tok_s=out_tokens / (end - start) if end > start else 0.0,
        max_over_mean_running=float(np.mean(ratios)) if ratios else 0.0,
        repeat_miss_share=repeat / len(completions) if completions else 0.0,
        requests=len(completions), batches_published=published, batches_decoded=decoded, batches_lost=lost,
        index_stats=index.stats() if decoded else {},
    )


def _bucket(tokens: int) -> int:
    return _predict_bucket(tokens, 21)


def _attainment(workload: Workload, completions: list[Completion]) -> tuple[float | None, dict]:
    """Share of the requests that met both their targets (TTFT, and TPOT over the tokens after the first); a
    request naming none is held to the defaults a kvgate replica holds it to (the slo scorer's, KVGATE_SLO_TARGETS'
    default), so every workload reports attainment."""
    default = Capacity.default_targets
    targets = {r.req_id: (r.slo_ttft_s, r.slo_tpot_s) if r.slo_ttft_s > 0 else default for r in workload.requests}
    if not targets:
        return None, {}
    met: Counter = Counter()
    seen: Counter = Counter()
    for c in completions:
        t = targets.get(c.req_id)
        if t is None:
            continue
        n = len(c.output_token_ids)
        tpot = (c.finish_time - c.first_token_time) / (n - 1) if n > 1 else 0.0
        ok = c.ttft <= t[0] and tpot <= t[1]
        key = f"{t[0] * 1000:g}ms/{t[1] * 1000:g}ms"
        seen[key] += 1
        met[key] += ok
    return sum(met.values()) / sum(seen.values()), {k: met[k] / seen[k] for k in seen}
