"""A large batch cut between events (kvcache/_native.c split_batch, PrefixIndex.split_payload): the
parts, applied in order, are the batch; each holds at most the bound (an event is never cut)."""
from __future__ import annotations

import random

import msgpack
import pytest

from kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvcache.index import PrefixIndex
from kvcache.native import native
from kvcache.wire import decode_batch, encode_batch


def _batch(rng: random.Random, n_events: int, next_hash: list[int]) -> EventBatch:
    events = []
    for _ in range(n_events):
        if rng.random() < 0.3:
            events.append(BlockRemoved(tuple(rng.randrange(1, next_hash[0] + 1) for _ in range(rng.randrange(1, 40))),
                                       "GPU"))
            continue
        n = rng.randrange(1, 30)
        hashes = tuple(range(next_hash[0], next_hash[0] + n))
        next_hash[0] += n
        tokens = tuple(rng.randrange(50_000) for _ in range(4 * n))
        events.append(BlockStored(hashes, None, tokens, 4, None, "GPU", rng.choice((None, None, "adapter"))))
    return EventBatch(1.5, tuple(events), rng.choice((None, 0, 3)))


def _blocks(payload: bytes) -> int:
    scan = native.scan_batch(payload)
    return scan[1] + scan[3]


@pytest.mark.parametrize("seed", range(6))
def test_parts_applied_in_order_are_the_batch(seed):
    rng = random.Random(seed)
    # no eviction here (eviction runs after each part, so under the bound's pressure parts may evict
    # other victims than the whole batch would: the bound holds either way, see below)
    whole, parted = PrefixIndex(max_entries=10**6), PrefixIndex(max_entries=10**6)
    next_hash, split, prompts = [1], 0, []
    for _ in range(60):
        batch = _batch(rng, rng.randrange(1, 40), next_hash)
        prompts += [(e.lora_name, list(e.token_ids)) for e in batch.events if isinstance(e, BlockStored)]
        payload = encode_batch(batch, "0.33")
        bound = rng.choice((1, 7, 50, 200))
        parts = parted.split_payload(payload, bound)
        assert whole.apply_payload("p", "m", 0, payload) is not None
        if parts is None:  # within the bound, or a single event
            assert _blocks(payload) <= bound or len(batch.events) == 1
            parted.apply_payload("p", "m", 0, payload)
            continue
        split += 1
        decoded = [decode_batch(p).batch for p in parts]
        assert [e for d in decoded for e in d.events] == list(batch.events)  # every event once, in order
        assert {(d.ts, d.data_parallel_rank) for d in decoded} == {(batch.ts, batch.data_parallel_rank)}
        for p, d in zip(parts, decoded):
            assert _blocks(p) <= bound or len(d.events) == 1  # an event is never cut
            assert parted.apply_payload("p", "m", 0, p) is not None
        # each part but the last is full: adding the next part's first event would pass the bound
        for p, nxt in zip(parts, decoded[1:]):
            first = encode_batch(EventBatch(0.0, nxt.events[:1], None), "0.33")
            assert _blocks(p) + _blocks(first) > bound
    assert split > 10
    assert parted.stats()["entries"] == whole.stats()["entries"] > 0
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
    encode_batch(EventBatch(1.0, (BlockRemoved(tuple(range(1, 500)), "GPU"),), None), "0.33"),  # one event
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
