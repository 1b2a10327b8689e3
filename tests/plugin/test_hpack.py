"""plugin.hpack against RFC 7541's own examples (Appendix C) and its rules for the dynamic table, Huffman
padding and malformed blocks."""
from __future__ import annotations

import pytest

from plugin import hpack
from plugin.hpack import Decoder, HpackError, encode, encode_integer, huffman_codes, huffman_decode


def _huffman_encode(data: bytes) -> bytes:
    """The encoder RFC 7541 5.2 describes (a test's own): codes concatenated, padded with the EOS prefix."""
    codes = huffman_codes()
    bits = nbits = 0
    for byte in data:
        code, length = codes[byte]
        bits, nbits = (bits << length) | code, nbits + length
    pad = -nbits % 8
    bits, nbits = (bits << pad) | ((1 << pad) - 1), nbits + pad
    return bits.to_bytes(nbits // 8, "big")


def test_the_canonical_code_is_rfc_7541s():
    codes = huffman_codes()
    assert sum(2.0 ** -length for _, length in codes) == 1.0  # a complete prefix code
    assert codes[ord("0")] == (0x0, 5) and codes[ord("a")] == (0x3, 5) and codes[ord("t")] == (0x9, 5)
    assert codes[ord(" ")] == (0x14, 6) and codes[0] == (0x1FF8, 13) and codes[hpack.EOS] == (0x3FFFFFFF, 30)


def test_every_symbol_decodes():
    data = bytes(range(256)) * 2
    assert huffman_decode(_huffman_encode(data)) == data
    for byte in range(256):
        assert huffman_decode(_huffman_encode(bytes([byte]))) == bytes([byte])


def test_rfc_7541_c3_requests_without_huffman():
    d = Decoder()
    assert d.decode(bytes.fromhex("828684410f7777772e6578616d706c652e636f6d")) == [
        (":method", "GET"), (":scheme", "http"), (":path", "/"), (":authority", "www.example.com")]
    assert d._size == 57
    assert d.decode(bytes.fromhex("828684be58086e6f2d6361636865")) == [
        (":method", "GET"), (":scheme", "http"), (":path", "/"), (":authority", "www.example.com"),
        ("cache-control", "no-cache")]
    assert d._size == 110
    assert d.decode(bytes.fromhex("828785bf400a637573746f6d2d6b65790c637573746f6d2d76616c7565")) == [
        (":method", "GET"), (":scheme", "https"), (":path", "/index.html"), (":authority", "www.example.com"),
        ("custom-key", "custom-value")]
    assert d._size == 164
    assert list(d._table) == [("custom-key", "custom-value"), ("cache-control", "no-cache"),
                              (":authority", "www.example.com")]


def test_rfc_7541_c4_requests_with_huffman():
    d = Decoder()
    assert d.decode(bytes.fromhex("828684418cf1e3c2e5f23a6ba0ab90f4ff"))[-1] == (":authority", "www.example.com")
    assert d.decode(bytes.fromhex("828684be5886a8eb10649cbf"))[-1] == ("cache-control", "no-cache")
    assert d.decode(bytes.fromhex("828785bf408825a849e95ba97d7f8925a849e95bb8e8b4bf"))[-1] == (
        "custom-key", "custom-value")
    assert d._size == 164


def test_rfc_7541_c2_literals():
    d = Decoder()
    assert d.decode(bytes.fromhex("400a637573746f6d2d6b65790d637573746f6d2d686561646572")) == [
        ("custom-key", "custom-header")]
    assert d._size == 55
    assert d.decode(bytes.fromhex("040c2f73616d706c652f70617468")) == [(":path", "/sample/path")]
    assert d.decode(bytes.fromhex("100870617373776f726406736563726574")) == [("password", "secret")]
    assert d.decode(bytes.fromhex("82")) == [(":method", "GET")]
    assert d._size == 55  # neither literal without indexing entered the table


def test_the_table_evicts_oldest_first_and_a_size_update_shrinks_it():
    d = Decoder(max_table_size=100)

    def add(name: str, value: str) -> bytes:
        return b"\x40" + encode_integer(len(name), 7) + name.encode() + encode_integer(len(value), 7) + value.encode()
    d.decode(add("a", "1") + add("b", "2"))  # 34 bytes each
    d.decode(add("c", "3"))  # 102 > 100: "a" goes
    assert list(d._table) == [("c", "3"), ("b", "2")]
    assert d.decode(bytes([0x80 | 62, 0x80 | 63])) == [("c", "3"), ("b", "2")]
    d.decode(encode_integer(40, 5, 0x20))  # a size update to 40: only the newest fits
    assert list(d._table) == [("c", "3")]
    d.decode(add("x" * 80, "y"))  # larger than the table: empties it, not kept
    assert list(d._table) == []
    with pytest.raises(HpackError, match="above the 100 announced"):
        d.decode(encode_integer(101, 5, 0x20))


def test_a_block_of_references_is_read_again_after_the_table_changed():
    d = Decoder()
    d.decode(b"\x40\x01k\x01a")
    assert d.decode(bytes([0x80 | 62])) == [("k", "a")]
    assert d.decode(bytes([0x80 | 62])) == [("k", "a")]  # remembered
    d.decode(b"\x40\x01k\x01b")
    assert d.decode(bytes([0x80 | 62])) == [("k", "b")]


@pytest.mark.parametrize("block, message", [
    (b"\x80", "neither table"),  # index 0
    (bytes([0x80 | 62]), "neither table"),  # an empty dynamic table
    (b"\xff", "inside an integer"),
    (b"\xff\xff\xff\xff\xff\xff\x01", "longer than 4 bytes"),
    (b"\x00\x05ab", "runs past"),
    (b"\x04", "before a string"),
    (b"\x82\x3f\xe1\x1f", "after a header field"),
])
def test_malformed_blocks_are_refused(block, message):
    with pytest.raises(HpackError, match=message):
        Decoder().decode(block)


def test_huffman_padding_and_eos_are_checked():
    good = _huffman_encode(b"a")  # 00011 + 111 padding
    assert huffman_decode(good) == b"a"
    with pytest.raises(HpackError, match="padding"):
        huffman_decode(bytes([0b00011000]))  # padded with zeros
    with pytest.raises(HpackError, match="padding"):
        huffman_decode(good + b"\xff")  # 11 bits of padding
    with pytest.raises(HpackError, match="EOS"):
        huffman_decode(b"\xff\xff\xff\xff")  # EOS, 30 ones, then padding


def test_encoded_literals_read_back_whatever_the_table_holds():
    fields = [(":status", b"200"), ("content-type", b"application/grpc"), ("grpc-message", b"x" * 300)]
    d = Decoder()
    d.decode(b"\x40\x01k\x01a")
    assert d.decode(encode(fields)) == [(k, v.decode()) for k, v in fields]
    assert list(d._table) == [("k", "a")]
