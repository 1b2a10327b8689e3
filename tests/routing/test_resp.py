"""routing.state.resp, the lean Redis client of the replicas' shared state: URLs read as redis-py reads them (or
left to it), commands pipelined in order against a real redis-server, a caller that stops waiting closing the
connection (no reply ever reaches the wrong caller), AUTH, SELECT, Unix sockets, scripts sent whole once, and a
channel followed through Redis restarts; against servers of our own that answer garbage or nothing."""
from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess

import pytest
from redis.asyncio.connection import parse_url

from routing.background import follow_channel
from routing.state.resp import LeanRedis, RespError, Target, lean_target, pack, shared_state_client
from helpers import RedisServer, free_port, wait_until_async

needs_redis = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")


# --- URLs --------------------------------------------------------------------------------------

@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:6379/0", "redis://127.0.0.1", "redis://h:1/2", "redis://:p%40ss@h:7/3", "redis://u:pw@h",
    "redis://u@h:9", "redis://h:1?db=4", "redis://h/5", "unix:///tmp/r.sock", "unix:///tmp/r.sock?db=3",
    "unix://:pw@/tmp/r.sock", "redis://[::1]:6380/1",
])
def test_a_url_is_read_as_redis_py_reads_it(url):
    ref = parse_url(url)
    t = lean_target(url)
    assert t is not None
    assert (t.path or None) == ref.get("path")
    if not t.path:
        assert (t.host, t.port) == (ref["host"], ref.get("port", 6379))
    assert t.username == ref.get("username") and t.password == ref.get("password")
    assert t.db == ref.get("db", 0)


@pytest.mark.parametrize("url", [
    "rediss://h:1/0",  # TLS: redis-py's
    "redis://h/0?socket_timeout=1", "redis://h/0?ssl_cert_reqs=none", "redis://h/0?db=1&db=2",  # options: redis-py's
    "redis://h/x", "redis://h/-1", "redis://h:99999/0", "redis:///0", "unix://", "http://h:1/0", "",
])
def test_what_it_does_not_serve_is_left_to_redis_py(url):
    assert lean_target(url) is None


def test_a_targets_password_is_never_shown():
    t = lean_target("redis://user:s3cret@h:1/0")
    assert t is not None and t.password == "s3cret" and "s3cret" not in repr(t)


def test_the_client_for_a_url():
    assert isinstance(shared_state_client("redis://127.0.0.1:1/0"), LeanRedis)
    from redis.asyncio import Redis
    assert isinstance(shared_state_client("rediss://127.0.0.1:1/0"), Redis)


def test_commands_are_resp_arrays_of_bulk_strings():
    assert pack(("SET", "k", b"v\r\n", 12, 1.5)) == b"*5\r\n$3\r\nSET\r\n$1\r\nk\r\n$3\r\nv\r\n\r\n$2\r\n12\r\n$3\r\n1.5\r\n"
    assert pack(("PUBLISH", "c", "é")) == b"*3\r\n$7\r\nPUBLISH\r\n$1\r\nc\r\n$2\r\n\xc3\xa9\r\n"
    for bad in (None, True, ["x"]):
        with pytest.raises(TypeError):
            pack(("SET", "k", bad))


# --- against redis-server ------------------------------------------------------------------------

@pytest.fixture
async def lean(redis_server):
    """Makes LeanRedis clients of the test's redis-server (LeanRedis's keyword arguments), closed after the test."""
    made: list[LeanRedis] = []

    def make(**options) -> LeanRedis:
        made.append(LeanRedis(lean_target(redis_server.url), **options))
        return made[-1]
    yield make
    for client in made:
        await client.aclose()


@contextlib.asynccontextmanager
async def following(client: LeanRedis, on_message, events: list):
    """follow_channel on channel "ch" through `client` for the block's length, "on" and each end's error in `events`."""
    task = asyncio.ensure_future(follow_channel(client, "ch", on_message, retry_s=0.05,
                                                subscribed=lambda: events.append("on"), ended=events.append,
                                                subscribe_timeout_s=2.0))
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@needs_redis
async def test_commands_pipelined_each_get_their_own_reply(lean):
    r = lean(decode=True)
    replies = await asyncio.gather(*(r.call("INCR", f"k{i % 3}") for i in range(60)))
    assert sorted(replies) == sorted([n for _ in range(3) for n in range(1, 21)])
    assert await r.call("GET", "k0") == "20"  # decoded
    with pytest.raises(RespError, match="WRONGTYPE|ERR"):
        await r.call("HGETALL", "k0")
    assert await r.call("PING") == "PONG"  # an error reply leaves the connection as it was
    assert await lean().call("GET", "k1") == b"20"


@needs_redis
async def test_a_caller_that_stops_waiting_closes_the_connection_and_no_reply_goes_astray(lean):
    r = lean(decode=True)
    await r.call("SET", "a", "1")
    await r.call("SET", "b", "2")
    blocked = asyncio.ensure_future(r.call("BLPOP", "nothing", 0))  # never answered
    other = asyncio.ensure_future(r.call("GET", "a"))  # queued behind it on the same connection
    await asyncio.sleep(0.05)
    blocked.cancel()
    with pytest.raises(asyncio.CancelledError):
        await blocked
    with pytest.raises(ConnectionError):  # its connection closed under it
        await other
    assert await r.call("GET", "b") == "2"  # a new connection, its own reply
    async with asyncio.timeout(0.1):
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.02):
                await r.call("BLPOP", "nothing", 0)
    assert await r.call("GET", "a") == "1"


@needs_redis
async def test_its_connections_probe_an_idle_peer(lean):
    import socket
    r = lean()
    await r.call("PING")
    sock = r._conn.transport.get_extra_info("socket")
    assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 30
    assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3


@needs_redis
async def test_a_command_that_cannot_be_sent_takes_no_replys_place(lean):
    r = lean(decode=True)
    await r.call("SET", "k", "v")
    with pytest.raises(TypeError):
        await r.call("SET", "k", None)
    assert await r.call("GET", "k") == "v"
    assert await r.call("PING") == "PONG"


@needs_redis
async def test_a_channel_outlives_bad_text_and_a_failing_callback(lean):
    pub = lean()
    got, events = [], []

    def take(m):
        if m == "boom":
            raise ValueError("boom")
        got.append(m)
    async with following(lean(decode=True), take, events):
        await wait_until_async(lambda: events == ["on"], timeout=10)
        await pub.publish("ch", b"gw-\xff")  # not UTF-8: read with a replacement character
        await wait_until_async(lambda: got == ["gw-\ufffd"], timeout=10)
        await pub.publish("ch", b"boom")  # the callback fails: the subscription ends with its error, then again
        await wait_until_async(lambda: events[-1:] == ["on"] and len(events) == 3, timeout=10)
        assert isinstance(events[1], ValueError)
        await pub.publish("ch", b"after")
        await wait_until_async(lambda: got[-1:] == ["after"], timeout=10)


@needs_redis
async def test_password_user_and_db():
    server = RedisServer(password="s3cret")
    server.start()
    try:
        good = LeanRedis(lean_target(f"redis://:s3cret@127.0.0.1:{server.port}/2"), decode=True)
        await good.call("SET", "k", "in db 2")
        other_db = LeanRedis(lean_target(f"redis://:s3cret@127.0.0.1:{server.port}/0"), decode=True)
        assert await other_db.call("GET", "k") is None
        assert await good.call("GET", "k") == "in db 2"
        await other_db.call("ACL", "SETUSER", "kv", "on", ">pw2", "~*", "+@all")
        user = LeanRedis(lean_target(f"redis://kv:pw2@127.0.0.1:{server.port}/2"), decode=True)
        assert await user.call("GET", "k") == "in db 2"
        for url in (f"redis://:wrong@127.0.0.1:{server.port}/0", f"redis://127.0.0.1:{server.port}/0"):
            bad = LeanRedis(lean_target(url))
            with pytest.raises(RespError, match="WRONGPASS|NOAUTH|invalid"):
                await bad.call("GET" if "wrong" in url else "SET", "k", *(() if "wrong" in url else ("v",)))
            await bad.aclose()
        for c in (good, other_db, user):
            await c.aclose()
    finally:
        server.kill()


@needs_redis
async def test_a_unix_socket(tmp_path):
    sock = tmp_path / "r.sock"
    proc = subprocess.Popen(["redis-server", "--port", "0", "--unixsocket", str(sock), "--save", "", "--appendonly",
                             "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await wait_until_async(sock.exists, timeout=10)
        r = LeanRedis(lean_target(f"unix://{sock}?db=1"), decode=True)
        await wait_until_async(lambda: r.call("PING"), timeout=10)
        await r.call("SET", "k", "v")
        assert await r.call("GET", "k") == "v"
        await r.aclose()
    finally:
        proc.kill()
        proc.wait(5)


@needs_redis
async def test_a_script_is_sent_whole_once_then_by_its_sha(lean):
    r = lean(decode=True)
    script = r.register_script("return {KEYS[1], ARGV[1] + 1}")
    assert await script(keys=["k"], args=[41]) == ["k", 42]  # NOSCRIPT, then EVAL
    assert await r.call("SCRIPT", "EXISTS", script.sha) == [1]
    await r.call("SCRIPT", "FLUSH")
    assert await script(keys=["j"], args=[1]) == ["j", 2]
    with pytest.raises(RespError):
        await r.register_script("return redis.call('NOPE')")(keys=[], args=[])


@needs_redis
async def test_dead_redis_is_a_connection_error_and_a_restart_heals(redis_server, lean):
    r = lean(decode=True, connect_timeout_s=1.0)
    assert await r.call("PING") == "PONG"
    redis_server.kill()
    with pytest.raises(OSError):  # ConnectionError (lost, refused) is an OSError
        await r.call("PING")
    with pytest.raises(OSError):
        await r.call("PING")
    redis_server.start()
    assert await r.call("PING") == "PONG"


@needs_redis
async def test_a_channel_followed_through_a_restart(redis_server, lean):
    pub = lean()
    got, events = [], []
    async with following(lean(), got.append, events):
        await wait_until_async(lambda: events == ["on"], timeout=10)
        for i in range(50):
            await pub.publish("ch", b"m%d" % i)
        await pub.publish("other", b"not for it")
        await wait_until_async(lambda: len(got) == 50, timeout=10)
        assert got == [b"m%d" % i for i in range(50)]
        redis_server.kill()
        await wait_until_async(lambda: len(events) >= 2, timeout=10)
        assert isinstance(events[1], ConnectionError)
        redis_server.start()
        await wait_until_async(lambda: events[-1] == "on", timeout=10)
        await pub.publish("ch", b"after")
        await wait_until_async(lambda: got[-1:] == [b"after"], timeout=10)


# --- servers that are not Redis ------------------------------------------------------------------

async def _server(answer: bytes | None, left: list | None = None):
    """A loopback server that answers each connection's first read with `answer` (None: never answers); `left`
    gets a None each time a client leaves."""
    async def handle(reader, writer):
        try:
            await reader.read(4096)
            if answer is not None:
                writer.write(answer)
                await writer.drain()
            await reader.read()  # until the client leaves
            if left is not None:
                left.append(None)
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_garbage_is_a_connection_error_not_a_reply():
    server, port = await _server(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    r = LeanRedis(Target(host="127.0.0.1", port=port))
    try:
        with pytest.raises(ConnectionError, match="not RESP"):
            await r.call("PING")
    finally:
        await r.aclose()
        server.close()


async def test_a_reply_nothing_asked_for_closes_the_connection():
    left: list = []
    server, port = await _server(b"+OK\r\n+EXTRA\r\n", left)
    r = LeanRedis(Target(host="127.0.0.1", port=port))
    try:
        assert await r.call("PING") == b"OK"
        await wait_until_async(lambda: left, timeout=5)  # the client hung up on the second
    finally:
        await r.aclose()
        server.close()


async def test_a_subscription_never_confirmed_fails_and_is_tried_again():
    server, port = await _server(None)
    r = LeanRedis(Target(host="127.0.0.1", port=port))
    ended = []
    task = asyncio.ensure_future(follow_channel(r, "ch", lambda m: None, retry_s=0.01,
                                                subscribed=lambda: ended.append("on"), ended=ended.append,
                                                subscribe_timeout_s=0.05))
    try:
        await wait_until_async(lambda: len(ended) >= 2, timeout=5)
        assert "on" not in ended and all(isinstance(e, TimeoutError) for e in ended)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        server.close()


async def test_nothing_listening_is_refused():
    port = free_port()
    r = LeanRedis(Target(host="127.0.0.1", port=port), connect_timeout_s=1.0)
    with pytest.raises(OSError):
        await r.call("PING")
    await r.aclose()
