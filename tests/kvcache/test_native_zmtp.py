"""The ZMTP frame splitter (kvcache/csrc/zmtp.c, zmtp_split): whole messages only, wherever the received
bytes stop; a live batch's three frames as (seq, payload), any other message as its frames; a stop before
a command that starts a message; ValueError for an oversized frame or a command inside a message; and on
any bytes, never a read past the end it is given."""
from __future__ import annotations

import random

import pytest

from kvcache.native import native
from kvcache.zmtp import MAX_FRAME


def frame(body: bytes, more: bool = False, command: bool = False) -> bytes:
    flags = (1 if more else 0) | (4 if command else 0)
    if len(body) > 255:
        return bytes((flags | 2,)) + len(body).to_bytes(8, "big") + body
    return bytes((flags, len(body))) + body


def live(seq: int, payload: bytes) -> bytes:
    return frame(b"", more=True) + frame(seq.to_bytes(8, "big"), more=True) + frame(payload)


def test_split_takes_whole_messages_only_wherever_the_bytes_stop():
    stream = (live(1, b"a" * 300) + frame(b"x") + live(2, b"b") + frame(b"\x04PING\x00\x01", command=True)
              + live(3, b"c"))
    expected = [(1, b"a" * 300), [b"x"], (2, b"b")]
    for cut in range(len(stream) + 1):  # what one recv may have delivered so far
        buf = bytearray(stream[:cut])
        got, pos = native.zmtp_split(buf, 0, len(buf), 100, MAX_FRAME)
        assert got == expected[:len(got)]
        if got:  # it stops right after the last whole message it took
            assert pos == len(b"".join([live(1, b"a" * 300), frame(b"x"), live(2, b"b")][:len(got)]))
    buf = bytearray(stream)
    got, pos = native.zmtp_split(buf, 0, len(buf), 100, MAX_FRAME)
    assert got == expected and buf[pos] & 4  # stopped at the command: the caller handles it
    got, pos2 = native.zmtp_split(buf, 0, len(buf), 2, MAX_FRAME)
    assert got == expected[:2] and pos2 < pos  # at most `limit`


def test_split_rejects_oversized_frames_and_commands_inside_a_message():
    with pytest.raises(ValueError, match="frame of"):
        native.zmtp_split(bytearray(b"\x02" + (1 << 40).to_bytes(8, "big")), 0, 9, 10, MAX_FRAME)
    inside = bytearray(frame(b"", more=True) + frame(b"\x04PING\x00\x00", command=True))
    with pytest.raises(ValueError, match="command inside"):
        native.zmtp_split(inside, 0, len(inside), 10, MAX_FRAME)
    with pytest.raises(ValueError, match="bad range"):
        native.zmtp_split(bytearray(4), 0, 5, 10, MAX_FRAME)


def test_split_survives_random_and_mutated_bytes():
    """Whatever the bytes: messages, a stop, or ValueError; never a read past `end` (run under ASan by
    ./dev sanitize)."""
    rng = random.Random(14)
    good = live(1, b"a" * 300) + frame(b"x") + live(2, b"b") + frame(b"\x04PING\x00\x01", command=True)
    for i in range(3000):
        if i % 2:
            data = bytearray(rng.randbytes(rng.randrange(0, 64)))
        else:
            data = bytearray(good)
            for _ in range(rng.randrange(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            data = data[:rng.randrange(len(data) + 1)]
        end = len(data)
        data += b"\xff" * 16  # bytes past `end` must never be taken
        try:
            got, pos = native.zmtp_split(data, 0, end, 100, MAX_FRAME)
        except ValueError:
            continue
        assert 0 <= pos <= end
        for item in got:
            assert type(item) in (tuple, list)
            assert b"\xff" * 16 not in (item[1] if type(item) is tuple else b"".join(item))
