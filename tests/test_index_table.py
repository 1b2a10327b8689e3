"""The prefix index's building blocks: vectorised block keys equal the incremental ones, the
open-addressing tables behave like dicts (growth, tombstones, wrap-around, bulk deletion), and
fleets of more than 64 pod-ranks (holder bits beyond the tables' arrays) match exactly."""
from __future__ import annotations

import random

import msgpack
import numpy as np
import pytest

from kvcache.blockkeys import KEY_MASK, block_keys, chain_key_array, chain_keys, reference_chain_keys, root_key
from kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvcache.index import _TICK_LIMIT, PrefixIndex
from kvcache.table import TOMB, HashMap, KeyTable


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_vectorised_keys_equal_the_incremental_chain(block_size):
    rng = random.Random(block_size)
    for n_blocks in [0, 1, 2, 23, 24, 25, 100, 600]:
        tokens = [rng.randrange(1 << rng.choice((8, 17, 40))) for _ in range(n_blocks * block_size + rng.randrange(block_size))]
        parent = rng.getrandbits(60)
        want, k = [], parent
        for i in range(n_blocks):
            k = reference_chain_keys(k, tokens[i * block_size:(i + 1) * block_size], block_size)[0]  # one block on its own
            want.append(k)
        assert chain_keys(parent, tokens, block_size) == want
        assert chain_key_array(parent, tokens, block_size).tolist() == want
        assert all(0 <= x <= KEY_MASK for x in want)
    assert block_keys("m", None, list(range(64)), 4) == chain_keys(root_key("m", None), list(range(64)), 4)


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


@pytest.mark.parametrize("cls", [HashMap, KeyTable])
def test_table_behaves_like_a_dict_through_growth_deletion_and_rebuilds(cls):
    rng = random.Random(5)
    t, model = cls(), {}
    col = "value" if cls is HashMap else "mask"
    pool = [rng.getrandbits(60) for _ in range(3000)]
    for step_no in range(20000):
        k = rng.choice(pool)
        x = rng.random()
        if x < 0.55:
            s, new = t.claim(k)
            assert new == (k not in model)
            getattr(t, "_" + col)[s] = v = rng.getrandbits(63) + 1
            model[k] = v
        elif x < 0.9:
            s = t.find(k)
            assert (s >= 0) == (k in model)
            if s >= 0:
                t.delete(s)
                del model[k]
        elif x < 0.92 and model:  # bulk deletion of a random subset
            gone = rng.sample(sorted(model), min(len(model), 50))
            t.delete_slots(np.array([t.find(g) for g in gone], np.intp))
            for g in gone:
                del model[g]
        if step_no % 2000 == 0 or step_no == 19999:
            assert t.live == len(model) and t.used <= t.cap
            probe = np.array(pool, np.uint64)
            slots = t.lookup(probe)
            got = {k: getattr(t, col)[s].item() for k, s in zip(pool, slots.tolist()) if s >= 0}
            assert got == model
            occupied = t.occupied()
            assert sorted(t.keys[occupied].tolist()) == sorted(model)
    assert (t.keys == np.uint64(TOMB)).sum() == t.used - t.live


def test_rebuild_wraps_keys_that_run_past_the_end():
    t = HashMap()
    keys = [(0xFFFF_FFFF << 32) | i for i in range(300)]  # every home is the last slot
    for k in keys:
        t.put(k, k & 0xFFFF)
    assert t.cap > 300  # it grew (rebuilding) while the run wrapped around
    assert [t.get(k) for k in keys] == [k & 0xFFFF for k in keys]
    assert t.lookup(np.array(keys + [5], np.uint64)).tolist()[-1] == -1
    assert (t.lookup(np.array(keys, np.uint64)) >= 0).all()
    for k in keys[::2]:
        t.delete(t.find(k))
    assert [t.get(k) for k in keys[1::2]] == [k & 0xFFFF for k in keys[1::2]]
    assert all(t.get(k) is None for k in keys[::2])


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


def test_eviction_keeps_recently_matched_keys_and_the_clock_rebases():
    ix = PrefixIndex(max_entries=55)
    ix._tick = _TICK_LIMIT - 6  # the uint32 clock nears its end: an apply past the limit shifts every stamp down
    prompts = [tuple(range(1000 * i, 1000 * i + 40)) for i in range(6)]  # 10 blocks of 4 each
    for i, toks in enumerate(prompts[:5]):
        ix.apply("a", "m", 0, [BlockStored(tuple(range(100 * i, 100 * i + 10)), None, toks, 4)])
    ix.match("m", None, list(prompts[0]), ["a"])
    ix.apply("a", "m", 0, [BlockStored(tuple(range(500, 510)), None, prompts[5], 4)])
    assert ix.stats()["entries"] <= 55 and ix._tick < 1000
    held = [ix.match("m", None, list(p), ["a"])["a"].blocks for p in prompts]
    assert held[0] == 10 and held[5] == 10 and held[1] < 10
    ix.match("m", None, list(prompts[0]), ["a"])
    ix.apply("a", "m", 0, [BlockStored(tuple(range(600, 610)), None, tuple(range(9000, 9040)), 4)])
    assert ix.match("m", None, list(prompts[0]), ["a"])["a"].blocks == 10  # matched since: kept
    assert ix.stats()["entries"] <= 55 and ix.stats()["evicted_entries"] == 70 - ix.stats()["entries"]


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


def test_native_table_columns_are_checked_by_item_size_and_capacity():
    """The C loops read the tables' arrays raw: a stamp column of the wrong item size (same byte length
    as the right one) and a table of capacity 0 (no slot 0 to probe) are refused, never read."""
    from kvcache import _native

    empty = np.full(8, np.iinfo(np.uint64).max, np.uint64)
    masks, stamps = np.zeros(8, np.uint64), np.zeros(8, np.uint32)
    assert _native.match_runs([1, 2], 1, 0, 1, 1, empty, masks, stamps) == {}
    with pytest.raises(TypeError, match="kt_stamps: expected 4-byte items"):
        _native.match_runs([1, 2], 1, 0, 1, 1, empty, masks, np.zeros(16, np.uint16))
    none64, none32 = np.zeros(0, np.uint64), np.zeros(0, np.uint32)
    with pytest.raises(ValueError, match="capacity 0"):
        _native.match_runs([1, 2], 1, 0, 1, 1, none64, none64, none32)
    payload = msgpack.packb([1.0, [["BlockStored", [5], None, [1], 1, None, "GPU", None]]])
    assert _native.scan_batch(payload) is not None
    with pytest.raises(TypeError, match="kt_stamps: expected 4-byte items"):
        _native.apply_batch(payload, 0, 1, 0, empty.copy(), masks.copy(), empty.copy(), masks.copy(),
                            np.zeros(16, np.uint16), (), {})
    with pytest.raises(ValueError, match="capacity 0"):
        _native.apply_batch(payload, 0, 1, 0, none64, none64, none64, none64, none32, (), {})
    with pytest.raises(ValueError, match="others: a table of capacity 0"):
        _native.apply_batch(payload, 0, 1, 0, empty.copy(), masks.copy(), empty.copy(), masks.copy(),
                            stamps.copy(), (none64,), {})
