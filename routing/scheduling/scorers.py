"""The scorers: each gives every candidate pod 0..1, higher is better."""
from __future__ import annotations

import time
from collections import Counter, OrderedDict
from typing import Callable, Mapping, Protocol, Sequence

from kvcache.blockkeys import BlockExtras, block_keys, extra_digest
from routing.scheduling.approx import ApproxPrefixTable
from routing.scheduling.family import SharedOpening
from routing.state.engine_metrics import EngineMetrics
from routing.pods import Pod
from routing.scheduling.scoring import PickContext, Scorer, rendezvous
from routing.state.counts import RunningCounts
from routing.state.prompts import RunningPrompts


class PrefixMatchLike(Protocol):
    # Read-only: kvcache.index.PrefixMatch is a frozen dataclass.
    @property
    def blocks(self) -> int: ...

    @property
    def by_medium(self) -> Mapping[str, int]: ...

    @property
    def total_blocks(self) -> int: ...


class PrefixSource(Protocol):
    """What `kv-sync` needs of kvcache.index.PrefixIndex. `extras`: what the prompt's block hashes carry besides
    tokens and LoRA (kvcache.blockkeys.BlockExtras); given only when there is some (None is never passed).
    Optional: `block_size(model)` and `pod_cache(pods)` (CacheRoom), read where the source has them."""

    def match(self, model: str, lora: str | None, token_ids: Sequence[int],
              pods: Sequence[str], *, extras: BlockExtras | None = None) -> Mapping[str, PrefixMatchLike]: ...

    def match_ranks(self, model: str, lora: str | None, token_ids: Sequence[int],
                    targets: Sequence[tuple[str, int]], *,
                    extras: BlockExtras | None = None) -> Mapping[tuple[str, int], PrefixMatchLike]: ...

    def stats(self) -> dict: ...


def _relative(values: Mapping[str, float], scale: float) -> dict[str, float]:
    """1 for the smallest value, falling linearly with the gap; a gap of `scale` or the
    spread (whichever is larger) gives 0, so small differences weigh little."""
    if not values:
        return {}
    least = min(values.values())
    span = max(values.values()) - least
    if scale > span:  # max(span, scale)
        span = scale
    return {k: 1.0 - (v - least) / span for k, v in values.items()}


class LoadScorer(Scorer):
    """Fewer running requests (over every gateway, picks not yet finished included) is better."""

    name = "load"
    needs_tokens = False

    def __init__(self, scale: float = 8.0) -> None:
        self._scale = scale

    def score(self, ctx: PickContext, pods: Sequence[Pod]) -> dict[str, float]:
        running = ctx.running.get
        return _relative({p.name: running(p.name, 0) for p in pods}, self._scale)


ROUTED = "\x00routed"  # a pod's key in the shared prefill counts: uncached tokens every gateway routed there (grows)


class PrefillBacklog:
    """Per pod, the prefill work (prompt tokens not served from cache) the gateways sent and the
    engine has probably not done yet: each pick adds its uncached tokens, and the pile drains at
    `tokens_per_s` (an engine prefills one prompt after another). An estimate: it knows the picks and a
    prefill speed: nominal, or per pod (a function of the pod's name: the learned one).

    With `shared` (the replicas' prefill counts, through Redis: plugin.app), a pick also adds to its pod's
    counter of routed tokens (`pod + ROUTED`, which only grows) and `sync` folds the other replicas' additions
    since the last read into the piles (as of the read: they drain from then), so each replica weighs the
    backlog all of them made, its own picks as before. Without it, this
    gateway's picks alone: behind two replicas each piled long prompts onto a pod the other had just loaded
    (bench routing W3 heavy, 3 seeds: kv-sync's TTFT mean 80.8 ms behind 2 replicas, 60.8 behind 1)."""

    def __init__(self, tokens_per_s: float | Callable[[str], float],
                 clock: Callable[[], float] = time.monotonic, shared: RunningCounts | None = None) -> None:
        if not callable(tokens_per_s):
            if not tokens_per_s > 0:
                raise ValueError("tokens_per_s must be positive")
            nominal = tokens_per_s
            tokens_per_s = lambda pod: nominal  # noqa: E731
        self._rate = tokens_per_s
        self._clock = clock
        self._piles: dict[str, tuple[float, float]] = {}  # pod -> (tokens, as of time)
        self.shared = shared
        self._seen: dict[str, int] | None = None  # pod -> its shared counter when last read (None: never read)

    # A counter that jumped by more than this many seconds of its pod's prefill since the last read is history
    # come back (the other replicas' view returning after Redis was out of reach), not backlog.
    HISTORY_S = 10.0

    def sync(self) -> None:
        """Fold what every replica routed since the last read into the piles (with `shared`; else nothing). The
        first read, a counter that went back (a replica's share expired) and a jump longer than HISTORY_S of
        prefill are taken as they are, no news."""
        if self.shared is None:
            return
        now = self._clock()
        first = self._seen is None
        if self._seen is None:
            self._seen = {}
        seen = self._seen
        for key, total in self.shared.totals().items():
            if not key.endswith(ROUTED):
                continue
            pod = key[:-len(ROUTED)]
            new = total - seen.get(pod, 0)
            seen[pod] = total
            if not first and 0 < new <= self._rate(pod) * self.HISTORY_S:
                self._pile(pod, new, now)

    def now(self) -> float:
        return self._clock()

    def get(self, pod: str, now: float | None = None) -> float:
        entry = self._piles.get(pod)
        if entry is None:
            return 0.0
        tokens, at = entry
        now = self._clock() if now is None else now
        left = tokens - (now - at) * self._rate(pod)
        return left if left > 0.0 else 0.0  # max(0.0, left)

    def add(self, pod: str, tokens: float) -> None:
        if self.shared is not None and tokens >= 1:  # counted where every replica reads it
            self.shared.add(pod + ROUTED, int(tokens))
            if self._seen is not None:  # piled here now, so not again when the next sync reads it back
                self._seen[pod] = self._seen.get(pod, 0) + int(tokens)
        self._pile(pod, tokens, self._clock())

    def _pile(self, pod: str, tokens: float, now: float) -> None:
        left = self.get(pod, now)
        if left + tokens > 0:
            self._piles[pod] = (left + tokens, now)
        else:
            self._piles.pop(pod, None)


class CacheRoom:
    """Per pod, how many more blocks its prefix cache takes before it evicts, learnt from the index
    (`cache`: PrefixIndex.pod_cache: the blocks a pod holds, the BlockRemoved events and the resets seen for
    it), read at each pick. A cache that has evicted is full, and stays full: vLLM takes a new block from
    the head of its free queue, the least recently freed, evicting whatever that held, so once every block
    has held a prefix a new one evicts one whatever the count of blocks held says (blocks of running
    requests not yet full are counted by no event). Its size then is the most blocks it was seen holding.
    After a reset its blocks are free until it evicts again: the room is that size less what it holds.
    Unknown until the first eviction (a cache still filling evicts nothing; a reset before any says nothing
    of the size): no answer for that pod. A stream dropped as untrusted counts as a reset (the index forgets
    what the engine holds): room is seen where there is none until the engine evicts again."""

    def __init__(self, cache: Callable[[Sequence[str]], Mapping[str, tuple[int, int, int]]]) -> None:
        self._cache = cache
        self._most: dict[str, int] = {}  # pod -> the most blocks it was seen holding
        self._seen: dict[str, tuple[int, int, bool]] = {}  # pod -> (removals, resets, reset since it evicted)

    def rooms(self, pods: Sequence[str]) -> dict[str, int]:
        """Per pod of `pods` whose cache has shown its size, the blocks it takes before it evicts."""
        out = {}
        most, seen = self._most, self._seen
        for pod, (held, removals, resets) in self._cache(pods).items():
            top = most.get(pod, 0)
            if held > top:
                most[pod] = top = held
            last = seen.get(pod)
            fresh = False
            if last is not None:  # a reset and evictions both since: the reset taken as the later
                fresh = last[2]
                if resets != last[1]:
                    fresh = True
                elif removals != last[0]:
                    fresh = False
            seen[pod] = (removals, resets, fresh)
            if removals:
                out[pod] = top - held if fresh else 0
        return out

    def sizes(self) -> dict[str, int]:
        """Per pod whose cache has shown its size, that size in blocks (/debug)."""
        return {pod: self._most.get(pod, 0) for pod, (removals, _, _) in self._seen.items() if removals}

    def forget(self, pod: str) -> None:
        self._most.pop(pod, None)
        self._seen.pop(pod, None)


class AdmissionWait:
    """Seconds a request sent to a pod now waits to be admitted (a batch slot, or the KV blocks its prompt
    needs): none while the pod's engine reports nothing waiting (per its last scrape); else until the
    requests waiting and this one have found room, one finished request each. The running requests are
    spread over their outputs, so of `running` of them the j-th finishes after j / (running + 1) of a
    mean output on average (order statistics of uniform progress), a decode step per token: the wait is
    (waiting + 1) x step x mean output / (running + 1). The step time is the pod's learned one at its
    running batch (routing.learning.profiles), the mean output the model's recent one
    (routing.learning.predictor; `default_output` before any).

    Why running + 1 (it was running alone): with a full batch the two agree (64 running: 1.5% apart;
    bench routing W1, 1 replica, picks at a pod with requests waiting: estimated 0.091 s, real 0.079 s),
    but an engine waiting for KV blocks runs few requests, whose next finish is half an output away, not
    a whole one (W12, 2 replicas, 3 seeds: 0.84 s estimated against 0.44 s real with `running`), and
    the overestimate moved requests off the engine holding their prefix."""

    def __init__(self, engines: EngineMetrics, step_time: Callable[[str, float], float],
                 mean_output: Callable[[str], float | None], default_output: float = 128.0) -> None:
        self._engines = engines
        self._step_time = step_time
        self._mean_output = mean_output
        self._default_output = default_output

    def __call__(self, ctx: PickContext, pod: Pod) -> float:
        load = self._engines.get(pod.pod_name, pod.rank)
        if load is None or load.waiting <= 0:
            return 0.0
        running = max(load.running, 1.0)
        out = self._mean_output(ctx.base_model) or self._default_output
        return (load.waiting + 1) * self._step_time(pod.pod_name, running) * out / (running + 1.0)


class MediumWeights:
    """What a cached block is worth by the medium holding it (GPU 1.0, CPU 0.8 by default; a medium not
    named counts at the lowest weight): blocks on slower media count partly uncached."""

    def __init__(self, medium_weights: Mapping[str, float] | None = None, other_medium_weight: float = 0.8) -> None:
        weights = {m.upper(): w for m, w in (medium_weights or {"GPU": 1.0, "CPU": 0.8}).items()}
        self._ranked = sorted(weights.items(), key=lambda kv: -kv[1])
        self._floor = min([other_medium_weight, *weights.values()])

    def weighted_blocks(self, blocks: int, by_medium: Mapping[str, int]) -> float:
        # Credit blocks to the best medium holding them first; what is left counts at the lowest weight.
        if blocks <= 0:
            return 0.0
        score = 0.0
        covered = 0
        for medium, w in self._ranked:
            n = min(by_medium.get(medium, 0), blocks - covered)
            if n > 0:
                score += n * w
                covered += n
        return score + (blocks - covered) * self._floor


_MATCHES = "\x00matches"  # ctx.state key: the index's answer and the names it is for, asked once per pick


def index_matches(index: PrefixSource, ctx: PickContext, tokens: Sequence[int], pods: Sequence[Pod],
                  names: Sequence[str]) -> Mapping[str, PrefixMatchLike]:
    """The index's answer per candidate name: per pod, or per rank where the candidates are data-parallel
    rank targets. The prompt's extra keys go with it only when it has some (a plain prompt, most of them:
    the call as it always was). Asked once per pick: slo's cost model asks first, then kv-sync's prefix score
    among slo's safe pods (a subset), which reads the same answer (a pod's match depends on that pod only)."""
    asked = ctx.state.get(_MATCHES)
    if asked is not None and asked[0] is tokens and asked[1].issuperset(names):
        return {n: m for n in names if (m := asked[2].get(n)) is not None}
    matches = _ask_index(index, ctx, tokens, pods, names)
    ctx.state[_MATCHES] = (tokens, frozenset(names), matches)
    return matches


def _ask_index(index: PrefixSource, ctx: PickContext, tokens: Sequence[int], pods: Sequence[Pod],
               names: Sequence[str]) -> Mapping[str, PrefixMatchLike]:
    extras = ctx.request.extras
    if ctx.ranks:  # data-parallel rank targets among the candidates: what each rank holds
        targets = [(p.pod_name, p.rank or 0) for p in pods]
        by_rank = (index.match_ranks(ctx.base_model, ctx.lora, tokens, targets) if extras is None else
                   index.match_ranks(ctx.base_model, ctx.lora, tokens, targets, extras=extras))
        return {p.name: m for p in pods if (m := by_rank.get((p.pod_name, p.rank or 0))) is not None}
    if extras is None:
        return index.match(ctx.base_model, ctx.lora, tokens, names)
    return index.match(ctx.base_model, ctx.lora, tokens, names, extras=extras)


def prompt_block_size(size: Callable[[str], int | None] | None, model: str, n_tokens: int, total_blocks: int) -> int:
    """The model's block size as the index knows it (`size`: its block_size, if it has one), else the prompt's
    tokens over the index's block count."""
    bs = size(model) if size is not None else None
    return bs if bs else max(1, n_tokens // max(total_blocks, 1))


def uncached_tokens(matches: Mapping[str, PrefixMatchLike], names: Sequence[str], n: int, bs: int,
                    media: MediumWeights, matched: dict[str, int], least: float) -> dict[str, float]:
    """Per pod of `names` the index answered for, the prompt's tokens (n) it does not hold (at least
    `least`), its cached blocks capped at the prompt's length - 1 (vLLM always computes the last token)
    and recorded in `matched`."""
    out: dict[str, float] = {}
    cap = (n - 1) // bs
    for name in names:
        m = matches.get(name)
        if m is None:
            continue
        blocks = matched[name] = m.blocks if m.blocks <= cap else cap
        if not blocks:  # holds none of it (most pods, most of the time)
            out[name] = n
            continue
        left = n - media.weighted_blocks(blocks, m.by_medium or {}) * bs
        out[name] = left if left > least else least
    return out


_CLAIMED = "\x00claimed"  # ctx.state key: RunningPrompts.held's answer and the names it is for, asked once per pick


def running_prompts_held(prompts: RunningPrompts | None, ctx: PickContext, pods: Sequence[Pod], n: int, bs: int,
                         uncached: dict[str, float]) -> dict[str, float]:
    """`uncached` less what each pod is computing for a running request of this gateway's (vLLM caches a
    scheduled request's prompt blocks before computing them: one admitted after it hits them); where that adds
    any, ctx.placed gets each pod's leading blocks held or computed (ctx.matched as filled, raised)."""
    if prompts is None:
        return uncached
    # slo's pick asks twice, as index_matches: its own cost model, then kv-sync's prefix score among its safe pods
    asked = ctx.state.get(_CLAIMED)
    if asked is not None and asked[0].issuperset(p.name for p in pods):
        claimed = asked[1]
    else:
        claimed = prompts.held(ctx.base_model, ctx.lora, ctx.request.token_ids, ctx.request.extras,
                               [(p.name, p.pod_name, p.rank or 0) for p in pods])
        ctx.state[_CLAIMED] = (frozenset(p.name for p in pods), claimed)
    if not claimed:
        return uncached
    cap = (n - 1) // bs
    left = dict(uncached)
    placed = ctx.placed = dict(ctx.matched)
    for name, blocks in claimed.items():
        u = left.get(name)
        if u is None:
            continue
        blocks = min(blocks, cap)
        if blocks > placed.get(name, 0):
            placed[name] = blocks
        if n - blocks * bs < u:
            left[name] = n - blocks * bs
    return left


class PrecisePrefixScorer(Scorer):
    """Estimated time to first token, in prompt tokens to prefill: this request's tokens the pod
    does not hold per the event-fed index (blocks on slower media count partly uncached: GPU 1.0,
    CPU 0.8 by default) plus the pod's prefill backlog (PrefillBacklog, when given). Uncached tokens
    count `uncached_weight` (2) times: this request waits for them, and so does whatever queues
    behind them on that pod. The cheapest pod scores 1; the others fall linearly with their extra
    cost, a whole prompt's worth (or the spread, if larger) giving 0. Without a backlog this is
    the matched share of the prompt.

    With `admission` (AdmissionWait), a pod's wait to admit the request counts too, in the prompt tokens
    prefilled meanwhile, but on a pod holding some of the prompt only beyond the prefill of what it holds:
    leaving it costs that prefill again elsewhere, and the copy evicts as many tokens of other prefixes
    there once that cache is full, while the wait is an estimate (admission needs KV blocks as well as a
    batch slot, and one finish may free blocks for several). Bench routing W12 (agents: 2-8k-token tool
    lists, KV at 67% of the working set), 2 replicas, 3 seeds: with the wait counted in full, kv-sync
    moved conversations off the engine holding their tool list, and each copy evicted other tenants'
    prefixes (hit rate 73.2% against 75.3% without the wait, the oracle 76.9%).

    With `prompts` (routing.state.prompts), a pod also holds what it is computing for this gateway's running
    requests: vLLM caches a scheduled request's prompt blocks before computing them, so a request sent after
    it hits them, while the index learns them from the events, a queue and a prefill later. Without it a
    burst of one tenant's conversations went where the backlog was least, a copy of the tenant's prefix on
    each engine (bench bakeoff, evicting, 24 conversations at a time: hit rate 55.7 -> 71.0%). `ctx.placed`
    gets those holdings (the `affinity` scorer's); `ctx.matched` stays the index's.

    With `room` (CacheRoom), the tokens a pod would cache for this request beyond the room its cache has left
    cost `eviction_weight` (0.5) each: caching them there evicts as many tokens of other prefixes, the pod's
    least recently used (worth less than the prompt's own). Where engines evict steadily that is half the
    uncached tokens again on every full pod (a copy of a prefix elsewhere evicts as much there); a full pod
    whose cache was just reset takes a prompt no pod holds for free. Bench routing, kv-sync, 1 / 2 replicas,
    3 seeds, without -> with it: W12 (agents' tool lists) hit rate 77.79 / 77.14 -> 77.94 / 78.78%, TTFT mean
    212.5 / 201.4 -> 213.2 / 171.4 ms; W8 (a hybrid model) behind 2 replicas 72.44 -> 72.83%, p90 229.1 ->
    201.8 ms (behind 1: 204.5 -> 210.7); W10 (images) 69.47 / 69.09 -> 69.68 / 69.50%; W3 p50 39.2 / 40.7 ->
    38.2 / 40.0 ms (behind 2: p90 137.4 -> 141.1); W4 (resets, no eviction) unchanged."""

    name = "prefix"
    needs_tokens = True

    def __init__(self, index: PrefixSource, medium_weights: Mapping[str, float] | None = None,
                 other_medium_weight: float = 0.8, backlog: PrefillBacklog | None = None,
                 uncached_weight: float = 2.0, admission: AdmissionWait | None = None,
                 tokens_per_s: float = 10_000.0, prompts: RunningPrompts | None = None,
                 room: CacheRoom | None = None, eviction_weight: float = 0.5) -> None:
        self._index = index
        self.room = room  # /debug reads its sizes
        self._eviction_weight = eviction_weight
        self._prompts = prompts
        self._admission = admission
        self._tokens_per_s = tokens_per_s
        self._media = MediumWeights(medium_weights, other_medium_weight)
        self.backlog = backlog
        self.reads_prefill = backlog is not None and backlog.shared is not None
        self._uncached_weight = uncached_weight
        size = getattr(index, "block_size", None)  # optional in PrefixSource
        self._index_block_size = size if callable(size) else None

    def weighted_blocks(self, blocks: int, by_medium: Mapping[str, int]) -> float:
        return self._media.weighted_blocks(blocks, by_medium)

    def score(self, ctx: PickContext, pods: Sequence[Pod]) -> dict[str, float]:
        tokens = ctx.request.token_ids
        if not tokens:
            return {}
        names = [p.name for p in pods]
        matches = index_matches(self._index, ctx, tokens, pods, names)
        total = max([m.total_blocks for m in matches.values()], default=0)
        if total <= 0:
            return {}
        n = len(tokens)
        bs = prompt_block_size(self._index_block_size, ctx.base_model, n, total)
        uncached = uncached_tokens(matches, names, n, bs, self._media, ctx.matched, 0.0)
        if total > ctx.total_blocks:
            ctx.total_blocks = total
        left = running_prompts_held(self._prompts, ctx, pods, n, bs, uncached)
        ctx.state[self.name] = left  # for picked(): the chosen pod's prefill joins its backlog
        if self.backlog is None:
            return {name: 1.0 - u / n for name, u in left.items()}
        self.backlog.sync()
        backlog = self.backlog.get
        now = self.backlog.now()
        k = self._uncached_weight
        costs = {name: k * u + backlog(name, now) for name, u in left.items()}
        if self._admission is not None:  # the wait to be admitted, in the prompt tokens prefilled meanwhile
            wait, rate = self._admission, self._tokens_per_s
            for p in pods:
                u = left.get(p.name)
                if u is not None:
                    waited = wait(ctx, p) * rate - (n - u)  # beyond the prefill of what the pod holds
                    if waited > 0.0:
                        costs[p.name] += waited
        if self.room is not None:  # what caching the uncached tokens there would evict
            rooms = self.room.rooms(list({p.pod_name for p in pods}))
            if rooms:
                w = self._eviction_weight
                for p in pods:
                    room = rooms.get(p.pod_name)
                    u = left.get(p.name)
                    if room is not None and u is not None and u > room * bs:
                        costs[p.name] += w * (u - room * bs)
        return _relative(costs, k * n)

    def picked(self, ctx: PickContext, pod: Pod) -> None:
        uncached = ctx.state.get(self.name)
        if self.backlog is not None and uncached is not None:
            self.backlog.add(pod.name, uncached.get(pod.name, 0.0))

    def pods_changed(self, added: Sequence[Pod], removed: Sequence[Pod]) -> None:
        if self.room is not None:
            for p in removed:
                self.room.forget(p.pod_name)


class FamilyAffinityScorer(Scorer):
    """Where a prompt's family lives. The family: the prompts sharing it through its first block past the
    opening most of the model's prompts begin with (routing.scheduling.family). Its home (the others 0): where
    some pods but not all hold the family's own blocks per the index, the one holding the most of the prompt
    (ties: rendezvous order), HOLDER; where none does, the pod this gateway last sent the family to, HOME; else a
    placement, PLACED: among the pods this gateway has given the fewest families, rendezvous order. Before the
    opening is known (the model's first few prompts) the family is the first block, and the scorer is silent
    wherever a pod holds any of the prompt. Reads the index's answer from ctx.matched and ctx.total_blocks, which
    the `prefix` scorer fills (weigh this one after it); without that answer it gives nothing.

    Why: the `prefix` scorer prices a pod's cached prefix into this request's wait, not what the placement does
    to the fleet's cache. Sent off the pod holding its prefix because that pod's prefill backlog is longer, a
    family gets a second copy of its prefix, which evicts another family's where KV is short, and its next
    requests split between the copies; left to load while nobody holds it (never seen, evicted everywhere, its
    engine flushed) it scatters, and each engine it lands on misses its prefix. The holder's point (weighed as
    kv-sync weighs it, 1, the load of 4 running requests) tips such near calls to the holder, and makes every
    replica tip the same way. Bench bakeoff, evicting, 24 conversations at a time (the running
    conversations' KV more than the fleet's): keyed on the first block (a chat template's, so one family for
    every tenant) and silent wherever a pod held a block, a tenant's requests were on its busiest engine 63% of
    the time and the engines' hit rate was 43.8%, against SGLang's gateway's 1.00 and 69.9%; now 0.76 and 56.4%,
    TTFT p50 333 against 550 ms (docs/BENCHMARKS.md, bakeoff). Its price, where decode is the bottleneck: bench
    routing W3 heavy behind 2 replicas, 12 seeds, TTFT mean 65.3 against 62.2 ms (one seed's 112.5 against
    69.0; the median seed's 62.0 against 63.3), hit rate 75.3 against 75.0%.

    A family nobody holds any more (its engine's cache reset, or evicted everywhere) goes home twice as firmly
    as to a holder (the load of 8 running requests, or two thirds of a prompt's prefill in the prefix score):
    it recomputes its prefix wherever it goes, so what draws it away is only the home's wait now, mostly the
    home's other families recomputing theirs, which clears within their prefills; sent where that wait is
    shortest at that moment, it moves for good. At the holder's weight a quarter of a reset engine's tenants
    went elsewhere (bench bakeoff's flush-rotate, traced: docs/BENCHMARKS.md, bakeoff). Bench routing, kv-sync
    at the holder's weight and at this one, hit rate / TTFT mean / p90, 8 seeds: W8 @1gw (a hybrid model,
    evicting) 73.58% / 87.7 / 224.9 against 75.11% / 72.4 / 185.2 ms, W8 @2gw 73.05 / 82.9 / 204.3 against
    73.85 / 78.7 / 191.3, W4 @1gw (resets) 64.20 / 76.4 / 162.3 against 64.91 / 74.4 / 160.5; W1, W3, W5, W7
    and W4 with random resets within 0.1 point and 2%; W12 within 0.1 point (its p50 behind 2 replicas 6%
    slower); W9 (salted) 1-2% slower, W10 @1gw (images) 2%.

    A new family goes where the fewest families live: each family brings its prefix's cache demand and its
    future requests, so homes placed by rendezvous alone (a binomial spread: with 150 families on 8 pods, 18 on
    one and 26 on another) overfill some caches and some decode batches (bench routing W1, one replica:
    evictions 13.7k against 9.8k for a router that places new text on its emptiest pod). Gateway replicas
    agree without talking where the index shows the family (the same index, the same rendezvous order in every
    process); a family nobody holds follows each replica's own last decision, and converges once one of them
    has warmed a pod. Also sets `ctx.family`, so the picker breaks ties the same way. Per replica, at most
    `capacity` families (least recently picked dropped first)."""

    name = "affinity"
    needs_tokens = True
    # the scores: a pod holding the family; the home of a family nobody holds; a new family's placement
    HOLDER, HOME, PLACED = 0.5, 1.0, 0.25

    def __init__(self, block_size: Callable[[str], int | None] | None = None, default_block_size: int = 16,
                 capacity: int = 100_000, opening: SharedOpening | None = None) -> None:
        if default_block_size < 1 or capacity < 1:
            raise ValueError("default_block_size and capacity must be positive")
        self._block_size = block_size
        self._default_block_size = default_block_size
        self._capacity = capacity
        self.opening = opening if opening is not None else SharedOpening()
        self._homes: OrderedDict[int, str] = OrderedDict()  # family key -> pod last sent to
        self._families: Counter[str] = Counter()  # pod -> families whose home it is

    def score(self, ctx: PickContext, pods: Sequence[Pod]) -> dict[str, float]:
        tokens = ctx.request.token_ids
        bs = (self._block_size(ctx.base_model) if self._block_size is not None else None) or self._default_block_size
        if not tokens or len(tokens) < bs:
            return {}
        head = block_keys(ctx.base_model, ctx.lora, tokens[:min(len(tokens) // bs, self.opening.max_blocks + 1) * bs],
                          bs)
        opening = self.opening.depth(ctx.base_model, head)
        at = min(opening or 0, len(head) - 1)  # the family's block: a prompt no longer than the opening, its last
        key = head[at]
        extras = ctx.request.extras
        first = extras.per_block(bs, 1).get(0) if extras else None
        if first:  # a salt (or media in block 0) makes another family: it shares nothing with the plain one.
            # The same number in every process (not Python's string hash), so replicas' rendezvous agree.
            key = (key ^ extra_digest(first)) & ((1 << 60) - 1)
        ctx.family = key
        if not ctx.total_blocks:
            return {}  # the index did not answer (no prefix scorer, or it failed)
        matched = ctx.placed if ctx.placed is not None else ctx.matched
        best = max(matched.get(p.name, 0) for p in pods)
        if opening is None:  # the model's first prompts: keyed on the first block, silent where a pod holds one
            if best > 0:
                return {}
        elif best > at:  # some pod holds the family's own blocks: the one holding the most of the prompt
            holders = [p for p in pods if matched.get(p.name, 0) == best]
            if len(holders) == len(pods):
                return {}  # every pod alike: nothing to keep together
            return {max(holders, key=lambda p: rendezvous(key, p.name)).name: self.HOLDER}
        home = self._homes.get(key)
        if home is not None and any(p.name == home for p in pods):
            return {home: self.HOME}
        # never sent (or its home set aside by a filter): a placement, not a home to keep, so half as strong
        # as a holder, below a load gap the load scorer counts in full (an idle newcomer wins)
        families = self._families
        fewest = min(families[p.name] for p in pods)
        return {max((p for p in pods if families[p.name] == fewest),
                    key=lambda p: rendezvous(key, p.name)).name: self.PLACED}

    def picked(self, ctx: PickContext, pod: Pod) -> None:
        key = ctx.family
        if key is None:
            return
        homes, families = self._homes, self._families
        before = homes.get(key)
        if before != pod.name:
            if before is not None:
                families[before] -= 1
            families[pod.name] += 1
        homes[key] = pod.name
        homes.move_to_end(key)
        if len(homes) > self._capacity:
            families[homes.popitem(last=False)[1]] -= 1

    def pods_changed(self, added: Sequence[Pod], removed: Sequence[Pod]) -> None:
        gone = {p.name for p in removed}
        if gone:
            for key in [k for k, pod in self._homes.items() if pod in gone]:
                del self._homes[key]
            for name in gone:
                self._families.pop(name, None)

    def __len__(self) -> int:
        return len(self._homes)


class ApproxPrefixScorer(Scorer):
    """Leading prompt blocks this gateway already sent to a pod, over the prompt's blocks."""

    name = "approx-prefix"
    needs_tokens = True

    def __init__(self, table: ApproxPrefixTable) -> None:
        self.table = table

    def score(self, ctx: PickContext, pods: Sequence[Pod]) -> dict[str, float]:
        tokens = ctx.request.token_ids
        if not tokens:
            return {}
        keys = self.table.block_keys(ctx.base_model, ctx.lora, tokens, ctx.request.extras)
        ctx.state[self.name] = keys  # for picked(): what to record against the chosen pod
        if not keys:
            return {}
        matched = self.table.match(keys, [p.name for p in pods])
        ctx.total_blocks = len(keys)
        ctx.matched.update(matched)
        return {name: n / len(keys) for name, n in matched.items()}

    def picked(self, ctx: PickContext, pod: Pod) -> None:
        keys = ctx.state.get(self.name)
        if keys:
            self.table.record(keys, pod.name)

    def pods_changed(self, added: Sequence[Pod], removed: Sequence[Pod]) -> None:
        for p in removed:
            self.table.forget_pod(p.name)


class QueueScorer(Scorer):
    """Fewer requests waiting in the engine's queue (scraped) is better; unknown pods score 0.5."""

    name = "queue"
    needs_tokens = False

    def __init__(self, engines: EngineMetrics, scale: float = 4.0) -> None:
        self._engines = engines
        self._scale = scale

    def score(self, ctx: PickContext, pods: Sequence[Pod]) -> dict[str, float]:
        known = {}
        for p in pods:
            load = self._engines.get(p.pod_name, p.rank)  # a data-parallel rank's own queue
            if load is not None:
                known[p.name] = load.waiting
        out = dict.fromkeys((p.name for p in pods), 0.5)
        out.update(_relative(known, self._scale))
        return out


class KVUtilizationScorer(Scorer):
    """More free KV cache in the engine (scraped) is better: 1 - usage; unknown pods score 0.5."""

    name = "kv-util"
    needs_tokens = False

    def __init__(self, engines: EngineMetrics) -> None:
        self._engines = engines

    def score(self, ctx: PickContext, pods: Sequence[Pod]) -> dict[str, float]:
        out = {}
        for p in pods:
            load = self._engines.get(p.pod_name, p.rank)  # a data-parallel rank's own usage
            out[p.name] = 0.5 if load is None or load.kv_usage is None else 1.0 - load.kv_usage
        return out


class KVFreeScorer(Scorer):
    """kv-util where engine metrics may be off (the pd-decode strategy must run without them): 1 - the engine's
    scraped KV usage; unknown pods, or every pod without scraping, 0.5."""

    name = "kv-free"
    needs_tokens = False

    def __init__(self, engines: EngineMetrics | None) -> None:
        self._engines = engines

    def score(self, ctx: PickContext, pods: Sequence[Pod]) -> dict[str, float]:
        if self._engines is None:
            return {p.name: 0.5 for p in pods}
        out = {}
        for p in pods:
            load = self._engines.get(p.pod_name, p.rank)
            out[p.name] = 0.5 if load is None or load.kv_usage is None else 1.0 - load.kv_usage
        return out
def _least(values: Mapping[str, float], pods: Sequence[Pod]) -> dict[str, float]:
    """Min-max over the pods with a value (the least 1, the most 0, all equal 1), as AIBrix normalizes its
    "least-*" metrics; a pod without a value (no fresh scrape) 0.5."""
    out = dict.fromkeys((p.name for p in pods), 0.5)
    out.update(_relative(values, 1e-12))
    return out


class EngineBusyScorer(Scorer):
    """Fewer requests in the engine, running and waiting, by its own scraped numbers (per data-parallel rank
    where it reports them): what the engine is busy with, including other gateways' and direct traffic."""

    name = "busy"
    needs_tokens = False

    def __init__(self, engines: EngineMetrics) -> None:
        self._engines = engines

    def score(self, ctx: PickContext, pods: Sequence[Pod]) -> dict[str, float]:
        get = self._engines.get
        return _least({p.name: load.running + load.waiting for p in pods
                       if (load := get(p.pod_name, p.rank)) is not None}, pods)


class ThroughputScorer(Scorer):
    """Less token throughput since the last scrape: 2 x prompt tokens/s + generation tokens/s
    (`vllm:prompt_tokens_total`, `vllm:generation_tokens_total`; a prompt token costs twice a generated
    one, as AIBrix weighs them)."""

    name = "throughput"
    needs_tokens = False

    def __init__(self, engines: EngineMetrics) -> None:
        self._engines = engines

    def score(self, ctx: PickContext, pods: Sequence[Pod]) -> dict[str, float]:
        get = self._engines.get
        rates = {}
        for p in pods:
            load = get(p.pod_name)
            if load is not None and load.token_rate is not None:
                rates[p.name] = 2.0 * load.token_rate[0] + load.token_rate[1]
        return _least(rates, pods)


class LatencyScorer(Scorer):
    """Lower expected latency from the engine's own histograms: its recent mean TTFT plus `output_tokens`
    (100, AIBrix's guess) times its recent mean TPOT (`vllm:time_to_first_token_seconds`,
    `vllm:time_per_output_token_seconds` / `inter_token_latency_seconds`, over the last scrape interval)."""

    name = "latency"
    needs_tokens = False

    def __init__(self, engines: EngineMetrics, output_tokens: float = 100.0) -> None:
        self._engines = engines
        self._output = output_tokens

    def score(self, ctx: PickContext, pods: Sequence[Pod]) -> dict[str, float]:
        get = self._engines.get
        expected = {}
        for p in pods:
            load = get(p.pod_name)
            if load is not None and (load.ttft_mean is not None or load.tpot_mean is not None):
                expected[p.name] = (load.ttft_mean or 0.0) + self._output * (load.tpot_mean or 0.0)
        return _least(expected, pods)
