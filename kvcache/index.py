"""The prefix index: which pod holds which prefix block, exactly, in bounded memory.

It answers one question per request: for each candidate pod, how many leading blocks of the
prompt does that pod already hold (in any medium, and per medium). It is the EventSink the
subscribers feed: events of one (pod, rank) arrive in order, from one thread.

Layout (kept compact because the index holds millions of entries):
- a block is identified by kvgate's own key (kvcache.blockkeys), never by the engine's hash;
- each (pod, rank) is a "slot" with a small bit number; per medium, a dict maps a block key to
  the int bitmask of the slots holding it there, least recently stored first (eviction takes
  from that end; a key matched since gets a second chance);
- per model, one dict maps the engine's block hash (an int cut to 60 bits: a 32-byte object
  instead of 48) to our key, shared by every pod of the model: engines of one model agree on
  hashes since vLLM 0.29, and where they differ the entries simply coexist. A per-(pod, rank)
  map would cost a dict entry and an int per (block, pod) entry. A BlockStored whose parent hash
  is in no such map is kept out of chains and counted.
Limits: two engine blocks with the same tokens but different extra keys (multimodal inputs, cache
salt) share one key, so removing either clears it (a conservative miss). Only KV cache group 0
is indexed. Not thread-safe.
"""
from __future__ import annotations

import logging
from bisect import bisect_right
from collections import Counter
from dataclasses import dataclass, field
from itertools import accumulate, islice, repeat, takewhile
from operator import and_, neg, or_
from typing import Iterable, Sequence

from kvcache.blockkeys import KEY_MASK, MULT, chain_keys, root_key
from kvcache.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent

log = logging.getLogger(__name__)

DEFAULT_MEDIUM = "GPU"  # what vLLM before 0.10.2 (medium None) means
_TOUCH_BACKLOG = 1 << 17  # matched keys listed before apply() folds them into the second-chance set


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """One pod's hit: `blocks` consecutive leading blocks held in any medium by its best rank;
    `by_medium[m]` the consecutive leading blocks that rank holds in medium m (non-zero only)."""
    blocks: int
    by_medium: dict[str, int] = field(default_factory=dict)
    total_blocks: int = 0  # full blocks in the request


class PrefixIndex:
    """Which (pod, rank) holds which block, from KV events; at most `max_entries` (block, pod,
    medium) entries, least recently stored evicted first, with a second chance for matched ones."""

    def __init__(self, max_entries: int = 4_000_000) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        self._max = max_entries
        self._held: dict[str, dict[int, int]] = {}  # medium -> key -> slot bitmask, LRU first
        self._keys_of: dict[str, dict[BlockHash, int]] = {}  # model -> engine hash -> our key
        self._block_size: dict[str, int] = {}
        self._slot: dict[tuple[str, int], int] = {}  # (pod, rank) -> bit number
        self._slot_owner: dict[int, tuple[str, int]] = {}
        self._one_slot: dict[int, int] = {}  # 1 << b -> its shared object
        self._pod_bits: dict[str, int] = {}  # pod -> OR of its slots' bits
        self._entries = 0  # set bits over every medium dict
        # Recency from matches is a second chance (CLOCK): matched keys are remembered and, when
        # eviction reaches one of them, it moves to the back instead of going.
        self._touched: list[list[int]] = []  # keys of recent matches, not yet folded into the set
        self._touched_n = 0
        self._referenced: set[int] = set()
        self._skipped: Counter[str] = Counter()
        self._evicted = 0

    # --- EventSink -------------------------------------------------------------------------

    def apply(self, pod: str, model: str, rank: int, events: Sequence[KVEvent]) -> None:
        """Apply one (pod, rank)'s events in order. Bad events are logged, counted and skipped."""
        if self._touched_n > _TOUCH_BACKLOG:
            self._fold_touches()
        bit = self._slot_bit(pod, rank)
        keys_of = self._keys_of.get(model)
        if keys_of is None:
            keys_of = self._keys_of[model] = {}
        for ev in events:
            t = type(ev)
            try:
                if getattr(ev, "group_idx", None):
                    self._skip("other_kv_cache_group", ev)
                elif t is BlockStored:
                    self._store(bit, model, keys_of, ev)
                elif t is BlockRemoved:
                    self._remove(bit, keys_of, ev)
                elif t is AllBlocksCleared:
                    self._clear(bit)
                else:
                    self._skip("unknown_event", ev)
            except TypeError:  # e.g. an unhashable token id or block hash
                self._skip("malformed_event", ev)
        if self._entries > self._max:
            self._evict()
        self._maybe_sweep_engine_hashes()

    def drop(self, pod: str, rank: int) -> None:
        """Forget what (pod, rank) holds: its stream can no longer be trusted."""
        bit = self._slot.get((pod, rank))
        if bit is not None:
            self._clear(1 << bit)
            self._maybe_sweep_engine_hashes()

    def remove_pod(self, pod: str) -> None:
        """Forget every rank of `pod` (it left discovery) and free their slots."""
        bits = self._pod_bits.pop(pod, 0)
        if not bits:
            return
        self._clear(bits)
        self._maybe_sweep_engine_hashes()
        for b, owner in list(self._slot_owner.items()):
            if owner[0] == pod:
                del self._slot_owner[b]
                del self._slot[owner]

    # --- queries ---------------------------------------------------------------------------

    def block_size(self, model: str) -> int | None:
        """The block size `model`'s engines publish, once a BlockStored has been seen."""
        return self._block_size.get(model)

    def match(self, model: str, lora: str | None, token_ids: Sequence[int],
              pods: Iterable[str]) -> dict[str, PrefixMatch]:
        """Per candidate pod, the consecutive leading blocks of `token_ids` it holds (best rank)."""
        pods = list(pods)
        bs = self._block_size.get(model)
        total = len(token_ids) // bs if bs else 0
        cand = 0
        for p in pods:
            cand |= self._pod_bits.get(p, 0)
        media = [(name, d) for name, d in self._held.items() if d]
        if not cand or not total or not media:
            return {p: PrefixMatch(0, {}, total) for p in pods}
        keys = chain_keys(root_key(model, lora), token_ids, bs)
        if len(media) == 1:
            run_any = _runs(cand, map(media[0][1].get, keys, repeat(0)))
            run_med = {media[0][0]: run_any}
        else:
            held = [list(map(d.get, keys, repeat(0))) for _, d in media]
            either = held[0]
            for more in held[1:]:
                either = list(map(or_, either, more))
            run_any = _runs(cand, either)
            run_med = {name: _runs(cand, held[j]) for j, (name, _) in enumerate(media)}
        deepest = max(run_any.values(), default=0)
        if deepest:
            self._touch(keys[:deepest])
        return self._per_pod(pods, run_any, run_med, total)

    def stats(self) -> dict:
        """Counters and sizes, JSON-able."""
        return {
            "entries": self._entries,
            "max_entries": self._max,
            "keys_by_medium": {m: len(d) for m, d in self._held.items()},
            "engine_hashes": sum(len(d) for d in self._keys_of.values()),
            "slots": len(self._slot),
            "pods": len(self._pod_bits),
            "block_sizes": dict(self._block_size),
            "evicted_entries": self._evicted,
            "skipped": dict(self._skipped),
        }

    # --- events ----------------------------------------------------------------------------

    def _slot_bit(self, pod: str, rank: int) -> int:
        b = self._slot.get((pod, rank))
        if b is None:
            b = 0
            while b in self._slot_owner:  # lowest free bit keeps masks small ints
                b += 1
            self._slot[(pod, rank)] = b
            self._slot_owner[b] = (pod, rank)
            self._pod_bits[pod] = self._pod_bits.get(pod, 0) | (1 << b)
        return self._single(1 << b)

    def _single(self, mask: int) -> int:
        """One shared int object per one-slot mask: most keys have one holder, so this saves an int
        per key and keeps the mask objects a match reads in cache."""
        return self._one_slot.setdefault(mask, mask)

    def _store(self, bit: int, model: str, keys_of: dict[BlockHash, int], ev: BlockStored) -> None:
        bs, hashes, tokens = ev.block_size, ev.block_hashes, ev.token_ids
        n = len(hashes)
        if type(bs) is not int or bs <= 0 or len(tokens) != n * bs:
            self._skip("malformed_block_stored", ev)
            return
        if self._block_size.get(model) != bs:
            self._learn_block_size(model, bs)
        parent = ev.parent_block_hash
        if parent is None:
            k = self._root(model, ev)
        else:
            k = keys_of.get(parent & KEY_MASK if type(parent) is int else parent)
            if k is None:  # its chain is unknown: never guess a chain start
                if not self._skipped["unknown_parent_blocks"]:
                    log.info("prefix index: model %s: blocks under an unknown parent are kept out of chains", model)
                self._skipped["unknown_parent_blocks"] += n
                return
        held = self._held.get(ev.medium or DEFAULT_MEDIUM)
        if held is None:
            held = self._held[ev.medium or DEFAULT_MEDIUM] = {}
        if n == 1 and type(tokens) is tuple:  # a decode step's block: no chunking
            k = (k * MULT + hash(tokens)) & KEY_MASK
            h = hashes[0]
            keys_of[h & KEY_MASK if type(h) is int else h] = k
            m = held.pop(k, 0)
            if not m & bit:
                self._entries += 1
                m = m | bit if m else bit
            held[k] = m
            return
        pop = held.pop
        mask = KEY_MASK
        if type(hashes[0]) is int:
            hashes = [h & mask for h in hashes]
        added = 0
        try:
            for h, bh in zip(hashes, map(hash, zip(*[iter(tokens)] * bs))):
                k = (k * MULT + bh) & mask
                keys_of[h] = k
                m = pop(k, 0)  # pop and re-insert: the key becomes the most recent
                if not m & bit:
                    added += 1
                    m = m | bit if m else bit
                held[k] = m
        finally:  # an unhashable token id stops the event; the blocks before it stay counted
            self._entries += added

    def _learn_block_size(self, model: str, bs: int) -> None:
        known = self._block_size.get(model)
        if known is not None:
            log.warning("model %s: block size changed from %d to %d", model, known, bs)
            self._skipped["block_size_changes"] += 1
        self._block_size[model] = bs

    @staticmethod
    def _root(model: str, ev: BlockStored) -> int:
        lora = ev.lora_name
        if lora is None and ev.lora_id is not None:  # before vLLM 0.14: keep apart from the base model
            lora = f"#lora_id={ev.lora_id}"
        return root_key(model, lora)

    def _remove(self, bit: int, keys_of: dict[BlockHash, int], ev: BlockRemoved) -> None:
        held = self._held.get(ev.medium or DEFAULT_MEDIUM) or {}
        for h in ev.block_hashes:
            if type(h) is int:
                h &= KEY_MASK
            k = keys_of.get(h)
            if k is None:
                self._skipped["unknown_removed_blocks"] += 1
                continue
            m = held.get(k, 0)
            if not m & bit:
                continue
            self._entries -= 1
            m ^= bit
            if m:
                held[k] = m if m & (m - 1) else self._single(m)
            else:
                del held[k]
                if len(self._held) == 1 or not any(k in d for d in self._held.values()):
                    del keys_of[h]  # nobody holds the block any more

    def _clear(self, bits: int) -> None:
        """Unset `bits` everywhere: a scan of every key, fine for rare clears and restarts."""
        for held in self._held.values():
            for k in [k for k, m in held.items() if m & bits]:
                m = held[k]
                self._entries -= (m & bits).bit_count()
                m &= ~bits
                if m:
                    held[k] = m if m & (m - 1) else self._single(m)
                else:
                    del held[k]

    def _maybe_sweep_engine_hashes(self) -> None:
        """Drop engine hashes whose key nobody holds once they outnumber the live keys: until then
        they are harmless (they resolve to a key no pod holds)."""
        live = sum(len(d) for d in self._held.values())
        if sum(len(d) for d in self._keys_of.values()) <= 2 * live + 4096:
            return
        media = [d for d in self._held.values() if d]
        for model, keys_of in self._keys_of.items():
            if len(media) == 1:
                held = media[0]
                self._keys_of[model] = {h: k for h, k in keys_of.items() if k in held}
            else:
                self._keys_of[model] = {h: k for h, k in keys_of.items() if any(k in d for d in media)}

    def _evict(self) -> None:
        """Evict from the least recently stored end down to 31/32 of the bound, giving keys matched
        since a second chance (batched: the front scan of a dict is linear in the entries deleted
        before it)."""
        self._fold_touches()
        ref = self._referenced
        target = self._max - (self._max >> 5)
        while self._entries > target:
            held = max(self._held.values(), key=len)
            if not held:  # cannot happen while the count is right; never spin
                self._entries = 0
                break
            for k in list(islice(held, 1024)):
                m = held.pop(k)
                if k in ref:
                    ref.discard(k)
                    held[k] = m
                    continue
                n = m.bit_count()
                self._entries -= n
                self._evicted += n
                if self._entries <= target:
                    break

    def _skip(self, reason: str, ev: object) -> None:
        if not self._skipped[reason]:
            log.warning("prefix index: skipping %s (first of its kind): %.200r", reason, ev)
        self._skipped[reason] += 1

    # --- matching --------------------------------------------------------------------------

    def _per_pod(self, pods: list[str], run_any: dict[int, int], run_med: dict[str, dict[int, int]],
                 total: int) -> dict[str, PrefixMatch]:
        hit = 0
        for b in run_any:
            hit |= 1 << b
        miss = PrefixMatch(0, {}, total)  # shared by every pod without a hit: treat results as read-only
        out: dict[str, PrefixMatch] = {}
        pod_bits = self._pod_bits
        for p in pods:
            bits = pod_bits.get(p, 0) & hit
            if not bits:
                out[p] = miss
                continue
            best = (0, 0)  # (blocks, sum of medium runs) of the pod's best rank
            best_bit = -1
            while bits:
                low = bits & -bits
                b = low.bit_length() - 1
                bits ^= low
                score = (run_any[b], sum(r.get(b, 0) for r in run_med.values()))
                if score > best:
                    best, best_bit = score, b
            by_medium = {m: r[best_bit] for m, r in run_med.items() if r.get(best_bit)}
            out[p] = PrefixMatch(best[0], by_medium, total)
        return out

    # --- recency of matched keys -------------------------------------------------------------

    def _touch(self, keys: list[int]) -> None:
        """Remember matched keys: a match pays only a list append."""
        if keys:
            self._touched.append(keys)
            self._touched_n += len(keys)
            if self._touched_n > 2 * _TOUCH_BACKLOG:  # matches but no events for a long while: forget
                self._touched.clear()
                self._touched_n = 0

    def _fold_touches(self) -> None:
        ref = self._referenced
        for keys in self._touched:
            ref.update(keys)
        self._touched.clear()
        self._touched_n = 0
        if len(ref) > max(self._max >> 2, _TOUCH_BACKLOG):  # bounded memory: forget the oldest chances
            ref.clear()


def _runs(cand: int, masks: Iterable[int]) -> dict[int, int]:
    """Per slot bit of `cand`, how many leading `masks` hold it (runs of 0 are not recorded).
    The running AND only ever loses bits, so it is non-increasing: a bisection finds each drop."""
    alive = list(takewhile(bool, accumulate(masks, and_, initial=cand)))  # alive[i]: holders of blocks < i
    runs: dict[int, int] = {}
    if len(alive) < 2:
        return runs
    down = list(map(neg, alive))
    i, n = 1, len(alive)
    while i < n:
        v = alive[i]
        j = bisect_right(down, -v, i)  # the first index where a holder drops out
        _record(runs, v & ~alive[j] if j < n else v, j - 1)
        i = j
    return runs


def _record(runs: dict[int, int], dropped: int, i: int) -> None:
    """Slots in the `dropped` mask have a run of `i` blocks (runs of 0 are not recorded)."""
    while dropped and i:
        low = dropped & -dropped
        runs[low.bit_length() - 1] = i
        dropped ^= low
