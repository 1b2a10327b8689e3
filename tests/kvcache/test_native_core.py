"""The Core type (kvcache/csrc/core.c), kvcache/index.py's native object: it hands out ids of media,
models, pods and slots, lowest free first, reuses one only once nothing refers to it any more, refuses
ids it never gave and ragged buffers, and counts a pod's distinct blocks over its slots and media."""
from __future__ import annotations

import msgpack
import numpy as np
import pytest

from kvcache.native import native


def _u64(xs) -> bytes:
    return np.array(xs, np.uint64).tobytes()


def test_ids_are_the_lowest_free_and_reused_once_nothing_refers_to_them():
    core = native.Core(1000)
    assert (core.new_medium(), core.new_medium(), core.new_model(), core.new_model()) == (0, 1, 0, 1)
    pod_a, pod_b = core.new_group(), core.new_group()
    assert (pod_a, pod_b) == (0, 1)
    slots = [core.new_slot(pod_a), core.new_slot(pod_a), core.new_slot(pod_b)]
    assert slots == [0, 1, 2]
    assert core.store(0, 0, 1, _u64([10, 11]), _u64([100, 101])) == 2
    assert core.store(0, 0, 2, _u64([10]), _u64([100])) == 1
    assert (core.key_of(0, 10), core.key_of(0, 11), core.key_of(0, 12), core.key_of(1, 10)) == (100, 101, None, None)
    core.kill_slot(1)  # its entries uncounted at once, its marks gone in the background
    assert core.dead_slots == 1 and core.stats()[0] == 1
    assert core.new_slot(pod_a) == 3  # slot 1 is still marked in the tables: not reused yet
    core.maintain()
    assert core.dead_slots == 0 and core.stats()[4] == [1, 0]  # key 101 had no other holder: gone
    assert core.new_slot(pod_b) == 1
    core.remove_group(pod_b)  # slots 1 and 2 die with it
    assert core.dead_slots == 2
    assert core.new_group() == 2  # pod_b's id waits for its slots
    core.maintain()
    assert core.dead_slots == 0 and core.new_group() == pod_b
    assert core.stats()[:2] == (0, 0) and core.stats()[4] == [0, 0]
    core.free_medium(1)
    assert core.new_medium() == 1
    core.check()


def test_a_pods_blocks_are_counted_once_over_its_slots_and_media():
    core = native.Core(1000)
    gpu, cpu, model = core.new_medium(), core.new_medium(), core.new_model()
    pod, other = core.new_group(), core.new_group()
    rank0, rank1, elsewhere = core.new_slot(pod), core.new_slot(pod), core.new_slot(other)
    assert core.store(model, gpu, rank0, _u64([1, 2, 3]), _u64([11, 12, 13])) == 3
    assert core.store(model, gpu, rank1, _u64([1, 2]), _u64([11, 12])) == 2  # the same blocks on another rank
    assert core.store(model, cpu, rank0, _u64([3, 4]), _u64([13, 14])) == 2  # and in another medium
    assert core.store(model, gpu, elsewhere, _u64([1]), _u64([11])) == 1
    assert (core.group_blocks(pod), core.group_blocks(other)) == (4, 1)
    assert core.stats()[0] == 8  # entries: one per (block, slot, medium)
    assert core.release(model, gpu, rank0, _u64([1, 2, 3, 99])) == (3, 1)  # 99: an unknown hash
    assert core.group_blocks(pod) == 4  # rank1 still holds 1 and 2; the CPU table 3 and 4
    assert core.release(model, cpu, rank0, _u64([3])) == (1, 0)
    assert core.group_blocks(pod) == 3
    with pytest.raises(ValueError, match="no group"):
        core.group_blocks(7)
    core.check()


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


def test_holders_give_each_candidates_held_positions_and_match_takes_keys():
    core = native.Core(1000)
    gpu, cpu = core.new_medium(), core.new_medium()
    core.new_model()
    pod = core.new_group()
    slots = [core.new_slot(pod) for _ in range(70)]  # two words of slots
    core.store(0, gpu, slots[1], _u64([1, 2, 3]), _u64([10, 11, 12]))
    core.store(0, gpu, slots[65], _u64([3]), _u64([12]))
    core.store(0, cpu, slots[1], _u64([4]), _u64([13]))
    cand = ((1 << 1) | (1 << 65)).to_bytes(9, "little")
    keys = _u64([10, 99, 12, 13])
    by_medium = core.holders(keys, cand, (gpu, cpu))
    assert [{s: int.from_bytes(b, "little") for s, b in d.items()} for d in by_medium] == [
        {1: 0b0101, 65: 0b0100}, {1: 0b1000}]
    assert core.holders(keys, (1 << 2).to_bytes(1, "little"), (gpu,)) == [{}]  # a candidate holding none
    assert core.holders(b"", cand, (gpu,)) == [{}]
    runs, per_medium = core.match(_u64([10, 11, 12]), 0, 0, cand, (gpu,))  # block size 0: keys given
    assert (runs, per_medium) == ({1: 3}, None)
    with pytest.raises(ValueError):
        core.match(_u64([10]), -1, 0, cand, (gpu,))
    with pytest.raises(ValueError):
        core.holders(keys, cand, (7,))  # a medium it never gave
