"""The msgpack reader (kvcache/csrc/msgpack.c), through scan_batch and the index's fast path: integers
in every width read as their values (hashes and token ids alike), strs, arrays and maps in every header
width, float or int timestamps, bin hashes, and any value skipped where a field is not modelled; what it
does not read is declined (None), never misread: ext types, non-ASCII strs, nesting past its depth,
truncated payloads and trailing bytes."""
from __future__ import annotations

import struct

import msgpack
import pytest

from kvcache.events import BlockRemoved
from kvcache.index import PrefixIndex
from kvcache.native import native

NIL = b"\xc0"


def uint(v: int, width: int) -> bytes:
    return bytes((0xcc + width.bit_length() - 1,)) + v.to_bytes(width, "big")


def sint(v: int, width: int) -> bytes:
    return bytes((0xd0 + width.bit_length() - 1,)) + v.to_bytes(width, "big", signed=True)


def string(s: str, width: int | None = None) -> bytes:
    """A str as fixstr (width None) or str 8/16/32."""
    b = s.encode()
    if width is None:
        return bytes((0xa0 | len(b),)) + b
    return bytes((0xd9 + width.bit_length() - 1,)) + len(b).to_bytes(width, "big") + b


def header(n: int, width: int | None, fix: int, wide: int) -> bytes:
    """An array (fix 0x90, wide 0xdc) or map (0x80, 0xde) header: fix form, or 16/32-bit."""
    if width is None:
        return bytes((fix | n,))
    return bytes((wide + (width == 4),)) + n.to_bytes(width, "big")


def array(items: list[bytes], width: int | None = None) -> bytes:
    return header(len(items), width, 0x90, 0xdc) + b"".join(items)


def mapping(pairs: list[tuple[bytes, bytes]], width: int | None = None) -> bytes:
    return header(len(pairs), width, 0x80, 0xde) + b"".join(k + v for k, v in pairs)


def store(hash_: bytes, tokens: list[bytes], medium: bytes = NIL, extra: bytes = NIL, hashes_width=None) -> bytes:
    """A BlockStored in the array form of vLLM 0.23 (a block of len(tokens) ids)."""
    return array([string("BlockStored"), array([hash_], hashes_width), NIL, array(tokens), uint(len(tokens), 1),
                  NIL, medium, NIL, extra])


def batch(*events: bytes, ts: bytes = b"\xcb" + struct.pack(">d", 1.5), width=None) -> bytes:
    return array([ts, array(list(events), width), NIL])


INTS = [(7, b"\x07"), (-3, b"\xfd"), (200, uint(200, 1)), (40_000, uint(40_000, 2)),
        (3_000_000_000, uint(3_000_000_000, 4)), (2**63 + 5, uint(2**63 + 5, 8)), (7, uint(7, 8)),
        (-5, sint(-5, 1)), (-30_000, sint(-30_000, 2)), (-2_000_000_000, sint(-2_000_000_000, 4)),
        (-2**62, sint(-2**62, 8)), (100, sint(100, 8))]


@pytest.mark.parametrize("value, encoded", INTS, ids=[e.hex() for _, e in INTS])
def test_integers_of_every_width_read_as_their_values(value, encoded):
    """A block whose hash and token ids are `value`, written in one form: matched by those token ids,
    then gone once the engine removes that hash (written as the decoder's path folds it)."""
    ix = PrefixIndex()
    assert ix.apply_payload("p", "m", 0, batch(store(encoded, [encoded, encoded]))) is not None
    assert ix.match("m", None, [value, value], ["p"])["p"].blocks == 1
    ix.apply("p", "m", 0, [BlockRemoved((value,))])
    assert ix.match("m", None, [value, value], ["p"])["p"].blocks == 0


@pytest.mark.parametrize("width", [None, 1, 2, 4])
def test_strs_of_every_width_and_ascii_only(width):
    assert native.scan_batch(batch(store(b"\x01", [b"\x01"], medium=string("CPU", width))))[5] == "CPU"
    tag_wide = array([string("BlockRemoved", width), array([b"\x01"]), string("CPU", width)])
    assert native.scan_batch(batch(tag_wide)) == (0, 0, 1, 1, 0, "CPU", set())
    assert native.scan_batch(batch(store(b"\x01", [b"\x01"], medium=string("GPÜ", width)))) is None


@pytest.mark.parametrize("width", [None, 2, 4])
def test_arrays_and_maps_of_every_header_width(width):
    events = [store(bytes((i,)), [b"\x01", b"\x02"], hashes_width=width) for i in range(1, 4)]
    assert native.scan_batch(batch(*events, width=width)) == (3, 3, 0, 0, 2, "GPU", set())
    removal = mapping([(string("type"), string("BlockRemoved")),
                       (string("block_hashes"), array([b"\x01", b"\x02"], width))], width)
    assert native.scan_batch(batch(removal, width=width)) == (0, 0, 1, 2, 0, "GPU", set())
    envelope = mapping([(string("ts"), b"\x01"), (string("events"), array([removal], width)),
                        (string("data_parallel_rank"), NIL)], width)
    assert native.scan_batch(envelope) == (0, 0, 1, 2, 0, "GPU", set())


def test_a_timestamp_is_a_float_of_either_width_or_an_int():
    removal = array([string("BlockRemoved"), array([b"\x01"])])
    for ts in (b"\xcb" + struct.pack(">d", 2.5), b"\xca" + struct.pack(">f", 2.5), b"\x05", uint(2**40, 8)):
        assert native.scan_batch(batch(removal, ts=ts)) is not None, ts
    for ts in (NIL, string("now"), b"\xc3"):
        assert native.scan_batch(batch(removal, ts=ts)) is None, ts


@pytest.mark.parametrize("width", [1, 2, 4])
def test_bin_hashes_read_as_their_last_eight_bytes(width):
    digest = bytes(range(1, 33))
    encoded = bytes((0xc4 + width.bit_length() - 1,)) + len(digest).to_bytes(width, "big") + digest
    ix = PrefixIndex()
    assert ix.apply_payload("p", "m", 0, batch(store(encoded, [b"\x01"]))) is not None
    assert ix.match("m", None, [1], ["p"])["p"].blocks == 1
    ix.apply("p", "m", 0, [BlockRemoved((int.from_bytes(digest[-8:], "big"),))])  # vLLM's int for that digest
    assert ix.match("m", None, [1], ["p"])["p"].blocks == 0


def _nested(depth: int) -> bytes:
    return b"\x91" * depth + b"\x01"


def store_map(**fields: bytes) -> bytes:
    """A BlockStored in the map form of vLLM 0.24+ (one block of one token), with `fields` added."""
    pairs = [(string("type"), string("BlockStored")), (string("block_hashes"), array([b"\x01"])),
             (string("parent_block_hash"), NIL), (string("token_ids"), array([b"\x01"])),
             (string("block_size"), uint(1, 1)), (string("lora_id"), NIL), (string("medium"), NIL),
             (string("lora_name"), NIL)]
    return mapping(pairs + [(string(k), v) for k, v in fields.items()])


def test_values_of_every_kind_are_skipped_but_ext_non_ascii_and_deep_nesting_decline():
    every = array([b"\x01", sint(-9, 8), string("x", 2), b"\xc4\x02ab", b"\xca" + struct.pack(">f", 1.0),
                   NIL, b"\xc2", b"\xc3", mapping([(string("k"), array([b"\x02", NIL]))], 2), _nested(20)], 4)
    # session_id: a field the index does not model, skipped whatever it holds
    assert native.scan_batch(batch(store_map(session_id=every))) == (1, 1, 0, 0, 1, "GPU", set())
    for bad in (b"\xd4\x01\x00",  # fixext 1
                b"\xc7\x01\x05\x00",  # ext 8
                string("ü"),
                _nested(40)):
        assert native.scan_batch(batch(store_map(session_id=array([bad])))) is None, bad


def test_extra_keys_group_fields_and_lookahead_take_the_general_path_unless_they_say_nothing():
    """The fast path keys a block by its tokens alone: a block with extra keys (a salt, media, a LoRA
    name), a group other than 0, a kind other than full attention, a window or lookahead tokens is the
    general path's (kvcache.index keys those). Nil extras, group 0 and full attention stay fast."""
    plain = (1, 1, 0, 0, 1, "GPU", set())
    assert native.scan_batch(batch(store(b"\x01", [b"\x01"], extra=array([NIL])))) == plain
    assert native.scan_batch(batch(store_map(extra_keys=array([NIL]), group_idx=b"\x00",
                                             kv_cache_spec_kind=string("full_attention"),
                                             kv_cache_spec_sliding_window=NIL, lookahead_token_ids=array([])))) == plain
    for fields in ({"extra_keys": array([array([string("salt")])])},
                   {"group_idx": b"\x01"},
                   {"kv_cache_spec_kind": string("sliding_window")},
                   {"kv_cache_spec_kind": string("mamba")},
                   {"kv_cache_spec_sliding_window": uint(128, 1)},
                   {"lookahead_token_ids": array([b"\x05"])}):
        assert native.scan_batch(batch(store_map(**fields))) is None, fields
    assert native.scan_batch(batch(store(b"\x01", [b"\x01"], extra=array([array([string("salt")])])))) is None


def test_truncated_payloads_and_trailing_bytes_decline():
    good = batch(store(uint(2**63 + 5, 8), [b"\x01", uint(40_000, 2)], medium=string("CPU", 2)),
                 array([string("BlockRemoved"), array([b"\xc4\x03abc"]), string("CPU")]))
    assert native.scan_batch(good) == (1, 1, 1, 1, 2, "CPU", set())
    assert msgpack.unpackb(good)  # what the decoder reads
    for cut in range(len(good)):
        assert native.scan_batch(good[:cut]) is None, cut
    assert native.scan_batch(good + b"\x00") is None
