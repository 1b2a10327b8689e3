"""The ZMTP SUB peer (kvcache/zmtp.py), against real libzmq sockets and a raw peer (its C frame splitter
on its own: test_native_zmtp.py)."""
from __future__ import annotations

import asyncio
import select
import socket
import time

import zmq

from kvcache.ingest import SubscriberManager
from kvcache.stream import EndpointSpec
from kvcache.zmtp import Connection, ping
from helpers import free_port, wait_until_async
from kv_engines import counter, FAST, RecordingSink
from test_native_zmtp import frame, live


def connect_ready(port: int, timeout: float = 5.0) -> tuple[Connection, list]:
    conn = Connection(("127.0.0.1", port), socket.AF_INET)
    out: list = []
    deadline = time.monotonic() + timeout
    while conn.state != "ready":
        assert time.monotonic() < deadline, f"no handshake (state {conn.state})"
        if conn.state == "connecting":
            if select.select([], [conn], [], 0.05)[1]:
                conn.on_writable()
            continue
        if select.select([conn], [], [], 0.05)[0]:
            assert conn.recv(), "the peer closed the connection"
            conn.messages(out, 100)
    return conn, out


def test_handshake_with_libzmq_pub_then_messages_and_pong():
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)  # XPUB: tells when the subscription arrived
    port = free_port()
    pub.bind(f"tcp://127.0.0.1:{port}")
    try:
        conn, out = connect_ready(port)
        assert pub.poll(5000) and pub.recv() == b"\x01"  # subscribed to everything
        pub.send_multipart([b"topic", (7).to_bytes(8, "big"), b"payload"])
        pub.send_multipart([b"only", b"two"])
        received = conn.bytes_in
        conn.send(ping(2.0))
        deadline = time.monotonic() + 5
        while len(out) < 2 or conn.bytes_in - received < len(b"".join(frame(b"") for _ in range(2))) + 7:
            assert time.monotonic() < deadline, f"got {out}"
            if select.select([conn], [], [], 0.05)[0]:
                assert conn.recv()
                conn.messages(out, 100)
        assert out == [(7, b"payload"), [b"only", b"two"]]
        conn.close()
    finally:
        pub.close(0)
        ctx.term()


async def test_a_peer_that_is_not_a_publisher_is_dropped_and_retried():
    """libzmq itself closes a SUB's connection to a ROUTER during the handshake: retried, never connected."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = free_port()
    router.bind(f"tcp://127.0.0.1:{port}")
    manager = SubscriberManager(RecordingSink(), FAST)
    try:
        manager.sync([EndpointSpec("p", "m", "127.0.0.1", port, None, 0)])
        await wait_until_async(lambda: manager.status()[0]["reconnects"] >= 2)
        assert not manager.status()[0]["connected"]
    finally:
        await manager.aclose()
        router.close(0)
        ctx.term()


async def test_a_peer_announcing_another_socket_type_is_a_counted_protocol_error():
    """A hand-made ZMTP peer that says it is a ROUTER: the connection is dropped, counted, logged, retried."""
    from kvcache.zmtp import GREETING, _command

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    accepted: list[socket.socket] = []

    async def serve():
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(listener)
            accepted.append(conn)
            await loop.sock_sendall(conn, GREETING + _command(b"READY", b"\x0bSocket-Type" + (6).to_bytes(4, "big")
                                                               + b"ROUTER"))

    server = asyncio.create_task(serve())
    manager = SubscriberManager(RecordingSink(), FAST)
    try:
        manager.sync([EndpointSpec("p", "m", "127.0.0.1", listener.getsockname()[1], None, 0)])
        protocol_errors = lambda: counter(manager, "errors", type="protocol")  # noqa: E731
        await wait_until_async(lambda: protocol_errors() >= 2)  # dropped, reconnected, dropped again
        assert not manager.status()[0]["connected"] and manager.status()[0]["reconnects"] >= 1
    finally:
        server.cancel()
        await manager.aclose()
        for c in accepted:
            c.close()
        listener.close()


def _raw_pub() -> tuple[socket.socket, Connection, socket.socket]:
    """A Connection to a raw ZMTP PUB peer (a plain socket that sends the greeting and READY), handshake done."""
    from kvcache.zmtp import GREETING, _command

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    conn = Connection(server.getsockname(), socket.AF_INET)
    peer, _ = server.accept()
    peer.sendall(GREETING + _command(b"READY", b"\x0bSocket-Type" + (3).to_bytes(4, "big") + b"PUB"))
    deadline = time.monotonic() + 5
    while conn.state != "ready":
        assert time.monotonic() < deadline, conn.state
        if conn.state == "connecting":
            if select.select([], [conn], [], 0.05)[1]:
                conn.on_writable()
        elif select.select([conn], [], [], 0.05)[0]:
            assert conn.recv()
            conn.messages([], 100)
    peer.settimeout(5)
    assert peer.recv(64)  # our greeting, READY and subscription
    return server, conn, peer


def _deliver(peer, conn, piece: bytes, take) -> None:
    """Send `piece` from the raw peer, calling `take` whenever the connection is readable until it
    has read all of it (5 s at most)."""
    peer.sendall(piece)
    got = conn.bytes_in + len(piece)
    deadline = time.monotonic() + 5
    while conn.bytes_in < got:
        assert time.monotonic() < deadline
        if select.select([conn], [], [], 0.05)[0]:
            take()


def test_a_read_ending_inside_a_message_waits_for_the_rest():
    """A read that ends after a message's first frame but before its end is no protocol error: the
    message is taken once the rest has come (it dropped the connection: "message before READY")."""
    server, conn, peer = _raw_pub()
    try:
        message = live(1, b"a" * 300)
        out: list = []
        for piece in (message[:5], message[5:]):

            def take() -> None:
                assert conn.recv()
                conn.messages(out, 100)

            _deliver(peer, conn, piece, take)
        assert out == [(1, b"a" * 300)]
    finally:
        conn.close()
        peer.close()
        server.close()


def test_read_takes_messages_across_reads_answers_pings_and_reports_the_end():
    """Connection.read (recv and parse in one call) against a raw ZMTP PUB peer that sends messages cut
    at arbitrary points, a PING between two of them, then closes."""
    server, conn, peer = _raw_pub()
    out: list = []
    try:
        stream = live(1, b"a" * 300) + live(2, b"b") + frame(b"\x04PING\x00\x0aHI", command=True) + live(3, b"c")
        for cut in (5, 310, len(stream)):  # the first two reads end inside a message
            piece, stream = stream[:cut], stream[cut:]

            def take() -> None:
                assert conn.read(out) is not None

            _deliver(peer, conn, piece, take)
        assert out == [(1, b"a" * 300), (2, b"b"), (3, b"c")]
        assert peer.recv(64).endswith(b"\x04PONGHI")  # the PING answered, its context echoed
        peer.close()
        deadline = time.monotonic() + 5
        while not (select.select([conn], [], [], 0.05)[0] and conn.read(out) is None):
            assert time.monotonic() < deadline, "the end of the connection was not reported"
    finally:
        conn.close()
        server.close()
