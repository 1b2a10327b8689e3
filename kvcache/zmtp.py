"""A ZMTP 3 SUB peer on a plain non-blocking TCP socket (NULL security), for the ingest thread.

Why not libzmq's SUB socket: libzmq reads every TCP socket on its own I/O thread, which wakes
once per message and hands it over through a pipe and a mailbox; following three engines at
~1000 one-block batches/s cost that thread 16-23 us per batch and the ingest thread's zmq_poll
and recv calls another ~30 (bench ingest). Read here, the ingest thread takes every message
that queued meanwhile with one recv() per engine per wake-up.

What it speaks (rfc.zeromq.org 23/ZMTP, 37/ZMTP): the 64-byte greeting announcing 3.1 and
NULL and a READY command with Socket-Type SUB; once the peer's READY (PUB or XPUB) has come, the
subscription to everything as a message starting with 1 (accepted from 3.0 and 3.1 peers);
frames with short or long sizes; PING (answered by libzmq with PONG) for dead-peer detection;
a PING from the peer is answered. The caller owns the socket's polling; `feed` parses.
"""
from __future__ import annotations

import errno
import socket

from kvcache.native import native

zmtp_split = native.zmtp_split

SIGNATURE_END = 0x7F
GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x01" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
_PEER_TYPES = (b"PUB", b"XPUB")
MAX_FRAME = 1 << 28  # a frame announcing more (256 MiB) is not a KV event batch: the connection is dropped
RECV_BYTES = 1 << 16  # the read buffer's size (grown for a larger frame); recv_into, never recv(n):
# recv(n) allocates n bytes per call (past 128 KiB an mmap and munmap each time)


class ProtocolError(Exception):
    """The peer does not speak ZMTP 3 as a PUB: the connection is dropped (and retried)."""


def _command(name: bytes, body: bytes = b"") -> bytes:
    data = bytes((len(name),)) + name + body
    if len(data) < 256:
        return bytes((0x04, len(data))) + data
    return b"\x06" + len(data).to_bytes(8, "big") + data


READY = _command(b"READY", b"\x0bSocket-Type" + (3).to_bytes(4, "big") + b"SUB")
SUBSCRIBE_ALL = b"\x00\x01\x01"  # one frame, one byte: 1 (subscribe), empty topic


def ping(ttl_s: float) -> bytes:
    return _command(b"PING", min(0xFFFF, int(ttl_s * 10)).to_bytes(2, "big"))


def _properties(body: bytes) -> dict[bytes, bytes]:
    out, i = {}, 0
    while i < len(body):
        n = body[i]
        name = body[i + 1:i + 1 + n]
        i += 1 + n
        if i + 4 > len(body):
            raise ProtocolError("truncated READY property")
        size = int.from_bytes(body[i:i + 4], "big")
        out[name.lower()] = body[i + 4:i + 4 + size]
        i += 4 + size
    if i != len(body):
        raise ProtocolError("truncated READY property")
    return out


class Connection:
    """One TCP connection to an engine's PUB socket. States: connecting -> greeting -> ready."""

    __slots__ = ("sock", "state", "_buf", "_view", "_pos", "_end", "_out", "bytes_in")

    def __init__(self, addr: tuple, family: int) -> None:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setblocking(False)
        self.sock = sock
        self.state = "connecting"
        self._buf = bytearray(RECV_BYTES)
        self._view = memoryview(self._buf)
        self._pos = 0  # next byte to parse
        self._end = 0  # end of the bytes received
        self._out = b""
        self.bytes_in = 0  # bytes received so far (any traffic counts as a sign of life)
        err = sock.connect_ex(addr)
        if err not in (0, errno.EINPROGRESS, errno.EAGAIN):
            sock.close()
            raise OSError(err, f"connect: {errno.errorcode.get(err, err)}")

    def fileno(self) -> int:
        return self.sock.fileno()

    @property
    def wants_write(self) -> bool:
        return self.state == "connecting" or bool(self._out)

    def close(self) -> None:
        self.state = "closed"
        self.sock.close()
        self._view.release()

    def on_writable(self) -> None:
        """Connection established (or failed: OSError), or room for pending output."""
        if self.state == "connecting":
            err = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                raise OSError(err, f"connect: {errno.errorcode.get(err, err)}")
            self.state = "greeting"
            self.send(GREETING + READY)  # NULL: our READY needs no reply first
            return
        self.send(b"")

    def send(self, data: bytes) -> None:
        out = self._out + data
        if out:
            try:
                n = self.sock.send(out)
            except (BlockingIOError, InterruptedError):
                n = 0
            self._out = out[n:]

    def recv(self) -> bool:
        """Read what the socket holds into the buffer; False when the peer closed the connection
        (OSError on a reset)."""
        pos, end = self._pos, self._end
        if pos == end:
            pos = end = self._pos = self._end = 0
        elif end == len(self._buf):  # full: move the unparsed tail to the front, or grow
            n = end - pos
            if pos:
                self._buf[:n] = self._view[pos:end]
            else:
                grown = bytearray(2 * len(self._buf))
                grown[:n] = self._buf
                self._view.release()
                self._buf, self._view = grown, memoryview(grown)
            pos, end, self._pos, self._end = 0, n, 0, n
        try:
            got = self.sock.recv_into(self._view[end:])
        except (BlockingIOError, InterruptedError):
            return True
        if not got:
            return False
        self.bytes_in += got
        self._end = end + got
        return True

    def read(self, out: list) -> bool | None:
        """recv() then messages(out, no limit) in one call (the ingest thread's per wake-up read):
        None when the peer closed the connection (OSError on a reset, ProtocolError on a bad peer),
        else whether the handshake completed."""
        if self.state == "ready" and self._pos == self._end:  # the common case: everything read was parsed
            try:
                got = self.sock.recv_into(self._view)
            except (BlockingIOError, InterruptedError):
                return False
            if not got:
                return None
            self.bytes_in += got
            self._pos, self._end = 0, got
            try:
                msgs, pos = zmtp_split(self._buf, 0, got, 1 << 30, MAX_FRAME)
            except ValueError as e:
                raise ProtocolError(str(e)) from None
            out += msgs
            self._pos = pos
            if pos == got:
                return False
            # a command (a PING) or the start of a message still incomplete: the general way
        elif not self.recv():
            return None
        return self.messages(out, 1 << 30)

    def messages(self, out: list, limit: int) -> bool:
        """Append up to `limit` complete messages from the buffer to `out`: a live batch (three frames,
        an 8-byte second) as (seq, payload), any other as the list of its frames. True when the
        handshake completed during this call. Commands are handled here (PING answered)."""
        buf, pos, end = self._buf, self._pos, self._end
        became_ready = False
        if self.state == "greeting":
            if end - pos < 64:
                return False
            if buf[pos] != 0xFF or buf[pos + 9] != SIGNATURE_END:
                raise ProtocolError("not a ZMTP peer")
            if buf[pos + 10] < 3:
                raise ProtocolError(f"ZMTP version {buf[pos + 10]} (3 needed)")
            if buf[pos + 12:pos + 32].rstrip(b"\x00") != b"NULL":
                raise ProtocolError("security mechanism other than NULL")
            pos += 64
            self.state = "handshake"
        n = 0
        while True:
            if self.state == "ready":
                try:
                    got, pos = zmtp_split(buf, pos, end, limit - n, MAX_FRAME)
                except ValueError as e:
                    self._pos = pos
                    raise ProtocolError(str(e)) from None
                out += got
                n += len(got)
                if n >= limit:
                    break
            # One frame the slow way: a command (the handshake's READY, a PING...), if one is complete.
            if end - pos < 2:
                break
            flags = buf[pos]
            if flags & 0x02:
                if end - pos < 9:
                    break
                size = int.from_bytes(buf[pos + 1:pos + 9], "big")
                head = 9
            else:
                size = buf[pos + 1]
                head = 2
            if size > MAX_FRAME:
                raise ProtocolError(f"frame of {size} bytes")
            if end - pos < head + size:
                break
            if not flags & 0x04:
                if self.state == "ready":  # zmtp_split stopped before it: the rest of this message is still to come
                    break
                raise ProtocolError("message before READY")
            body = self._view[pos + head:pos + head + size].tobytes()
            pos += head + size
            if self._command(body):
                became_ready = True
        self._pos = pos
        return became_ready

    def _command(self, body: bytes) -> bool:
        if not body:
            raise ProtocolError("empty command")
        name = body[1:1 + body[0]]
        if self.state == "handshake":
            if name != b"READY":
                raise ProtocolError(f"{name!r} before READY")
            peer = _properties(body[1 + body[0]:]).get(b"socket-type")
            if peer not in _PEER_TYPES:
                raise ProtocolError(f"peer socket type {peer!r}, not PUB")
            self.state = "ready"
            # Only now: libzmq drops a connection whose first read holds the end of the greeting, READY
            # and a message together (seen with libzmq 4.3.5).
            self.send(SUBSCRIBE_ALL)
            return True
        if name == b"PING":  # ttl (2 bytes), then a context to echo
            self.send(_command(b"PONG", body[1 + body[0] + 2:]))
        elif name == b"ERROR":
            reason = body[2 + body[0]:]
            raise ProtocolError(f"peer error {reason[:64]!r}")
        return False  # PONG and anything else: a sign of life, nothing to do
