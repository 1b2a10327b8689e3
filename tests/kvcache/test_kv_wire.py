"""vLLM KV event payloads: byte-exact encoding per generation, tolerant decoding."""
from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvcache.wire import GENERATIONS, MALFORMED_EVENT, UNKNOWN_FIELD, UNKNOWN_TAG, WireError, decode_batch, encode_batch


def s(text: str) -> bytes:
    """msgpack fixstr, written by hand so the expected bytes do not come from the encoder under test."""
    assert len(text) < 32
    return bytes([0xA0 | len(text)]) + text.encode()


NIL = b"\xc0"
TS = b"\xcb" + struct.pack(">d", 1.5)
STORED = BlockStored((7,), None, (1, 2), 2, None, "GPU", None)


def test_023_is_a_tagged_array_with_every_field():
    payload = encode_batch(EventBatch(1.5, (STORED, BlockRemoved((7,), "GPU"), AllBlocksCleared()), 0), "0.23")
    stored = b"\x9c" + s("BlockStored") + b"\x91\x07" + NIL + b"\x92\x01\x02\x02" + NIL + s("GPU") + NIL * 5
    removed = b"\x94" + s("BlockRemoved") + b"\x91\x07" + s("GPU") + NIL
    cleared = b"\x91" + s("AllBlocksCleared")
    assert payload == b"\x93" + TS + b"\x93" + stored + removed + cleared + b"\x00"


@pytest.mark.parametrize("generation", ["0.25", "0.33"])
def test_map_generations_omit_defaults_but_keep_fields_without_one(generation):
    payload = encode_batch(EventBatch(1.5, (STORED, BlockRemoved((7,), "GPU"), AllBlocksCleared()), 3), generation)
    stored = (b"\x88" + s("type") + s("BlockStored") + s("block_hashes") + b"\x91\x07" + s("parent_block_hash") + NIL
              + s("token_ids") + b"\x92\x01\x02" + s("block_size") + b"\x02" + s("lora_id") + NIL
              + s("medium") + s("GPU") + s("lora_name") + NIL)
    removed = b"\x83" + s("type") + s("BlockRemoved") + s("block_hashes") + b"\x91\x07" + s("medium") + s("GPU")
    cleared = b"\x81" + s("type") + s("AllBlocksCleared")
    assert payload == b"\x93" + TS + b"\x93" + stored + removed + cleared + b"\x03"


def test_non_default_optional_fields_are_written_in_declaration_order():
    ev = BlockStored((1,), 2, (5,), 1, None, "CPU", "ad", ((b"x",),), 0, "full_attention", 128)
    obj = msgpack.unpackb(encode_batch(EventBatch(0.0, (ev,), 0), "0.33"))
    assert list(obj[1][0]) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                               "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                               "kv_cache_spec_sliding_window"]


def test_hash_encodings_uint64_negative_and_32_bytes():
    big, neg, raw = 2**64 - 1, -(2**63), bytes(range(32))
    payload = encode_batch(EventBatch(1.5, (BlockRemoved((big, neg, raw)),), 0), "0.23")
    hashes = b"\x93" + b"\xcf" + big.to_bytes(8, "big") + b"\xd3" + neg.to_bytes(8, "big", signed=True) + b"\xc4\x20" + raw
    assert hashes in payload
    assert decode_batch(payload).batch.events[0].block_hashes == (big, neg, raw)


def test_unknown_generation_is_rejected():
    with pytest.raises(ValueError, match="0.99"):
        encode_batch(EventBatch(0.0, ()), "0.99")


# --- decoding every shape ---------------------------------------------------

def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def test_two_element_batch_from_vllm_0_10_0():
    d = decode_batch(pack([2.0, [["BlockStored", [1, 2], None, [1, 2, 3, 4], 2, None]]]))
    assert d.batch == EventBatch(2.0, (BlockStored((1, 2), None, (1, 2, 3, 4), 2),), None)
    assert d.skipped == {}


def test_map_shaped_batch():
    d = decode_batch(pack({"ts": 3, "events": [{"type": "AllBlocksCleared"}], "data_parallel_rank": 1}))
    assert d.batch == EventBatch(3.0, (AllBlocksCleared(),), 1)


def test_oldest_array_events_without_medium():
    d = decode_batch(pack([1.0, [["BlockStored", [-5], -4, [9], 1, 3], ["BlockRemoved", [-5]]], 0]))
    assert d.batch.events == (BlockStored((-5,), -4, (9,), 1, 3), BlockRemoved((-5,)))


def test_map_event_with_fields_omitted_and_newer_known_fields():
    ev = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [4, 5],
          "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None, "locality": "local",
          "ownership": "owner", "session_id": "s", "lookahead_token_ids": [1]}
    d = decode_batch(pack([1.0, [ev, {"type": "BlockRemoved", "block_hashes": [1]}], 0]))
    assert d.batch.events == (BlockStored((1,), None, (4, 5), 2, None, "GPU", lookahead_token_ids=(1,)),
                              BlockRemoved((1,)))
    assert d.skipped == {}


def test_unknown_fields_and_tags_are_skipped_and_counted():
    events = [
        ["BlockStored", [1], None, [1], 1, None, "GPU", None, None, None, None, None, "future", "fields"],
        {"type": "BlockRemoved", "block_hashes": [1], "medium": None, "brand_new": 1},
        ["BlockMoved", [1]],
        {"type": "SomethingElse"},
        {"no": "type"},
        ["AllBlocksCleared"],
    ]
    d = decode_batch(pack([1.0, events, 0]))
    assert [type(e) for e in d.batch.events] == [BlockStored, BlockRemoved, AllBlocksCleared]
    assert d.skipped == {UNKNOWN_FIELD: 3, UNKNOWN_TAG: 3}


@pytest.mark.parametrize("bad", [
    ["BlockStored", [1], None, [1, 2, 3], 2],  # token count is not blocks * block_size
    ["BlockStored", [1, 2, 3], None, [1, 2, 3, 4], 2],  # more hashes than blocks (fewer is a sparse store)
    ["BlockStored", [1], None, [1, 2], 0],  # block_size 0
    ["BlockStored", ["str-hash"], None, [1], 1],
    ["BlockStored", [[1]], None, [1], 1],
    ["BlockStored", [1], None],
    ["BlockStored", [1], None, [1], 1, None, 5],  # medium not a string
    ["BlockRemoved", 7],
    ["BlockRemoved"],
    {"type": "BlockStored", "block_hashes": [1]},
    {"type": ["unhashable"]},
    5,
    [],
    None,
])
def test_malformed_event_is_skipped_not_fatal(bad):
    d = decode_batch(pack([1.0, [bad, ["AllBlocksCleared"]], 0]))
    assert d.batch.events == (AllBlocksCleared(),)
    assert sum(d.skipped.values()) == 1 and (MALFORMED_EVENT in d.skipped or UNKNOWN_TAG in d.skipped)


@pytest.mark.parametrize("payload", [
    b"", b"\xc1", b"\x93\xcb", pack(5), pack([1.0]), pack(["x", []]), pack([1.0, 5]), pack([1.0, [], "r"]),
    pack({"events": []}), b"\x93\xcb" + b"\x00" * 8 + b"\x90\x00trailing",
])
def test_undecodable_batch_raises_wire_error(payload):
    with pytest.raises(WireError):
        decode_batch(payload)


# --- properties ---------------------------------------------------------------

hashes = st.one_of(st.integers(-(2**63), 2**64 - 1), st.binary(min_size=32, max_size=32))
opt_str = st.none() | st.sampled_from(["GPU", "CPU", "disk", "adapter-ü"])
opt_int = st.none() | st.integers(0, 2**31)


@st.composite
def stored(draw):
    n = draw(st.integers(0, 4))
    block_size = draw(st.integers(1, 4))
    extra = draw(st.none() | st.tuples(*[st.none() | st.tuples(st.text(max_size=3), st.integers(0, 9))] * n))
    return BlockStored(
        tuple(draw(hashes) for _ in range(n)), draw(st.none() | hashes),
        tuple(draw(st.integers(0, 2**32 - 1)) for _ in range(n * block_size)), block_size,
        draw(opt_int), draw(opt_str), draw(opt_str), extra, draw(opt_int), draw(opt_str), draw(opt_int))


events = st.one_of(stored(), st.builds(BlockRemoved, st.lists(hashes, max_size=4).map(tuple), opt_str, opt_int),
                   st.just(AllBlocksCleared()))
batches = st.builds(EventBatch, st.floats(allow_nan=False), st.lists(events, max_size=5).map(tuple),
                    st.none() | st.integers(0, 64))


@settings(max_examples=150, deadline=None)
@given(batches, st.sampled_from(GENERATIONS))
def test_round_trip(batch, generation):
    d = decode_batch(encode_batch(batch, generation))
    assert d.batch == batch
    assert d.skipped == {}


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=5) | st.binary(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.binary(max_size=64), msgpack_values.map(pack),
                 st.lists(msgpack_values, max_size=4).map(lambda evs: pack([1.0, evs, 0]))))
def test_decoder_never_fails_otherwise_than_with_wire_error(payload):
    try:
        d = decode_batch(payload)
    except WireError:
        return
    assert all(type(e) in (BlockStored, BlockRemoved, AllBlocksCleared) for e in d.batch.events)


def test_batch_ts_reads_the_timestamp_of_the_array_form_without_decoding():
    from kvcache.wire import batch_ts
    for generation in GENERATIONS:
        payload = encode_batch(EventBatch(ts=1234.5, events=(STORED,)), generation=generation)
        assert batch_ts(payload) == 1234.5, generation  # every generation publishes the batch as an array
    assert batch_ts(b"\x93" + TS + b"\x90" + NIL) == 1.5
    assert batch_ts(b"\x92\xca" + struct.pack(">f", 2.5) + b"\x90") == 2.5
    assert batch_ts(msgpack.packb([7, [], None])) is None  # an int ts: decode_batch's business
    assert batch_ts(b"\x93\xcb\x00") is None and batch_ts(b"") is None
