"""HPACK (RFC 7541), as kvgate's gRPC server (plugin.grpcserver) needs it: a full decoder of the header
blocks a client sends (static and dynamic tables, table size updates, integers, literals raw or
Huffman-coded), and literal header blocks for its own answers (never indexed: nothing to keep in step).

The Huffman code is canonical (RFC 7541 Appendix B: within a code length, codes rise with the symbol),
so it is kept here as its 257 code lengths and the codes are rebuilt from them; it is read four bits at
a time through a table of the code tree's states, built on first use.
"""
from __future__ import annotations

import functools
from collections import deque


class HpackError(ValueError):
    """A header block that cannot be decoded: the connection cannot go on (HTTP/2 COMPRESSION_ERROR)."""


# RFC 7541 Appendix A: index 1..61.
STATIC_TABLE: tuple[tuple[str, str], ...] = (
    (":authority", ""), (":method", "GET"), (":method", "POST"), (":path", "/"), (":path", "/index.html"),
    (":scheme", "http"), (":scheme", "https"), (":status", "200"), (":status", "204"), (":status", "206"),
    (":status", "304"), (":status", "400"), (":status", "404"), (":status", "500"), ("accept-charset", ""),
    ("accept-encoding", "gzip, deflate"), ("accept-language", ""), ("accept-ranges", ""), ("accept", ""),
    ("access-control-allow-origin", ""), ("age", ""), ("allow", ""), ("authorization", ""), ("cache-control", ""),
    ("content-disposition", ""), ("content-encoding", ""), ("content-language", ""), ("content-length", ""),
    ("content-location", ""), ("content-range", ""), ("content-type", ""), ("cookie", ""), ("date", ""),
    ("etag", ""), ("expect", ""), ("expires", ""), ("from", ""), ("host", ""), ("if-match", ""),
    ("if-modified-since", ""), ("if-none-match", ""), ("if-range", ""), ("if-unmodified-since", ""),
    ("last-modified", ""), ("link", ""), ("location", ""), ("max-forwards", ""), ("proxy-authenticate", ""),
    ("proxy-authorization", ""), ("range", ""), ("referer", ""), ("refresh", ""), ("retry-after", ""),
    ("server", ""), ("set-cookie", ""), ("strict-transport-security", ""), ("transfer-encoding", ""),
    ("user-agent", ""), ("vary", ""), ("via", ""), ("www-authenticate", ""),
)
_STATIC_NAMES = {name: i + 1 for i, (name, _) in reversed(list(enumerate(STATIC_TABLE)))}  # first index of each name

# RFC 7541 Appendix B: the code length of each symbol 0..255 and EOS (256).
HUFFMAN_LENGTHS: tuple[int, ...] = (
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 30, 28, 28, 28, 28, 28,
    28, 28, 28, 28, 6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6, 5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 7, 8, 15, 6,
    12, 10, 13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 8, 7, 8, 13, 19, 13, 14, 6, 15, 5,
    6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6, 6, 5, 6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7, 15, 11, 14, 13, 28, 20, 22, 20, 20,
    22, 22, 22, 23, 22, 23, 23, 23, 23, 23, 24, 23, 24, 24, 22, 23, 24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24,
    22, 21, 20, 22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23, 23, 21, 21, 22, 21, 23, 22, 23, 23, 20, 22, 22, 22,
    23, 22, 22, 23, 26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25, 19, 21, 26, 27, 27, 26, 27, 24,
    21, 21, 26, 26, 28, 27, 27, 27, 20, 24, 20, 21, 22, 21, 21, 23, 22, 22, 25, 25, 24, 24, 26, 23, 26, 27, 26, 26,
    27, 27, 27, 27, 27, 28, 27, 27, 27, 27, 27, 26, 30,
)
EOS = 256


def huffman_codes() -> list[tuple[int, int]]:
    """(code, length) of each symbol 0..256, rebuilt from the canonical code's lengths."""
    codes: list[tuple[int, int]] = [(0, 0)] * len(HUFFMAN_LENGTHS)
    code, previous = 0, 0
    for symbol in sorted(range(len(HUFFMAN_LENGTHS)), key=lambda s: (HUFFMAN_LENGTHS[s], s)):
        length = HUFFMAN_LENGTHS[symbol]
        code <<= length - previous
        codes[symbol] = (code, length)
        code, previous = code + 1, length
    return codes


class _HuffmanTable:
    """The decoder's table: for each state (an inner node of the code tree) and each 4-bit group, the
    next state and the symbol emitted on the way (-1: none; a 4-bit group emits at most one, since
    every code is 5 bits or longer); and the states where the input may end (padding: a prefix of EOS,
    so all ones, at most 7 bits)."""

    def __init__(self) -> None:
        children: list[list[int]] = [[-1, -1]]  # node -> [child on 0, child on 1]; a leaf is ~symbol
        for symbol, (code, length) in enumerate(huffman_codes()):
            node = 0
            for shift in range(length - 1, -1, -1):
                bit = (code >> shift) & 1
                if shift == 0:
                    children[node][bit] = ~symbol
                else:
                    if children[node][bit] == -1:
                        children[node][bit] = len(children)
                        children.append([-1, -1])
                    node = children[node][bit]
        # states along the all-ones path from the root, 0..7 deep, may end the input
        ones, node = {0}, 0
        for _ in range(7):
            node = children[node][1]
            ones.add(node)
        self.accepting = [n in ones for n in range(len(children))]
        self.next_state: list[int] = []
        self.emit: list[int] = []
        for state in range(len(children)):
            for group in range(16):
                node, out = state, -1
                for shift in (3, 2, 1, 0):
                    child = children[node][(group >> shift) & 1]
                    if child < 0:
                        out = ~child  # EOS (256) in the input is an error: huffman_decode refuses it
                        node = 0
                        if out == EOS:
                            break
                    else:
                        node = child
                self.next_state.append(node)
                self.emit.append(out)


@functools.cache
def _huffman_table() -> _HuffmanTable:
    """The one decoding table (a constant), built on first use."""
    return _HuffmanTable()


def huffman_decode(data: bytes) -> bytes:
    table = _huffman_table()
    nxt, emit = table.next_state, table.emit
    out = bytearray()
    state = 0
    for byte in data:
        for nibble in (byte >> 4, byte & 15):
            i = (state << 4) | nibble
            symbol = emit[i]
            if symbol >= 0:
                if symbol == EOS:
                    raise HpackError("EOS inside a Huffman-coded string")
                out.append(symbol)
            state = nxt[i]
    if not table.accepting[state]:
        raise HpackError("a Huffman-coded string's padding is not a short run of ones")
    return bytes(out)


class Decoder:
    """One connection's decoder: header blocks in the order they came, each into (name, value) pairs (text
    as latin-1, so every byte is kept). `max_table_size` is what this side announced
    (SETTINGS_HEADER_TABLE_SIZE); the peer may lower the table below it with size updates."""

    __slots__ = ("_table", "_size", "_max", "_limit", "_blocks")

    def __init__(self, max_table_size: int = 4096) -> None:
        self._table: deque[tuple[str, str]] = deque()  # newest first: dynamic index 62 is _table[0]
        self._size = 0
        self._limit = max_table_size  # the bound the peer may not exceed
        self._max = max_table_size  # the bound now in force
        # Blocks that only referred to entries, decoded while the table stood as it stands now: a peer
        # that indexed everything sends the same bytes for every stream. Cleared whenever the table changes.
        self._blocks: dict[bytes, list[tuple[str, str]]] = {}

    def decode(self, block: bytes) -> list[tuple[str, str]]:
        known = self._blocks.get(block)
        if known is not None:
            return known
        headers: list[tuple[str, str]] = []
        changed = False
        pos, end = 0, len(block)
        while pos < end:
            first = block[pos]
            if first & 0x80:  # indexed field
                index, pos = _integer(block, pos, 7)
                headers.append(self._entry(index))
            elif first & 0x40:  # literal with incremental indexing
                index, pos = _integer(block, pos, 6)
                name, pos = (self._entry(index)[0], pos) if index else _string(block, pos)
                value, pos = _string(block, pos)
                headers.append((name, value))
                self._add(name, value)
                changed = True
            elif first & 0x20:  # dynamic table size update
                if headers:
                    raise HpackError("a table size update after a header field")
                size, pos = _integer(block, pos, 5)
                if size > self._limit:
                    raise HpackError(f"a table size update to {size}, above the {self._limit} announced")
                self._max = size
                self._evict(0)
                changed = True
            else:  # literal without indexing (0000) or never indexed (0001)
                index, pos = _integer(block, pos, 4)
                name, pos = (self._entry(index)[0], pos) if index else _string(block, pos)
                value, pos = _string(block, pos)
                headers.append((name, value))
        if changed:
            self._blocks.clear()
        elif len(self._blocks) < 64:
            self._blocks[block] = headers
        return headers

    def _entry(self, index: int) -> tuple[str, str]:
        if 0 < index <= len(STATIC_TABLE):
            return STATIC_TABLE[index - 1]
        i = index - len(STATIC_TABLE) - 1
        if index == 0 or i >= len(self._table):
            raise HpackError(f"index {index} is in neither table ({len(self._table)} dynamic entries)")
        return self._table[i]

    def _add(self, name: str, value: str) -> None:
        size = len(name) + len(value) + 32  # latin-1: one character per byte
        self._evict(size)
        if size <= self._max:  # an entry larger than the table empties it and is not kept (RFC 7541 4.4)
            self._table.appendleft((name, value))
            self._size += size

    def _evict(self, room: int) -> None:
        while self._table and self._size + room > self._max:
            name, value = self._table.pop()
            self._size -= len(name) + len(value) + 32


def _integer(block: bytes, pos: int, prefix: int) -> tuple[int, int]:
    """An integer with a `prefix`-bit prefix starting at block[pos]; (value, the position after it)."""
    mask = (1 << prefix) - 1
    value = block[pos] & mask
    pos += 1
    if value < mask:
        return value, pos
    shift = 0
    while True:
        if pos >= len(block):
            raise HpackError("a header block ends inside an integer")
        byte = block[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift > 28:
            raise HpackError("an integer longer than 4 bytes")


def _string(block: bytes, pos: int) -> tuple[str, int]:
    if pos >= len(block):
        raise HpackError("a header block ends before a string")
    huffman = block[pos] & 0x80
    length, pos = _integer(block, pos, 7)
    end = pos + length
    if end > len(block):
        raise HpackError(f"a string of {length} bytes runs past its header block")
    raw = block[pos:end]
    return (huffman_decode(raw) if huffman else raw).decode("latin-1"), end


def encode_integer(value: int, prefix: int, flags: int = 0) -> bytes:
    mask = (1 << prefix) - 1
    if value < mask:
        return bytes((flags | value,))
    out = bytearray((flags | mask,))
    value -= mask
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def encode_literal(name: str, value: bytes) -> bytes:
    """One field as a literal never added to a table: the name by its static index where it has one."""
    index = _STATIC_NAMES.get(name)
    if index is not None:
        head = encode_integer(index, 4)
    else:
        raw = name.encode("latin-1")
        head = b"\x00" + encode_integer(len(raw), 7) + raw
    return head + encode_integer(len(value), 7) + value


def encode(headers: list[tuple[str, bytes]]) -> bytes:
    """A header block of literals (none indexed): any decoder reads it whatever its table holds."""
    return b"".join(encode_literal(name, value) for name, value in headers)
