"""The one helper module of the tests: polling with a deadline (wait_until, wait_until_async), a
manual clock (Clock), free loopback ports (free_port, free_ports, free_port_run), aiohttp servers on
a port of their own (serve_app), load from worker threads (Load, start_threads), and the integration
stacks on loopback (start_kvgate, GatewayEnv, stack_fixture, RedisServer). Test files import these
from here; none keeps a copy. Support modules beside it (kube_api, hubstub, ...) may import it too."""
from __future__ import annotations

import asyncio
import inspect
import json
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Iterable

import httpx
import pytest
from aiohttp import web

from devkit.stack import Proc, Stack, free_port, free_port_run, wait_for_port

__all__ = ["QUICK_STOP", "wait_until", "wait_until_async", "Clock", "free_port", "free_ports", "free_port_run",
           "serve_app", "Load", "start_threads", "join_all", "Kvgate", "start_kvgate", "envoy_pool", "make_tls_certs",
           "start_canary", "canary_hits", "refused_port", "GatewayEnv", "stack_fixture", "RedisServer"]


# kvgate's environment in the test stacks: SIGTERM stops it at once. The drain delay (3 s by default) is
# for a load balancer to see readiness turn NOT_SERVING; no test but the drain's own needs it, and every
# stop of a stack or restart of a kvgate would wait it out. Tests of the drain set their own delay.
QUICK_STOP = {"KVGATE_DRAIN_DELAY_S": "0"}


# --- polling ---------------------------------------------------------------------------------

def _describe(predicate: Callable) -> str:
    """What a predicate waits for, for a timeout's message: its source line, or its name."""
    try:
        return " ".join(inspect.getsource(predicate).split())[:300]
    except (OSError, TypeError):
        return getattr(predicate, "__qualname__", repr(predicate))


def _timed_out(predicate: Callable, timeout: float, what: str | None, value: object,
               detail: Callable[[], object] | None) -> AssertionError:
    message = f"waited {timeout:g} s for {what or _describe(predicate)}; last value {value!r}"
    if detail is not None:
        message += f"\n{detail()}"
    return AssertionError(message)


def wait_until(predicate: Callable[[], Any], timeout: float = 15.0, interval: float = 0.05, *,
               what: str | None = None, detail: Callable[[], object] | None = None) -> Any:
    """Poll `predicate` until it returns something true, and return that. After `timeout` s raises
    AssertionError saying what was awaited (`what`, else the predicate's source), its last value and
    `detail()` (a log tail, a snapshot: whatever explains the failure)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _timed_out(predicate, timeout, what, value, detail)
        time.sleep(interval)


async def wait_until_async(predicate: Callable[[], Any], timeout: float = 15.0, interval: float = 0.02, *,
                           what: str | None = None, detail: Callable[[], object] | None = None) -> Any:
    """wait_until for a test on the event loop: polls with asyncio.sleep, so the loop's tasks run; the
    predicate may be a coroutine function (or return an awaitable), awaited at each poll."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _timed_out(predicate, timeout, what, value, detail)
        await asyncio.sleep(interval)


async def swallowed_wait(seconds: float = 10.0) -> None:
    """Wait as redis-py 8.1's asyncio client can mid-call: a cancellation that comes meanwhile is swallowed and
    the call goes on to its answer (measured: 15 of 20 cancels of a task in a loop of script calls; what
    routing.background.cancel_swallowed is for)."""
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        pass


class SwallowingRedis:
    """A Redis client whose GET answers `value` after swallowed_wait: `gets` counts the calls begun."""

    def __init__(self, value: bytes | None) -> None:
        self.value = value
        self.gets = 0

    async def get(self, key: str) -> bytes | None:
        self.gets += 1
        await swallowed_wait()
        return self.value


# --- time ------------------------------------------------------------------------------------

@asynccontextmanager
async def prefill_counts(redis_url: str, n: int = 2) -> AsyncIterator[list]:
    """`n` gateway replicas' prefill counts in one Redis, started, as plugin.app builds them (a quick write
    interval and a short key TTL for tests); closed on the way out."""
    from routing.state.counts import RedisCounts
    counts = [RedisCounts(redis_url, f"gw{i}", key_prefix="kvgate:{prefill}:", ttl_s=5.0, heartbeat_s=1.0,
                          stale_ok_s=1.0, write_interval_s=0.005) for i in range(n)]
    try:
        for c in counts:
            await c.start()
        yield counts
    finally:
        for c in counts:
            await c.close()


class Clock:
    """A clock that moves only when the test moves it (`clock.t += 1.0`); calling it gives the time."""

    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


# --- ports and servers -----------------------------------------------------------------------
# free_port(host) and free_port_run(n, host) (the first of n consecutive ports) are devkit.stack's,
# re-exported here so that tests take every port from one place.

def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` different free ports (free_port's: none is drawn twice within a minute)."""
    return [free_port(host) for _ in range(n)]


async def serve_app(app: web.Application, host: str = "127.0.0.1", port: int = 0,
                    **runner_options: Any) -> tuple[web.AppRunner, int]:
    """`app` served on `host` (a free port unless `port`); returns its runner (`await runner.cleanup()`
    stops it) and the port it listens on."""
    runner = web.AppRunner(app, **runner_options)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner, runner.addresses[-1][1]


# --- load ------------------------------------------------------------------------------------

def start_threads(target: Callable[..., object], args: Iterable[tuple], daemon: bool = True) -> list[threading.Thread]:
    """One started thread per argument tuple in `args`, each running `target(*a)`."""
    threads = [threading.Thread(target=target, args=a, daemon=daemon) for a in args]
    for t in threads:
        t.start()
    return threads


def join_all(threads: Iterable[threading.Thread], timeout: float = 30.0) -> None:
    """Join each thread, waiting at most `timeout` s for each."""
    for t in threads:
        t.join(timeout)


@dataclass
class Load:
    """Requests from `workers` threads, back to back, until the `with` block ends. `send(client, worker,
    n)` makes the worker's n-th request (from 1) with its own httpx.Client on `url` and returns the
    outcome (a status code, or text saying what went wrong); an httpx error is recorded as its type and
    message. Every result is (started, ended, outcome), in time.monotonic()."""

    url: str
    send: Callable[[httpx.Client, int, int], object]
    workers: int = 3
    timeout: float = 30.0
    results: list[tuple[float, float, object]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> "Load":
        self._threads = start_threads(self._run, [(w,) for w in range(self.workers)])
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        join_all(self._threads, self.timeout)

    def _run(self, worker: int) -> None:
        n = 0
        with httpx.Client(base_url=self.url, timeout=self.timeout) as client:
            while not self._stop.is_set():
                n += 1
                started = time.monotonic()
                try:
                    outcome = self.send(client, worker, n)
                except httpx.HTTPError as e:
                    outcome = f"{type(e).__name__}: {e}"
                self.results.append((started, time.monotonic(), outcome))

    def outcomes(self, started_after: float = 0.0, ended_before: float = float("inf")) -> list:
        """The outcomes of the requests started at or after `started_after` that ended before `ended_before`."""
        return [o for t0, t1, o in list(self.results) if t0 >= started_after and t1 < ended_before]

    def done(self, started_after: float = 0.0) -> int:
        """Requests started at or after `started_after` (monotonic) that have ended."""
        return len(self.outcomes(started_after))

    def wait_done(self, n: int, started_after: float = 0.0, timeout: float = 20.0) -> None:
        """Wait until `n` requests started at or after `started_after` have ended."""
        wait_until(lambda: self.done(started_after) >= n, timeout=timeout,
                   what=f"{n} requests started after {started_after:.3f}", detail=lambda: self.results[-5:])

    def failures(self, started_after: float = 0.0, ended_before: float = float("inf")) -> list:
        return [o for o in self.outcomes(started_after, ended_before) if o != 200]


# --- stacks ----------------------------------------------------------------------------------

@dataclass
class Kvgate:
    """A `kvgate serve` of a test stack: its process and ports."""

    proc: Proc
    grpc_port: int
    http_port: int
    env: dict[str, str]

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metrics"

    def metrics(self) -> str:
        return httpx.get(self.metrics_url, timeout=5).text

    def debug(self) -> dict:
        return httpx.get(f"http://127.0.0.1:{self.http_port}/debug", timeout=5).json()


def start_kvgate(stack: Stack, pods_file: Path, env: dict[str, str] | None = None, *, name: str = "kvgate",
                 wait: bool = True) -> Kvgate:
    """`kvgate serve` over `pods_file` on free ports, quick to stop (QUICK_STOP), with `env` on top;
    returned once ready (wait=False: started; `stack.ready(k.proc, ("127.0.0.1", k.grpc_port))`)."""
    grpc_port, http_port = free_ports(2)
    full = {"KVGATE_PODS_FILE": str(pods_file), "KVGATE_GRPC_PORT": str(grpc_port),
            "KVGATE_HTTP_PORT": str(http_port), **QUICK_STOP, **(env or {})}
    return Kvgate(stack.kvgate(env=full, grpc_port=grpc_port, name=name, wait=wait), grpc_port, http_port, full)


def envoy_pool(pods: Iterable[dict]) -> list[tuple[str, int]]:
    """Envoy's pool (the endpoints override_host may pick) for pods as in a pods file."""
    return [(p["address"], p["port"]) for p in pods]


def make_tls_certs(workdir: Path, name: str = "test", ca: tuple[Path, Path] | None = None) -> dict[str, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it, both as strict X.509 verification
    (Python 3.13's default contexts, VERIFY_X509_STRICT) wants them: the CA with basicConstraints
    CA:TRUE (critical), keyUsage keyCertSign (critical) and a subject key identifier; the server's
    with a SAN, serverAuth, and subject and authority key identifiers. `ca` (cert, key): sign with
    that CA instead of a new one. Returns the paths: ca, ca_key, cert, key."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    if ca is None:
        ca = (workdir / f"{name}-ca.pem", workdir / f"{name}-ca.key")
        ca_ext = workdir / f"{name}-ca.cnf"
        ca_ext.write_text(f"[req]\ndistinguished_name = dn\nprompt = no\n[dn]\nCN = kvgate {name} CA\n"
                          "[v3]\nbasicConstraints = critical, CA:TRUE\nkeyUsage = critical, keyCertSign, cRLSign\n"
                          "subjectKeyIdentifier = hash\n")
        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-config", str(ca_ext), "-extensions", "v3",
            "-keyout", str(ca[1]), "-out", str(ca[0]))
    cert, key, csr = (workdir / f"{name}-server.{ext}" for ext in ("pem", "key", "csr"))
    ext = workdir / f"{name}-server.cnf"
    ext.write_text("basicConstraints = critical, CA:FALSE\nkeyUsage = critical, digitalSignature, keyEncipherment\n"
                   "extendedKeyUsage = serverAuth\nsubjectAltName = IP:127.0.0.1\n"
                   "subjectKeyIdentifier = hash\nauthorityKeyIdentifier = keyid\n")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(csr))
    run("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial", "-days", "2",
        "-extfile", str(ext), "-out", str(cert))
    return {"ca": ca[0], "ca_key": ca[1], "cert": cert, "key": key}


def start_canary(stack: Stack) -> tuple[Proc, int]:
    """An HTTP server outside discovery: nothing a client sends may ever reach it."""
    port = free_port()
    proc = stack.start("canary", [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                       ready_port=("127.0.0.1", port))
    return proc, port


def canary_hits(proc: Proc) -> int:
    """Requests the canary has logged so far, whatever their method (`"PUT /x HTTP/1.1" 501 -`)."""
    text = proc.log_path.read_text(errors="replace")
    return sum(1 for line in text.splitlines() if "HTTP/1" in line)


def refused_port() -> tuple[socket.socket, int]:
    """A loopback port that refuses connections for as long as the returned socket stays open: bound,
    never listening, so no later free_port() can hand it to another server (an engine that is down)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock, sock.getsockname()[1]


class GatewayEnv:
    """The integration stack's common part: `kvgate serve` and Envoy in front of pods a subclass
    started, a canary outside discovery, and a client through Envoy. A subclass's __init__ starts its
    engines (and Redis, ...) on `self.stack`, then calls `start_gateway`; `on_close` registers what
    else must be released at the end (sockets, threads)."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self._closers: list[Callable[[], object]] = []

    def start_gateway(self, pods: list[dict], env: dict[str, str], client_timeout: float = 30,
                      watch_percent: int | None = None) -> None:
        """kvgate over `pods` (a pods file), then Envoy in front of it with every pod in its pool (the
        override_host policy picks only among those); `watch_percent`: Envoy's runtime key
        kvgate.watch_percent (None: envoy/envoy.yaml's 10)."""
        self.pods = pods
        self.pods_file = self.stack.pods_file(pods)
        self.canary, self.canary_port = start_canary(self.stack)
        gate = start_kvgate(self.stack, self.pods_file, env)
        self.kvgate, self.kvgate_env = gate.proc, gate.env
        self.grpc_port, self.http_port = gate.grpc_port, gate.http_port
        wait_for_port("127.0.0.1", self.http_port, timeout=10)
        self.listen, self.envoy_admin = free_port(), free_port()
        self.envoy = self.stack.envoy(listen_port=self.listen, extproc_port=self.grpc_port, pool=envoy_pool(pods),
                                      admin_port=self.envoy_admin, watch_percent=watch_percent)
        self.url = f"http://127.0.0.1:{self.listen}"
        self.client = httpx.Client(base_url=self.url, timeout=client_timeout)
        self.on_close(self.client.close)

    def on_close(self, fn: Callable[[], object]) -> None:
        self._closers.append(fn)

    def close(self) -> None:
        for fn in reversed(self._closers):
            fn()

    # --- kvgate's view --------------------------------------------------------------------
    def debug(self) -> dict:
        return httpx.get(f"http://127.0.0.1:{self.http_port}/debug", timeout=5).json()

    def debug_text(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.http_port}/debug", timeout=5).text

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.http_port}/metrics", timeout=5).text

    def counts_are_zero(self) -> bool:
        d = self.debug()
        return d["in_flight_here"] == 0 and all(p["running"] == 0 for p in d["pods"])

    def canary_hits(self) -> int:
        return canary_hits(self.canary)

    def envoy_counter(self, name: str) -> int:
        """One of Envoy's counters (its admin /stats), e.g. `cluster.pool.upstream_rq_total`."""
        text = httpx.get(f"http://127.0.0.1:{self.envoy_admin}/stats", params={"filter": f"^{name}$"}, timeout=5).text
        return int(text.split(":")[1]) if text.strip() else 0

    def restart_kvgate(self, **overrides: str) -> None:
        """kvgate again, with its settings and `overrides`; returns once both its ports listen."""
        self.kvgate = self.stack.restart(self.kvgate, env={**self.kvgate_env, **overrides},
                                         ready_port=("127.0.0.1", self.grpc_port))
        wait_for_port("127.0.0.1", self.http_port, timeout=10)


def stack_fixture(make: Callable[[Stack], GatewayEnv]):
    """The module-scoped fixture of an integration module: `env = stack_fixture(Env)`. One stack per
    module, stopped whatever happens; the logs of kvgate and Envoy are printed if a process died."""

    @pytest.fixture(scope="module")
    def env():
        with Stack() as stack:
            e = make(stack)
            try:
                yield e
            finally:
                e.close()
                dead = [p.name for p in stack.procs if not p.alive()]
                if dead:
                    print(f"stack processes not running at the end: {dead}", e.kvgate.log_tail(), e.envoy.log_tail())

    return env


class RedisServer:
    """A real redis-server on a free loopback port, without persistence; `kill` and `start` again
    keep the port (a restart loses every key)."""

    def __init__(self, password: str | None = None) -> None:
        self.port = free_port()
        self.password = password
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port("127.0.0.1", self.port, timeout=10, proc=self.proc, name="redis-server")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(5)
            self.proc = None


# --- kvgate.watch streams (plugin.watch) ------------------------------------------------------

def watch_headers(request_id: str = "r1", gateway: str = "gw-a", status: int = 200,
                  ctype: str = "text/event-stream", path: str = "/v1/chat/completions", served: str = ""):
    """The first message of a kvgate.watch stream (envoy/envoy.yaml): the response headers, the request's id and path
    as attributes, the routing replica in the forwarded kvgate metadata (and the served endpoint, if given)."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from google.protobuf import struct_pb2
    msg = pb.ProcessingRequest(observability_mode=True)
    for k, v in ((":status", str(status)), ("content-type", ctype)):
        msg.response_headers.headers.headers.add(key=k, raw_value=v.encode())
    attrs = struct_pb2.Struct()
    if request_id:
        attrs.update({"request.id": request_id, "request.path": path})
    msg.attributes["kvgate.watch"].CopyFrom(attrs)
    if gateway:
        msg.metadata_context.filter_metadata["kvgate"].update({"gw": gateway, "pod": "p0"})
    if served:
        msg.metadata_context.filter_metadata["envoy.lb"].update({"x-gateway-destination-endpoint-served": served})
    return msg


def watch_chunk(body: bytes, end: bool = False):
    """A body chunk of a kvgate.watch stream."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    return pb.ProcessingRequest(observability_mode=True,
                                response_body=pb.HttpBody(body=body, end_of_stream=end))


def sse(obj) -> bytes:
    """One server-sent event carrying `obj` as JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
