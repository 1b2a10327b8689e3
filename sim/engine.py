"""The simulated engine's model: a paged prefix cache, a scheduler and a timing
model, driven by whatever clock the caller passes in (no I/O, no real time).

Time is in seconds on the caller's clock. Call `add_request(..., now)`, then
`advance(now)` whenever `next_event_time()` is reached (or later): it returns the
requests finished by then. The same inputs always give the same outputs.

The model, and where it simplifies vLLM:
- KV cache: `num_blocks` blocks of `block_size` tokens. A full block is keyed by a
  chained hash (sha256 of the parent's digest and the block's token ids; the root
  depends on the LoRA adapter), published as the digest's last 8 bytes as an int
  (vLLM's default) or as the 32 raw bytes. Unreferenced cached blocks are evicted
  least recently released first (a request releases its blocks tail first), and
  only when no never-cached block is free. A block already cached by another
  request is shared, never stored twice, so the events always equal the contents.
- Admission: first come, first served, at most `max_num_seqs` running; a request is
  admitted when blocks for its prompt plus `max_tokens` can be reserved (so no
  preemption). KV usage counts reserved blocks as used.
- Prefix hits: leading cached full blocks of the prompt, at most `prompt_len - 1`
  tokens (the last prompt token is always computed, as in vLLM). An admitted request's
  full prompt blocks are cached at once, before its prefill computes them (vLLM caches a
  scheduled request's blocks when it allocates them): a request admitted after it hits
  them, and its prefill follows that one's in the lane.
- Prefill: unchunked, one request at a time, alongside decoding (neither slows the
  other): first token = max(admitted, previous prefill done)
  + `prefill_s_per_token` * uncached tokens + `ttft_overhead_s`.
- Decode: all decoding requests advance one token per step; a step takes
  `tpot_base_s + tpot_per_seq_s * n` for n decoding requests. A request whose
  prefill finishes joins at the next step boundary. Output length is always
  `max_tokens`; the output token ids are a deterministic function of the prompt
  (like greedy decoding), drawn from `output_token_ids`.
- Events: one EventBatch per engine step with events (ts = engine time): one
  BlockStored per request per step for its newly full blocks (prompt blocks when
  its prefill completes, though cached since its admission; output blocks at decode batch boundaries, at most every
  `block_size` steps, and at completion), one BlockRemoved per evicted block,
  AllBlocksCleared on `reset_prefix_cache()` (refused while requests run, as in vLLM,
  unless forced: see there).

KV cache groups (`EngineConfig.groups`, vLLM 0.33's hybrid models; empty = the model above, events
without group fields): `block_size` is then the hash unit, each group has its own block size (a
multiple of it) and holds its own blocks, keyed (group, hash); a group's block hash is the chain hash
at its last hash unit. The hit is vLLM's fixed point over the groups (sim.cache_rules.longest_hit),
aligned to the LCM of the group sizes, and blocks are cached up to that alignment. Sliding-window and
mamba groups free the blocks that leave the attention (keeping their hash, so still hit-able until
evicted) and, with sparse retention (`retention_interval` 0 or N), hash only the blocks that can serve
a hit (sim.cache_rules.retained_blocks); the others are private memory. Their BlockStored is vLLM
0.33's: one per group per request per step, `token_ids` over the whole range, skipped blocks included
(vLLM issue 44451), also with no hash at all; `event_block_offsets` publishes one exact event per run
instead. Simplifications: one pool of `num_blocks` blocks shared by every group (a block of any group
is one block); a request reserves, per group, every block of prompt + max_tokens at admission (vLLM
allocates the whole prompt for an unchunked prefill too; its mamba groups need far fewer); no EAGLE,
no fine-grained mamba hits.
Extra keys (vLLM's generate_block_hash_extra_keys): `cache_salt` enters block 0's hash, media items
(`kvcache.blockkeys.MediaItem`) every block overlapping their placeholders as (identifier, offset from
the block's start); the LoRA adapter already changes the chain's root. Events carry `extra_keys` per
block (LoRA name first, media pairs, salt on block 0); without groups only when a request has a salt or
media (as before otherwise).
"""
from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from math import ceil, floor
from typing import Final

from kvcache.blockkeys import MediaItem
from kvcache.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, EventBatch, KVEvent
from sim.cache_rules import (
    FULL, GroupSpec, first_needed_block, longest_hit, retained_blocks, scheduler_block_size,
)

_MEDIUM = "GPU"
_WORD = array("I").itemsize
_LCG_A = 6364136223846793005
_LCG_C = 1442695040888963407
_MASK64 = 2**64 - 1


class _Private:
    """A held position whose block is memory outside the cache (counted in the request's `reserved`)."""


_PRIVATE: Final = _Private()


@dataclass(frozen=True, slots=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int = 4096
    max_num_seqs: int = 64
    ttft_overhead_s: float = 0.005
    prefill_s_per_token: float = 0.0001
    tpot_base_s: float = 0.008
    tpot_per_seq_s: float = 0.0002
    lora_names: tuple[str, ...] = ()  # lora_id of an adapter = its position + 1
    output_token_ids: tuple[int, ...] = tuple(range(256, 1024))
    int_block_hashes: bool = True  # False: publish 32-byte hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)
    hash_seed: str = "kvgate-sim"
    data_parallel_rank: int | None = None  # carried in every EventBatch
    groups: tuple[GroupSpec, ...] = ()  # KV cache groups; () = one full_attention group of block_size, old events
    retention_interval: int | None = 0  # sparse groups: 0 only reachable boundaries (vLLM's default), None dense
    publish_group_fields: bool = True  # with groups: group_idx, kv_cache_spec_kind, ..._sliding_window (0.22+)
    # False: vLLM 0.33's sparse BlockStored, token_ids spanning skipped blocks (issue 44451). True: one exact
    # event per run of hashed blocks. TODO: PR 44488's `block_offsets` field, once its shape is settled.
    event_block_offsets: bool = False

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("ttft_overhead_s", "prefill_s_per_token", "tpot_base_s", "tpot_per_seq_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"EngineConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.tpot_base_s + self.tpot_per_seq_s <= 0:
            raise ValueError("EngineConfig: a decode step must take some time (tpot_base_s + tpot_per_seq_s > 0)")
        if not self.output_token_ids:
            raise ValueError("EngineConfig.output_token_ids must not be empty")
        for i, g in enumerate(self.groups):
            if not isinstance(g, GroupSpec):
                raise ValueError(f"EngineConfig.groups[{i}] must be a GroupSpec, got {g!r}")
            if g.block_size % self.block_size:
                raise ValueError(f"EngineConfig.groups[{i}].block_size ({g.block_size}) must be a multiple of "
                                 f"block_size, the hash unit ({self.block_size})")
        r = self.retention_interval
        if r is not None:
            if type(r) is not int or r < 0:
                raise ValueError(f"EngineConfig.retention_interval must be None or an int >= 0, got {r!r}")
            if r and not any(g.sparse for g in self.groups):
                raise ValueError("EngineConfig.retention_interval applies only to sliding_window and mamba groups; "
                                 "set it to 0 (or None) for this model")
            if r % scheduler_block_size(self.groups or (GroupSpec(FULL, self.block_size),)):
                raise ValueError(f"EngineConfig.retention_interval ({r}) must be a multiple of the scheduler "
                                 f"block size (the LCM of the groups' block sizes)")

    @property
    def max_model_len(self) -> int:
        """Most tokens (prompt + max_tokens) one request may need."""
        return self.num_blocks * self.block_size


@dataclass(frozen=True, slots=True)
class Completion:
    """A finished request."""

    req_id: str
    prompt_tokens: int
    cached_tokens: int  # prompt tokens served from the prefix cache
    output_token_ids: tuple[int, ...]
    arrival_time: float
    first_token_time: float
    finish_time: float
    lora: str | None = None

    @property
    def ttft(self) -> float:
        return self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float:
        return self.finish_time - self.arrival_time


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    running: int  # admitted: prefilling or decoding
    waiting: int
    kv_usage: float  # fraction of blocks referenced or reserved by running requests
    prefix_cache_queries: int  # prompt tokens looked up (counter)
    prefix_cache_hits: int  # of which found in the cache (counter)
    cached_blocks: int
    num_blocks: int
    requests_finished: int
    prompt_tokens: int  # counter, at admission
    generation_tokens: int  # counter, at completion
    peak_live: int = 0  # most requests live at once since start (the simulator's own, not vLLM's)
    # vLLM's latency histograms, as (sum of seconds, count): TTFT per request, inter-token latency per token
    ttft: tuple[float, int] = (0.0, 0)
    inter_token: tuple[float, int] = (0.0, 0)


class _Request:
    __slots__ = (
        "req_id", "tokens", "max_tokens", "lora", "arrival", "root", "digests", "keys", "seq", "packed",
        "held", "freed", "reserved", "cached_tokens", "first_token_time", "join_step", "finish_step", "state",
        "salt", "media", "junction", "remote_tokens", "deferred",
    )

    def __init__(self, req_id: str, tokens: tuple[int, ...], packed: bytes, max_tokens: int, lora: str | None,
                 arrival: float, root: bytes, n_groups: int, salt: str | None,
                 media: tuple[MediaItem, ...]) -> None:
        self.req_id = req_id
        self.tokens = tokens
        self.max_tokens = max_tokens
        self.lora = lora
        self.arrival = arrival
        self.root = root
        self.digests: list[bytes] = []  # chained digests of the full blocks of `seq` computed so far
        self.keys: list[BlockHash] = []  # published hash of each of those blocks
        self.seq: tuple[int, ...] = tokens  # prompt, then prompt + output once admitted
        self.packed = packed  # `seq` as 4-byte unsigned ints, for hashing
        # Per group, per block in sequence order: the cached block's key it references, _PRIVATE (memory
        # outside the cache), or None (no memory: outside the attention window, or freed).
        self.held: list[list[BlockHash | _Private | None]] = [[] for _ in range(n_groups)]
        self.freed = [0] * n_groups  # per group: blocks before this are None
        self.salt = salt
        self.media = media
        self.junction = 0  # vLLM's shared_prefix_boundary: a shared prefix a sparse group had not cached
        self.remote_tokens = 0  # leading prompt tokens whose KV a remote prefill engine computed (P/D decode leg)
        self.reserved = 0  # blocks reserved but not (yet) cached
        self.cached_tokens = 0
        self.first_token_time = 0.0
        self.join_step = 0
        self.finish_step = 0
        self.state = "waiting"  # waiting | prefill | pending | decode | done | aborted
        self.deferred: list[KVEvent] = []  # BlockStored of prompt blocks cached at admission, published at prefill's end


class EngineModel:
    """One simulated vLLM engine (one data-parallel rank)."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        c = self.config
        self._bs = c.block_size
        self._legacy = not c.groups  # the one-group model of before: events without group fields
        self._groups = c.groups or (GroupSpec(FULL, c.block_size),)
        self._align = scheduler_block_size(self._groups)
        self._ratio = tuple(g.block_size // c.block_size for g in self._groups)
        self._lora_ids = {name: i + 1 for i, name in enumerate(c.lora_names)}
        self._roots = {lora: hashlib.sha256(f"{c.hash_seed}\0{lora or ''}".encode()).digest()
                       for lora in (None, *c.lora_names)}
        self._clock = float("-inf")
        self._live: dict[str, _Request] = {}
        self._peak_live = 0  # most requests live at once (waiting, prefilling or decoding) since start
        self._waiting: deque[_Request] = deque()
        self._running: dict[str, _Request] = {}
        # KV cache: (group, key) -> reference count; unreferenced entries also in _lru, oldest release first.
        self._blocks: dict[tuple[int, BlockHash], int] = {}
        self._lru: OrderedDict[tuple[int, BlockHash], None] = OrderedDict()
        self._reserved_total = 0
        # Prefill lane: FIFO, completion times non-decreasing.
        self._prefilling: deque[tuple[float, _Request]] = deque()
        self._prefill_free_at = float("-inf")
        # Decode batch.
        self._decoding: dict[str, _Request] = {}
        self._pending: deque[tuple[float, _Request]] = deque()  # prefill done, join at next step boundary
        self._finish_heap: list[tuple[int, int, _Request]] = []
        self._heap_seq = 0
        self._steps = 0  # decode steps since start
        self._decode_t = 0.0  # time of the last step boundary
        # Outputs.
        self._completed: list[Completion] = []
        self._events: list[KVEvent] = []
        self._batches: list[EventBatch] = []
        self._queries = self._hits = self._finished = self._prompt_tokens = self._gen_tokens = 0
        self._ttft_sum, self._ttft_n, self._itl_sum, self._itl_n = 0.0, 0, 0.0, 0

    # ---- public API -------------------------------------------------------------------------

    def add_request(self, req_id: str, token_ids: list[int] | tuple[int, ...], max_tokens: int, now: float,
                    lora: str | None = None, *, cache_salt: str | None = None,
                    mm_items: tuple[MediaItem, ...] = (), remote_tokens: int = 0) -> None:
        """Queue a request at time `now` (not before the last `advance`). `cache_salt` and `mm_items` (media
        placeholders, by prompt position) enter the block hashes as in vLLM. `remote_tokens`: the decode leg of
        a disaggregated request, its leading prompt tokens' KV already pulled from the prefill engine (not
        computed here, still stored and published here as the engine's own blocks once its prefill step ends;
        not counted as prefix cache hits). Raises ValueError on bad input."""
        if isinstance(token_ids, (str, bytes, bytearray)):  # array() would read bytes as raw machine words
            raise ValueError("token ids must be a sequence of ints")
        try:
            packed = array("I", token_ids)
        except (TypeError, OverflowError) as e:
            raise ValueError(f"token ids must be ints in [0, 2**32): {e}") from e
        tokens = tuple(packed)
        self._validate(req_id, tokens, max_tokens, now, lora)
        media = _checked_media(mm_items, len(tokens))
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r}")
        self._run_until(now)
        if type(remote_tokens) is not int or remote_tokens < 0:
            raise ValueError(f"remote_tokens must be an int >= 0, got {remote_tokens!r}")
        req = _Request(req_id, tokens, packed.tobytes(), max_tokens, lora, now, self._roots[lora],
                       len(self._groups), cache_salt, tuple(media))
        req.remote_tokens = min(remote_tokens, len(tokens) - 1)  # the last prompt token is always computed
        self._extend_keys(req, len(tokens) // self._bs)
        self._live[req_id] = req
        self._peak_live = max(self._peak_live, len(self._live))
        self._waiting.append(req)
        self._admit(now)
        self._flush_events(now)

    def advance(self, now: float) -> list[Completion]:
        """Run the engine up to `now`; return the requests finished since the last call, in order."""
        if now < self._clock:
            raise ValueError(f"time went backwards: {now} < {self._clock}")
        self._run_until(now)
        done, self._completed = self._completed, []
        return done

    def next_event_time(self) -> float | None:
        """When the engine's state next changes by itself (None: idle)."""
        nxt = self._next()
        return None if nxt is None else max(nxt[0], self._clock)  # float rounding never goes back in time

    def abort(self, req_id: str, now: float) -> bool:
        """Drop a live request (client gone) at `now`; False if it is not live."""
        req = self._live.get(req_id)
        if req is None:
            return False
        self._run_until(now)
        if req.state == "decode":
            self._materialize(now)
            del self._decoding[req_id]
        elif req.state == "waiting":
            self._waiting.remove(req)
        # A request in the prefill lane or pending join is skipped when reached.
        if req.deferred:  # its prompt blocks stay cached once it is gone: announced now
            self._events.extend(req.deferred)
            req.deferred = []
        if req.state != "waiting":
            self._release(req)
        req.state = "aborted"
        del self._live[req_id]
        if not self._decoding and self._pending:
            self._decode_t = now
            self._join_pending(now)
        self._admit(now)
        self._flush_events(now)
        return True

    def output_so_far(self, req_id: str, now: float) -> tuple[int, ...] | None:
        """Output token ids produced by `now` (call after `advance(now)`); None if not live."""
        req = self._live.get(req_id)
        if req is None:
            return None
        if req.state in ("waiting", "prefill"):
            n = 0
        elif req.state == "pending":
            n = 1
        else:
            extra = floor((now - self._decode_t) / self._step_time()) if now > self._decode_t else 0
            n = min(req.max_tokens - 1, 1 + self._steps - req.join_step + extra)
        start = len(req.tokens)
        return req.seq[start:start + n]

    def drain_events(self) -> list[EventBatch]:
        """KV event batches since the last call, one per engine step, ts = engine time."""
        out, self._batches = self._batches, []
        return out

    def reset_prefix_cache(self, now: float | None = None, force: bool = False) -> bool:
        """Drop every cached block (AllBlocksCleared). Refused (False) while requests run, as in vLLM,
        unless `force` (the routing benchmark's flushes, under load): then the running requests keep
        the memory of the blocks they hold, as private blocks outside the cache (counted as reserved
        until they finish), and the blocks they fill afterwards are cached as usual (chained on
        blocks no longer cached, so reachable only once those are computed again)."""
        if now is not None:
            self._run_until(now)
        if (self._running or self._waiting) and not force:
            return False
        for req in self._running.values():
            req.deferred = []  # its prompt blocks were never announced, and are not cached any more
            for held in req.held:
                for i, key in enumerate(held):
                    if key is not None and not isinstance(key, _Private):
                        held[i] = _PRIVATE  # position kept: caching resumes after it
                        req.reserved += 1
                        self._reserved_total += 1
        self._blocks.clear()
        self._lru.clear()
        self._events.append(AllBlocksCleared())
        self._flush_events(self._clock if now is None else now)
        return True

    def metrics(self) -> EngineMetrics:
        c = self.config
        free = c.num_blocks - len(self._blocks) - self._reserved_total
        used = c.num_blocks - free - len(self._lru)
        return EngineMetrics(
            running=len(self._running), waiting=len(self._waiting), kv_usage=used / c.num_blocks,
            prefix_cache_queries=self._queries, prefix_cache_hits=self._hits, cached_blocks=len(self._blocks),
            num_blocks=c.num_blocks, requests_finished=self._finished, prompt_tokens=self._prompt_tokens,
            generation_tokens=self._gen_tokens, peak_live=self._peak_live,
            ttft=(self._ttft_sum, self._ttft_n), inter_token=(self._itl_sum, self._itl_n),
        )

    def step_time(self) -> float:
        """How long a decode step takes with the current batch."""
        return self._step_time()

    @property
    def now(self) -> float:
        """The latest time the engine has been run to."""
        return self._clock

    def cached_block_hashes(self) -> set[BlockHash]:
        """The keys of every block now in the prefix cache, of any group (for checks)."""
        return {key for _, key in self._blocks}

    def unannounced_block_hashes(self) -> set[BlockHash]:
        """The keys of the cached blocks whose BlockStored has not left yet: prompt blocks of requests still
        prefilling (cached at admission, announced when their prefill ends; for checks)."""
        return {h for req in self._running.values() for ev in req.deferred
                if isinstance(ev, BlockStored) for h in ev.block_hashes}

    def cached_blocks_by_group(self) -> dict[int, set[BlockHash]]:
        """The keys of the blocks now in the prefix cache, per KV cache group (for checks)."""
        out: dict[int, set[BlockHash]] = {g: set() for g in range(len(self._groups))}
        for g, key in self._blocks:
            out[g].add(key)
        return out

    def prefix_hit(self, token_ids: list[int] | tuple[int, ...], lora: str | None = None, *,
                   cache_salt: str | None = None, mm_items: tuple[MediaItem, ...] = (), announced: bool = False) -> int:
        """The prompt tokens this engine would serve from its prefix cache to such a request admitted now
        (the hit admission computes), without queuing it or touching the cache (for checks and the routing
        benchmark's oracle). `announced`: counting only blocks whose BlockStored has left (what a follower of
        the events can know), not those of prompts still prefilling."""
        req = self._probe(token_ids, lora, cache_salt, mm_items)
        return 0 if req is None else self._hit(req, announced)

    def prefix_hits(self, engines: Sequence["EngineModel"], token_ids: list[int] | tuple[int, ...],
                    lora: str | None = None, *, cache_salt: str | None = None,
                    mm_items: tuple[MediaItem, ...] = ()) -> list[int]:
        """prefix_hit on each of `engines`, the prompt's block hashes computed once where an engine hashes as
        this one does (same hash seed, block size and KV cache groups)."""
        req = self._probe(token_ids, lora, cache_salt, mm_items)
        if req is None:
            return [0] * len(engines)
        return [e._hit(req, False) if e._same_keys(self) else
                e.prefix_hit(token_ids, lora, cache_salt=cache_salt, mm_items=mm_items) for e in engines]

    def _same_keys(self, other: "EngineModel") -> bool:
        a, b = self.config, other.config
        return (a.hash_seed == b.hash_seed and self._bs == other._bs and a.int_block_hashes == b.int_block_hashes
                and self._groups == other._groups and self._align == other._align)

    def _probe(self, token_ids: list[int] | tuple[int, ...], lora: str | None, cache_salt: str | None,
               mm_items: tuple[MediaItem, ...]) -> _Request | None:
        packed = array("I", token_ids)
        tokens = tuple(packed)
        if not tokens:
            return None
        req = _Request("", tokens, packed.tobytes(), 1, lora, self._clock, self._roots[lora], len(self._groups),
                       cache_salt, tuple(_checked_media(mm_items, len(tokens))))
        self._extend_keys(req, len(tokens) // self._bs)
        return req

    def _hit(self, req: _Request, announced: bool) -> int:
        holds = [partial(self._holds, req, g) for g in range(len(self._groups))]
        if announced and (hidden := self.unannounced_block_hashes()):
            holds = [partial(self._holds_announced, req, hidden, g) for g in range(len(self._groups))]
        return longest_hit(self._groups, holds, len(req.tokens) - 1, self._align)[0]

    def is_live(self, req_id: str) -> bool:
        return req_id in self._live

    def first_token_time(self, req_id: str) -> float | None:
        """When a live request's first token came (None: not yet, or not live)."""
        req = self._live.get(req_id)
        return req.first_token_time if req is not None and req.first_token_time > 0 else None

    # ---- input checks -----------------------------------------------------------------------

    def _validate(self, req_id: str, tokens: tuple[int, ...], max_tokens: int, now: float, lora: str | None) -> None:
        if req_id in self._live:
            raise ValueError(f"request id {req_id!r} is already live")
        if not tokens:
            raise ValueError("the prompt must have at least one token")
        if type(max_tokens) is not int or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        if lora is not None and lora not in self._lora_ids:
            raise ValueError(f"unknown LoRA adapter {lora!r}")
        if len(tokens) + max_tokens > self.config.max_model_len:
            raise ValueError(
                f"prompt ({len(tokens)} tokens) + max_tokens ({max_tokens}) exceeds the cache "
                f"({self.config.max_model_len} tokens)")
        if now < self._clock:
            raise ValueError(f"time went backwards: {now} < {self._clock}")

    # ---- the event loop ---------------------------------------------------------------------

    def _next(self) -> tuple[float, bool] | None:
        """(time, is a prefill completion) of the next internal event."""
        tp = self._prefilling[0][0] if self._prefilling else None
        if self._decoding:
            td = self._next_boundary()
            if tp is None or td < tp:
                return td, False
        return None if tp is None else (tp, True)

    def _run_until(self, now: float) -> None:
        while (nxt := self._next()) is not None and nxt[0] <= now:
            t = max(nxt[0], self._clock)
            if nxt[1]:
                self._on_prefill_done(self._prefilling.popleft()[1], t)
            else:
                self._on_step_boundary(t)
            self._admit(t)
            self._flush_events(t)
        self._clock = max(self._clock, now)

    def _step_time(self) -> float:
        return self.config.tpot_base_s + self.config.tpot_per_seq_s * len(self._decoding)

    def _next_boundary(self) -> float:
        steps = self._segment_steps()
        return self._decode_t + steps * self._step_time()

    def _segment_steps(self) -> int:
        heap = self._finish_heap
        while heap[0][2].state != "decode":  # lazily drop aborted entries
            heapq.heappop(heap)
        k = min(heap[0][0] - self._steps, self._bs)
        if self._pending:
            k = min(k, max(1, ceil((self._pending[0][0] - self._decode_t) / self._step_time())))
        return max(k, 1)

    def _materialize(self, now: float) -> None:
        """Count the whole steps run since the last boundary (before the batch size changes)."""
        d = self._step_time()
        j = floor((now - self._decode_t) / d) if now > self._decode_t else 0
        j = min(j, self._segment_steps() - 1)  # the segment's end is a boundary not yet processed
        if j > 0:
            self._steps += j
            self._decode_t += j * d

    def _on_prefill_done(self, req: _Request, t: float) -> None:
        if req.state != "prefill":  # aborted meanwhile
            return
        if req.deferred:
            self._events.extend(req.deferred)
            req.deferred = []
        self._cache_upto(req, len(req.tokens) // self._bs)
        self._free_skipped(req, len(req.tokens))
        req.first_token_time = t
        self._ttft_sum += t - req.arrival
        self._ttft_n += 1
        if req.max_tokens == 1:
            self._finish(req, t)
        elif self._decoding:
            req.state = "pending"
            self._pending.append((t, req))
        else:
            self._start_decode(req, t)

    def _on_step_boundary(self, t: float) -> None:
        self._steps += self._segment_steps()
        self._decode_t = t
        heap = self._finish_heap
        while heap and heap[0][0] <= self._steps:
            req = heapq.heappop(heap)[2]
            if req.state == "decode":
                del self._decoding[req.req_id]
                self._finish(req, t)
        for req in self._decoding.values():
            n = len(req.tokens) + self._steps - req.join_step
            self._cache_upto(req, n // self._bs)
            self._free_skipped(req, n)
        self._join_pending(t)

    def _join_pending(self, t: float) -> None:
        while self._pending:
            req = self._pending.popleft()[1]
            if req.state == "pending":
                self._start_decode(req, t)

    def _start_decode(self, req: _Request, t: float) -> None:
        if not self._decoding:
            self._decode_t = t
        req.state = "decode"
        req.join_step = self._steps
        req.finish_step = self._steps + req.max_tokens - 1
        self._decoding[req.req_id] = req
        self._heap_seq += 1
        heapq.heappush(self._finish_heap, (req.finish_step, self._heap_seq, req))

    # ---- admission, caching, release --------------------------------------------------------

    def _admit(self, now: float) -> None:
        c = self.config
        while self._waiting and len(self._running) < c.max_num_seqs:
            req = self._waiting[0]
            holds = [partial(self._holds, req, g) for g in range(len(self._groups))]
            hit, longest = longest_hit(self._groups, holds, len(req.tokens) - 1, self._align)
            hit_entries = []  # per group: the cached entries the hit reuses, after None for skipped blocks
            need = 0
            for g, spec in enumerate(self._groups):
                first, n = first_needed_block(spec, hit), hit // spec.block_size
                hit_entries.append((first, [(g, self._key(req, g, i)) for i in range(first, n)]))
                need += ceil((len(req.tokens) + req.max_tokens) / spec.block_size) - n
            hit_unreferenced = sum(self._blocks[e] == 0 for _, entries in hit_entries for e in entries)
            free = c.num_blocks - len(self._blocks) - self._reserved_total
            if need > free + len(self._lru) - hit_unreferenced:
                break  # head of line waits for blocks
            self._waiting.popleft()
            for g, (first, entries) in enumerate(hit_entries):
                for entry in entries:
                    self._ref(entry)
                req.held[g] = [None] * first
                req.held[g] += [key for _, key in entries]
                req.freed[g] = first
            self._evict(need - free)
            req.reserved = need
            self._reserved_total += need
            req.junction = longest if longest > hit else 0
            req.cached_tokens = hit
            self._queries += len(req.tokens)
            self._hits += req.cached_tokens
            self._prompt_tokens += len(req.tokens)
            output = self._output_ids(req)
            req.seq = req.tokens + output
            req.packed += array("I", output).tobytes()
            req.state = "prefill"
            self._running[req.req_id] = req
            if not req.remote_tokens:
                # vLLM caches a scheduled request's full prompt blocks when it allocates them, before the
                # forward pass computes them (KVCacheManager.allocate_slots -> cache_blocks): a request admitted
                # after this one hits them while this one is still prefilling. Their BlockStored leave after
                # the step that computed them (here: when the prefill ends). A decode leg's remote KV is cached
                # once it has arrived (vLLM's delay_cache_blocks): at the prefill's end, as before.
                events, self._events = self._events, []
                self._cache_upto(req, len(req.tokens) // self._bs)
                req.deferred, self._events = self._events, events
            start = max(now, self._prefill_free_at)
            computed = len(req.tokens) - max(req.cached_tokens, req.remote_tokens)
            self._prefill_free_at = start + c.prefill_s_per_token * computed
            self._prefilling.append((self._prefill_free_at + c.ttft_overhead_s, req))

    def _key(self, req: _Request, g: int, i: int) -> BlockHash:
        """The published hash of the request's block i in group g: the chain hash at its last hash unit."""
        return req.keys[(i + 1) * self._ratio[g] - 1]

    def _holds(self, req: _Request, g: int, i: int) -> bool:
        return (g, self._key(req, g, i)) in self._blocks

    def _holds_announced(self, req: _Request, hidden: set[BlockHash], g: int, i: int) -> bool:
        key = self._key(req, g, i)
        return (g, key) in self._blocks and key not in hidden

    def _ref(self, entry: tuple[int, BlockHash]) -> None:
        rc = self._blocks[entry]
        if rc == 0:
            del self._lru[entry]
        self._blocks[entry] = rc + 1

    def _unref(self, entry: tuple[int, BlockHash]) -> None:
        rc = self._blocks[entry] - 1
        self._blocks[entry] = rc
        if rc == 0:
            self._lru[entry] = None

    def _evict(self, n: int) -> None:
        for _ in range(n):
            (g, key), _ = self._lru.popitem(last=False)
            del self._blocks[(g, key)]
            group = None if self._legacy or not self.config.publish_group_fields else g
            self._events.append(BlockRemoved(block_hashes=(key,), medium=_MEDIUM, group_idx=group))

    def _cache_upto(self, req: _Request, n_units: int) -> None:
        """Cache the request's blocks full within its first `n_units` hash units, in every group (up to the
        scheduler block size when there are several groups, as vLLM does)."""
        n_tokens = n_units * self._bs
        if len(self._groups) > 1:
            n_tokens -= n_tokens % self._align
        for g in range(len(self._groups)):
            self._cache_group(req, g, n_tokens // self._groups[g].block_size)

    def _cache_group(self, req: _Request, g: int, n_full: int) -> None:
        """Cache group g's full blocks [len(held), n_full) that retention keeps; share those already cached."""
        held = req.held[g]
        start = len(held)
        if n_full <= start:
            return
        self._extend_keys(req, n_full * self._ratio[g])
        spec = self._groups[g]
        mask = None
        if not self._legacy:
            boundaries = [len(req.tokens) - 1] + ([req.junction] if req.junction else [])
            mask = retained_blocks(spec, start, n_full, self._align, self.config.retention_interval, boundaries)
        new: list[int] = []
        for i in range(start, n_full):
            if mask is not None and not mask[i - start]:
                held.append(_PRIVATE)  # computed, never hashed: stays reserved until freed
                continue
            key = self._key(req, g, i)
            if (g, key) in self._blocks:  # computed meanwhile by another request: share it
                self._ref((g, key))
            else:
                self._blocks[(g, key)] = 1
                new.append(i)
            held.append(key)
            req.reserved -= 1
            self._reserved_total -= 1
        if mask is not None and self.config.retention_interval is not None and spec.sparse \
                and not self.config.event_block_offsets:
            self._store(req, g, start, n_full, new)  # vLLM 0.33: one event over the whole range
            return
        run: list[int] = []
        for i in new:  # one exact event per run of consecutive new blocks
            if run and i != run[-1] + 1:
                self._store(req, g, run[0], run[-1] + 1, run)
                run = []
            run.append(i)
        if run:
            self._store(req, g, run[0], run[-1] + 1, run)

    def _store(self, req: _Request, g: int, start: int, end: int, blocks: list[int]) -> None:
        """One BlockStored for group g: the hashes of `blocks`, the token ids of blocks [start, end)."""
        spec = self._groups[g]
        bs = spec.block_size
        extra = [self._event_extra_keys(req, i * bs, (i + 1) * bs) for i in blocks]
        grouped = not self._legacy and self.config.publish_group_fields
        self._events.append(BlockStored(
            block_hashes=tuple(self._key(req, g, i) for i in blocks),
            parent_block_hash=self._key(req, g, start - 1) if start else None,
            token_ids=req.seq[start * bs:end * bs],
            block_size=bs,
            lora_id=self._lora_ids.get(req.lora) if req.lora else None,
            medium=_MEDIUM,
            lora_name=req.lora,
            extra_keys=tuple(extra) if extra and (not self._legacy or any(extra)) else None,
            group_idx=g if grouped else None,
            kv_cache_spec_kind=spec.kind if grouped else None,
            kv_cache_spec_sliding_window=spec.sliding_window if grouped else None,
        ))

    def _event_extra_keys(self, req: _Request, start: int, end: int) -> tuple | None:
        """A block's extra keys as vLLM's events carry them: LoRA name, media (identifier, offset from the
        block's start), the salt on block 0. Without groups, only for requests with a salt or media."""
        keys = _hash_extras(req, start, end)
        if self._legacy and not keys:
            return None
        if req.lora is not None:
            keys = (req.lora, *keys)
        return keys or None

    def _free_skipped(self, req: _Request, n_computed: int) -> None:
        """Free the blocks of sliding-window and mamba groups that left the attention, tail first (vLLM's
        remove_skipped_blocks): cached ones stay in the cache, unreferenced."""
        for g, spec in enumerate(self._groups):
            if not spec.sparse:
                continue
            held = req.held[g]
            first = min(first_needed_block(spec, n_computed), len(held))
            for i in range(first - 1, req.freed[g] - 1, -1):
                key = held[i]
                if isinstance(key, _Private):
                    req.reserved -= 1
                    self._reserved_total -= 1
                elif key is not None:
                    self._unref((g, key))
                held[i] = None
            req.freed[g] = max(req.freed[g], first)

    def _release(self, req: _Request) -> None:
        for g, held in enumerate(req.held):
            for key in reversed(held):  # tail blocks become the oldest: evicted first
                if key is not None and not isinstance(key, _Private):  # private: freed with `reserved`
                    self._unref((g, key))
        req.held = [[] for _ in req.held]
        self._reserved_total -= req.reserved
        req.reserved = 0
        self._running.pop(req.req_id, None)

    def _finish(self, req: _Request, t: float) -> None:
        # KV exists for every token but the last one sampled.
        self._cache_upto(req, (len(req.tokens) + req.max_tokens - 1) // self._bs)
        self._release(req)
        req.state = "done"
        del self._live[req.req_id]
        self._finished += 1
        self._gen_tokens += req.max_tokens
        if req.max_tokens > 1:
            self._itl_sum += t - req.first_token_time
            self._itl_n += req.max_tokens - 1
        self._completed.append(Completion(
            req_id=req.req_id, prompt_tokens=len(req.tokens), cached_tokens=req.cached_tokens,
            output_token_ids=req.seq[len(req.tokens):], arrival_time=req.arrival,
            first_token_time=req.first_token_time, finish_time=t, lora=req.lora,
        ))

    # ---- hashing and output -----------------------------------------------------------------

    def _extend_keys(self, req: _Request, n_full: int) -> None:
        width, packed, digests, keys = _WORD * self._bs, req.packed, req.digests, req.keys
        int_keys = self.config.int_block_hashes
        parent = digests[-1] if digests else req.root
        sha256 = hashlib.sha256
        bs = self._bs
        plain = req.salt is None and not req.media
        for i in range(len(digests), n_full):
            block = parent + packed[i * width:(i + 1) * width]
            extras = () if plain else _hash_extras(req, i * bs, (i + 1) * bs)
            if extras:
                block += b"\0" + repr(extras).encode()
            parent = sha256(block).digest()
            digests.append(parent)
            keys.append(int.from_bytes(parent[24:], "big") if int_keys else parent)

    def _output_ids(self, req: _Request) -> tuple[int, ...]:
        n_full = len(req.tokens) // self._bs
        tail = req.packed[n_full * self._bs * _WORD:]
        seed = hashlib.sha256((req.digests[n_full - 1] if n_full else req.root) + tail).digest()
        x = int.from_bytes(seed[:8], "big")
        pool = self.config.output_token_ids
        n = len(pool)
        out = []
        for _ in range(req.max_tokens):
            x = (x * _LCG_A + _LCG_C) & _MASK64
            out.append(pool[(x >> 33) % n])
        return tuple(out)

    def _flush_events(self, t: float) -> None:
        if self._events:
            self._batches.append(EventBatch(ts=t, events=tuple(self._events),
                                            data_parallel_rank=self.config.data_parallel_rank))
            self._events = []


def _hash_extras(req: _Request, start: int, end: int) -> tuple:
    """What enters the hash of the block of tokens [start, end) besides its tokens and the LoRA adapter:
    (identifier, offset from the block's start) per media item overlapping it, then the salt on block 0."""
    keys: list = [(m.identifier, m.offset - start) for m in req.media
                  if m.offset < end and m.offset + m.length > start]
    if start == 0 and req.salt is not None:
        keys.append(req.salt)
    return tuple(keys)


def _checked_media(items: tuple[MediaItem, ...] | list[MediaItem], n_tokens: int) -> list[MediaItem]:
    out = list(items)
    end = 0
    for m in out:
        if not isinstance(m, MediaItem):
            raise ValueError(f"mm_items must be MediaItem, got {m!r}")
        if not isinstance(m.identifier, str) or not m.identifier:
            raise ValueError(f"a media item needs a non-empty identifier, got {m.identifier!r}")
        if type(m.offset) is not int or type(m.length) is not int or m.length < 1 or m.offset < end \
                or m.offset + m.length > n_tokens:
            raise ValueError(f"media placeholders must be sorted, disjoint and inside the prompt "
                             f"({n_tokens} tokens), got {m!r}")
        end = m.offset + m.length
    return out
