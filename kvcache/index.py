"""The prefix index: which pod holds which prefix block, exactly, in bounded memory.

It answers one question per request: for each candidate pod, how many leading blocks of the
prompt does that pod already hold (in any medium, and per medium). It is the EventSink the
subscribers feed: events of one (pod, rank) arrive in order, from one thread.

Layout (flat numpy tables, kvcache.table, because the index holds millions of entries):
- a block is identified by kvgate's own key (kvcache.blockkeys), never by the engine's hash;
- each (pod, rank) is a "slot" with a small bit number; per medium, a KeyTable maps a block key
  to the bitmask of the slots holding it there and a recency stamp (set when stored or matched);
  eviction drops the least recent keys first;
- per model, one HashMap maps the engine's block hash (folded to 64 bits) to our key, shared by
  every pod of the model: engines of one model agree on hashes since vLLM 0.29, and where they
  differ the entries simply coexist. A BlockStored whose parent hash is in no such map is kept
  out of chains and counted.
A match computes the prompt's keys and probes them (kvcache/_native.c for the common case of one
medium and at most 64 pod-ranks; numpy otherwise), then finds each slot's leading run from the
running AND of the holder masks. Raw batches take a native one-pass path (apply_payload).
Limits: two engine blocks with the same tokens but different extra keys (multimodal inputs, cache
salt) share one key, so removing either clears it (a conservative miss). Two engine hashes that
fold to the same 64 bits (about 2**-64 per pair) share a map entry. Only KV cache group 0 is
indexed. Not thread-safe.
"""
from __future__ import annotations

import logging
from bisect import bisect_right
from collections import Counter
from dataclasses import dataclass, field
from itertools import accumulate, takewhile
from operator import and_, neg, or_
from typing import Iterable, Sequence

import numpy as np

from kvcache.blockkeys import chain_key_array, chain_keys, root_key
from kvcache.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent
from kvcache.native import native
from kvcache.table import FREED, TOMB, UNKNOWN, HashMap, KeyTable, release, store

log = logging.getLogger(__name__)

DEFAULT_MEDIUM = "GPU"  # what vLLM before 0.10.2 (medium None) means
_M64 = (1 << 64) - 1
_MIX = 0x9E3779B97F4A7C15  # odd: multiplying spreads small or sequential engine hashes
_LOW_BITS = 64  # slot bits kept in the tables' arrays; higher ones in KeyTable.high
_TICK_LIMIT = 0xF000_0000  # rebase the uint32 recency stamps here: room for any one batch's ticks


@dataclass(frozen=True, slots=True)
class BatchApplied:
    """What apply_payload applied: events by type."""
    stored: int
    removed: int


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """One pod's hit: `blocks` consecutive leading blocks held in any medium by its best rank;
    `by_medium[m]` the consecutive leading blocks that rank holds in medium m (non-zero only)."""
    blocks: int
    by_medium: dict[str, int] = field(default_factory=dict)
    total_blocks: int = 0  # full blocks in the request


def _bytes_hash(h: bytes) -> int:
    """A bytes block hash (a 32-byte digest, published raw when VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)
    as the int vLLM publishes by default: its last 8 bytes, big-endian (kvcache/_native.c reads it
    the same way)."""
    return int.from_bytes(h[-8:], "big")


def _fold(h: BlockHash) -> int:
    """An engine block hash as a HashMap key: 64 mixed bits (a bijection of the int), below the
    table's reserved values."""
    if type(h) is not int:
        h = _bytes_hash(h)
    h = h * _MIX & _M64
    return h - 2 if h >= TOMB else h


class PrefixIndex:
    """Which (pod, rank) holds which block, from KV events; at most `max_entries` (block, pod,
    medium) entries, the least recently stored or matched keys evicted first."""

    def __init__(self, max_entries: int = 4_000_000) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        self._max = max_entries
        self._held: dict[str, KeyTable] = {}  # medium -> key -> slot bitmask, recency
        self._keys_of: dict[str, HashMap] = {}  # model -> folded engine hash -> our key
        self._block_size: dict[str, int] = {}
        self._slot: dict[tuple[str, int], int] = {}  # (pod, rank) -> bit number
        self._slot_owner: dict[int, tuple[str, int]] = {}
        self._pod_bits: dict[str, int] = {}  # pod -> OR of its slots' bits
        self._entries = 0  # set bits over every medium table
        self._tick = 1  # recency clock: one tick per applied event and per match
        self._applies = 0
        self._skipped: Counter[str] = Counter()
        self._evicted = 0

    # --- EventSink -------------------------------------------------------------------------

    def apply(self, pod: str, model: str, rank: int, events: Sequence[KVEvent]) -> None:
        """Apply one (pod, rank)'s events in order. Bad events are logged, counted and skipped."""
        bit = self._slot.get((pod, rank))
        if bit is None:
            bit = self._slot_bit(pod, rank)
        keys_of = self._keys_of.get(model)
        if keys_of is None:
            keys_of = self._keys_of[model] = HashMap()
        cleared = False
        for ev in events:
            t = type(ev)
            try:
                if t is BlockRemoved:
                    if ev.group_idx:
                        self._skip("other_kv_cache_group", ev)
                    else:
                        self._remove(bit, keys_of, ev)
                elif t is BlockStored:
                    if ev.group_idx:
                        self._skip("other_kv_cache_group", ev)
                    else:
                        self._store(bit, model, keys_of, ev)
                elif t is AllBlocksCleared:
                    self._clear(1 << bit)
                    cleared = True
                else:
                    self._skip("unknown_event", ev)
            except (TypeError, OverflowError):  # e.g. an unhashable token id or block hash
                self._skip("malformed_event", ev)
        self._after_batch(cleared)

    def apply_payload(self, pod: str, model: str, rank: int, payload: bytes) -> BatchApplied | None:
        """Decode and apply one raw batch (vLLM's msgpack bytes) in one native pass, without a
        Python object per event: the subscriber's fast path. None when the batch is outside that
        path's shape (see kvcache/_native.c scan_batch: AllBlocksCleared, non-ASCII names,
        several media in one batch, unknown fields, anything malformed...) or this index tracks
        more than 64 pod-ranks: the caller then decodes it (kvcache.wire) and calls apply()."""
        scan = native.scan_batch(payload)
        if scan is None:
            return None
        stored_events, stored_blocks, removed_events, _, bs, medium, loras = scan
        bit = self._slot.get((pod, rank))
        if bit is None:
            if len(self._slot_owner) >= _LOW_BITS:
                return None
            bit = self._slot_bit(pod, rank)
        if bit >= _LOW_BITS:
            return None
        medium = medium or DEFAULT_MEDIUM
        table = self._held.get(medium)
        if table is None and not stored_events:
            return None  # removals in a medium nothing was stored in: counted by the general path
        if table is not None and table.high or len(self._held) > 8:
            return None
        keys_of = self._keys_of.get(model)
        if keys_of is None:
            keys_of = self._keys_of[model] = HashMap()
        if table is None:
            table = self._table(medium)
        if stored_events:
            if self._block_size.get(model) != bs:
                self._learn_block_size(model, bs)
            if keys_of.used + stored_blocks > keys_of._limit:  # room for every block: no rebuild inside
                keys_of._rebuild(stored_blocks)
            if table.used + stored_blocks > table._limit:
                table._rebuild(stored_blocks)
        added, removed, self._tick, h_live, h_used, t_live, t_used, unknown_parent, unknown_removed = \
            native.apply_batch(payload, root_key(model, None), 1 << bit, self._tick, keys_of.keys, keys_of.value,
                               table.keys, table.mask, table.stamp,
                               tuple(t.keys for t in self._held.values() if t is not table),
                               {lora: root_key(model, lora) for lora in loras})
        keys_of.live += h_live
        keys_of.used += h_used
        table.live += t_live
        table.used += t_used
        self._entries += added - removed
        if unknown_parent:
            if not self._skipped["unknown_parent_blocks"]:
                log.info("prefix index: model %s: blocks under an unknown parent are kept out of chains", model)
            self._skipped["unknown_parent_blocks"] += unknown_parent
        if unknown_removed:
            self._skipped["unknown_removed_blocks"] += unknown_removed
        self._after_batch(False)
        return BatchApplied(stored_events, removed_events)

    def _after_batch(self, cleared: bool) -> None:
        if self._entries > self._max:
            self._evict()
        if self._tick >= _TICK_LIMIT:
            self._rebase_stamps()
        self._applies += 1
        if cleared or not self._applies & 63:  # the sweep's check sums every table: not on every batch
            for medium in [m for m, t in self._held.items() if not t.live]:
                del self._held[medium]  # a medium nobody holds blocks in (any name an engine sent)
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
        cand = 0
        for p in pods:
            cand |= self._pod_bits.get(p, 0)
        total, run_any, run_med = self._leading_runs(model, lora, token_ids, cand)
        return self._per_pod(pods, run_any, run_med, total)

    def match_ranks(self, model: str, lora: str | None, token_ids: Sequence[int],
                    targets: Iterable[tuple[str, int]]) -> dict[tuple[str, int], PrefixMatch]:
        """Per candidate (pod, rank), the consecutive leading blocks of `token_ids` that rank holds:
        match() rank by rank, for sending a request to one rank of a data-parallel pod."""
        targets = list(targets)
        slot = self._slot.get
        cand = 0
        for target in targets:
            b = slot(target)
            if b is not None:
                cand |= 1 << b
        total, run_any, run_med = self._leading_runs(model, lora, token_ids, cand)
        out = dict.fromkeys(targets, PrefixMatch(0, {}, total))  # one shared miss: read-only results
        if run_any:
            media = list(run_med.items())
            for target in targets:
                b = slot(target)
                n = run_any.get(b, 0) if b is not None else 0
                if n:
                    out[target] = PrefixMatch(n, {m: r[b] for m, r in media if r.get(b)}, total)
        return out

    def _leading_runs(self, model: str, lora: str | None, token_ids: Sequence[int],
                      cand: int) -> tuple[int, dict[int, int], dict[str, dict[int, int]]]:
        """(full blocks in the request, per slot bit of `cand` its leading run in any medium, the
        same per medium); runs of 0 are left out."""
        bs = self._block_size.get(model)
        total = len(token_ids) // bs if bs else 0
        media = [(name, t) for name, t in self._held.items() if t.live]
        if not cand or not total or not media:
            return total, {}, {}
        if len(media) == 1 and not cand >> _LOW_BITS and not media[0][1].high:  # one medium, <= 64 pod-ranks
            name, t = media[0]
            if self._tick >= _TICK_LIMIT:
                self._rebase_stamps()
            self._tick += 1
            run_any = native.match_runs(token_ids, bs, root_key(model, lora), cand, self._tick, t.keys, t.mask,
                                        t.stamp)
            return total, run_any, {name: run_any}
        keys = chain_key_array(root_key(model, lora), token_ids, bs)
        found = [(name, t, t.lookup(keys)) for name, t in media]
        if cand >> _LOW_BITS or any(t.high for _, t in media):  # more than 64 pod-ranks: Python ints
            runs, masks_of, either = _runs, _any_masks, _or_lists
        else:
            runs, masks_of, either = _runs_low, _low_masks, np.bitwise_or.reduce
        masks = [masks_of(t, keys, slots, cand) for _, t, slots in found]
        if len(masks) == 1:
            run_any = runs(cand, masks[0])
            run_med = {media[0][0]: run_any}
        else:
            run_any = runs(cand, either(masks))
            run_med = {name: runs(cand, masks[j]) for j, (name, _) in enumerate(media)}
        deepest = max(run_any.values(), default=0)
        if deepest:  # recency: the matched keys are the most recently used
            if self._tick >= _TICK_LIMIT:
                self._rebase_stamps()
            self._tick += 1
            for _, t, slots in found:
                s = slots[:deepest]
                t.stamp[s[s >= 0]] = self._tick
        return total, run_any, run_med

    def stats(self) -> dict:
        """Counters and sizes, JSON-able."""
        return {
            "entries": self._entries,
            "max_entries": self._max,
            "keys_by_medium": {m: t.live for m, t in self._held.items()},
            "engine_hashes": sum(m.live for m in self._keys_of.values()),
            "table_bytes": sum(t.nbytes() for t in self._held.values()) + sum(
                m.nbytes() for m in self._keys_of.values()),
            "slots": len(self._slot),
            "pods": len(self._pod_bits),
            "blocks_per_pod": self._blocks_per_pod(),
            "block_sizes": dict(self._block_size),
            "evicted_entries": self._evicted,
            "skipped": dict(self._skipped),
        }

    def _blocks_per_pod(self) -> dict[str, int]:
        """Per pod, the distinct blocks any of its ranks holds in any medium. Vectorised, for
        debug snapshots, not per request: one-rank pods in a one-medium index read a per-bit count
        (a few passes over the table); others take a pass per pod."""
        held = []  # per medium: (keys, low masks, high masks)
        for t in self._held.values():
            occ = t.occupied()
            held.append((t.keys[occ], t.mask[occ], t.high))
        per_bit = _bit_counts(held[0][1]) if len(held) == 1 else None
        out = {}
        for pod, bits in self._pod_bits.items():
            if per_bit is not None and not bits & (bits - 1) and bits.bit_length() <= _LOW_BITS:
                out[pod] = per_bit[bits.bit_length() - 1]
                continue
            low, high = np.uint64(bits & _M64), bits >> _LOW_BITS
            keys = []
            for ks, masks, highs in held:
                hit = (masks & low) != 0
                if high and highs:
                    hit |= np.isin(ks, np.array([k for k, m in highs.items() if m & high], np.uint64))
                keys.append(ks[hit])
            out[pod] = len(keys[0]) if len(keys) == 1 else len(np.unique(np.concatenate(keys))) if keys else 0
        return out

    # --- events ----------------------------------------------------------------------------

    def _slot_bit(self, pod: str, rank: int) -> int:
        b = self._slot.get((pod, rank))
        if b is None:
            b = 0
            while b in self._slot_owner:  # lowest free bit keeps masks in the tables' arrays
                b += 1
            self._slot[(pod, rank)] = b
            self._slot_owner[b] = (pod, rank)
            self._pod_bits[pod] = self._pod_bits.get(pod, 0) | (1 << b)
        return b

    def _table(self, medium: str | None) -> KeyTable:
        t = self._held.get(medium or DEFAULT_MEDIUM)
        if t is None:
            t = self._held[medium or DEFAULT_MEDIUM] = KeyTable()
        return t

    def _store(self, bit: int, model: str, keys_of: HashMap, ev: BlockStored) -> None:
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
            k = keys_of.get(_fold(parent))
            if k is None:  # its chain is unknown: never guess a chain start
                if not self._skipped["unknown_parent_blocks"]:
                    log.info("prefix index: model %s: blocks under an unknown parent are kept out of chains", model)
                self._skipped["unknown_parent_blocks"] += n
                return
        table = self._held.get(ev.medium or DEFAULT_MEDIUM) or self._table(ev.medium)
        self._tick += 1
        keys = chain_keys(k, tokens, bs)  # an unhashable token id raises before any change
        folded = list(map(_fold, hashes))
        if bit < _LOW_BITS:
            self._entries += store(keys_of, table, folded, keys, 1 << bit, self._tick)
            return
        store(keys_of, table, folded, keys, 0, self._tick)
        high, one = table.high, 1 << (bit - _LOW_BITS)
        for k in keys:
            m = high.get(k, 0)
            if not m & one:
                high[k] = m | one
                self._entries += 1

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

    def _remove(self, bit: int, keys_of: HashMap, ev: BlockRemoved) -> None:
        table = self._held.get(ev.medium or DEFAULT_MEDIUM)
        if table is None or bit >= _LOW_BITS:
            self._remove_slow(bit, keys_of, table, ev)
            return
        one, sole = 1 << bit, len(self._held) == 1
        for h in map(_fold, ev.block_hashes):
            r = release(keys_of, table, h, one, sole)
            if r >= FREED:
                self._entries -= 1
                if r == FREED and not sole:
                    self._forget_hash_if_unheld(keys_of, h)
            elif r == UNKNOWN:
                self._skipped["unknown_removed_blocks"] += 1

    def _forget_hash_if_unheld(self, keys_of: HashMap, h: int) -> None:
        hs = keys_of.find(h)
        k = keys_of._value[hs]
        if all(t.find(k) < 0 for t in self._held.values()):
            keys_of.delete(hs)

    def _remove_slow(self, bit: int, keys_of: HashMap, table: KeyTable | None, ev: BlockRemoved) -> None:
        """_remove for a medium nothing was stored in, or a slot bit beyond the tables' arrays."""
        for h in ev.block_hashes:
            h = _fold(h)
            hs = keys_of.find(h)
            if hs < 0:
                self._skipped["unknown_removed_blocks"] += 1
                continue
            if table is None:
                continue
            k = keys_of._value[hs]
            s = table.find(k)
            if s < 0:
                continue
            m = self._remove_high(table, k, bit - _LOW_BITS)
            if m < 0:
                continue
            self._entries -= 1
            if m or (table.high and k in table.high):
                continue
            table.delete(s)
            if all(t.find(k) < 0 for t in self._held.values()):
                keys_of.delete(hs)  # nobody holds the block any more

    @staticmethod
    def _remove_high(table: KeyTable, k: int, bit: int) -> int:
        """Unset `bit` of `k`'s high mask: -1 if it was not set, else the key's low mask."""
        m = table.high.get(k, 0)
        if not m >> bit & 1:
            return -1
        m ^= 1 << bit
        if m:
            table.high[k] = m
        else:
            del table.high[k]
        return table._mask[table.find(k)]

    def _clear(self, bits: int) -> None:
        """Unset `bits` everywhere: a vectorised pass over every table, fine for rare clears."""
        low = np.uint64(bits & _M64)
        high = bits >> _LOW_BITS
        for t in self._held.values():
            if low:
                occ = t.occupied()
                m = t.mask[occ]
                hit = (m & low) != 0
                if hit.any():
                    slots = occ[hit]
                    cleared = m[hit] & ~low
                    self._entries -= int(np.bitwise_count(m[hit] & low).sum())
                    t.mask[slots] = cleared
            if high and t.high:
                for k, m in list(t.high.items()):
                    if m & high:
                        self._entries -= (m & high).bit_count()
                        if m & ~high:
                            t.high[k] = m & ~high
                        else:
                            del t.high[k]
            occ = t.occupied()
            empty = occ[t.mask[occ] == 0]
            if len(empty) and t.high:
                empty = np.array([s for s, k in zip(empty.tolist(), t.keys[empty].tolist())
                                  if k not in t.high], np.intp)
            t.delete_slots(empty)

    def _maybe_sweep_engine_hashes(self) -> None:
        """Drop engine hashes whose key nobody holds once they outnumber the live keys: until then
        they are harmless (they resolve to a key no pod holds)."""
        live = sum(t.live for t in self._held.values())
        if sum(m.live for m in self._keys_of.values()) <= 2 * live + 4096:
            return
        tables = list(self._held.values())
        for keys_of in self._keys_of.values():
            occ = keys_of.occupied()
            vals = keys_of.value[occ]
            held = np.zeros(len(occ), bool)
            for t in tables:
                held |= t.lookup(vals) >= 0
            keys_of.delete_slots(occ[~held])

    def _evict(self) -> None:
        """Evict the least recently stored or matched keys down to 31/32 of the bound."""
        target = self._max - (self._max >> 5)
        while self._entries > target:
            tables = [t for t in self._held.values() if t.live]
            if not tables:  # cannot happen while the count is right; never spin
                self._entries = 0
                break
            occ = [t.occupied() for t in tables]
            stamps = np.concatenate([t.stamp[o] for t, o in zip(tables, occ)])
            which = np.concatenate([np.full(len(o), i, np.intp) for i, o in enumerate(occ)])
            slots = np.concatenate(occ)
            n = min(self._entries - target, len(stamps))  # every key holds at least one entry
            oldest = np.argpartition(stamps, n - 1)[:n] if n < len(stamps) else np.arange(len(stamps))
            for i, t in enumerate(tables):
                gone = slots[oldest[which[oldest] == i]]
                freed = int(np.bitwise_count(t.mask[gone]).sum())
                if t.high:
                    for k in t.keys[gone].tolist():
                        freed += t.high.pop(k, 0).bit_count()
                self._entries -= freed
                self._evicted += freed
                t.delete_slots(gone)

    def _rebase_stamps(self) -> None:
        """Keep the uint32 recency clock from wrapping: shift every stamp down."""
        low = min((int(t.stamp[t.occupied()].min(initial=self._tick)) for t in self._held.values()),
                  default=self._tick)
        for t in self._held.values():
            occ = t.occupied()
            t.stamp[occ] -= np.uint32(low)
        self._tick -= low

    def _skip(self, reason: str, ev: object) -> None:
        if not self._skipped[reason]:
            log.warning("prefix index: skipping %s (first of its kind): %.200r", reason, ev)
        self._skipped[reason] += 1

    # --- matching --------------------------------------------------------------------------

    def _per_pod(self, pods: list[str], run_any: dict[int, int], run_med: dict[str, dict[int, int]],
                 total: int) -> dict[str, PrefixMatch]:
        """Results per pod from runs per slot bit (every bit there is a candidate's)."""
        # one shared miss for every pod without a hit: treat results as read-only
        out = dict.fromkeys(pods, PrefixMatch(0, {}, total))
        ranks: dict[str, list[int]] = {}
        owner = self._slot_owner
        for b in sorted(run_any):
            ranks.setdefault(owner[b][0], []).append(b)
        media = list(run_med.items())
        for pod, bits in ranks.items():
            if len(bits) == 1:  # one rank holds it: the common case
                b = bits[0]
            else:  # the best rank: most blocks, then most blocks over every medium
                b = max(bits, key=lambda b: (run_any[b], sum(r.get(b, 0) for _, r in media)))
            out[pod] = PrefixMatch(run_any[b], {m: r[b] for m, r in media if r.get(b)}, total)
        return out


def _bit_counts(masks: np.ndarray) -> list[int]:
    """How many of the uint64 `masks` have each bit 0..63 set. Most masks hold one bit: those
    are counted by bit number at once, the rest bit by bit."""
    one = (masks & (masks - np.uint64(1))) == 0
    single = masks[one]
    counts = np.bincount(np.bitwise_count(single[single != 0] - np.uint64(1)), minlength=_LOW_BITS)
    many = masks[~one]
    if len(many):
        for b in range(_LOW_BITS):
            counts[b] += np.count_nonzero(many & np.uint64(1 << b))
    return counts.tolist()


def _runs_low(cand: int, masks: np.ndarray) -> dict[int, int]:
    """_runs for slot bits below 64: `masks` a uint64 array already ANDed with `cand`."""
    runs: dict[int, int] = {}
    if not len(masks) or not masks[0]:
        return runs
    alive = np.bitwise_and.accumulate(masks)
    drops = np.flatnonzero(alive[1:] != alive[:-1]).tolist()
    values = alive[[0] + [j + 1 for j in drops]].tolist()
    for i, j in enumerate(drops):
        _record(runs, values[i] & ~values[i + 1], j + 1)
    _record(runs, values[-1], len(masks))
    return runs


def _low_masks(table: KeyTable, keys: np.ndarray, slots: np.ndarray, cand: int) -> np.ndarray:
    masks = np.where(slots >= 0, table.mask[slots], np.uint64(0))
    masks &= np.uint64(cand)
    return masks


def _any_masks(table: KeyTable, keys: np.ndarray, slots: np.ndarray, cand: int) -> list[int]:
    masks = np.where(slots >= 0, table.mask[slots], np.uint64(0)).tolist()
    high = table.high
    if not high:
        return masks
    return [m | (high.get(k, 0) << _LOW_BITS) for m, k in zip(masks, keys.tolist())]


def _or_lists(masks: list[list[int]]) -> list[int]:
    either = masks[0]
    for more in masks[1:]:
        either = list(map(or_, either, more))
    return either


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
