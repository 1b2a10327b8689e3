"""plugin.grpcserver, kvgate's own gRPC server: grpcio's client against it for every kind of method (streams,
unary, server streams), status codes, cancels, deadlines, large messages both ways, many streams at once,
TLS and a graceful stop; and a raw socket for what a client library never sends (broken frames, a bad
preface, a compressed message, a small window)."""
from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from plugin import grpcserver, hpack
from plugin.grpcserver import Server
from plugin.tls import self_signed
from helpers import wait_until_async


class Echo:
    """A processor answering each request with its body's bytes in the answer's dynamic metadata; a body of
    b"fail" raises, b"big:N" answers N bytes, b"hang" waits forever, b"linger" waits forever once the requests
    end."""

    def __init__(self) -> None:
        self.cancelled = 0
        self.finished = 0
        self.ended = 0  # requests that ended (before anything else)

    async def Process(self, requests, context):  # noqa: N802
        linger = False
        try:
            async for msg in requests:
                body = msg.request_body.body
                linger = linger or body == b"linger"
                if body == b"fail":
                    raise RuntimeError("the processor broke")
                if body == b"hang":
                    await asyncio.sleep(3600)
                if body.startswith(b"big:"):
                    body = b"z" * int(body[4:])
                yield pb.ProcessingResponse(
                    request_body=pb.BodyResponse(response=pb.CommonResponse(body_mutation=pb.BodyMutation(body=body))))
            self.ended += 1
            if linger:
                await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.finished += 1


def _body(data: bytes) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=True))


def _answer(r: pb.ProcessingResponse) -> bytes:
    return r.request_body.response.body_mutation.body


@pytest.fixture
async def served():
    """(server, port, echo, health servicer, registry); stopped after the test."""
    registry = CollectorRegistry()
    server = Server(registry)
    echo = Echo()
    healthy = health.aio.HealthServicer()
    await healthy.set("readiness", health_pb2.HealthCheckResponse.SERVING)
    server.add(grpcserver.EXT_PROC_SERVICE, grpcserver.ext_proc_methods(echo))
    server.add(grpcserver.HEALTH_SERVICE, grpcserver.health_methods(healthy))
    port = await server.listen("127.0.0.1", 0)
    yield server, port, echo, healthy, registry
    await server.stop(0)


async def test_a_stream_answers_each_request_in_order(served):
    _, port, echo, _, _ = served
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        call = stub.Process()
        for i in range(5):
            await call.write(_body(f"m{i}".encode()))
            assert _answer(await call.read()) == f"m{i}".encode()
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
    assert echo.finished == 1


async def test_messages_of_8_mib_go_both_ways_under_flow_control(served):
    _, port, _, _, _ = served
    big = bytes(range(256)) * (8 << 12)  # 8 MiB: past both windows of each side
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[
            ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]) as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)

        async def requests():
            yield _body(big)
            yield _body(b"big:%d" % (9 << 20))
        answers = [_answer(r) async for r in stub.Process(requests())]
    assert answers[0] == big and answers[1] == b"z" * (9 << 20)


async def test_many_streams_at_once_on_one_connection(served):
    _, port, echo, _, _ = served
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)

        async def one(i: int) -> bytes:
            answers = [_answer(r) async for r in stub.Process(iter([_body(b"%d" % i)]))]
            return answers[0]
        got = await asyncio.gather(*(one(i) for i in range(300)))
    assert got == [b"%d" % i for i in range(300)]
    assert echo.finished == 300


async def test_a_failing_method_ends_its_call_unknown_and_the_connection_serves_on(served):
    _, port, _, _, _ = served
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            [r async for r in stub.Process(iter([_body(b"fail")]))]
        assert e.value.code() == grpc.StatusCode.UNKNOWN and "the processor broke" in e.value.details()
        assert [_answer(r) async for r in stub.Process(iter([_body(b"ok")]))] == [b"ok"]


async def test_a_clients_cancel_cancels_the_method(served):
    _, port, echo, _, _ = served
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process()
        await call.write(_body(b"hang"))
        await asyncio.sleep(0.1)
        call.cancel()
        await wait_until_async(lambda: echo.cancelled == 1, timeout=5)


async def test_a_deadline_ends_the_call_on_the_server_too(served):
    _, port, echo, _, _ = served
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        # connected first, and a second for the write: the deadline, counted from the call's start, must pass
        # after the server has the body (at 0.3 s, from an unconnected channel, it once passed during the write
        # on a loaded CI machine)
        await channel.channel_ready()
        call = pb_grpc.ExternalProcessorStub(channel).Process(timeout=1.0)
        await call.write(_body(b"hang"))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call.read()
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await wait_until_async(lambda: echo.cancelled == 1, timeout=5)


async def test_health_check_watch_and_an_unknown_service(served):
    _, port, _, healthy, _ = served
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        answer = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"))
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.Check(health_pb2.HealthCheckRequest(service="nothing"))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        watch = stub.Watch(health_pb2.HealthCheckRequest(service="readiness"))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        await healthy.set("readiness", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        watch.cancel()


async def test_an_unknown_method_is_unimplemented(served):
    _, port, _, _, _ = served
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        method = channel.unary_unary("/no.Such/Method", request_serializer=lambda b: b,
                                     response_deserializer=lambda b: b)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await method(b"")
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_tls_with_alpn_h2():
    cert, key = self_signed()
    server = Server()
    healthy = health.aio.HealthServicer()
    server.add(grpcserver.HEALTH_SERVICE, grpcserver.health_methods(healthy))
    port = await server.listen("127.0.0.1", 0, grpcserver.tls_context(cert, key))
    try:
        creds = grpc.ssl_channel_credentials(root_certificates=cert)
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds) as channel:
            answer = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""))
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(0)


async def test_a_plaintext_peer_at_a_tls_port_is_counted_and_logged_and_tls_peers_go_on(caplog):
    """HTTP/2 in plaintext (Envoy's cluster for kvgate without its TLS transport socket) and HTTP/1 at a TLS port:
    each a failed handshake, counted under `tls` and logged with the peer; a peer that connects and leaves
    without a word is neither; a TLS client is served meanwhile."""
    cert, key = self_signed()
    registry = CollectorRegistry()
    server = Server(registry)
    echo = Echo()
    server.add(grpcserver.EXT_PROC_SERVICE, grpcserver.ext_proc_methods(echo))
    port = await server.listen("127.0.0.1", 0, grpcserver.tls_context(cert, key))
    try:
        assert registry.get_sample_value("kvgate_grpc_protocol_errors_total", {"reason": "tls"}) == 0  # exported

        async def send(data: bytes) -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(data)
            if not data:
                writer.write_eof()
            got = await asyncio.wait_for(reader.read(), 5)  # until the server closes
            writer.close()
            return got
        for data in (grpcserver.PREFACE + _frame(4, 0, 0), b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b""):
            await send(data)
        await wait_until_async(lambda: registry.get_sample_value(
            "kvgate_grpc_protocol_errors_total", {"reason": "tls"}) == 2, timeout=5)
        assert "gRPC connection from ipv4:127.0.0.1:" in caplog.text and "TLS handshake failed" in caplog.text
        creds = grpc.ssl_channel_credentials(root_certificates=cert)
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", creds) as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            assert [_answer(a) async for a in stub.Process(iter([_body(b"tls")]))] == [b"tls"]
        assert registry.get_sample_value("kvgate_grpc_protocol_errors_total", {"reason": "tls"}) == 2
    finally:
        await server.stop(0)


async def test_a_stop_ends_tls_handshakes_in_progress():
    """A peer connected to a TLS port that has sent nothing yet (its handshake pending, up to 10 s) does not
    hold up a stop: its connection is closed."""
    server = Server()
    port = await server.listen("127.0.0.1", 0, grpcserver.tls_context(*self_signed()))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await asyncio.sleep(0.05)
    await asyncio.wait_for(server.stop(0), 2)
    assert await asyncio.wait_for(reader.read(), 2) == b""  # closed
    writer.close()


async def test_a_graceful_stop_lets_calls_in_flight_finish_and_refuses_new_ones(served):
    server, port, echo, _, _ = served
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        call = stub.Process()
        await call.write(_body(b"a"))
        assert _answer(await call.read()) == b"a"
        stopping = asyncio.create_task(server.stop(5))
        await asyncio.sleep(0.1)
        await call.write(_body(b"b"))  # the call in flight goes on
        assert _answer(await call.read()) == b"b"
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
        await asyncio.wait_for(stopping, 5)  # done once the last call ended, not after the grace
        with pytest.raises(grpc.aio.AioRpcError) as e:
            [r async for r in stub.Process(iter([_body(b"c")]), timeout=2)]
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert echo.finished == 1


async def test_a_stop_cancels_what_outlives_the_grace(served):
    server, port, echo, _, _ = served
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = pb_grpc.ExternalProcessorStub(channel).Process()
        await call.write(_body(b"hang"))
        await asyncio.sleep(0.1)
        await asyncio.wait_for(server.stop(0.2), 5)
        assert echo.cancelled == 1
        with pytest.raises(grpc.aio.AioRpcError):
            await call.read()


# --- a raw socket: what no client library sends ---------------------------------------------------

def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">IBI", (len(payload) << 8) | kind, flags, stream) + payload


_REQUEST_HEADERS = hpack.encode([(":method", b"POST"), (":scheme", b"http"),
                                 (":path", b"/envoy.service.ext_proc.v3.ExternalProcessor/Process"),
                                 (":authority", b"x"), ("content-type", b"application/grpc"), ("te", b"trailers")])


class Raw:
    """A client speaking HTTP/2 by hand on a blocking socket (run in a thread); without `preface`, nothing is
    sent first. A context manager: the socket is closed on leaving."""

    def __init__(self, port: int, settings: bytes = b"", preface: bool = True) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        if preface:
            self.sock.sendall(grpcserver.PREFACE + _frame(4, 0, 0, settings))
        self.buf = b""

    def __enter__(self) -> Raw:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def frames(self, until) -> list[tuple[int, int, int, bytes]]:
        """Frames read until `until(frame)` is true for one (or the connection closed)."""
        out = []
        while True:
            while len(self.buf) >= 9:
                length_kind, flags, stream = struct.unpack_from(">IBI", self.buf)
                length = length_kind >> 8
                if len(self.buf) < 9 + length:
                    break
                frame = (length_kind & 0xFF, flags, stream, self.buf[9:9 + length])
                self.buf = self.buf[9 + length:]
                out.append(frame)
                if until(frame):
                    return out
            data = self.sock.recv(1 << 16)
            if not data:
                out.append((-1, 0, 0, b""))  # closed
                return out
            self.buf += data


def _message(msg: pb.ProcessingRequest, compressed: int = 0) -> bytes:
    body = msg.SerializeToString()
    return struct.pack(">BI", compressed, len(body)) + body


@pytest.mark.parametrize("send, code, reason", [
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"x" * 30, 1, "preface"),
    (_frame(0, 0, 3, b"x"), 1, "idle_stream"),  # DATA on a stream never opened
    (_frame(1, 4, 1, b"\xff"), 9, "compression"),  # a header block that ends inside an integer
    (_frame(0, 0, 0, b"x"), 1, "stream_zero"),
    (_frame(6, 0, 0, b"short"), 6, "ping"),
    (_frame(4, 0, 0, b"12345"), 6, "settings"),
    (_frame(1, 0, 1, _REQUEST_HEADERS) + _frame(6, 0, 0, b"8 bytes!"), 1, "continuation"),
    (struct.pack(">IBI", ((2 << 20) << 8) | 0, 0, 1), 6, "frame_size"),
])
async def test_a_peer_breaking_http2_gets_goaway_and_is_counted_and_others_go_on(served, send, code, reason):
    _, port, _, _, registry = served

    def broken() -> list:
        with Raw(port, preface=not send.startswith(b"GET")) as raw:
            raw.send(send)
            return raw.frames(lambda f: f[0] == 7)
    frames = await asyncio.to_thread(broken)
    goaway = [f for f in frames if f[0] == 7]
    assert goaway and struct.unpack(">I", goaway[0][3][4:8])[0] == code
    assert registry.get_sample_value("kvgate_grpc_protocol_errors_total", {"reason": reason}) == 1
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        assert [_answer(r) async for r in stub.Process(iter([_body(b"still")]))] == [b"still"]


def _mangled(r: random.Random) -> bytes:
    """An Envoy-like conversation (SETTINGS and its ACK, one to three streams each sending a message split
    across two DATA frames, some reset, a WINDOW_UPDATE, a PING) with one to four frames changed: their kind,
    flags, stream id or a payload byte changed, a payload cut short, a frame repeated or dropped; and in one
    in ten a byte of the whole changed, which may break a frame's length."""
    frames = [(4, 0, 0, b""), (4, 1, 0, b"")]
    for stream in (1, 3, 5)[:r.randrange(1, 4)]:
        message = _message(_body(r.randbytes(r.randrange(50))))
        cut = r.randrange(len(message) + 1)
        frames += [(1, 4, stream, _REQUEST_HEADERS), (0, 0, stream, message[:cut]), (0, 1, stream, message[cut:])]
        if r.random() < 0.5:
            frames.append((3, 0, stream, struct.pack(">I", 0)))
    frames += [(8, 0, 0, struct.pack(">I", 1000)), (6, 0, 0, b"pingpong")]
    for _ in range(r.randrange(1, 5)):
        i = r.randrange(len(frames))
        kind, flags, stream, payload = frames[i]
        change = r.randrange(7)
        if change == 0:
            kind = r.randrange(11)
        elif change == 1:
            flags = r.randrange(256)
        elif change == 2:
            stream = r.choice([0, 2, 7, 2**31 - 1, r.randrange(2**31)])
        elif change == 3 and payload:
            at = r.randrange(len(payload))
            payload = payload[:at] + bytes([r.randrange(256)]) + payload[at + 1:]
        elif change == 4:
            payload = payload[:r.randrange(len(payload) + 1)]
        elif change == 5:
            frames.insert(i, frames[i])
        else:
            del frames[i]
            continue
        frames[i] = (kind, flags, stream, payload)
    data = grpcserver.PREFACE + b"".join(_frame(*f) for f in frames)
    if r.random() < 0.1:
        at = r.randrange(len(grpcserver.PREFACE), len(data))
        data = data[:at] + bytes([r.randrange(256)]) + data[at + 1:]
    return data


async def test_mangled_conversations_are_counted_or_served_and_leave_nothing_behind(served):
    """120 seeded conversations at once, each with frames changed at random (_mangled), each read until the
    server closes or is quiet for 0.3 s: none is answered with an internal error (a bug of the
    server's), nothing raises on the loop, no call is left running, and a client after them is served."""
    server, port, echo, _, registry = served
    loop_errors: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, context: loop_errors.append(context))
    r = random.Random(26)
    conversations = [_mangled(r) for _ in range(120)]

    async def talk(data: bytes) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        with contextlib.suppress(OSError, TimeoutError):
            writer.write(data)
            while await asyncio.wait_for(reader.read(1 << 16), 0.3):
                pass
        writer.close()
    await asyncio.gather(*(talk(c) for c in conversations))
    errors = {s.labels["reason"]: s.value for m in registry.collect() for s in m.samples
              if s.name == "kvgate_grpc_protocol_errors_total"}
    assert "internal" not in errors and sum(errors.values()) >= 60, errors  # most changes break HTTP/2...
    assert echo.finished >= 30  # ...and the streams they left whole were served
    await wait_until_async(lambda: not any(c.calls for c in server._connections), timeout=5)
    assert echo.cancelled == 0 and not loop_errors, loop_errors[:3]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        assert [_answer(a) async for a in stub.Process(iter([_body(b"after")]))] == [b"after"]


async def test_a_peer_that_stops_answering_pings_is_closed_and_its_calls_end(caplog):
    """A peer gone without a word (its host lost: no FIN, no RST) leaves its calls parked on their requests, and
    each of Envoy's holds a routed request's running count. With keepalive_s 0.5: a connection silent that long
    gets a PING; one that does not answer it within as long again is closed and its calls' requests end, as at a
    lost connection, counted. A peer that answers (grpcio's client, idle 2 s) is kept, its call served on."""
    registry = CollectorRegistry()
    server = Server(registry, keepalive_s=0.5)
    closes = lambda: registry.get_sample_value("kvgate_grpc_keepalive_closes_total")  # noqa: E731
    echo = Echo()
    server.add(grpcserver.EXT_PROC_SERVICE, grpcserver.ext_proc_methods(echo))
    port = await server.listen("127.0.0.1", 0)
    try:
        assert closes() == 0  # exported from the start
        def mute() -> list:
            with Raw(port) as raw:  # a stream opened, one message answered, then nothing more from this peer
                raw.send(_frame(1, 4, 1, _REQUEST_HEADERS) + _frame(0, 0, 1, _message(_body(b"parked"))))
                return raw.frames(lambda f: False)  # read (never answering) until the server closes
        frames = await asyncio.to_thread(mute)
        assert any(kind == 6 and not flags & 1 for kind, flags, _, _ in frames)  # the server's PING, unanswered
        assert frames[-1][0] == -1  # then closed
        await wait_until_async(lambda: echo.ended == 1 and echo.finished == 1, timeout=5)
        assert "no answer to a PING" in caplog.text and closes() == 1

        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process()
            await call.write(_body(b"a"))
            assert _answer(await call.read()) == b"a"
            await asyncio.sleep(2.0)  # four keepalive periods: pinged, answered by grpcio
            await call.write(_body(b"b"))
            assert _answer(await call.read()) == b"b"
            await call.done_writing()
        assert echo.finished == 2 and closes() == 1
    finally:
        await server.stop(0)


async def test_ping_is_answered_and_a_compressed_message_ends_only_its_call(served):
    _, port, _, _, _ = served

    def talk() -> list:
        with Raw(port) as raw:
            raw.send(_frame(6, 0, 0, b"pingpong"))
            raw.send(_frame(1, 4, 1, _REQUEST_HEADERS) + _frame(0, 0, 1, _message(_body(b"x"), compressed=1)))
            raw.send(_frame(1, 4, 3, _REQUEST_HEADERS) + _frame(0, 1, 3, _message(_body(b"y"))))
            return raw.frames(lambda f: f[0] == 1 and f[2] == 3 and f[1] & 1)
    frames = await asyncio.to_thread(talk)
    assert (6, 1, 0, b"pingpong") in frames
    decoder = hpack.Decoder()
    by_stream: dict[int, list] = {}
    for kind, _flags, stream, payload in frames:
        if kind == 1:
            by_stream.setdefault(stream, []).extend(decoder.decode(payload))
    assert ("grpc-status", "12") in by_stream[1]  # UNIMPLEMENTED
    assert ("grpc-status", "0") in by_stream[3]
    data3 = b"".join(p for kind, _, stream, p in frames if kind == 0 and stream == 3)
    assert pb.ProcessingResponse.FromString(data3[5:]).request_body.response.body_mutation.body == b"y"


async def test_data_waits_on_the_peers_window_and_the_trailers_wait_on_the_data(served):
    _, port, _, _, _ = served

    def talk() -> list:
        with Raw(port, settings=struct.pack(">HI", 4, 10)) as raw:  # SETTINGS_INITIAL_WINDOW_SIZE 10
            raw.send(_frame(1, 4, 1, _REQUEST_HEADERS) + _frame(0, 1, 1, _message(_body(b"big:100"))))
            first = raw.frames(lambda f: f[0] == 0)
            assert sum(len(p) for kind, _, _, p in first if kind == 0) == 10
            assert not any(kind == 1 and flags & 1 for kind, flags, _, _ in first)  # no trailers yet
            rest = []
            while not any(kind == 1 and flags & 1 for kind, flags, _, _ in rest):
                raw.send(_frame(8, 0, 1, struct.pack(">I", 30)))
                rest += raw.frames(lambda f: f[0] == 0 or (f[0] == 1 and f[1] & 1))
            return first + rest
    frames = await asyncio.to_thread(talk)
    data = b"".join(p for kind, _, _, p in frames if kind == 0)
    assert all(len(p) <= 30 for kind, _, _, p in frames if kind == 0)
    assert pb.ProcessingResponse.FromString(data[5:]).request_body.response.body_mutation.body == b"z" * 100


async def test_a_peer_lowering_its_header_table_gets_a_size_update_first(served):
    _, port, _, _, _ = served

    def talk() -> list:
        with Raw(port, settings=struct.pack(">HI", 1, 0)) as raw:  # SETTINGS_HEADER_TABLE_SIZE 0
            raw.frames(lambda f: f[0] == 4 and f[1] & 1)  # its SETTINGS acknowledged
            raw.send(_frame(1, 4, 1, _REQUEST_HEADERS) + _frame(0, 1, 1, _message(_body(b"t"))))
            return raw.frames(lambda f: f[0] == 1 and f[1] & 1)
    frames = await asyncio.to_thread(talk)
    blocks = [payload for kind, _, stream, payload in frames if kind == 1 and stream == 1]
    assert blocks[0][:1] == b"\x20" and blocks[1][:1] != b"\x20"  # once, at the first block after the change
    decoder = hpack.Decoder(max_table_size=0)
    assert (":status", "200") in decoder.decode(blocks[0]) and ("grpc-status", "0") in decoder.decode(blocks[1])


async def test_a_reset_after_end_stream_ends_the_requests_and_the_method_finishes(served):
    """Envoy ends an ext_proc stream with END_STREAM and RST_STREAM at once: the method, waiting for its next
    request, sees its requests end and finishes (as under grpcio), and is not cancelled."""
    _, port, echo, _, _ = served

    def talk() -> None:
        with Raw(port) as raw:
            raw.send(_frame(1, 4, 1, _REQUEST_HEADERS) + _frame(0, 0, 1, _message(_body(b"a"))))
            raw.frames(lambda f: f[0] == 0 and f[2] == 1)
            raw.send(_frame(0, 1, 1) + _frame(3, 0, 1, struct.pack(">I", 2)))  # END_STREAM, then RST_STREAM
            raw.send(_frame(1, 4, 3, _REQUEST_HEADERS) + _frame(0, 0, 3, _message(_body(b"b"))))
            raw.frames(lambda f: f[0] == 0 and f[2] == 3)
            raw.send(_frame(3, 0, 3, struct.pack(">I", 8)))  # RST_STREAM alone (CANCEL), the method parked
    await asyncio.to_thread(talk)
    await wait_until_async(lambda: echo.finished == 2, timeout=5)
    assert echo.cancelled == 0


async def test_a_method_still_running_after_the_reset_ended_its_requests_is_cancelled_after_the_grace(
        served, monkeypatch):
    monkeypatch.setattr(grpcserver, "RESET_GRACE_S", 0.2)
    _, port, echo, _, _ = served

    def talk() -> None:
        with Raw(port) as raw:
            raw.send(_frame(1, 4, 1, _REQUEST_HEADERS) + _frame(0, 0, 1, _message(_body(b"linger"))))
            raw.frames(lambda f: f[0] == 0 and f[2] == 1)
            raw.send(_frame(3, 0, 1, struct.pack(">I", 8)))
    await asyncio.to_thread(talk)
    await wait_until_async(lambda: echo.ended == 1, timeout=5)
    assert echo.cancelled == 0
    await wait_until_async(lambda: echo.cancelled == 1, timeout=5)


async def test_a_deadline_ends_the_requests_of_a_method_waiting_for_them(served):
    """As grpcio's server: a method parked on its requests when the deadline passes sees them end."""
    _, port, echo, _, _ = served
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await channel.channel_ready()  # as above: the deadline must pass after the first answer, not during it
        call = pb_grpc.ExternalProcessorStub(channel).Process(timeout=1.0)
        await call.write(_body(b"a"))
        assert _answer(await call.read()) == b"a"
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call.read()
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        await wait_until_async(lambda: echo.finished == 1, timeout=5)
        assert echo.cancelled == 0


async def test_a_connection_lost_ends_the_requests_of_a_method_waiting_for_them(served):
    """As grpcio's server: the peer's connection gone, a method parked on its requests sees them end."""
    _, port, echo, _, _ = served

    def talk() -> None:
        with Raw(port) as raw:
            raw.send(_frame(1, 4, 1, _REQUEST_HEADERS) + _frame(0, 0, 1, _message(_body(b"a"))))
            raw.frames(lambda f: f[0] == 0 and f[2] == 1)
    await asyncio.to_thread(talk)
    await wait_until_async(lambda: echo.finished == 1, timeout=5)
    assert echo.cancelled == 0


async def test_continuation_padding_priority_split_messages_and_unknown_frames(served):
    """What a client may send that grpcio's client does not here: a header block split over CONTINUATION, a
    padded HEADERS carrying a priority, a message split over padded DATA frames, PRIORITY and unknown frames."""
    _, port, _, _, _ = served
    message = _message(_body(b"pieces"))

    def talk() -> list:
        with Raw(port) as raw:
            first, rest = _REQUEST_HEADERS[:10], _REQUEST_HEADERS[10:]
            padded = bytes([3]) + b"\x00\x00\x00\x00\x10" + first + b"\x00" * 3  # pad length 3, priority, padding
            raw.send(_frame(1, 0x8 | 0x20, 1, padded) + _frame(9, 0, 1, rest[:5]) + _frame(9, 4, 1, rest[5:]))
            raw.send(_frame(2, 0, 1, b"\x00\x00\x00\x00\x10") + _frame(0xEE, 0, 0, b"unknown"))
            half = len(message) // 2
            raw.send(_frame(0, 0x8, 1, bytes([2]) + message[:half] + b"\x00\x00"))
            raw.send(_frame(0, 0x1, 1, message[half:]))
            raw.send(_frame(8, 0, 99, struct.pack(">I", 10)))  # a window update for a stream never opened: ignored
            return raw.frames(lambda f: f[0] == 1 and f[2] == 1 and f[1] & 1)
    frames = await asyncio.to_thread(talk)
    assert not any(kind == 7 for kind, _, _, _ in frames)  # no GOAWAY
    data = b"".join(p for kind, _, stream, p in frames if kind == 0 and stream == 1)
    assert pb.ProcessingResponse.FromString(data[5:]).request_body.response.body_mutation.body == b"pieces"


async def test_a_larger_window_from_settings_releases_held_data(served):
    _, port, _, _, _ = served

    def talk() -> list:
        with Raw(port, settings=struct.pack(">HI", 4, 10)) as raw:
            raw.send(_frame(1, 4, 1, _REQUEST_HEADERS) + _frame(0, 1, 1, _message(_body(b"big:100"))))
            raw.frames(lambda f: f[0] == 0)
            raw.send(_frame(4, 0, 0, struct.pack(">HI", 4, 1000)))  # the stream's window grows by 990
            return raw.frames(lambda f: f[0] == 1 and f[1] & 1)
    frames = await asyncio.to_thread(talk)
    data = b"".join(p for kind, _, _, p in frames if kind == 0)
    answer = pb.ProcessingResponse(request_body=pb.BodyResponse(
        response=pb.CommonResponse(body_mutation=pb.BodyMutation(body=b"z" * 100)))).SerializeToString()
    assert data == (struct.pack(">BI", 0, len(answer)) + answer)[10:]  # the rest, once the window opened
