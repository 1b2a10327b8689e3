"""The index's tables (kvcache/csrc/tables.c, through Core): the key table and the hash map behave like
dicts through growth, backward-shift deletion and wrap-around (holder lists growing into bitmasks and
back on the way), large tables are rehashed without the GIL and keep every key, and large tables ask for
transparent huge pages."""
from __future__ import annotations

import os
import random

import numpy as np
import pytest

from kvcache.events import BlockStored
from kvcache.index import PrefixIndex
from kvcache.native import native


def _u64(xs) -> bytes:
    return np.array(xs, np.uint64).tobytes()


@pytest.mark.parametrize("wrap", [False, True])
def test_core_tables_behave_like_dicts_through_growth_and_deletion(wrap):
    """Random stores and removals straight on the C tables against dicts: engine hash -> key and
    key -> holders. With `wrap`, every key's home is the table's last position (probe runs wrap)."""
    rng = random.Random(5 + wrap)
    core = native.Core(10**9)
    model, medium = core.new_model(), core.new_medium()
    slots = [core.new_slot(core.new_group()) for _ in range(150)]  # holder bitmasks of 3 words
    top = (0xFFFF_FFFF << 28) if wrap else 0
    pool = [(top | rng.getrandbits(28 if wrap else 60)) for _ in range(400)]
    key_of = {h: k for h, k in zip((rng.getrandbits(62) for _ in pool), pool)}
    hashes = list(key_of)
    holders: dict[int, set[int]] = {}
    for step in range(12000):
        h = rng.choice(hashes)
        k = key_of[h]
        slot = rng.choice(slots[:6] if rng.random() < 0.5 else slots)  # a few slots hold much: >4 holders
        if rng.random() < 0.6:
            added = core.store(model, medium, slot, _u64([h]), _u64([k]))
            assert added == (slot not in holders.get(k, set()))
            holders.setdefault(k, set()).add(slot)
        else:
            removed, unknown = core.release(model, medium, slot, _u64([h]))
            held = slot in holders.get(k, set())
            assert removed == held
            if held:
                holders[k].discard(slot)
                if not holders[k]:
                    del holders[k]
        if step % 1000 == 999:
            core.check()
            assert core.stats()[0] == sum(map(len, holders.values()))
            assert core.stats()[4] == [len(holders)]
    core.check()


def test_tables_grown_past_the_unlocked_rehash_size_keep_every_key():
    """Tables of 65,536 slots and more are rehashed with the GIL released (the event loop runs
    meanwhile): 100,000 engine hashes and keys grow both tables past that size, twice, and every
    key, holder and count is still there."""
    core = native.Core(10**9)
    model, medium = core.new_model(), core.new_medium()
    a, b = core.new_slot(core.new_group()), core.new_slot(core.new_group())
    rng = random.Random(11)
    keys = [rng.getrandbits(60) for _ in range(100_000)]
    hashes = [rng.getrandbits(64) % ((1 << 64) - 2) for _ in keys]  # folded engine hashes: full 64-bit range
    for i in range(0, len(keys), 5_000):
        assert core.store(model, medium, a, _u64(hashes[i:i + 5_000]), _u64(keys[i:i + 5_000])) == 5_000
    assert core.store(model, medium, b, _u64(hashes[::2]), _u64(keys[::2])) == 50_000
    core.check()
    assert core.stats()[0] == 150_000 and core.stats()[4] == [100_000]
    assert core.release(model, medium, b, _u64(hashes[::2])) == (50_000, 0)
    assert core.release(model, medium, a, _u64(hashes[:10])) == (10, 0)
    core.check()
    assert core.stats()[0] == 99_990


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux's /proc/self/smaps reports the advice")
def test_large_tables_ask_for_transparent_huge_pages():
    """Probes of a large table are random: on 4 KiB pages nearly every one also misses the TLB. Tables
    of 4 MiB and more are advised MADV_HUGEPAGE (smaps shows the flag as `hg`), which kernels set to
    `madvise` (a common default) need before they use huge pages there."""
    def advised_mib() -> float:
        total, size = 0, 0
        with open("/proc/self/smaps") as f:
            for line in f:
                if line.startswith("Size:"):
                    size = int(line.split()[1])
                elif line.startswith("VmFlags:") and " hg" in f" {line.split(':', 1)[1]}":
                    total += size
        return total / 1024

    ix = PrefixIndex(max_entries=1_000_000)
    for i in range(500):  # 200k keys: a key table of ~4.8 MB (300k slots)
        tokens = tuple(range(i * 1600, i * 1600 + 1600))
        ix.apply("a", "m", 0, [BlockStored(tuple(range(i * 400, i * 400 + 400)), None, tokens, 4)])
    assert sum(ix.stats()["keys_by_medium"].values()) == 200_000
    assert advised_mib() >= 4
