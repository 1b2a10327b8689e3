"""kvgate's own gRPC server: HTTP/2 (RFC 9113) and gRPC's message framing in one asyncio protocol on the
event loop that runs the pipeline (KVGATE_GRPC_SERVER=kvgate, the default).

Why: grpcio's asyncio server hands every event across three threads (gRPC's I/O thread reads the socket
and wakes its completion-queue poller through an eventfd, the poller wakes the event loop through a
socket, and each answer goes back the same way), so a request arriving at an idle replica pays a
thread's wake-up several times over before and after kvgate's own work (docs/BENCHMARKS.md, ## path).
Here the loop reads the socket, runs the call and writes the answer: one wake-up.

What it serves: the methods registered (`unary_unary`, `unary_stream`, `stream_stream`), each called as
grpcio's asyncio server calls a servicer's method (a request iterator or a request, and a context with
`abort`, `write`, `invocation_metadata`, `peer`, `cancelled`), so the same servicers run on either
server. The HTTP/2 it needs: the connection preface and SETTINGS, HEADERS and CONTINUATION through
plugin.hpack, DATA with flow control both ways (this side's windows large and replenished as bytes
arrive, the peer's respected, with data held until it opens them), RST_STREAM (the method's requests end,
or it is cancelled: _Call.peer_reset), PING, GOAWAY both ways, `grpc-timeout` as the call's
deadline. No compression (a compressed message is refused, UNIMPLEMENTED), no server push. A peer that
breaks the protocol gets GOAWAY with the HTTP/2 error code and its connection closed, logged (once per 10 s
and kind) and counted in kvgate_grpc_protocol_errors_total; its calls' requests end, no other connection is
touched. With TLS, a peer whose handshake fails (plaintext at a TLS port) is logged and counted too (`tls`).
"""
from __future__ import annotations

import asyncio
import logging
import ssl
import struct
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import grpc
from prometheus_client import CollectorRegistry, Counter

from plugin import hpack
from plugin.throttle import LogThrottle

log = logging.getLogger("kvgate.grpcserver")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0, 1, 2, 3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 5, 6, 7, 8, 9
SETTINGS_HEADER_TABLE_SIZE, SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE = 1, 4, 5
DEFAULT_WINDOW = 65_535
MAX_WINDOW = (1 << 31) - 1
DEFAULT_FRAME = 16_384
# This side's receive windows: bodies of several MiB (a request with images) arrive without waiting on an
# update; updates go out once half a window is used.
STREAM_WINDOW = 4 << 20
CONNECTION_WINDOW = 16 << 20
MAX_FRAME = 1 << 20  # the largest frame this side reads (announced)
MAX_HEADER_BLOCK = 1 << 20  # HEADERS + CONTINUATION of one block, at most
MAX_MESSAGE = (1 << 31) - 1  # gRPC's length field; Envoy's buffer limit bounds a body long before
# A connection silent this long gets a PING; one that leaves it unanswered as long again is closed, its calls'
# requests ended (a peer whose host was lost sends no FIN: without this its calls, each holding a routed request's
# running count, would wait for ever; grpcio's server pings after 2 hours)
KEEPALIVE_S = 30.0
_KEEPALIVE_PING = b"kvgate\x00\x00"
HANDSHAKE_TIMEOUT_S = 10.0  # a TLS peer's handshake must be done within this (asyncio's default: 60)
RESET_GRACE_S = 1.0  # a method whose requests ended with the peer's reset is cancelled if it runs on this long

_HEAD = struct.Struct(">IBI")  # length (24 bits) and type (8) in one, flags, stream id
_SETTING = struct.Struct(">HI")
_UINT = struct.Struct(">I")
_PREFIX = struct.Struct(">BI")  # a gRPC message: compressed flag, length

_CONTENT_TYPE = b"application/grpc"
_RESPONSE_HEADERS = hpack.encode([(":status", b"200"), ("content-type", _CONTENT_TYPE)])
_OK_TRAILERS = hpack.encode([("grpc-status", b"0")])
_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return _HEAD.pack((len(payload) << 8) | kind, flags, stream) + payload


def _status_block(code: int, details: str, with_headers: bool) -> bytes:
    """The trailers of a call that ended with `code` (the response's headers first: `with_headers`)."""
    if not code and not details:  # the usual end: made once
        return _RESPONSE_HEADERS + _OK_TRAILERS if with_headers else _OK_TRAILERS
    fields = [("grpc-status", str(code).encode())]
    if details:
        # gRPC's percent-encoding of grpc-message: printable ASCII but '%' kept, the rest as UTF-8 escapes
        fields.append(("grpc-message", quote(details, safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~").encode()))
    block = hpack.encode(fields)
    return _RESPONSE_HEADERS + block if with_headers else block


class ProtocolError(Exception):
    """The peer broke HTTP/2: the connection ends with GOAWAY carrying `code`."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason  # the counter's label


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


@dataclass(frozen=True)
class Method:
    """A registered method: its kind (unary_unary, unary_stream, stream_stream), how its requests are read
    and its answers written, and the servicer's handler."""
    kind: str
    deserialize: Callable[[bytes], Any]
    serialize: Callable[[Any], bytes]
    handler: Callable[..., Any]


class Context:
    """What a servicer's method may ask of its call (a subset of grpc.aio.ServicerContext)."""

    __slots__ = ("_call", "_code", "_details")

    def __init__(self, call: _Call) -> None:
        self._call = call
        self._code: grpc.StatusCode | None = None
        self._details = ""

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        raise _Abort(code, details)

    async def write(self, message: Any) -> None:
        self._call.send(message)

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return tuple((k, v) for k, v in self._call.headers if not k.startswith(":")
                     and k not in ("content-type", "te", "grpc-timeout"))

    def peer(self) -> str:
        return self._call.conn.peer

    def cancelled(self) -> bool:
        return self._call.reset

    def done(self) -> bool:
        return self._call.finished


class _Call:
    """One stream: its requests in, in order, as they complete, and its answers out under flow control."""

    __slots__ = ("conn", "id", "method", "headers", "inbox", "waiter", "ended", "reset", "finished", "task",
                 "partial", "window", "held", "headers_sent", "unacked", "timer")

    def __init__(self, conn: _Connection, stream_id: int, method: Method, headers: list[tuple[str, str]]) -> None:
        self.conn = conn
        self.id = stream_id
        self.method = method
        self.headers = headers
        self.inbox: deque[Any] = deque()
        self.waiter: asyncio.Future | None = None
        self.ended = False  # the peer sent END_STREAM
        self.reset = False  # the peer reset the stream, or the connection is gone
        self.finished = False
        self.task: asyncio.Task | None = None
        self.partial = bytearray()  # an incomplete message's bytes
        self.window = conn.peer_initial_window
        self.held: deque[bytes] = deque()  # DATA payloads (and then the trailers) waiting on a window
        self.headers_sent = False
        self.unacked = 0  # bytes received since this side last opened the stream's window
        self.timer: asyncio.TimerHandle | None = None

    # --- in ------------------------------------------------------------------------------
    def received(self, data: bytes, end: bool) -> None:
        if data:
            buf: bytes | bytearray = data
            if self.partial:
                self.partial += data
                buf = self.partial
            pos, size = 0, len(buf)
            while size - pos >= 5:
                compressed, length = _PREFIX.unpack_from(buf, pos)
                if compressed:
                    self.fail(grpc.StatusCode.UNIMPLEMENTED, "compressed messages are not accepted")
                    return
                if length > MAX_MESSAGE:
                    self.fail(grpc.StatusCode.RESOURCE_EXHAUSTED, f"a message of {length} bytes")
                    return
                if size - pos - 5 < length:
                    break
                body = bytes(buf[pos + 5:pos + 5 + length])
                pos += 5 + length
                try:
                    self.inbox.append(self.method.deserialize(body))
                except Exception as e:  # a message that does not parse: the call ends, the connection goes on
                    self.fail(grpc.StatusCode.INTERNAL, f"cannot parse the request message: {e}")
                    return
            if pos < size:
                self.partial = bytearray(buf[pos:])
            elif self.partial:
                self.partial = bytearray()
        if end:
            self.ended = True
            if self.partial:
                self.fail(grpc.StatusCode.INTERNAL, "the stream ended inside a message")
                return
        waiter = self.waiter
        if waiter is not None and (self.inbox or self.ended) and not waiter.done():
            waiter.set_result(None)

    async def requests(self) -> AsyncIterator[Any]:
        inbox = self.inbox
        while True:
            if inbox:
                yield inbox.popleft()
            elif self.ended:
                return
            else:
                self.waiter = asyncio.get_running_loop().create_future()
                try:
                    await self.waiter
                finally:
                    self.waiter = None

    async def _one(self) -> Any:
        async for request in self.requests():
            return request
        raise _Abort(grpc.StatusCode.INTERNAL, "the stream ended before its request")

    # --- the handler -----------------------------------------------------------------------
    async def run(self) -> None:
        m = self.method
        context = Context(self)
        code, details = grpc.StatusCode.OK, ""
        try:
            if m.kind == "stream_stream":
                async for answer in m.handler(self.requests(), context):
                    self.send(answer)
            elif m.kind == "unary_unary":
                answer = await m.handler(await self._one(), context)
                if answer is not None:
                    self.send(answer)
            else:  # unary_stream: an async generator, or a coroutine writing through the context
                result = m.handler(await self._one(), context)
                if hasattr(result, "__aiter__"):
                    async for answer in result:
                        self.send(answer)
                else:
                    answer = await result
                    if answer is not None:
                        self.send(answer)
            if context._code is not None:
                code, details = context._code, context._details
        except _Abort as e:
            code, details = e.code, e.details
        except asyncio.CancelledError:
            if self.reset or self.finished or self.conn.closed:
                return  # the peer is gone, or the call already ended with its status
            code, details = grpc.StatusCode.CANCELLED, "the server is stopping"
        except Exception as e:
            log.exception("gRPC %s: the method failed", m.handler)
            code, details = grpc.StatusCode.UNKNOWN, f"Unexpected {type(e).__name__}: {e}"
        finally:
            if self.timer is not None:
                self.timer.cancel()
        self.finish(code.value[0], details)

    def fail(self, code: grpc.StatusCode, details: str) -> None:
        """End the call from this side while its handler runs: the handler is cancelled, the peer told `code`."""
        if self.finished:
            return
        self.finish(code.value[0], details)
        if self.task is not None:
            self.task.cancel()

    def deadline(self) -> None:
        """The call's grpc-timeout passed: the peer is told DEADLINE_EXCEEDED, and the method's requests end as
        at a reset (as grpcio's server ends them)."""
        if self.finished:
            return
        self.timer = None
        self.finish(grpc.StatusCode.DEADLINE_EXCEEDED.value[0], "Deadline Exceeded")
        self._end_or_cancel()

    def peer_reset(self) -> None:
        """The peer reset the stream, as Envoy does to an ext_proc stream at the end of every HTTP request. As
        under grpcio: a method waiting for its next request sees its requests end and finishes as it would at
        their end (an ext_proc stream's release, a watched response's last word); one busy elsewhere is
        cancelled, and so is one still running RESET_GRACE_S after its requests ended."""
        self.reset = True
        if self.timer is not None:
            self.timer.cancel()
        self._end_or_cancel()

    def _end_or_cancel(self) -> None:
        self.ended = True
        task = self.task
        if task is None or task.done():
            return
        waiter = self.waiter
        if waiter is None:  # busy elsewhere than its requests
            task.cancel()
            return
        if not waiter.done():  # parked on its requests (or woken by the END_STREAM just before: Envoy sends both)
            waiter.set_result(None)
        self.timer = asyncio.get_running_loop().call_later(RESET_GRACE_S, task.cancel)

    # --- out -------------------------------------------------------------------------------
    def send(self, message: Any) -> None:
        if self.reset or self.finished:
            return
        body = self.method.serialize(message)
        payload = _PREFIX.pack(0, len(body)) + body
        conn = self.conn
        head = b""
        if not self.headers_sent:
            self.headers_sent = True
            head = _frame(HEADERS, END_HEADERS, self.id, conn.header_block(_RESPONSE_HEADERS))
        size = len(payload)
        if not self.held and size <= self.window and size <= conn.send_window and size <= conn.peer_max_frame:
            self.window -= size
            conn.send_window -= size
            conn.write(head + _frame(DATA, 0, self.id, payload))
            return
        if head:
            conn.write(head)
        self.held.append(payload)
        self.flush()

    def finish(self, code: int, details: str) -> None:
        """The call's status: the trailers (with the headers, if nothing was sent yet) after any data held."""
        if self.finished:
            return
        self.finished = True
        conn = self.conn
        if self.reset or conn.closed:
            conn.forget(self)
            return
        block = _status_block(code, details, not self.headers_sent)
        self.headers_sent = True
        self.held.append((block,))  # type: ignore[arg-type]
        self.flush()

    def flush(self) -> None:
        """Send what the windows allow of the held data, then the trailers once all data before them is out."""
        conn = self.conn
        out = []
        held = self.held
        while held:
            item = held[0]
            if type(item) is tuple:  # the trailers
                held.popleft()
                out.append(_frame(HEADERS, END_HEADERS | END_STREAM, self.id, conn.header_block(item[0])))
                if not self.ended:  # the peer may stop sending: what it still sends is dropped
                    self.reset = True
                    out.append(_frame(RST_STREAM, 0, self.id, _UINT.pack(NO_ERROR)))
                break
            room = min(self.window, conn.send_window, conn.peer_max_frame)
            if room <= 0:
                conn.blocked.add(self)
                break
            if len(item) <= room:
                held.popleft()
                chunk = item
            else:
                chunk, held[0] = item[:room], item[room:]
            self.window -= len(chunk)
            conn.send_window -= len(chunk)
            out.append(_frame(DATA, 0, self.id, chunk))
        if out:
            conn.write(b"".join(out))
        if not held:
            conn.blocked.discard(self)
            if self.finished:
                conn.forget(self)


class _Connection(asyncio.Protocol):
    """One client connection: frames in, calls started and fed, answers written."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.buffer = bytearray()
        self.preface = False
        self.calls: dict[int, _Call] = {}
        self.last_stream = 0
        self.decoder = hpack.Decoder()
        self.send_window = DEFAULT_WINDOW
        self.peer_initial_window = DEFAULT_WINDOW
        self.peer_max_frame = DEFAULT_FRAME
        self.unacked = 0  # bytes received since this side last opened the connection's window
        self.block: tuple[int, int, bytearray] | None = None  # a header block awaiting CONTINUATION
        self.blocked: set[_Call] = set()  # calls with data held on a window
        self.going_away = False  # this side sent GOAWAY: no new streams
        self.peer_going_away = False
        self.closed = False
        # The peer changed its decoder's table size (SETTINGS_HEADER_TABLE_SIZE): the next header block sent
        # starts with a size update (to 0: this side's blocks never index, whatever the table holds).
        self.table_size_update = False
        self.heard = False  # a byte arrived since the keepalive's last look
        self.quiet_since = 0.0  # the loop's time at which the keepalive last found the peer heard
        self.pinged: float | None = None  # when the keepalive's PING went out, unanswered as yet

    # --- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.peer = _peer_name(transport)
        self.quiet_since = asyncio.get_running_loop().time()
        settings = b"".join(_SETTING.pack(k, v) for k, v in (
            (SETTINGS_INITIAL_WINDOW_SIZE, STREAM_WINDOW), (SETTINGS_MAX_FRAME_SIZE, MAX_FRAME)))
        transport.write(_frame(SETTINGS, 0, 0, settings)
                        + _frame(WINDOW_UPDATE, 0, 0, _UINT.pack(CONNECTION_WINDOW - DEFAULT_WINDOW)))
        self.server._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server._connections.discard(self)
        self._cancel_calls()

    def _cancel_calls(self) -> None:
        """The connection is gone: every call's requests end as at a reset (as under grpcio; Server.stop
        cancels what outlives its grace itself)."""
        for call in list(self.calls.values()):
            call.peer_reset()
        self.calls.clear()
        self.blocked.clear()
        self.server._idle_check()

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self.heard = True
        buf = self.buffer
        buf += data
        try:
            pos = 0
            if not self.preface:
                if len(buf) < len(PREFACE):
                    if not PREFACE.startswith(bytes(buf)):
                        raise ProtocolError(PROTOCOL_ERROR, "preface", "not an HTTP/2 connection preface")
                    return
                if buf[:len(PREFACE)] != PREFACE:
                    raise ProtocolError(PROTOCOL_ERROR, "preface", "not an HTTP/2 connection preface")
                self.preface = True
                pos = len(PREFACE)
            size = len(buf)
            while size - pos >= 9:
                length_kind, flags, stream = _HEAD.unpack_from(buf, pos)
                length = length_kind >> 8
                if length > MAX_FRAME:
                    raise ProtocolError(FRAME_SIZE_ERROR, "frame_size", f"a frame of {length} bytes")
                end = pos + 9 + length
                if end > size:
                    break
                payload = bytes(buf[pos + 9:end])
                pos = end
                self._frame(length_kind & 0xFF, flags, stream & 0x7FFFFFFF, payload)
                if self.closed:
                    return
            del buf[:pos]
        except ProtocolError as e:
            self._abandon(e)
        except hpack.HpackError as e:
            self._abandon(ProtocolError(COMPRESSION_ERROR, "compression", str(e)))
        except Exception as e:  # a defect here: this connection ends, the others go on
            log.exception("gRPC connection from %s: failed reading its frames", self.peer)
            self._abandon(ProtocolError(INTERNAL_ERROR, "internal", f"{type(e).__name__}: {e}"))

    # --- frames --------------------------------------------------------------------------------
    def _frame(self, kind: int, flags: int, stream: int, payload: bytes) -> None:
        if self.block is not None and kind != CONTINUATION:
            raise ProtocolError(PROTOCOL_ERROR, "continuation", "a frame inside a header block")
        if kind == DATA:
            self._data(flags, stream, payload)
        elif kind == HEADERS:
            if stream == 0:
                raise ProtocolError(PROTOCOL_ERROR, "stream_zero", "HEADERS on stream 0")
            payload = _unpad(flags, payload)
            if flags & PRIORITY_FLAG:
                payload = payload[5:]
            if flags & END_HEADERS:
                self._headers(stream, flags, payload)
            else:
                self.block = (stream, flags, bytearray(payload))
        elif kind == CONTINUATION:
            if self.block is None or self.block[0] != stream:
                raise ProtocolError(PROTOCOL_ERROR, "continuation", "CONTINUATION without its HEADERS")
            self.block[2].extend(payload)
            if len(self.block[2]) > MAX_HEADER_BLOCK:
                raise ProtocolError(PROTOCOL_ERROR, "header_size", "a header block over 1 MiB")
            if flags & END_HEADERS:
                stream, first_flags, block = self.block
                self.block = None
                self._headers(stream, first_flags, bytes(block))
        elif kind == SETTINGS:
            self._settings(flags, stream, payload)
        elif kind == WINDOW_UPDATE:
            self._window_update(stream, payload)
        elif kind == PING:
            if len(payload) != 8 or stream:
                raise ProtocolError(FRAME_SIZE_ERROR, "ping", "a malformed PING")
            if not flags & ACK:
                self.write(_frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            if len(payload) != 4 or stream == 0:
                raise ProtocolError(PROTOCOL_ERROR, "rst_stream", "a malformed RST_STREAM")
            call = self.calls.pop(stream, None)
            if call is not None:
                self.blocked.discard(call)
                call.peer_reset()
                self.server._idle_check()
            elif stream > self.last_stream:
                raise ProtocolError(PROTOCOL_ERROR, "idle_stream", "RST_STREAM on an idle stream")
        elif kind == GOAWAY:
            self.peer_going_away = True
            if not self.calls:
                self._close()
        elif kind == PUSH_PROMISE:
            raise ProtocolError(PROTOCOL_ERROR, "push_promise", "PUSH_PROMISE from a client")
        # PRIORITY and unknown kinds: ignored (RFC 9113 5.5)

    def _data(self, flags: int, stream: int, payload: bytes) -> None:
        if stream == 0:
            raise ProtocolError(PROTOCOL_ERROR, "stream_zero", "DATA on stream 0")
        length = len(payload)
        self.unacked += length
        if self.unacked >= CONNECTION_WINDOW // 2:
            self.write(_frame(WINDOW_UPDATE, 0, 0, _UINT.pack(self.unacked)))
            self.unacked = 0
        call = self.calls.get(stream)
        if call is None or call.reset or call.ended:
            if stream > self.last_stream:
                raise ProtocolError(PROTOCOL_ERROR, "idle_stream", "DATA on an idle stream")
            return  # a stream this side closed or reset: its late data is dropped
        end = bool(flags & END_STREAM)
        call.unacked += length
        if call.unacked >= STREAM_WINDOW // 2 and not end:
            self.write(_frame(WINDOW_UPDATE, 0, stream, _UINT.pack(call.unacked)))
            call.unacked = 0
        call.received(_unpad(flags, payload), end)

    def _headers(self, stream: int, flags: int, block: bytes) -> None:
        headers = self.decoder.decode(block)  # always: the table must follow every block
        call = self.calls.get(stream)
        if call is not None:  # trailers from the client: only their END_STREAM matters
            if flags & END_STREAM:
                call.received(b"", True)
            return
        if stream <= self.last_stream or not stream & 1:
            if stream <= self.last_stream:
                return  # a stream already closed here: its late trailers are dropped
            raise ProtocolError(PROTOCOL_ERROR, "stream_id", f"a new stream with the id {stream}")
        self.last_stream = stream
        if self.going_away or self.server.refusing:
            self.write(_frame(RST_STREAM, 0, stream, _UINT.pack(REFUSED_STREAM)))
            return
        path = method_name = content_type = ""
        timeout = None
        for name, value in headers:
            if name == ":path":
                path = value
            elif name == ":method":
                method_name = value
            elif name == "content-type":
                content_type = value
            elif name == "grpc-timeout":
                timeout = value
        method = self.server.methods.get(path)
        if method_name != "POST" or not content_type.startswith("application/grpc"):
            self._refuse(stream, grpc.StatusCode.INTERNAL, "not a gRPC request")
            return
        if method is None:
            self._refuse(stream, grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
            return
        call = _Call(self, stream, method, headers)
        self.calls[stream] = call
        if flags & END_STREAM:
            call.ended = True
        call.task = asyncio.get_running_loop().create_task(call.run())
        if timeout is not None:
            seconds = _timeout(timeout)
            if seconds is not None:
                call.timer = asyncio.get_running_loop().call_later(seconds, call.deadline)

    def _refuse(self, stream: int, code: grpc.StatusCode, details: str) -> None:
        out = _frame(HEADERS, END_HEADERS | END_STREAM, stream,
                     self.header_block(_status_block(code.value[0], details, True)))
        self.write(out + _frame(RST_STREAM, 0, stream, _UINT.pack(NO_ERROR)))

    def _settings(self, flags: int, stream: int, payload: bytes) -> None:
        if stream:
            raise ProtocolError(PROTOCOL_ERROR, "settings", "SETTINGS on a stream")
        if flags & ACK:
            return
        if len(payload) % 6:
            raise ProtocolError(FRAME_SIZE_ERROR, "settings", "a SETTINGS frame of a length not a multiple of 6")
        for pos in range(0, len(payload), 6):
            key, value = _SETTING.unpack_from(payload, pos)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ProtocolError(FLOW_CONTROL_ERROR, "settings", "an initial window over 2^31-1")
                delta = value - self.peer_initial_window
                self.peer_initial_window = value
                for call in self.calls.values():
                    call.window += delta
            elif key == SETTINGS_HEADER_TABLE_SIZE:
                self.table_size_update = True
            elif key == SETTINGS_MAX_FRAME_SIZE:
                if not DEFAULT_FRAME <= value <= (1 << 24) - 1:
                    raise ProtocolError(PROTOCOL_ERROR, "settings", f"a max frame size of {value}")
                self.peer_max_frame = value
        self.write(_frame(SETTINGS, ACK, 0))
        self._unblock()

    def _window_update(self, stream: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ProtocolError(FRAME_SIZE_ERROR, "window_update", "a malformed WINDOW_UPDATE")
        increment = _UINT.unpack(payload)[0] & 0x7FFFFFFF
        if stream == 0:
            if increment == 0 or self.send_window + increment > MAX_WINDOW:
                raise ProtocolError(FLOW_CONTROL_ERROR, "window_update", "a bad connection window update")
            self.send_window += increment
            self._unblock()
            return
        call = self.calls.get(stream)
        if call is None:
            return
        if increment == 0 or call.window + increment > MAX_WINDOW:
            call.fail(grpc.StatusCode.INTERNAL, "a bad stream window update")
            return
        call.window += increment
        if call.held:
            call.flush()

    def _unblock(self) -> None:
        for call in list(self.blocked):
            if self.send_window <= 0:
                break
            call.flush()

    # --- out and end ---------------------------------------------------------------------------
    def header_block(self, block: bytes) -> bytes:
        """`block` as the next header block sent: after a size update when the peer's SETTINGS asked for one."""
        if self.table_size_update:
            self.table_size_update = False
            return b"\x20" + block
        return block

    def write(self, data: bytes) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(data)

    def forget(self, call: _Call) -> None:
        if self.calls.get(call.id) is call:
            del self.calls[call.id]
        self.blocked.discard(call)
        if not self.calls and (self.peer_going_away or self.going_away):
            self._close()
        self.server._idle_check()

    def keep_alive(self, now: float, period: float) -> None:
        """The keepalive's look (Server._keep_alive): a PING once the peer has been silent for `period`, the
        connection closed once that PING is `period` old without a byte from the peer since."""
        if self.heard:
            self.heard = False
            self.quiet_since = now
            self.pinged = None
        elif self.pinged is None:
            if now - self.quiet_since >= period:
                self.pinged = now
                self.write(_frame(PING, 0, 0, _KEEPALIVE_PING))
        elif now - self.pinged >= period:
            self.server.log_throttle.log(log, logging.WARNING, "keepalive", "gRPC connection from %s: no answer to "
                                         "a PING in %.3g s; closing it (its %d calls end)", self.peer, period,
                                         len(self.calls))
            self.server.keepalive_closes.inc()
            self._close(abort=True)

    def go_away(self) -> None:
        if not self.going_away and not self.closed:
            self.going_away = True
            self.write(_frame(GOAWAY, 0, 0, _UINT.pack(self.last_stream) + _UINT.pack(NO_ERROR)))
            if not self.calls:
                self._close()

    def _abandon(self, e: ProtocolError) -> None:
        self.server.peer_broke(e.reason, self.peer, f"{e}; closing it (HTTP/2 error {e.code})")
        self.write(_frame(GOAWAY, 0, 0, _UINT.pack(self.last_stream) + _UINT.pack(e.code)))
        self._close()

    def _close(self, abort: bool = False) -> None:
        """Close the connection (`abort`: without flushing what is written, as to a peer that reads no more)."""
        if self.transport is not None and not self.closed:
            self.closed = True
            if abort:
                self.transport.abort()
            else:
                self.transport.close()  # connection_lost follows, from the loop
            self._cancel_calls()


class _Handshake(asyncio.Protocol):
    """A TLS connection until its handshake is done (loop.start_tls), then its _Connection's. asyncio's own TLS
    server drops a failed handshake unseen (logged only in the loop's debug mode), so a peer speaking plaintext
    at a TLS port (Envoy's cluster for kvgate without its TLS transport socket, a health check) is counted here
    (reason `tls`) and logged as a broken HTTP/2 peer is. Reading waits until start_tls takes the socket, so
    the peer's first bytes are the TLS layer's."""

    def __init__(self, server: Server, tls: Callable[[], ssl.SSLContext]) -> None:
        self.server = server
        self.tls = tls  # the context for this connection, as the certificate is now

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.pause_reading()
        task = asyncio.get_running_loop().create_task(self._handshake(transport))
        self.server._handshakes.add(task)
        task.add_done_callback(self.server._handshakes.discard)

    async def _handshake(self, transport: asyncio.Transport) -> None:
        conn = _Connection(self.server)
        context = self.tls()
        try:
            secure = await asyncio.get_running_loop().start_tls(
                transport, conn, context, server_side=True, ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S)
        except ssl.SSLError as e:  # the peer spoke, but not TLS (or not a TLS this side accepts)
            self.server.peer_broke("tls", _peer_name(transport), f"TLS handshake failed ({e.reason or e}); closing it")
            transport.abort()
            return
        except (OSError, asyncio.TimeoutError):  # gone before a word, or mute
            transport.abort()
            return
        except asyncio.CancelledError:  # the server stops
            transport.abort()
            raise
        if secure is None:  # the peer closed as the handshake ended
            return
        conn.connection_made(secure)


def _peer_name(transport: asyncio.BaseTransport) -> str:
    """The peer as grpcio names it."""
    peername = transport.get_extra_info("peername")
    if isinstance(peername, tuple):
        host = peername[0]
        return f"ipv6:[{host}]:{peername[1]}" if ":" in host else f"ipv4:{host}:{peername[1]}"
    return f"unix:{peername}"


def _unpad(flags: int, payload: bytes) -> bytes:
    if not flags & PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        raise ProtocolError(PROTOCOL_ERROR, "padding", "padding as long as the frame")
    return payload[1:len(payload) - payload[0]]


def _timeout(value: str) -> float | None:
    unit = _TIMEOUT_UNITS.get(value[-1:])
    digits = value[:-1]
    if unit is None or not digits.isdigit() or len(digits) > 8:
        return None  # malformed: ignored, as no deadline
    return int(digits) * unit


class Server:
    """The methods by path (`/package.Service/Method`) on the sockets `listen` opened."""

    def __init__(self, registry: CollectorRegistry | None = None, protocol_errors: Counter | None = None,
                 keepalive_s: float = KEEPALIVE_S) -> None:
        if not keepalive_s > 0:
            raise ValueError("keepalive_s must be positive")
        self.keepalive_s = keepalive_s
        self._keepalive: asyncio.Task | None = None
        self.methods: dict[str, Method] = {}
        self._servers: list[asyncio.base_events.Server] = []
        self._connections: set[_Connection] = set()
        self._handshakes: set[asyncio.Task] = set()  # TLS connections not yet through their handshake
        self.refusing = False
        self._terminated = asyncio.Event()
        self._idle = asyncio.Event()
        # another server's counter (kvgate's health port counts on its ext_proc port's), or one in `registry`
        self.protocol_errors = protocol_errors if protocol_errors is not None else Counter(
            "kvgate_grpc_protocol_errors", "gRPC connections kvgate closed because the peer broke HTTP/2, by what "
            "it broke", ["reason"], registry=registry)
        # a series from the start for the reason a misconfigured peer gives (TLS or HTTP/1 at a plaintext
        # gRPC port), so that its first occurrence shows in increase() too
        self.protocol_errors.labels("preface")
        # (not registered without `registry`: the health port's peers are probes, connections of a moment)
        self.keepalive_closes = Counter(
            "kvgate_grpc_keepalive_closes", "gRPC connections kvgate closed because the peer answered no keepalive "
            "PING (KVGATE_GRPC_KEEPALIVE_S): a gateway host lost without closing them; their calls ended, and the "
            "running counts of their requests were released", registry=registry)
        self.log_throttle = LogThrottle(10.0)  # a peer repeating its error is logged once per 10 s and reason

    def peer_broke(self, reason: str, peer: str, what: str) -> None:
        """A connection closed because its peer broke the protocol (`reason`, its label): counted, and logged
        once per 10 s and reason."""
        self.protocol_errors.labels(reason).inc()
        self.log_throttle.log(log, logging.WARNING, reason, "gRPC connection from %s: %s", peer, what)

    def add(self, service: str, methods: dict[str, Method]) -> None:
        for name, method in methods.items():
            self.methods[f"/{service}/{name}"] = method

    async def listen(self, host: str, port: int, tls: ssl.SSLContext | Callable[[], ssl.SSLContext] | None = None
                     ) -> int:
        """Listen on `host`:`port` (0: a free port); the port listened on. OSError when it cannot. With `tls`, TLS
        with that context, or the one it gives at each new connection (a certificate read again once renewed)."""
        factory: Callable[[], asyncio.Protocol] = lambda: _Connection(self)  # noqa: E731
        if tls is not None:
            current = tls if callable(tls) else (lambda: tls)
            factory = lambda: _Handshake(self, current)  # noqa: E731
            self.protocol_errors.labels("tls")  # its series from the start, as `preface`'s
        server = await asyncio.get_running_loop().create_server(factory, host or None, port, reuse_port=False)
        self._servers.append(server)
        if self._keepalive is None:
            self._keepalive = asyncio.get_running_loop().create_task(self._keep_alive())
        return server.sockets[0].getsockname()[1]

    async def _keep_alive(self) -> None:
        """Every quarter of keepalive_s, each connection's keepalive look (_Connection.keep_alive): a silent peer
        pinged after 1-1.25 periods, closed 1-1.25 periods after that."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.keepalive_s / 4)
            now = loop.time()
            for conn in list(self._connections):
                conn.keep_alive(now, self.keepalive_s)

    def _idle_check(self) -> None:
        if self.refusing and not any(c.calls for c in self._connections):
            self._idle.set()

    async def stop(self, grace: float | None) -> None:
        """Refuse new streams (GOAWAY), give those in flight `grace` seconds, then cancel them and close."""
        self.refusing = True
        for server in self._servers:
            server.close()
        if self._keepalive is not None:
            self._keepalive.cancel()
        for handshake in list(self._handshakes):
            handshake.cancel()
        for conn in list(self._connections):
            conn.go_away()
        self._idle_check()
        if grace:
            try:
                await asyncio.wait_for(self._idle.wait(), grace)
            except asyncio.TimeoutError:
                pass
        tasks = [call.task for conn in list(self._connections) for call in list(conn.calls.values())
                 if call.task is not None]
        for conn in list(self._connections):
            conn._close()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for server in self._servers:
            await server.wait_closed()
        self._terminated.set()

    async def wait_for_termination(self) -> None:
        await self._terminated.wait()


def tls_context(cert: bytes, key: bytes) -> ssl.SSLContext:
    """A server TLS context offering HTTP/2 (ALPN h2) with this certificate and key (PEM)."""
    import os
    import tempfile
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["h2"])
    with tempfile.TemporaryDirectory() as tmp:  # the ssl module loads certificates from files only
        cert_path, key_path = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
        with open(cert_path, "wb") as f:
            f.write(cert)
        with open(os.open(key_path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
            f.write(key)
        ctx.load_cert_chain(cert_path, key_path)
    return ctx


def ext_proc_methods(servicer: Any) -> dict[str, Method]:
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    return {"Process": Method("stream_stream", pb.ProcessingRequest.FromString,
                              pb.ProcessingResponse.SerializeToString, servicer.Process)}


def health_methods(servicer: Any) -> dict[str, Method]:
    from grpc_health.v1 import health_pb2
    request, response = health_pb2.HealthCheckRequest.FromString, health_pb2.HealthCheckResponse.SerializeToString
    return {"Check": Method("unary_unary", request, response, servicer.Check),
            "Watch": Method("unary_stream", request, response, servicer.Watch)}


EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICE = "grpc.health.v1.Health"
