"""The prefix index: which pod holds which prefix block, exactly, in bounded memory.

It answers one question per request: for each candidate pod, how many leading blocks of the
prompt does that pod already hold (in any medium, and per medium). It implements the whole
kvcache.sink.EventSink the streams feed: events of one (pod, rank) arrive in order, from one thread.

The tables live in C (kvcache/csrc/, `Core`), one implementation for every fleet shape:
- a block is identified by kvgate's own key (kvcache.blockkeys), never by the engine's hash;
- each (pod, rank) is a "slot" (a small number) of its pod's group; per medium a key table maps
  a block key to the slots holding it there and a recency stamp (set when stored or matched);
  eviction drops the least recent keys first;
- per model, one map takes the engine's block hash (folded to 64 bits) to our key, shared by
  every pod of the model: engines of one model agree on hashes since vLLM 0.29, and where they
  differ the entries simply coexist. A BlockStored whose parent hash is in no such map is kept
  out of chains and counted.
- counts (entries, per pod) are kept as they change; eviction, clearing a slot and dropping
  engine hashes nobody's key uses are done a bounded amount at a time (no pass over the tables
  holds the caller). A cleared slot stops counting at once; its marks go in the background.
This module keeps names (pods, ranks, media, models, groups), logging and the per-pod answers. A match
computes the prompt's keys and probes them in C, which returns each candidate slot's leading run.
Raw batches take a native one-pass path (apply_payload); decoded events go through apply().
A block's extra keys (salt, media, prompt-embeds digests) are mixed into its key, on both sides.
Several KV cache groups (kvcache.groups): group 0's blocks live in the per-medium tables, group g's
in tables of their own; the engine-hash map serves every group (vLLM hashes one chain for all),
which also places a sparse-retention store's hashes; a request's hit is the groups' fixed point,
from each candidate slot's held positions (Core.holders). A model once seen with several groups,
extra keys or lookahead tokens keeps to the general path (apply) for its batches.
Limits: two physical copies of one block (two requests that computed it at once) are one entry, so
evicting either clears it (a conservative miss). Two engine hashes that fold to the same 64 bits
(about 2**-64 per pair) share a map entry. At most 65520 pod-ranks at once. Not thread-safe.
"""
from __future__ import annotations

import logging
from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence, cast

from kvcache.blockkeys import BlockExtras, extra_digest, mixed_keys, request_keys, root_key
from kvcache.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent
from kvcache.groups import Group, Shape, longest_hit
from kvcache.native import native
from kvcache.sink import BatchApplied, RunApplied

log = logging.getLogger(__name__)

DEFAULT_MEDIUM = "GPU"  # what vLLM before 0.10.2 (medium None) means
_M64 = (1 << 64) - 1
_MIX = 0x9E3779B97F4A7C15  # odd: multiplying spreads small or sequential engine hashes
_TOMB = _M64 - 1  # folded hashes stay below the tables' reserved values (kvcache/csrc/tables.h)


_applied = tuple.__new__  # BatchApplied made without its __new__ (a Python-level call, once per live batch)


_NO_ROOTS: dict[str, int] = {}
_LORA_ROOTS_MAX = 4096  # LoRA keys whose root key a model keeps for apply_run (cleared past this)
_MAX_GROUP = 255  # KV cache group indices beyond this are taken for malformed
_MAX_CARRIED = 4096  # sparse stores of a (pod, rank) waiting for their dense group's store, at most
_NOTHING = RunApplied(0, 0, 0, 0.0, None)
_BAD = object()  # malformed extra keys


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """One pod's hit: `blocks` consecutive leading blocks held in any medium by its best rank;
    `by_medium[m]` the consecutive leading blocks that rank holds in medium m (non-zero only)."""
    blocks: int
    by_medium: dict[str, int] = field(default_factory=dict)
    total_blocks: int = 0  # full blocks in the request


def _bytes_hash(h: bytes) -> int:
    """A bytes block hash (a 32-byte digest, published raw when VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)
    as the int vLLM publishes by default: its last 8 bytes, big-endian (kvcache/csrc/events.c reads it
    the same way)."""
    return int.from_bytes(h[-8:], "big")


def _fold(h: BlockHash) -> int:
    """An engine block hash as a map key: 64 mixed bits (a bijection of the int), below the
    tables' reserved values."""
    if type(h) is not int:
        h = _bytes_hash(cast(bytes, h))  # BlockHash is int | bytes
    h = h * _MIX & _M64
    return h - 2 if h >= _TOMB else h


def _folded(hashes: Iterable[BlockHash]) -> bytes:
    """Engine block hashes folded, as native uint64 bytes for the C tables."""
    return array("Q", map(_fold, hashes)).tobytes()


class PrefixIndex:
    """Which (pod, rank) holds which block, from KV events; at most `max_entries` (block, pod,
    medium) entries, the least recently stored or matched keys evicted first."""

    def __init__(self, max_entries: int = 4_000_000) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        self._max = max_entries
        self._core = native.Core(max_entries)
        self._media: dict[str, int] = {}  # medium name -> key table id
        self._media_ids: tuple[tuple[str, ...], tuple[int, ...]] = ((), ())
        self._models: dict[str, int] = {}  # model -> engine-hash map id
        self._block_size: dict[str, int] = {}
        self._slot: dict[tuple[str, int], int] = {}  # (pod, rank) -> slot number
        self._slot_owner: dict[int, tuple[str, int]] = {}
        self._pod_group: dict[str, int] = {}  # pod -> its group (pod) id in the tables
        self._pod_bits: dict[str, int] = {}  # pod -> OR of 1 << slot over its ranks
        self._cand: dict[tuple[str, ...], int] = {}  # candidate pods -> OR of their _pod_bits
        self._tables: dict[tuple[str, int], int] = {}  # (medium, KV cache group > 0) -> key table id
        self._shapes: dict[str, Shape] = {}  # model -> its KV cache groups, once a general-path store said
        # (pod, rank) -> sparse stores its last apply() could not place yet (kvcache.index._resolve)
        self._carried: dict[tuple[str, int], list[tuple[int, tuple[BlockHash, ...]]]] = {}
        self._roots: dict[str, int] = {}  # model -> root_key(model, None)
        self._lora_roots: dict[str, dict[str, int]] = {}  # model -> LoRA key -> root_key(model, key), as met
        self._applies = 0
        self._skipped: Counter[str] = Counter()
        self._cleared: Counter[tuple[str, int]] = Counter()  # (pod, rank) -> times its cache was cleared
        self._removals: Counter[str] = Counter()  # pod -> BlockRemoved events applied (its engine evicting)
        self._resets: Counter[str] = Counter()  # pod -> its ranks' clears (AllBlocksCleared, a dropped stream)

    # --- EventSink (kvcache.sink) ---------------------------------------------------------

    def apply(self, pod: str, model: str, rank: int, events: Sequence[KVEvent]) -> None:
        """Apply one (pod, rank)'s events in order. Bad events are logged, counted and skipped."""
        slot, model_id = self._ids(pod, rank, model)
        cleared = False
        removals = 0
        sparse: list[tuple[int, tuple[BlockHash, ...]]] = []  # to resolve once the batch's other groups are in
        ev: Any  # dispatched on its exact type through `t`, which mypy does not follow
        for ev in events:
            t = type(ev)
            try:
                if t is BlockRemoved:
                    if sparse:  # the batch's sparse stores so far go in first: a removal after them wins
                        waiting: list[tuple[int, tuple[BlockHash, ...]]] = []
                        self._resolve(slot, model_id, sparse, waiting)
                        sparse.extend(waiting)  # still waiting for their dense store
                    self._remove(slot, model_id, ev)
                    removals += 1
                elif t is BlockStored:
                    self._store(slot, model, model_id, ev, sparse)
                elif t is AllBlocksCleared:
                    if sparse:
                        self._resolve(slot, model_id, sparse, None)
                    slot = self._clear(pod, rank)
                    cleared = True
                else:
                    self._skip("unknown_event", ev)
            except (TypeError, OverflowError):  # e.g. an unhashable token id or block hash
                self._skip("malformed_event", ev)
        carried = self._carried.pop((pod, rank), None)
        if carried:  # the second and last try of what the previous call could not place
            self._resolve(slot, model_id, carried, None)
        if sparse:  # what this call cannot place waits for the next (a batch cut in chunks: kvcache.stream)
            left: list[tuple[int, tuple[BlockHash, ...]]] = []
            self._resolve(slot, model_id, sparse, left)
            if left:
                self._carried[(pod, rank)] = left
        if removals:
            self._removals[pod] += removals
        self._after_batch(cleared)

    def apply_payload(self, pod: str, model: str, rank: int, payload: bytes) -> BatchApplied | None:
        """Decode and apply one raw batch (vLLM's msgpack bytes) in one native pass, without a
        Python object per event: the subscriber's fast path. None when the batch is outside that
        path's shape (see kvcache/csrc/events.c scan_batch: AllBlocksCleared, non-ASCII names,
        several media in one batch, unknown fields, anything malformed...): the caller then
        decodes it (kvcache.wire) and calls apply()."""
        shape = self._shapes.get(model)
        if shape is not None and not shape.simple:  # several groups: the general path keys each
            return None
        scan = native.scan_batch(payload)
        if scan is None:
            return None
        stored_events, _, removed_events, _, bs, medium, loras = scan
        slot, model_id = self._ids(pod, rank, model)
        medium_id = self._media.get(medium or DEFAULT_MEDIUM, -1)
        if stored_events:
            if medium_id < 0:
                medium_id = self._medium_id(medium or DEFAULT_MEDIUM)
            if self._block_size.get(model) != bs:
                self._learn_block_size(model, bs)
        root = self._base_root(model)
        roots = {}
        if loras:
            known = self._lora_roots.get(model)
            if known is None or len(known) >= _LORA_ROOTS_MAX:
                known = self._lora_roots[model] = {}
            for lora in loras:
                r = known.get(lora)
                if r is None:
                    r = known[lora] = root_key(model, lora)
                roots[lora] = r
        _, _, unknown_parent, unknown_removed = self._core.apply_batch(payload, model_id, medium_id, slot, root, roots)
        self._count_unknown(model, unknown_parent, unknown_removed)
        if removed_events:
            self._removals[pod] += removed_events
        self._core.maintain()  # _after_batch, inline: once per live batch
        self._applies += 1
        if not self._applies & 63:
            self._drop_empty_media()
        return _applied(BatchApplied, (stored_events, removed_events))

    def split_payload(self, payload: bytes, max_blocks: int) -> list[bytes] | None:
        """`payload` (a batch apply_payload takes) cut into batches of at most `max_blocks` blocks stored
        and removed, to apply in order, one at a time: between events, and an event of more blocks into
        pieces (a store's blocks and their tokens, each piece chained to the block before it; one with
        extra_keys or lookahead tokens stays whole, a part of its own). None when it is within the bound
        or not in apply_payload's shape (apply it whole)."""
        if len(payload) <= max_blocks:  # a block takes a byte at least (a small int hash): within the bound
            return None
        return native.split_batch(payload, max_blocks)

    def apply_run(self, pod: str, model: str, rank: int, messages: list, start: int, seq: int, max_batches: int,
                  max_events: int, bounds: array, counts: array, max_blocks: int = 0) -> RunApplied:
        """Apply messages[start:], live (seq, payload) pairs of one (pod, rank) as kvcache.zmtp reads
        them, while they are the batches `seq`, `seq` + 1, ... in the shape apply_payload takes with
        nothing new to learn (a new medium, block size or LoRA adapter): each as apply_payload would (the
        background passes once, after the last), in one native call (kvcache/csrc/core.c apply_run). Stops
        before any other message (the caller takes it the usual way), after `max_batches` batches or once
        `max_events` events are applied, before a batch holding more than `max_blocks` blocks (0: no
        bound), even the first (the caller cuts it, split_payload), and before one that would take the
        blocks stored and removed in this call past `max_blocks` (one call is one hold of the caller's
        lock: this bounds it; a one-event batch outside vLLM's array envelope counts once applied).
        Each batch's decode-and-apply time is counted into `counts` (int64, len(bounds) + 1) at
        bisect_left(bounds (doubles), seconds)."""
        shape = self._shapes.get(model)
        if shape is not None and not shape.simple:  # several groups: the general path keys each
            return _NOTHING
        slot, model_id = self._ids(pod, rank, model)
        root = self._base_root(model)
        n, stored, removed, unknown_parent, unknown_removed, seconds, error = self._core.apply_run(
            messages, start, seq, model_id, slot, root, self._block_size.get(model, 0), self._media,
            self._lora_roots.get(model) or _NO_ROOTS, max_batches, max_events, bounds, counts, max_blocks)
        self._count_unknown(model, unknown_parent, unknown_removed)
        if removed:
            self._removals[pod] += removed
        if n:
            before = self._applies
            self._applies = before + n
            if before >> 6 != self._applies >> 6:  # apply_payload's every 64 batches
                self._drop_empty_media()
        return _applied(RunApplied, (n, stored, removed, seconds, error))

    def _after_batch(self, cleared: bool) -> None:
        self._core.maintain()  # eviction down to the bound, a bounded step of the background passes
        self._applies += 1
        if cleared or not self._applies & 63:
            self._drop_empty_media()

    def drop(self, pod: str, rank: int) -> None:
        """Forget what (pod, rank) holds: its stream can no longer be trusted."""
        if (pod, rank) in self._slot:
            self._clear(pod, rank)
            self._core.maintain()

    def remove_pod(self, pod: str) -> None:
        """Forget every rank of `pod` (it left discovery) and free their slots."""
        group = self._pod_group.pop(pod, None)
        if group is None:
            return
        self._core.remove_group(group)
        self._removals.pop(pod, None)
        self._resets.pop(pod, None)
        del self._pod_bits[pod]
        for key in [k for k in self._carried if k[0] == pod]:
            del self._carried[key]
        self._cand.clear()
        for s, owner in list(self._slot_owner.items()):
            if owner[0] == pod:
                del self._slot_owner[s]
                del self._slot[owner]
                self._cleared[owner] += 1
        self._core.maintain()
        self._drop_empty_media()

    # --- queries ---------------------------------------------------------------------------

    def block_size(self, model: str) -> int | None:
        """The block size `model`'s engines publish, once a BlockStored has been seen."""
        return self._block_size.get(model)

    def clears(self, pod: str, rank: int = 0) -> int:
        """How many times (pod, rank)'s cache was cleared (AllBlocksCleared, a dropped stream, the pod gone):
        what it held before a change of this number it holds no more."""
        return self._cleared.get((pod, rank), 0)

    def pod_cache(self, pods: Sequence[str]) -> dict[str, tuple[int, int, int]]:
        """Per pod of `pods` the index knows: the distinct blocks it holds (all its ranks and media, as
        stats()'s blocks_per_pod), the BlockRemoved events applied for it (0 until its engine evicts; a
        cache reset is not one) and its ranks' clears (as clears()). Kept as they change: nothing is
        scanned."""
        group_blocks = self._core.group_blocks
        removals, resets = self._removals, self._resets
        out = {}
        for pod in pods:
            g = self._pod_group.get(pod)
            if g is not None:
                out[pod] = (group_blocks(g), removals.get(pod, 0), resets.get(pod, 0))
        return out

    def single_group(self, model: str) -> bool:
        """Whether `model`'s hits are one leading run of its blocks: no event has shown it several KV cache
        groups (a hybrid model's hit is their fixed point, kvcache.groups)."""
        shape = self._shapes.get(model)
        return shape is None or shape.simple

    def match(self, model: str, lora: str | None, token_ids: Sequence[int],
              pods: Iterable[str], extras: BlockExtras | None = None) -> dict[str, PrefixMatch]:
        """Per candidate pod, the leading blocks of `token_ids` (with `extras`, what else the engine
        hashes) it would serve from its cache (best rank): its hit by the rules of the model's KV cache
        groups (kvcache.groups), in blocks of block_size(model)."""
        pods = key = tuple(pods)
        cand = self._cand.get(key)
        if cand is None:  # the router asks about the same pods again and again: kept until slots change
            cand = 0
            bits = self._pod_bits
            for p in pods:
                if p in bits:
                    cand |= bits[p]
            if len(self._cand) >= 64:
                self._cand.clear()
            self._cand[key] = cand
        total, run_any, run_med = self._runs(model, lora, token_ids, cand, extras)
        return self._per_pod(pods, run_any, run_med, total)

    def match_ranks(self, model: str, lora: str | None, token_ids: Sequence[int],
                    targets: Iterable[tuple[str, int]],
                    extras: BlockExtras | None = None) -> dict[tuple[str, int], PrefixMatch]:
        """Per candidate (pod, rank), the consecutive leading blocks of `token_ids` that rank holds:
        match() rank by rank, for sending a request to one rank of a data-parallel pod."""
        targets = list(targets)
        slot = self._slot.get
        cand = 0
        for target in targets:
            b = slot(target)
            if b is not None:
                cand |= 1 << b
        total, run_any, run_med = self._runs(model, lora, token_ids, cand, extras)
        out = dict.fromkeys(targets, PrefixMatch(0, {}, total))  # one shared miss: read-only results
        if run_any:
            media = list(run_med.items())
            for target in targets:
                b = slot(target)
                if b is not None:
                    n = run_any.get(b, 0)
                    if n:
                        out[target] = PrefixMatch(n, {m: r[b] for m, r in media if r.get(b)}, total)
        return out

    def _runs(self, model: str, lora: str | None, token_ids: Sequence[int], cand: int,
              extras: BlockExtras | None) -> tuple[int, dict[int, int], dict[str, dict[int, int]]]:
        """(full blocks of block_size(model) in the request, per slot of `cand` its hit in any medium, the
        same per medium); hits of 0 are left out. A model of several groups: their fixed point; else the
        leading run."""
        bs = self._block_size.get(model, 0)
        total = len(token_ids) // bs if bs else 0
        if not cand or not total or (extras is not None and extras.opaque):
            return total, {}, {}
        cand_bytes = cand.to_bytes((cand.bit_length() + 7) >> 3, "little")
        shape = self._shapes.get(model)
        if shape is not None and not shape.simple:
            keys = request_keys(root_key(model, lora), token_ids, shape.unit, extras)
            return total, *self._group_runs(shape, token_ids, keys, cand_bytes, bs)
        names, ids = self._media_ids
        if not ids:
            return total, {}, {}
        if extras:  # the keys with the extra keys mixed in, computed here (block size 0: keys given)
            run_any, per_medium = self._core.match(request_keys(root_key(model, lora), token_ids, bs, extras).tobytes(),
                                                   0, 0, cand_bytes, ids)
        else:
            run_any, per_medium = self._core.match(token_ids, bs, root_key(model, lora), cand_bytes, ids)
        if per_medium is None:
            return total, run_any, {names[0]: run_any}
        return total, run_any, dict(zip(names, per_medium))

    def _group_runs(self, shape: Shape, token_ids: Sequence[int], keys: array, cand: bytes,
                    bs: int) -> tuple[dict[int, int], dict[str, dict[int, int]]]:
        """Per slot, the hit (in blocks of `bs`, the alignment) by the rules of `shape`'s groups, in any
        medium and per medium: what each slot holds of `keys` in each group, then kvcache.groups."""
        groups: list[Group] = list(shape.groups.values())
        data = keys.tobytes()
        # held[medium][slot][group position] = bitmap of key positions
        held: dict[str, dict[int, list[int]]] = {}
        ng = len(groups)
        for gi, group in enumerate(groups):
            if group.index == 0:
                tables = list(self._media.items())
            else:
                tables = [(m, t) for (m, g), t in self._tables.items() if g == group.index]
            if not tables:
                continue
            per_medium = self._core.holders(data, cand, tuple(t for _, t in tables))
            for (name, _), by_slot_bytes in zip(tables, per_medium):
                if not by_slot_bytes:
                    continue
                by_slot = held.setdefault(name, {})
                for s, bitmap in by_slot_bytes.items():
                    bits = by_slot.get(s)
                    if bits is None:
                        bits = by_slot[s] = [0] * ng
                    bits[gi] = int.from_bytes(bitmap, "little")
        run_any: dict[int, int] = {}
        run_med: dict[str, dict[int, int]] = {}
        if not held:
            return run_any, run_med
        n, unit, align = len(token_ids), shape.unit, shape.align
        slots: dict[int, list[int]] = {}
        for name, by_slot in held.items():
            runs = run_med[name] = {}
            for s, bits in by_slot.items():
                hit = longest_hit(groups, bits, n, unit, align) // bs
                if hit:
                    runs[s] = hit
                merged = slots.get(s)
                if merged is None:
                    slots[s] = list(bits)
                else:
                    for i, b in enumerate(bits):
                        merged[i] |= b
        if len(held) == 1:
            run_any = next(iter(run_med.values()))
        else:
            for s, bits in slots.items():
                hit = longest_hit(groups, bits, n, unit, align) // bs
                if hit:
                    run_any[s] = hit
        return run_any, {m: r for m, r in run_med.items() if r}

    def stats(self) -> dict:
        """Counters and sizes, JSON-able; every figure is kept as it changes (nothing is scanned).
        A cleared rank's blocks leave blocks_per_pod as the background pass reaches them."""
        entries, evicted, hashes, nbytes, keys = self._core.stats()
        group_blocks = self._core.group_blocks
        return {
            "entries": entries,
            "max_entries": self._max,
            "keys_by_medium": {m: keys[i] for m, i in self._media.items()},
            "engine_hashes": hashes,
            "table_bytes": nbytes,
            "slots": len(self._slot),
            "pods": len(self._pod_group),
            "blocks_per_pod": {pod: group_blocks(g) for pod, g in self._pod_group.items()},
            "block_sizes": dict(self._block_size),
            "kv_cache_groups": {model: {"groups": {g.index: g.describe() for g in shape.groups.values()},
                                        "key_unit": shape.unit, "alignment": shape.align, "exact": shape.exact}
                                for model, shape in self._shapes.items()},
            "keys_by_group_table": {f"{m}/group{g}": keys[i] for (m, g), i in self._tables.items()},
            "evicted_entries": evicted,
            "skipped": dict(self._skipped),
        }

    # --- events ----------------------------------------------------------------------------

    def _new_slot(self, pod: str, rank: int) -> int:
        group = self._pod_group.get(pod)
        if group is None:
            group = self._pod_group[pod] = self._core.new_group()
        s = self._core.new_slot(group)  # the lowest free number: holder bitmasks stay short
        self._slot[(pod, rank)] = s
        self._slot_owner[s] = (pod, rank)
        self._pod_bits[pod] = self._pod_bits.get(pod, 0) | (1 << s)
        self._cand.clear()
        return s

    def _clear(self, pod: str, rank: int) -> int:
        """(pod, rank) holds nothing from now on: its slot is retired (its marks go in the
        background) and a fresh one takes its place. Returns the new slot."""
        s = self._slot.pop((pod, rank))
        self._cleared[(pod, rank)] += 1
        self._resets[pod] += 1
        self._carried.pop((pod, rank), None)  # sparse stores waiting to be placed: gone with the rest
        del self._slot_owner[s]
        self._pod_bits[pod] &= ~(1 << s)
        self._core.kill_slot(s)
        return self._new_slot(pod, rank)

    def _ids(self, pod: str, rank: int, model: str) -> tuple[int, int]:
        """(slot, model id) of a batch of (pod, rank) for `model`, made when first met."""
        slot = self._slot.get((pod, rank))
        if slot is None:
            slot = self._new_slot(pod, rank)
        model_id = self._models.get(model)
        if model_id is None:
            model_id = self._model_id(model)
        return slot, model_id

    def _base_root(self, model: str) -> int:
        root = self._roots.get(model)
        if root is None:
            root = self._roots[model] = root_key(model, None)
        return root

    def _count_unknown(self, model: str, unknown_parent: int, unknown_removed: int) -> None:
        """Blocks stored under a parent the index does not know (kept out of chains: logged once) and
        removals of blocks it does not hold, counted."""
        if unknown_parent:
            if not self._skipped["unknown_parent_blocks"]:
                log.info("prefix index: model %s: blocks under an unknown parent are kept out of chains", model)
            self._skipped["unknown_parent_blocks"] += unknown_parent
        if unknown_removed:
            self._skipped["unknown_removed_blocks"] += unknown_removed

    def _model_id(self, model: str) -> int:
        m = self._models[model] = self._core.new_model()
        return m

    def _medium_id(self, medium: str) -> int:
        m = self._media.get(medium)
        if m is None:
            m = self._media[medium] = self._core.new_medium()
            self._media_ids = (tuple(self._media), tuple(self._media.values()))
        return m

    def _drop_empty_media(self) -> None:
        keys = self._core.stats()[4]
        empty = [m for m, i in self._media.items() if not keys[i]]
        for m in empty:  # a medium nobody holds blocks in (any name an engine sent)
            self._core.free_medium(self._media.pop(m))
        for mg in [mg for mg, i in self._tables.items() if not keys[i]]:
            self._core.free_medium(self._tables.pop(mg))
        if empty:
            self._media_ids = (tuple(self._media), tuple(self._media.values()))

    def _store(self, slot: int, model: str, model_id: int, ev: BlockStored,
               sparse: list[tuple[int, tuple[BlockHash, ...]]]) -> None:
        bs, hashes, tokens = ev.block_size, ev.block_hashes, ev.token_ids
        n = len(hashes)
        g = ev.group_idx or 0
        if type(bs) is not int or bs <= 0 or type(g) is not int or not 0 <= g <= _MAX_GROUP:
            self._skip("malformed_block_stored", ev)
            return
        m, rest = divmod(len(tokens), bs)
        if rest or n > m:
            self._skip("malformed_block_stored", ev)
            return
        simple = (n == m and not g and ev.kv_cache_spec_sliding_window is None and not ev.extra_keys
                  and ev.lookahead_token_ids is None
                  and (ev.kv_cache_spec_kind is None or ev.kv_cache_spec_kind == "full_attention"))
        shape = self._shapes.get(model)
        if simple and (shape is None or shape.simple):
            # the fast path's shape (kept out of _shapes: a model of one plain group stays on it)
            if self._block_size.get(model) != bs:
                self._learn_block_size(model, bs)
            self._store_keys(slot, model_id, self._medium_id(ev.medium or DEFAULT_MEDIUM), ev,
                             self._parent_key(model, model_id, ev), bs, None)
            return
        if shape is None:
            shape = self._shapes[model] = Shape()
            known = self._block_size.get(model)
            if known is not None:  # what the fast path learnt: group 0, full attention
                shape.learn(0, None, None, known)
        group, changed = shape.learn(g, ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window, bs)
        if changed:
            self._learned(model, shape, group)
        if not n:
            return  # a store of no hashed block (a sparse group's decode block): nothing held
        if ev.lookahead_token_ids is not None:  # hashes that cover tokens after each block: not modelled
            self._skipped["lookahead_blocks"] += n
            return
        table = self._medium_id(ev.medium or DEFAULT_MEDIUM) if not g else self._table_id(ev.medium or DEFAULT_MEDIUM, g)
        if n < m:  # sparse retention: which blocks the hashes are is known by the hashes alone
            sparse.append((table, hashes))
            return
        extras = self._event_extras(ev, n)
        if extras is _BAD:
            self._skip("malformed_extra_keys", ev)
            return
        if extras and bs != shape.unit:
            self._skipped["extra_keys_on_a_coarse_group"] += n
            return
        self._store_keys(slot, model_id, table, ev, self._parent_key(model, model_id, ev), shape.unit,
                         cast("dict[int, int] | None", extras))

    def _parent_key(self, model: str, model_id: int, ev: BlockStored) -> int | None:
        """The key a store's first block chains on: its parent's, or the root of its model and adapter;
        None (counted) when the parent is a block the index does not know."""
        parent = ev.parent_block_hash
        if parent is None:
            return self._root(model, ev)
        k = self._core.key_of(model_id, _fold(parent))
        if k is None:  # its chain is unknown: never guess a chain start
            self._count_unknown(model, len(ev.block_hashes), 0)
        return k

    def _store_keys(self, slot: int, model_id: int, table: int, ev: BlockStored, k: int | None, unit: int,
                    digests: dict[int, int] | None) -> None:
        """Key a dense store's blocks under key `k` (at `unit`, the model's key granularity) and hold them."""
        if k is None:
            return
        bs, tokens = ev.block_size, ev.token_ids
        if digests:
            keys = mixed_keys(k, tokens, unit, digests).tobytes()
        else:
            keys = native.chain_keys(k, tokens, unit)  # an unhashable token id raises before any change
        if unit != bs:  # a coarser group's block is keyed by its last unit
            r = bs // unit
            keys = array("Q", keys)[r - 1::r].tobytes()
        self._core.store(model_id, table, slot, _folded(ev.block_hashes), keys)

    def _resolve(self, slot: int, model_id: int, sparse: list[tuple[int, tuple[BlockHash, ...]]],
                 left: list[tuple[int, tuple[BlockHash, ...]]] | None) -> None:
        """Hold the blocks of sparse stores (a window or state group that hashes only the blocks that can
        serve a hit; their token ids span the others too, vLLM issue 44451): one chain of hashes serves
        every group, so each hash is the block another group (full attention: dense) stored under it.
        Hashes no group has stored yet go to `left` (tried once more on the next call: a batch the
        stream applies in chunks may hold the dense store in the next one), or with `left` None are
        counted, never guessed."""
        for table, hashes in sparse:
            found: list[BlockHash] = []
            missing: list[BlockHash] = []
            keys = array("Q")
            for h in hashes:
                k = self._core.key_of(model_id, _fold(h))
                if k is None:
                    missing.append(h)
                    continue
                found.append(h)
                keys.append(k)
            if found:
                self._core.store(model_id, table, slot, _folded(found), keys.tobytes())
            if missing:
                if left is None or len(left) >= _MAX_CARRIED:
                    self._skipped["unresolved_sparse_blocks"] += len(missing)
                else:
                    left.append((table, tuple(missing)))
        sparse.clear()

    def _event_extras(self, ev: BlockStored, n: int) -> Any:
        """A store's extra keys as digests per block index (None: no block has any; _BAD: malformed).
        The LoRA name, first in each entry when the store names one, is the root's part, not an extra."""
        extra = ev.extra_keys
        if not extra:
            return None
        if type(extra) is not tuple or len(extra) != n:
            return _BAD
        lora = ev.lora_name
        out: dict[int, int] = {}
        for b, entry in enumerate(extra):
            if entry is None:
                continue
            if type(entry) is not tuple and type(entry) is not list:
                return _BAD
            if lora is not None and entry and entry[0] == lora:
                entry = entry[1:]
            if entry:
                try:
                    out[b] = extra_digest(tuple(entry))
                except (TypeError, ValueError):
                    return _BAD
        return out or None

    def _learned(self, model: str, shape: Shape, group: Group) -> None:
        """A group of `model` newly seen or changed: logged; the model's block size is the alignment."""
        log.info("model %s: KV cache group %d: %s", model, group.index, group.describe())
        if not group.modelled:
            self._skipped["unmodelled_kv_cache_groups"] += 1
            log.warning("model %s: KV cache group %d of kind %r is not modelled: its hits need every block "
                        "from block 0 (never more than the engine serves)", model, group.index, group.kind)
        self._block_size[model] = shape.align

    def _table_id(self, medium: str, group: int) -> int:
        t = self._tables.get((medium, group))
        if t is None:
            t = self._tables[(medium, group)] = self._core.new_medium()
        return t

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

    def _remove(self, slot: int, model_id: int, ev: BlockRemoved) -> None:
        g = ev.group_idx or 0
        if type(g) is not int or not 0 <= g <= _MAX_GROUP:
            self._skip("malformed_block_removed", ev)
            return
        medium = ev.medium or DEFAULT_MEDIUM
        table = self._media.get(medium, -1) if not g else self._tables.get((medium, g), -1)
        _, unknown = self._core.release(model_id, table, slot, _folded(ev.block_hashes))
        if unknown:
            self._skipped["unknown_removed_blocks"] += unknown

    def _skip(self, reason: str, ev: object) -> None:
        if not self._skipped[reason]:
            log.warning("prefix index: skipping %s (first of its kind): %.200r", reason, ev)
        self._skipped[reason] += 1

    # --- matching --------------------------------------------------------------------------

    def _per_pod(self, pods: Sequence[str], run_any: dict[int, int], run_med: dict[str, dict[int, int]],
                 total: int) -> dict[str, PrefixMatch]:
        """Results per pod from runs per slot (every slot there is a candidate's). Results are
        shared between pods with the same answer: treat them as read-only."""
        out = dict.fromkeys(pods, PrefixMatch(0, {}, total))
        if not run_any:
            return out
        owner = self._slot_owner
        if len(run_med) == 1:  # one medium: the best rank is the one with the longest run
            (name,) = run_med
            best: dict[str, int] = {}
            for b, n in run_any.items():
                pod = owner[b][0]
                if best.get(pod, 0) < n:
                    best[pod] = n
            made: dict[int, PrefixMatch] = {}
            for pod, n in best.items():
                m = made.get(n)
                if m is None:
                    m = made[n] = PrefixMatch(n, {name: n}, total)
                out[pod] = m
            return out
        ranks: dict[str, list[int]] = {}
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
