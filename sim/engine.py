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
  tokens (the last prompt token is always computed, as in vLLM).
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
  its prefill completes, output blocks at decode batch boundaries, at most every
  `block_size` steps, and at completion), one BlockRemoved per evicted block,
  AllBlocksCleared on `reset_prefix_cache()` (refused while requests run, as in vLLM,
  unless forced: see there).
"""
from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from math import ceil, floor

from kvcache.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, EventBatch, KVEvent

_MEDIUM = "GPU"
_WORD = array("I").itemsize
_LCG_A = 6364136223846793005
_LCG_C = 1442695040888963407
_MASK64 = 2**64 - 1


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


class _Request:
    __slots__ = (
        "req_id", "tokens", "max_tokens", "lora", "arrival", "root", "digests", "keys", "seq", "packed",
        "held", "reserved", "cached_tokens", "first_token_time", "join_step", "finish_step", "state",
    )

    def __init__(self, req_id: str, tokens: tuple[int, ...], packed: bytes, max_tokens: int, lora: str | None,
                 arrival: float, root: bytes) -> None:
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
        self.held: list[BlockHash | None] = []  # cached blocks referenced, in sequence order (None: private)
        self.reserved = 0  # blocks reserved but not (yet) cached
        self.cached_tokens = 0
        self.first_token_time = 0.0
        self.join_step = 0
        self.finish_step = 0
        self.state = "waiting"  # waiting | prefill | pending | decode | done | aborted


class EngineModel:
    """One simulated vLLM engine (one data-parallel rank)."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        c = self.config
        self._bs = c.block_size
        self._lora_ids = {name: i + 1 for i, name in enumerate(c.lora_names)}
        self._roots = {lora: hashlib.sha256(f"{c.hash_seed}\0{lora or ''}".encode()).digest()
                       for lora in (None, *c.lora_names)}
        self._clock = float("-inf")
        self._live: dict[str, _Request] = {}
        self._peak_live = 0  # most requests live at once (waiting, prefilling or decoding) since start
        self._waiting: deque[_Request] = deque()
        self._running: dict[str, _Request] = {}
        # KV cache: key -> reference count; unreferenced keys also in _lru, oldest release first.
        self._blocks: dict[BlockHash, int] = {}
        self._lru: OrderedDict[BlockHash, None] = OrderedDict()
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

    # ---- public API -------------------------------------------------------------------------

    def add_request(self, req_id: str, token_ids: list[int] | tuple[int, ...], max_tokens: int, now: float,
                    lora: str | None = None) -> None:
        """Queue a request at time `now` (not before the last `advance`). Raises ValueError on bad input."""
        if isinstance(token_ids, (str, bytes, bytearray)):  # array() would read bytes as raw machine words
            raise ValueError("token ids must be a sequence of ints")
        try:
            packed = array("I", token_ids)
        except (TypeError, OverflowError) as e:
            raise ValueError(f"token ids must be ints in [0, 2**32): {e}") from e
        tokens = tuple(packed)
        self._validate(req_id, tokens, max_tokens, now, lora)
        self._run_until(now)
        req = _Request(req_id, tokens, packed.tobytes(), max_tokens, lora, now, self._roots[lora])
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
            private = sum(key is not None for key in req.held)
            req.reserved += private
            self._reserved_total += private
            req.held = [None] * len(req.held)  # positions kept: caching resumes after them
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
        )

    def step_time(self) -> float:
        """How long a decode step takes with the current batch."""
        return self._step_time()

    @property
    def now(self) -> float:
        """The latest time the engine has been run to."""
        return self._clock

    def cached_block_hashes(self) -> set[BlockHash]:
        """The keys of every block now in the prefix cache (for checks)."""
        return set(self._blocks)

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
        self._cache_upto(req, len(req.tokens) // self._bs)
        req.first_token_time = t
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
            self._cache_upto(req, (len(req.tokens) + self._steps - req.join_step) // self._bs)
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
            max_hit = (len(req.tokens) - 1) // self._bs
            hits = 0
            hit_unreferenced = 0
            for key in req.keys[:max_hit]:
                rc = self._blocks.get(key)
                if rc is None:
                    break
                hits += 1
                hit_unreferenced += rc == 0
            need = ceil((len(req.tokens) + req.max_tokens) / self._bs) - hits
            free = c.num_blocks - len(self._blocks) - self._reserved_total
            if need > free + len(self._lru) - hit_unreferenced:
                break  # head of line waits for blocks
            self._waiting.popleft()
            for key in req.keys[:hits]:
                self._ref(key)
            req.held = list(req.keys[:hits])
            self._evict(need - free)
            req.reserved = need
            self._reserved_total += need
            req.cached_tokens = hits * self._bs
            self._queries += len(req.tokens)
            self._hits += req.cached_tokens
            self._prompt_tokens += len(req.tokens)
            output = self._output_ids(req)
            req.seq = req.tokens + output
            req.packed += array("I", output).tobytes()
            req.state = "prefill"
            self._running[req.req_id] = req
            start = max(now, self._prefill_free_at)
            self._prefill_free_at = start + c.prefill_s_per_token * (len(req.tokens) - req.cached_tokens)
            self._prefilling.append((self._prefill_free_at + c.ttft_overhead_s, req))

    def _ref(self, key: BlockHash) -> None:
        rc = self._blocks[key]
        if rc == 0:
            del self._lru[key]
        self._blocks[key] = rc + 1

    def _evict(self, n: int) -> None:
        for _ in range(n):
            key, _ = self._lru.popitem(last=False)
            del self._blocks[key]
            self._events.append(BlockRemoved(block_hashes=(key,), medium=_MEDIUM))

    def _cache_upto(self, req: _Request, n_full: int) -> None:
        """Cache the request's full blocks [len(held), n_full): one BlockStored per run of new blocks."""
        start = len(req.held)
        if n_full <= start:
            return
        self._extend_keys(req, n_full)
        run_start = None
        for i in range(start, n_full):
            key = req.keys[i]
            if key in self._blocks:  # computed meanwhile by another request: share it
                self._store_run(req, run_start, i)
                run_start = None
                self._ref(key)
            else:
                self._blocks[key] = 1
                if run_start is None:
                    run_start = i
            req.held.append(key)
            req.reserved -= 1
            self._reserved_total -= 1
        self._store_run(req, run_start, n_full)

    def _store_run(self, req: _Request, start: int | None, end: int) -> None:
        if start is None or start >= end:
            return
        bs = self._bs
        self._events.append(BlockStored(
            block_hashes=tuple(req.keys[start:end]),
            parent_block_hash=req.keys[start - 1] if start else None,
            token_ids=req.seq[start * bs:end * bs],
            block_size=bs,
            lora_id=self._lora_ids.get(req.lora) if req.lora else None,
            medium=_MEDIUM,
            lora_name=req.lora,
        ))

    def _release(self, req: _Request) -> None:
        for key in reversed(req.held):  # tail blocks become the oldest: evicted first
            if key is None:  # private since a forced reset: freed with `reserved`
                continue
            rc = self._blocks[key] - 1
            self._blocks[key] = rc
            if rc == 0:
                self._lru[key] = None
        req.held = []
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
        for i in range(len(digests), n_full):
            parent = sha256(parent + packed[i * width:(i + 1) * width]).digest()
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
