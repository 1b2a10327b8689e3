"""The prefix index's building blocks: block keys for a whole prompt equal the incremental ones, the C
tables behave like dicts (growth, backward-shift deletion, wrap-around, holder lists growing into
bitmasks and back), fleets of more than 64 pod-ranks match exactly, and recency survives the
uint32 clock wrapping."""
from __future__ import annotations

import os
import random

import msgpack
import numpy as np
import pytest

from kvcache.blockkeys import KEY_MASK, block_keys, chain_keys, reference_chain_keys, root_key
from kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvcache.index import PrefixIndex
from kvcache.native import native


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_batch_keys_equal_the_incremental_chain(block_size):
    rng = random.Random(block_size)
    for n_blocks in [0, 1, 2, 23, 24, 25, 100, 600]:
        tokens = [rng.randrange(1 << rng.choice((8, 17, 40))) for _ in range(n_blocks * block_size + rng.randrange(block_size))]
        parent = rng.getrandbits(60)
        want, k = [], parent
        for i in range(n_blocks):
            k = reference_chain_keys(k, tokens[i * block_size:(i + 1) * block_size], block_size)[0]  # one block on its own
            want.append(k)
        assert chain_keys(parent, tokens, block_size) == want
        assert all(0 <= x <= KEY_MASK for x in want)
    assert block_keys("m", None, list(range(64)), 4) == chain_keys(root_key("m", None), list(range(64)), 4)



def test_a_bad_token_id_is_reported_in_prompt_order():
    """Blocks are hashed four at a time; the error is still the first bad id's in prompt order (a
    str in block 1 at position 5, before an out-of-range id at the start of block 2)."""
    tokens = list(range(16)) + [1] * 5 + ["x"] + [1] * 10 + [2**70] + [1] * 15 + [3] * 16
    with pytest.raises(TypeError, match="token ids must be ints, got str"):
        chain_keys(0, tokens, 16)
    with pytest.raises(OverflowError):
        chain_keys(0, tokens[:21] + [1] + tokens[22:], 16)

def test_keys_depend_on_block_order_and_every_block():
    base = list(range(40 * 4))
    keys = chain_keys(7, base, 4)
    assert len(set(keys)) == 40
    swapped = base[4:8] + base[:4] + base[8:]
    assert chain_keys(7, swapped, 4)[1:] != keys[1:] and chain_keys(7, swapped, 4)[2:] != keys[2:]
    changed = base[:]
    changed[0] += 1
    assert all(a != b for a, b in zip(chain_keys(7, changed, 4), keys))
    with pytest.raises(ValueError):
        block_keys("m", None, base, 0)


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

def test_more_than_64_pod_ranks_match_exactly():
    bs = 2
    tokens = tuple(range(20))  # 10 blocks
    ix = PrefixIndex()
    pods = [f"p{i}" for i in range(70)]
    for i, pod in enumerate(pods):  # pod i holds the first i % 10 + 1 blocks; p66.. also on CPU
        n = i % 10 + 1
        hashes = tuple(range(1000, 1000 + n))
        ix.apply(pod, "m", 0, [BlockStored(hashes, None, tokens[:n * bs], bs, None, "GPU")])
        if i >= 66:
            ix.apply(pod, "m", 0, [BlockStored(hashes, None, tokens[:n * bs], bs, None, "CPU")])
    assert ix.stats()["entries"] == sum(i % 10 + 1 for i in range(70)) + sum(i % 10 + 1 for i in range(66, 70))
    got = ix.match("m", None, list(tokens), pods)
    assert {p: r.blocks for p, r in got.items()} == {p: i % 10 + 1 for i, p in enumerate(pods)}
    assert got["p67"].by_medium == {"GPU": 8, "CPU": 8} and got["p3"].by_medium == {"GPU": 4}
    ix.apply("p68", "m", 0, [BlockRemoved((1002,), "GPU"), BlockRemoved((1004,), "CPU")])
    ix.apply("p65", "m", 0, [BlockRemoved((1001,), "GPU")])
    got = ix.match("m", None, list(tokens), ["p68", "p65", "p64", "p1"])
    assert got["p68"].blocks == 9 and got["p68"].by_medium == {"GPU": 2, "CPU": 4}
    assert (got["p65"].blocks, got["p64"].blocks, got["p1"].blocks) == (1, 5, 2)
    ix.apply("p69", "m", 0, [AllBlocksCleared()])
    ix.remove_pod("p66")
    got = ix.match("m", None, list(tokens), ["p69", "p66", "p67"])
    assert [r.blocks for r in got.values()] == [0, 0, 8]
    assert ix.stats()["entries"] == sum(i % 10 + 1 for i in range(66)) - 1 + 8 * 2 + 9 * 2 - 2


def test_eviction_keeps_recently_matched_keys_across_the_clock_wrapping():
    ix = PrefixIndex(max_entries=55)
    ix._core.tick = 2**32 - 6  # the uint32 clock wraps within the test: stamps compare by age
    prompts = [tuple(range(1000 * i, 1000 * i + 40)) for i in range(6)]  # 10 blocks of 4 each
    for i, toks in enumerate(prompts[:5]):
        ix.apply("a", "m", 0, [BlockStored(tuple(range(100 * i, 100 * i + 10)), None, toks, 4)])
    ix.match("m", None, list(prompts[0]), ["a"])
    ix.apply("a", "m", 0, [BlockStored(tuple(range(500, 510)), None, prompts[5], 4)])
    assert ix.stats()["entries"] <= 55 and ix._core.tick < 1000
    held = [ix.match("m", None, list(p), ["a"])["a"].blocks for p in prompts]
    assert held[0] == 10 and held[5] == 10 and held[1] < 10
    ix.match("m", None, list(prompts[0]), ["a"])
    ix.apply("a", "m", 0, [BlockStored(tuple(range(600, 610)), None, tuple(range(9000, 9040)), 4)])
    assert ix.match("m", None, list(prompts[0]), ["a"])["a"].blocks == 10  # matched since: kept
    assert ix.stats()["entries"] <= 55 and ix.stats()["evicted_entries"] == 70 - ix.stats()["entries"]
    ix._core.check()


def test_maintenance_clamps_ages_so_old_keys_stay_oldest():
    """A key left alone for more than 2**31 ticks would look new again if ages wrapped: the
    background pass clamps them, so it is still evicted first."""
    ix = PrefixIndex(max_entries=20)
    ix.apply("a", "m", 0, [BlockStored(tuple(range(10)), None, tuple(range(40)), 4)])  # old
    for _ in range(7):  # 7 x 2**29 ticks pass, batches keep arriving
        ix._core.tick = (ix._core.tick + 2**29) % 2**32  # every key ages by 2**29
        ix.apply("b", "m", 0, [])
    ix.apply("a", "m", 0, [BlockStored(tuple(range(100, 110)), None, tuple(range(500, 540)), 4)])  # new
    ix._core.tick = (ix._core.tick + 2**29) % 2**32  # the old keys' unclamped age is 2**32 now: 0
    ix.apply("a", "m", 0, [BlockStored(tuple(range(200, 205)), None, tuple(range(900, 920)), 4)])  # over the bound
    held = [ix.match("m", None, list(p), ["a"])["a"].blocks
            for p in (range(40), range(500, 540), range(900, 920))]
    assert held[1:] == [10, 5] and held[0] < 10
    ix._core.check()


def test_chain_keys_read_integer_buffers_like_lists():
    """array.array and numpy token ids give the same keys as a list of ints; float buffers are refused."""
    from array import array

    import numpy as np
    from kvcache.blockkeys import reference_chain_keys

    tokens = [0, 1, 65535, 70000, 2**31 - 1, 5, 9, 12]
    want = reference_chain_keys(11, tokens, 2)
    for buf in (array("I", tokens), array("q", tokens), np.array(tokens, np.int64), np.array(tokens, np.uint32)):
        assert chain_keys(11, buf, 2) == want
    assert chain_keys(11, array("i", [-3, 4]), 2) == reference_chain_keys(11, [-3, 4], 2)
    with pytest.raises(TypeError):
        chain_keys(11, np.array([1.0, 2.0]), 1)


def test_core_refuses_ids_it_never_gave_and_ragged_buffers():
    """The C tables trust only what they handed out: an unknown model, medium or slot, a slot
    already cleared, and hashes and keys of different counts or not whole uint64s are refused
    with a clear error before anything is read or changed."""
    core = native.Core(100)
    model, medium = core.new_model(), core.new_medium()
    slot = core.new_slot(core.new_group())
    one = _u64([1])
    assert core.store(model, medium, slot, one, _u64([5])) == 1
    for bad in [(model + 1, medium, slot), (model, medium + 1, slot), (model, medium, slot + 1), (model, -1, slot)]:
        with pytest.raises(ValueError, match="no (model|medium table|live slot)"):
            core.store(*bad, one, one)
    with pytest.raises(ValueError, match="as many hashes as keys"):
        core.store(model, medium, slot, one, _u64([5, 6]))
    with pytest.raises(ValueError, match="uint64"):
        core.release(model, medium, slot, b"\x01\x02\x03")
    payload = msgpack.packb([1.0, [["BlockStored", [5], None, [1], 1, None, "GPU", None]]])
    assert native.scan_batch(payload) is not None
    with pytest.raises(ValueError, match="stores need a medium table"):
        core.apply_batch(payload, model, -1, slot, 0, {})
    core.kill_slot(slot)
    with pytest.raises(ValueError, match="no live slot"):
        core.release(model, medium, slot, one)
    with pytest.raises(ValueError, match="not empty"):
        core.free_medium(medium)  # the dead slot's mark is still there: the background pass removes it
    core.maintain()
    core.free_medium(medium)
    core.check()
    assert core.stats()[:3] == (0, 0, 1)  # no entry, none evicted; the engine hash waits for the sweep



def test_eviction_spreads_over_the_table_when_many_keys_are_equally_old():
    """At the bound every store evicts, and the sweep must spread its deletions over the table as the
    stores spread theirs, even when a third of the keys share one age (a 500-block prefill is one
    event, one tick). A sweep that dropped every such key near its cursor crawled while the stores
    filled the rest of the table into one probe run of ~10k keys: every lookup walked it."""
    rng = random.Random(5)
    bound, bs, h = 20_000, 2, 0
    ix = PrefixIndex(max_entries=bound)

    def store(i: int, n: int) -> None:
        nonlocal h
        tokens = tuple(rng.randrange(50_000) for _ in range(n * bs))
        ix.apply(f"p{i % 8}", "m", 0, [BlockStored(tuple(range(h, h + n)), None, tokens, bs)])
        h += n

    for i in range(bound // 500):
        store(i, 500)
    worst = (0.0, 0)
    for i in range(2 * bound // 8):  # the bound twice over, 8 blocks an event
        store(i, 8)
        if i % 100 == 0:
            for cap, live, total, longest in ix._core.probes():
                assert live <= 0.75 * cap
                worst = max(worst[0], total / live), max(worst[1], longest)
    assert ix.stats()["entries"] == bound
    assert worst[0] < 2 and worst[1] < 200, worst  # fresh tables at this load: ~0.8 and ~50
    ix._core.check()


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
