"""Compact open-addressing hash tables over numpy arrays, for the prefix index.

A Python dict costs about 80 bytes per int -> int entry (two int objects and a sparse slot);
these tables keep 64-bit keys and values in flat arrays (16 to 20 bytes per slot at a load of
0.55 to 0.75). Scalar operations go through memoryviews (Python ints, no numpy scalars; as cheap
to index as array.array, three times cheaper than numpy). Ingest costs are Python bytecodes per
probe and per call, so `store` and `release` handle a block in both tables in one call with the
probe loops inline; batch lookups and bulk deletions are vectorised. Linear probing from a home
slot taken from 32 of the key's bits (keys are hashes already); deleted slots become tombstones
until the next rebuild.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

EMPTY = 0xFFFF_FFFF_FFFF_FFFF
TOMB = EMPTY - 1  # keys must be below TOMB
_M64 = EMPTY
_MAX_LOAD = 0.75  # used slots (live + tombstones) per slot before a rebuild
_REBUILD_LOAD = 0.55  # live slots per slot right after a rebuild
_MIN_CAP = 64
_SCALAR_TAIL = 16  # a vectorised lookup finishes this few unresolved keys one by one


def _home(keys: np.ndarray, cap: int, shift: int) -> np.ndarray:
    """Home slots of uint64 `keys`: 32 well-mixed bits (key >> shift) scaled to [0, cap)."""
    return (((keys >> np.uint64(shift)) & np.uint64(0xFFFFFFFF)) * np.uint64(cap) >> np.uint64(32)).astype(np.intp)


class OpenTable:
    """uint64 key -> value columns. Subclasses name their columns in `_COLUMNS`."""

    _COLUMNS: tuple[tuple[str, type], ...] = ()
    _SHIFT = 32  # keys must be uniformly distributed in bits shift..shift+31

    def __init__(self, cap: int = _MIN_CAP) -> None:
        self.live = 0  # slots holding a key
        self.used = 0  # live + tombstones
        self._alloc(max(cap, _MIN_CAP))

    def _alloc(self, cap: int) -> None:
        self.cap = cap
        self._limit = int(cap * _MAX_LOAD)
        self.keys = np.full(cap, EMPTY, np.uint64)
        self._k = memoryview(self.keys)
        self._views = []
        for name, dtype in self._COLUMNS:
            col = np.zeros(cap, dtype)
            setattr(self, name, col)
            setattr(self, "_" + name, memoryview(col))
            self._views.append(memoryview(col))

    def nbytes(self) -> int:
        return self.keys.nbytes + sum(getattr(self, n).nbytes for n, _ in self._COLUMNS)

    # --- scalar ----------------------------------------------------------------------------

    def find(self, k: int) -> int:
        """The slot holding key `k`, or -1."""
        kv, cap = self._k, self.cap
        s = ((k >> self._SHIFT) & 0xFFFFFFFF) * cap >> 32
        x = kv[s]
        while x != k:
            if x == EMPTY:
                return -1
            s += 1
            if s == cap:
                s = 0
            x = kv[s]
        return s

    def claim(self, k: int) -> tuple[int, bool]:
        """(slot of `k`, whether it was just inserted with zeroed columns)."""
        if self.used >= self._limit:
            self._rebuild()
        s = self._probe(k)
        if s >= 0:
            return s, False
        return self._take(~s, k), True

    def _probe(self, k: int) -> int:
        """`k`'s slot, or ~(the slot to insert it at: the first tombstone or the empty slot)."""
        kv, cap = self._k, self.cap
        s = ((k >> self._SHIFT) & 0xFFFFFFFF) * cap >> 32
        tomb = -1
        while True:
            x = kv[s]
            if x == k:
                return s
            if x >= TOMB:
                if x == EMPTY:
                    return ~(s if tomb < 0 else tomb)
                if tomb < 0:
                    tomb = s
            s += 1
            if s == cap:
                s = 0

    def _take(self, s: int, k: int) -> int:
        if self._k[s] == EMPTY:
            self.used += 1
        self._k[s] = k
        for v in self._views:
            v[s] = 0
        self.live += 1
        return s

    def delete(self, s: int) -> None:
        """Free slot `s` (a claim zeroes its columns again). It becomes a tombstone until the next
        rebuild, unless it ends its probe run: then it is simply empty again."""
        kv = self._k
        nxt = s + 1 if s + 1 < self.cap else 0
        if kv[nxt] == EMPTY:
            kv[s] = EMPTY
            self.used -= 1
        else:
            kv[s] = TOMB
        self.live -= 1

    # --- vectorised ------------------------------------------------------------------------

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """Slots of uint64 `keys` (-1 where absent): probe rounds over every unresolved key at
        once, then the last few keys one by one."""
        out = np.full(len(keys), -1, np.intp)
        if not self.live or not len(keys):
            return out
        cap, table = self.cap, self.keys
        s = _home(keys, cap, self._SHIFT)
        idx = np.arange(len(keys))
        k = keys
        while len(idx) > _SCALAR_TAIL:
            x = table[s]
            hit = x == k
            out[idx[hit]] = s[hit]
            go = np.flatnonzero(~hit & (x != np.uint64(EMPTY)))
            idx, s, k = idx[go], s[go] + 1, k[go]
            s[s == cap] = 0
        find = self.find
        for i, kk in zip(idx.tolist(), k.tolist()):
            out[i] = find(kk)
        return out

    def occupied(self) -> np.ndarray:
        """Slots holding a key."""
        return np.flatnonzero(self.keys < np.uint64(TOMB))

    def delete_slots(self, slots: np.ndarray) -> None:
        """Free many slots at once, then shrink or clean up tombstones if worth it."""
        if not len(slots):
            return
        self.keys[slots] = TOMB
        for name, _ in self._COLUMNS:
            getattr(self, name)[slots] = 0
        self.live -= len(slots)
        if self.used - self.live > self.cap // 4 or (self.cap > _MIN_CAP and self.live < self.cap // 8):
            self._rebuild()

    def _rebuild(self, room: int = 0) -> None:
        """Reinsert the live keys into a table sized for them and `room` more: sorted by home slot, each key goes to
        max(home, previous slot + 1), a cumulative maximum; the few that run past the end wrap."""
        live = self.occupied()
        keys = self.keys[live]
        cols = [(name, getattr(self, name)[live]) for name, _ in self._COLUMNS]
        n = len(keys)
        self._alloc(max(_MIN_CAP, int((n + room) / _REBUILD_LOAD) + 1))
        self.live = self.used = 0
        if not n:
            return
        home = _home(keys, self.cap, self._SHIFT)
        order = np.argsort(home, kind="stable")
        home = home[order]
        rank = np.arange(n)
        pos = np.maximum.accumulate(home - rank) + rank
        fits = pos < self.cap
        placed = order[fits]
        self.keys[pos[fits]] = keys[placed]
        for name, col in cols:
            getattr(self, name)[pos[fits]] = col[placed]
        self.live = self.used = int(fits.sum())
        for i in order[~fits].tolist():  # wrapped past the end: probe from the start
            s, _ = self.claim(int(keys[i]))
            for name, col in cols:
                getattr(self, "_" + name)[s] = col[i].item()


class KeyTable(OpenTable):
    """Block key -> bitmask of the slots (pod, rank) holding it, and a recency stamp. Bits 0-63
    live in the array; higher bits (fleets of more than 64 pod-ranks) in the `high` dict."""

    _COLUMNS = (("mask", np.uint64), ("stamp", np.uint32))
    _SHIFT = 28  # block keys are 60-bit hashes: their top 32 bits

    def __init__(self, cap: int = _MIN_CAP) -> None:
        super().__init__(cap)
        self.high: dict[int, int] = {}  # key -> mask >> 64


class HashMap(OpenTable):
    """uint64 -> uint64 (the engine's folded block hash -> kvgate's block key). Keys must be
    mixed (e.g. multiplied by an odd constant): homes come from their top 32 bits."""

    _COLUMNS = (("value", np.uint64),)

    def get(self, k: int) -> int | None:
        s = self.find(k)
        return None if s < 0 else self._value[s]

    def put(self, k: int, v: int) -> None:
        s, _ = self.claim(k)
        self._value[s] = v


UNKNOWN, NOT_HELD, FREED, STILL_HELD = -2, -1, 0, 1


def release(hashes: HashMap, table: KeyTable, h: int, one: int, sole: bool) -> int:
    """The block whose (mixed) hash `h` maps to a key of `table` is no longer held by low holder
    bit `one`. Returns UNKNOWN (no entry for `h`), NOT_HELD (the bit was not set), STILL_HELD
    (other holders remain) or FREED: the key's slot is deleted, and `h`'s entry too when `sole`
    (no other table can hold the key). Both probes inline: one call per evicted block."""
    kv, cap = hashes._k, hashes.cap
    hs = (h >> 32) * cap >> 32
    x = kv[hs]
    while x != h:
        if x == EMPTY:
            return UNKNOWN
        hs += 1
        if hs == cap:
            hs = 0
        x = kv[hs]
    k = hashes._value[hs]
    tk, cap = table._k, table.cap
    s = ((k >> 28) & 0xFFFFFFFF) * cap >> 32
    x = tk[s]
    while x != k:
        if x == EMPTY:
            return NOT_HELD
        s += 1
        if s == cap:
            s = 0
        x = tk[s]
    masks = table._mask
    m = masks[s]
    if not m & one:
        return NOT_HELD
    m ^= one
    if m or (table.high and k in table.high):
        masks[s] = m
        return STILL_HELD
    masks[s] = 0
    nxt = s + 1 if s + 1 < cap else 0
    if tk[nxt] == EMPTY:
        tk[s] = EMPTY
        table.used -= 1
    else:
        tk[s] = TOMB
    table.live -= 1
    if sole:
        nxt = hs + 1 if hs + 1 < hashes.cap else 0
        if kv[nxt] == EMPTY:
            kv[hs] = EMPTY
            hashes.used -= 1
        else:
            kv[hs] = TOMB
        hashes.live -= 1
    return FREED


def store(hashes: HashMap, table: KeyTable, hs: Sequence[int], keys: Sequence[int], one: int,
          stamp: int) -> int:
    """For each pair: map mixed hash h to key k in `hashes`, set low holder bit `one` on k in
    `table` (inserting it if new) and stamp it. Returns how many bits were newly set. Both
    probes inline: one call per stored event."""
    n = len(keys)
    if hashes.used + n > hashes._limit:  # room for every pair: no rebuild inside the loop
        hashes._rebuild(n)
    if table.used + n > table._limit:
        table._rebuild(n)
    hk, values, hcap = hashes._k, hashes._value, hashes.cap
    tk, masks, stamps, cap = table._k, table._mask, table._stamp, table.cap
    added = hnew = hfresh = new = fresh = 0
    for h, k in zip(hs, keys):
        s = (h >> 32) * hcap >> 32
        tomb = -1
        while True:
            x = hk[s]
            if x == h:
                break
            if x >= TOMB:
                if x == EMPTY:
                    if tomb >= 0:
                        s = tomb
                    else:
                        hfresh += 1
                    hk[s] = h
                    hnew += 1
                    break
                if tomb < 0:
                    tomb = s
            s += 1
            if s == hcap:
                s = 0
        values[s] = k
        s = ((k >> 28) & 0xFFFFFFFF) * cap >> 32
        tomb = -1
        while True:
            x = tk[s]
            if x == k:
                m = masks[s]
                if not m & one:
                    masks[s] = m | one
                    added += 1
                break
            if x >= TOMB:
                if x == EMPTY:
                    if tomb >= 0:
                        s = tomb
                    else:
                        fresh += 1
                    tk[s] = k
                    masks[s] = one
                    new += 1
                    break
                if tomb < 0:
                    tomb = s
            s += 1
            if s == cap:
                s = 0
        stamps[s] = stamp
    if hnew:
        hashes.live += hnew
        hashes.used += hfresh
    if new:
        table.live += new
        table.used += fresh
    return added + new if one else 0
