"""A large batch cut between events, and a large event into pieces (kvcache/csrc/split.c, split_batch and
cut_event, PrefixIndex.split_payload): the parts, applied in order, are the batch; each holds at most
the bound (an event the cut does not model whole, alone)."""
from __future__ import annotations

import dataclasses
import random

import msgpack
import pytest

from kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvcache.index import PrefixIndex
from kvcache.native import native
from kvcache.wire import decode_batch, encode_batch

from eventcut import merged


def _batch(rng: random.Random, n_events: int, next_hash: list[int], as_bytes: bool = False) -> EventBatch:
    """Stores (some of hundreds of blocks, some continuing the chain before them) and removals; block
    hashes as ints, or as vLLM >= 0.11's 32 bytes."""
    def h(i: int):
        return i.to_bytes(32, "big") if as_bytes else i

    events = []
    for _ in range(n_events):
        if rng.random() < 0.3:
            events.append(BlockRemoved(tuple(h(rng.randrange(1, next_hash[0] + 1))
                                             for _ in range(rng.randrange(1, 40 if rng.random() < 0.8 else 400))),
                                       "GPU"))
            continue
        n = rng.randrange(1, 30) if rng.random() < 0.8 else rng.randrange(30, 300)
        hashes = tuple(h(i) for i in range(next_hash[0], next_hash[0] + n))
        parent = h(next_hash[0] - 1) if next_hash[0] > 1 and rng.random() < 0.3 else None
        next_hash[0] += n
        tokens = tuple(rng.randrange(50_000) for _ in range(4 * n))
        events.append(BlockStored(hashes, parent, tokens, 4, None, "GPU", rng.choice((None, None, "adapter"))))
    return EventBatch(1.5, tuple(events), rng.choice((None, 0, 3)))


def _blocks(payload: bytes) -> int:
    scan = native.scan_batch(payload)
    return scan[1] + scan[3]


@pytest.mark.parametrize("seed", range(6))
def test_parts_applied_in_order_are_the_batch(seed):
    rng = random.Random(seed)
    generation, as_bytes = rng.choice((("0.23", False), ("0.25", False), ("0.33", False), ("0.33", True)))
    # no eviction here (eviction runs after each part, so under the bound's pressure parts may evict
    # other victims than the whole batch would: the bound holds either way, see below)
    whole, parted = PrefixIndex(max_entries=10**6), PrefixIndex(max_entries=10**6)
    next_hash, split, cut, prompts = [1], 0, 0, []
    for _ in range(60):
        batch = _batch(rng, rng.randrange(1, 40), next_hash, as_bytes)
        prompts += [(e.lora_name, list(e.token_ids)) for e in batch.events
                    if isinstance(e, BlockStored) and e.parent_block_hash is None]
        payload = encode_batch(batch, generation)
        bound = rng.choice((1, 7, 50, 200))
        parts = parted.split_payload(payload, bound)
        assert whole.apply_payload("p", "m", 0, payload) is not None
        if parts is None:  # within the bound
            assert _blocks(payload) <= bound
            parted.apply_payload("p", "m", 0, payload)
            continue
        split += 1
        decoded = [decode_batch(p).batch for p in parts]
        pieces = [e for d in decoded for e in d.events]
        cut += len(pieces) - len(batch.events)
        assert merged(pieces) == merged(batch.events)  # every event once, in order, some in pieces
        assert {(d.ts, d.data_parallel_rank) for d in decoded} == {(batch.ts, batch.data_parallel_rank)}
        for p in parts:
            assert _blocks(p) <= bound
            assert parted.apply_payload("p", "m", 0, p) is not None
        # each part but the last is full: adding the next part's first event would pass the bound
        for p, nxt in zip(parts, decoded[1:]):
            first = encode_batch(EventBatch(0.0, nxt.events[:1], None), generation)
            assert _blocks(p) + _blocks(first) > bound
    assert split > 10 and cut > 10
    assert parted.stats()["entries"] == whole.stats()["entries"] > 0
    assert parted.stats()["blocks_per_pod"] == whole.stats()["blocks_per_pod"]
    for lora, tokens in prompts:
        assert parted.match("m", lora, tokens, ["p"]) == whole.match("m", lora, tokens, ["p"])


def test_parts_keep_the_index_within_its_bound():
    rng = random.Random(9)
    ix, next_hash = PrefixIndex(max_entries=300), [1]
    for _ in range(40):
        payload = encode_batch(_batch(rng, 30, next_hash), "0.33")
        for part in ix.split_payload(payload, 20) or [payload]:
            assert ix.apply_payload("p", "m", 0, part) is not None
            assert ix.stats()["entries"] <= 300
    assert ix.stats()["evicted_entries"] > 0


def test_the_map_form_and_its_other_keys_survive_the_cut():
    events = [[("BlockStored"), [i], None, [i, i], 2, None, "GPU", None] for i in range(1, 6)]
    payload = msgpack.packb({"ts": 2.5, "events": events, "data_parallel_rank": 1}, use_bin_type=True)
    parts = native.split_batch(payload, 2)
    assert parts is not None and len(parts) == 3
    assert [msgpack.unpackb(p) for p in parts] == [
        {"ts": 2.5, "events": events[i:i + 2], "data_parallel_rank": 1} for i in (0, 2, 4)]


def test_long_runs_of_events_get_the_wider_array_headers():
    events = tuple(BlockStored((i,), None, (i, i), 2, None, "GPU", None) for i in range(1, 70_002))
    payload = encode_batch(EventBatch(1.0, events, None), "0.33")
    parts = native.split_batch(payload, 66_000)  # 66,000 events (array 32), then 4,001 (array 16)
    assert [len(decode_batch(p).batch.events) for p in parts] == [66_000, 4_001]
    parts = native.split_batch(payload, 70_000)  # 70,000, then 1 (fixarray)
    assert [decode_batch(p).batch.events for p in parts] == [events[:70_000], events[70_000:]]


@pytest.mark.parametrize("payload", [
    b"", b"\x93", b"garbage", msgpack.packb([1.0, [], None]),
    encode_batch(EventBatch(1.0, (AllBlocksCleared(),) * 3, None), "0.33"),  # not the fast path's shape
    encode_batch(EventBatch(1.0, tuple(BlockRemoved((i,), "GPU") for i in range(1, 4)), None), "0.33"),  # within
])
def test_what_is_not_cut_is_declined(payload):
    assert native.split_batch(payload, 3) is None


def test_a_bound_below_one_is_declined_and_the_size_check_skips_small_batches():
    payload = encode_batch(EventBatch(1.0, tuple(BlockRemoved((i,), "GPU") for i in range(1, 40)), None), "0.33")
    assert native.split_batch(payload, 0) is None and native.split_batch(payload, -5) is None
    ix = PrefixIndex(max_entries=100)
    assert ix.split_payload(payload, len(payload)) is None  # no batch that short holds more blocks than bytes
    assert len(ix.split_payload(payload, 10)) == 4


@pytest.mark.parametrize("generation", ["0.23", "0.33"])
@pytest.mark.parametrize("as_bytes", [False, True])
def test_one_large_event_is_cut_into_pieces_each_chained_to_the_block_before(generation, as_bytes):
    def h(i: int):
        return i.to_bytes(32, "big") if as_bytes else i

    store = BlockStored(tuple(h(i) for i in range(100, 110)), h(7), tuple(range(1000, 1040)), 4, None, "CPU", "ad")
    parts = native.split_batch(encode_batch(EventBatch(2.5, (store,), 1), generation), 4)
    got = [decode_batch(p).batch for p in parts]
    assert [(b.ts, b.data_parallel_rank, len(b.events)) for b in got] == [(2.5, 1, 1)] * 3
    assert [b.events[0] for b in got] == [
        dataclasses.replace(store, block_hashes=store.block_hashes[i:i + 4], parent_block_hash=h(7) if i == 0 else h(99 + i),
                            token_ids=store.token_ids[4 * i:4 * i + 16]) for i in (0, 4, 8)]
    gone = BlockRemoved(tuple(h(i) for i in range(1, 8)), "GPU")
    parts = native.split_batch(encode_batch(EventBatch(2.5, (gone,), None), generation), 3)
    assert [decode_batch(p).batch.events for p in parts] == [
        (dataclasses.replace(gone, block_hashes=gone.block_hashes[i:i + 3]),) for i in (0, 3, 6)]


@pytest.mark.parametrize("form", ["array", "map"])
def test_extra_keys_saying_nothing_are_cut_and_real_ones_leave_the_batch_to_the_general_path(form):
    """An event with extra_keys of nils (vLLM 0.17-0.23 sends one nil per block) is fast but not cut (a part
    of its own: the cut does not model the per-block list); a batch with real
    extra keys (salt, media, LoRA name) is not in the fast path's shape: neither scanned nor cut."""
    def store(first, n, extra):
        fields = {"type": "BlockStored", "block_hashes": list(range(first, first + n)), "parent_block_hash": None,
                  "token_ids": list(range(100 * first, 100 * first + 2 * n)), "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None,
                  "extra_keys": extra}
        return fields if form == "map" else ["BlockStored", *list(fields.values())[1:]]

    events = [store(1, 6, None), store(10, 6, [None] * 6), store(20, 3, None)]
    payload = msgpack.packb([1.0, events, 0], use_bin_type=True)
    assert native.scan_batch(payload) is not None  # the fast path takes it
    parts = native.split_batch(payload, 4)
    assert [[len(e.block_hashes) for e in decode_batch(p).batch.events] for p in parts] == [[4], [2], [6], [3]]
    ix, ref = PrefixIndex(), PrefixIndex()
    assert ref.apply_payload("p", "m", 0, payload) is not None
    for p in parts:
        assert ix.apply_payload("p", "m", 0, p) is not None
    assert ix.stats()["entries"] == ref.stats()["entries"] == 15
    salted = msgpack.packb([1.0, [store(1, 6, None), store(10, 6, [["salt"]] + [None] * 5)], 0], use_bin_type=True)
    assert native.scan_batch(salted) is None
    assert native.split_batch(salted, 4) is None
