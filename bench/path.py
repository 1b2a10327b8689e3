"""`kvgate bench path`: time to first token through the shipped stack against straight to the engine.

The stack is the one kvgate ships and the demo runs: a real Envoy with envoy/envoy.yaml, two `kvgate
serve` replicas (kv-sync, running counts shared through redis-server, local tokenizer once verified,
responses watched as by default) and simulated engines publishing KV events. The engines are told
to take no time (no TTFT overhead, no prefill, 1 ms per token), so what is left is the path. The
ways to the same engines (PATHS):
- `direct`: straight to an engine (the engines taken in turn);
- `envoy_only`: Envoy without ext_proc (the pool's round robin): Envoy's own share;
- `noop`: Envoy with the shipped filter settings and a no-op Python processor (bench.noop_processor
  `--bodies`: it routes to one engine and answers the very messages Envoy sends kvgate, the same
  responses watched; on kvgate's own gRPC server, as kvgate serves): the least a Python processor adds on
  this path;
- `native_noop` (where Node is installed): the same, with a processor without Python (bench/native_noop.js,
  below) in the no-op's place, answering as the no-op answers a request it does not watch: what any processor
  adds on this path, on this machine;
- `kvgate`: the shipped stack;
- `kvgate_grpcio`: the same with the replicas on grpcio's gRPC server (KVGATE_GRPC_SERVER=grpcio);
- `sglang` (where sglang-router is installed, the bench extra): SGLang's model gateway (its Rust router,
  `cache_aware`, the peer of `kvgate bench bakeoff`) in front of the same engines, in Envoy's place: what a
  router that is itself the proxy adds, beside what Envoy and an ext_proc processor add.
Then the processors alone (`floor`): Envoy answering the chat itself (a one-token event stream, its
direct_response) after its filters ran, without ext_proc, with the no-op processor and with the same
kvgate replicas, one request at a time, interleaved; with the processes' CPU per request. Beside them, where
Node is installed, a processor without Python (`native_noop`: bench/native_noop.js, Node's HTTP/2 server in C
answering with the no-op's answers serialized beforehand): what any processor adds on this machine, Envoy's
ext_proc and one process hop. No engine
and no upstream connection on that path, so what separates them is the ext_proc messages alone,
measured with far less noise than through the engines. Back to back, though, every process on that path is
warm; through the engines each path's requests come ~20-30 ms apart (the other paths' turns) and its processes
wake from idle each time, which costs a Python processor about as much again: so the floor is run a second
time `paced` (FLOOR_PACE_S before every request). The Envoys in front of the processors keep an access log
(ACCESS_LOG_FORMAT): per phase, the ext_proc filter's own timing of the request headers' and body's round
trips and the time from the request's first byte to the upstream request.
Every request is a streamed chat (one of four ~1,200-token system prompts, a user message never
sent before); its time to first token is from the request's first byte sent to the first chunk
that carries a token, read by a bare HTTP/1.1 client (asyncio streams, one keep-alive connection
per client), so the client costs every path the same. One request at a time (`sequential`) and
`--concurrency` clients at once (`load`). The paths are interleaved request by request (one at a time) and burst by burst (at load), so that each
sees the machine as the others do; medians and ratios come from the same run.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import json
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import httpx

from bench.gateway import extproc_stats, metric, start_envoy
from bench.noop_processor import native_answers
from devkit.stack import Proc, Stack, StackError, envoy_routes, free_port, render_envoy_config
from tokenizer import testdata

MODEL = "path-model"
PATHS = ("direct", "envoy_only", "noop", "native_noop", "noop_nowait", "kvgate", "kvgate_grpcio", "kvgate_two",
         "sglang")  # native_noop: with Node; sglang: with sglang-router
# kvgate_grpcio: two more replicas as shipped (their own Redis) but serving ext_proc on grpcio's asyncio server
# (KVGATE_GRPC_SERVER=grpcio) instead of kvgate's own (plugin.grpcserver): the server's share, side by side.
# kvgate_two: the same kvgate replicas behind the shipped config with every request in two ext_proc messages
# (headers, then body: runtime keys kvgate.one_message_percent and kvgate.watch_percent 0), as before the
# one-message routes.
# Engines that take no time: what remains of a request's time to first token is the path.
SIM_ARGS = ["--ttft-overhead-ms", "0", "--prefill-ms-per-token", "0", "--tpot-ms", "1", "--tpot-ms-per-seq", "0",
            "--max-tokens-default", "4"]
_TENANTS = [" ".join([f"You are assistant {t} of tenant {t}; answer briefly and cite the cache rules."] * 60)
            for t in range(4)]
_TOKEN = re.compile(rb'"(?:content|text)":"[^"]')  # a chunk that carries a token (not the role-only one)
TARGET_ADDED_SEQ_MS = 1.5
IDLE_GAP_S = 1.5
FLOOR_PATHS = ("envoy_answers", "noop", "native_noop", "kvgate")  # native_noop where Node is installed
NATIVE_NOOP = Path(__file__).with_name("native_noop.js")
# The floor again with this pause before every request: through the engines each path waits ~20-30 ms between
# its requests (the other paths' turns), so its processes wake from idle; back to back they are warm.
FLOOR_PACE_S = 0.02
PHASE_HEADER = "x-bench-phase"  # which phase sent a request, for the access logs
# The access log of the Envoys in front of processors: the phase, the time from the request's first byte to the
# upstream request (through the engines) and the ext_proc filter's own timing of each call it waited on, from its
# filter state (`rh:<us>:<status>,rb:<calls>:<total us>:<status>,...`: request headers, request body, ...).
ACCESS_LOG_FORMAT = (f"%REQ({PHASE_HEADER.upper()})% %COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)% "
                     "%FILTER_STATE(envoy.filters.http.ext_proc:PLAIN)%\n")
FLUSH_LOGS = ("--file-flush-interval-msec", "200")  # Envoy writes file logs out every 10 s by default
# What Envoy answers on the floor's chat route: one token, as an engine's first chunk carries it.
FLOOR_ANSWER = 'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\ndata: [DONE]\n\n'


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--requests", type=int, default=400,
                   help="requests per path one at a time; at load, as many per client (default 400)")
    p.add_argument("--concurrency", type=int, default=8, help="clients at once in the load phase (default 8)")
    p.add_argument("--idle", type=int, default=20,
                   help=f"requests each to direct and kvgate after a {IDLE_GAP_S} s pause (default 20)")
    p.add_argument("--replicas", type=int, choices=(1, 2), default=2,
                   help="kvgate replicas; 1: one alone, its counts in process, no Redis (default 2, as shipped)")
    p.add_argument("--no-events", action="store_true",
                   help="engines publish no KV events: what following them costs the path on this machine")
    p.add_argument("--engines", type=int, default=2, help="simulated engines (default 2)")


def body(n: int) -> bytes:
    """Request `n`'s body: a streamed chat, tenant n % 4, a user message no other request has."""
    return json.dumps({"model": MODEL, "stream": True, "max_tokens": 4, "messages": [
        {"role": "system", "content": _TENANTS[n % len(_TENANTS)]},
        {"role": "user", "content": f"Question {n}: how long until the first token?"}]}).encode()


class Client:
    """One keep-alive HTTP/1.1 connection: streamed chat requests, each timed to its first token."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.reader is None or self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self.reader, self.writer

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
            self.writer = self.reader = None

    async def chat(self, payload: bytes, phase: str = "") -> tuple[float, int]:
        """(seconds to the first token, status); reads the whole response. `phase`: named in PHASE_HEADER."""
        status, started, first, _ = await self.timed_chat(payload, phase)
        return (first or time.perf_counter()) - started, status

    async def timed_chat(self, payload: bytes, phase: str = "",
                         tokens: list[float] | None = None) -> tuple[int, float, float | None, bool]:
        """One chat: (status, perf_counter() when sent, at its first token or None, whether the connection
        stays open); `tokens`, if given, gets the time of every chunk carrying a token."""
        reader, writer = await self._connect()
        marked = f"{PHASE_HEADER}: {phase}\r\n" if phase else ""
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n{marked}"
                f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n").encode()
        started = time.perf_counter()
        writer.write(head + payload)
        status, first, keep = await read_response(reader, tokens)
        if not keep:
            await self.close()
        return status, started, first, keep


async def read_response(reader: asyncio.StreamReader,
                        tokens: list[float] | None = None) -> tuple[int, float | None, bool]:
    """One HTTP/1.1 response: (status, perf_counter() at the first chunk carrying a token or None, whether
    the connection stays open). Chunked or Content-Length bodies. `tokens`, if given, gets the time of every
    chunk in which a token's marker ends."""
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("connection closed before a response")
    status = int(status_line.split()[1])
    chunked, length, keep = False, 0, True
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        name, value = name.strip().lower(), value.strip().lower()
        if name == "transfer-encoding" and "chunked" in value:
            chunked = True
        elif name == "content-length":
            length = int(value)
        elif name == "connection" and value == "close":
            keep = False
    first: float | None = None
    if not chunked:
        data = await reader.readexactly(length)
        if _TOKEN.search(data):
            first = time.perf_counter()
            if tokens is not None:
                tokens.append(first)
        return status, first, keep
    tail = b""  # the end of the previous chunk: a token's marker may straddle two chunks
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            await reader.readline()  # the CRLF after the last chunk (no trailers)
            return status, first, keep
        data = (await reader.readexactly(size + 2))[:-2]  # the chunk less its CRLF
        if (first is None or tokens is not None) and any(m.end() > len(tail) for m in _TOKEN.finditer(tail + data)):
            now = time.perf_counter()
            first = first or now
            if tokens is not None:
                tokens.append(now)
        tail = data[-32:]


def _clients(target: tuple[str, int] | list[tuple[str, int]], n: int) -> list[Client]:
    """`n` connections to a path (to the engines in turn for `direct`)."""
    targets = target if isinstance(target, list) else [target]
    return [Client(*targets[i % len(targets)]) for i in range(n)]


class Samples:
    """Times to first token per path (seconds), with failed requests counted apart."""

    def __init__(self, paths: Sequence[str] = PATHS) -> None:
        self.ttft: dict[str, list[float]] = {p: [] for p in paths}
        self.errors = dict.fromkeys(paths, 0)

    def add(self, path: str, ttft: float, status: int) -> None:
        if status == 200:
            self.ttft[path].append(ttft)
        else:
            self.errors[path] += 1


async def _measure(targets: dict[str, Any], requests: int, concurrency: int, idle: int,
                   log, warmed: Callable[[], None] = lambda: None) -> tuple[Samples, Samples, Samples]:
    """Both phases, the paths interleaved so that each sees the machine as the others do: one request at a
    time, the paths taken in turn request by request (the order rotating); then bursts of `concurrency`
    clients sending ten requests each, the paths taken in turn burst by burst; then `idle` requests each
    to direct and kvgate, every one after a pause of IDLE_GAP_S (longer than the running counts' view is
    fresh: 1 s). `warmed` is called once the warm-up is over."""
    ids = itertools.count()
    paths = [p for p in PATHS if p in targets]
    seq_clients = {p: _clients(targets[p], len(targets[p]) if p == "direct" else 1) for p in paths}
    load_clients = {p: _clients(targets[p], concurrency) for p in paths}
    seq, load, quiet = Samples(paths), Samples(paths), Samples(paths)
    try:
        for warm in seq_clients.values():  # warm up: kvgate verifies its tokenizer, connections open
            for i in range(40):
                await warm[i % len(warm)].chat(body(next(ids)))
        warmed()
        for k in range(requests):
            for path in paths[k % len(paths):] + paths[:k % len(paths)]:
                clients = seq_clients[path]
                seq.add(path, *await clients[k % len(clients)].chat(body(next(ids)), "seq"))
        log(f"  one at a time: {requests} requests per path")
        burst = 10

        async def worker(path: str, client: Client) -> None:
            for _ in range(burst):
                load.add(path, *await client.chat(body(next(ids)), "load"))
        for k in range(max(1, requests // burst)):
            for path in paths[k % len(paths):] + paths[:k % len(paths)]:
                await asyncio.gather(*(worker(path, c) for c in load_clients[path]))
        log(f"  {concurrency} at once: {len(load.ttft['direct'])} requests per path")
        for k in range(idle):  # after a pause: what a request meets on a quiet gateway
            for path in ("direct", "kvgate")[k % 2:] + ("direct", "kvgate")[:k % 2]:
                await asyncio.sleep(IDLE_GAP_S)
                clients = seq_clients[path]
                quiet.add(path, *await clients[k % len(clients)].chat(body(next(ids)), "idle"))
        if idle:
            log(f"  after {IDLE_GAP_S} s pauses: {idle} requests, direct and kvgate")
    finally:
        for cs in (*seq_clients.values(), *load_clients.values()):
            for c in cs:
                await c.close()
    return seq, load, quiet


def _hostport(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def run(requests: int, concurrency: int, n_engines: int, log, idle: int = 0, replicas: int = 2,
        events: bool = True) -> dict:
    if not shutil.which("redis-server"):
        raise StackError("redis-server not found (Debian package redis-server; ./dev setup installs it)")
    with Stack() as stack:
        pods = stack.engines(n_engines, model=MODEL, extra=SIM_ARGS + ([] if events else ["--no-kv-events"]))
        if not events:
            for p in pods:
                del p["kv_events"]
        pods_file = stack.pods_file(pods)
        redis_url = stack.redis()[1] if replicas > 1 else ""
        grpc_ports, http_ports, procs = start_replicas(stack, pods_file, redis_url, replicas)
        grpcio_ports, _, _ = start_replicas(stack, pods_file, stack.redis(name="redis_grpcio")[1] if replicas > 1 else "",
                                            replicas, env={"KVGATE_GRPC_SERVER": "grpcio"}, name="kvgate_grpcio")
        pool = [("127.0.0.1", p["port"]) for p in pods]
        noop_port = free_port()
        noop = stack.start("noop", [sys.executable, "-m", "bench.noop_processor", str(noop_port), f"127.0.0.1:{pods[0]['port']}",
                             "--bodies"], ready_port=("127.0.0.1", noop_port))
        native = _start_native_noop(stack, f"127.0.0.1:{pods[0]['port']}", log)
        processors = {"kvgate": grpc_ports, "kvgate_grpcio": grpcio_ports, "kvgate_two": grpc_ports, "noop": [noop_port]}
        if native is not None:
            processors["native_noop"] = [native[0]]
        listen = {name: free_port() for name in ("envoy_only", *processors)}
        admin = {name: free_port() for name in processors}
        logs = {name: stack.workdir / f"{name}.access.log" for name in (*processors, "floor_noop", "floor_kvgate")}
        for name, ports in processors.items():
            config = render_envoy_config(listen_port=listen[name], admin_port=admin[name], extproc_port=ports[0],
                                         more_extproc_ports=ports[1:], pool=pool,
                                         one_message_percent=0 if name == "kvgate_two" else None,
                                         watch_percent=0 if name == "kvgate_two" else None)
            start_envoy(stack, f"envoy_{name}", with_access_log(config, logs[name]), listen[name], FLUSH_LOGS)
        _envoy_only(stack, listen["envoy_only"], pool)
        if "noop_nowait" in PATHS:
            listen["noop_nowait"], admin["noop_nowait"] = free_port(), free_port()
            _envoy_nowait(stack, listen["noop_nowait"], admin["noop_nowait"], noop_port, pool)
        targets: dict[str, Any] = {"direct": pool, **{k: ("127.0.0.1", v) for k, v in listen.items()}}
        sglang = start_sglang(stack, [f"http://127.0.0.1:{p['port']}" for p in pods], "sglang", log)
        if sglang is not None:
            targets["sglang"] = ("127.0.0.1", sglang[1])

        floor_ports = {name: free_port() for name in FLOOR_PATHS}
        _envoy_answering(stack, "floor_envoy", floor_ports["envoy_answers"], pool, None)
        _envoy_answering(stack, "floor_noop", floor_ports["noop"], pool, [noop_port], logs["floor_noop"])
        _envoy_answering(stack, "floor_kvgate", floor_ports["kvgate"], pool, grpc_ports, logs["floor_kvgate"])
        floor_pids = {"noop": [noop.popen.pid], "kvgate": [p.popen.pid for p in procs]}
        if native is None:
            del floor_ports["native_noop"]
        else:
            logs["floor_native_noop"] = stack.workdir / "floor_native_noop.access.log"
            _envoy_answering(stack, "floor_native_noop", floor_ports["native_noop"], pool, [native[0]],
                             logs["floor_native_noop"])
            floor_pids["native_noop"] = [native[1]]

        _expect_routed(f"http://127.0.0.1:{listen['kvgate']}")
        urls = [f"http://127.0.0.1:{p}/metrics" for p in http_ports]
        inside = ("kvgate_routing_decision_seconds_sum", "kvgate_routing_decision_seconds_count",
                  "kvgate_tokenize_seconds_sum", "kvgate_tokenize_seconds_count")
        warm: dict[str, float] = {}

        def warmed() -> None:  # kvgate's own times from here: the warm-up's tokenizer verification waits apart
            warm.update((name, _metric_sum(urls, name)) for name in inside)
        seq, load, quiet = asyncio.run(_measure(targets, requests, concurrency, idle, log, warmed))
        floor = asyncio.run(_measure_floor({k: ("127.0.0.1", v) for k, v in floor_ports.items()}, floor_pids,
                                           requests, log))
        msgs = {name: _messages_per_stream(port) for name, port in admin.items()}
        sums, counts = (_metric_sum(urls, name) - warm.get(name, 0.0) for name in inside[:2])
        decision_ms = sums / counts * 1e3 if counts else None
        sums, counts = (_metric_sum(urls, name) - warm.get(name, 0.0) for name in inside[2:])
        tokenize_ms = sums / max(1.0, counts) * 1e3
        observed = _metric_sum(urls, "kvgate_requests_observed_total")
        waited = {name: extproc_timings(text) for name, text in _read_logs(logs, requests).items()}
    return summarize(seq, load, quiet, requests=requests, concurrency=concurrency, extproc_us=waited,
                     engines=n_engines, replicas=replicas, kv_events=events, responses_observed=observed,
                     extproc_msgs_per_request=msgs, kvgate_decision_mean_ms=_round3(decision_ms),
                     kvgate_tokenize_mean_ms=_round3(tokenize_ms), floor=floor)


def start_replicas(stack: Stack, pods_file: Path, redis_url: str, n: int,
                   env: dict[str, str] | None = None, name: str = "kvgate") -> tuple[list[int], list[int], list[Proc]]:
    """`n` kvgate replicas as shipped (kv-sync, the local tokenizer, counts through `redis_url` if any), `env` on
    top, named `name`0, 1...; returned ready: (gRPC ports, HTTP ports, processes)."""
    grpc_ports, http_ports, procs = [], [], []
    for g in range(n):
        grpc_port, http_port = free_port(), free_port()
        procs.append(stack.kvgate(name=f"{name}{g}", grpc_port=grpc_port, wait=False, env={
            "KVGATE_PODS_FILE": str(pods_file), "KVGATE_GRPC_PORT": str(grpc_port),
            "KVGATE_HTTP_PORT": str(http_port), "KVGATE_REDIS_URL": redis_url,
            "KVGATE_ROUTING_STRATEGY": "kv-sync", "KVGATE_GATEWAY_ID": f"kvgate{g}",
            "KVGATE_TOKENIZER_PATH": str(testdata.path()), "KVGATE_LOG_LEVEL": "warning",
            "KVGATE_DRAIN_DELAY_S": "0", **(env or {})}))
        grpc_ports.append(grpc_port)
        http_ports.append(http_port)
    for proc, port in zip(procs, grpc_ports):
        stack.ready(proc, ("127.0.0.1", port))
    return grpc_ports, http_ports, procs


def start_sglang(stack: Stack, engine_urls: list[str], name: str, log=None,
                 model: str = MODEL) -> tuple[Proc, int] | None:
    """SGLang's model gateway (sglang-router, `cache_aware`, its defaults) in front of `engine_urls`, once it
    serves a chat of `model` (it activates its workers after it listens): (its process, its port); None (said
    through `log`) where sglang-router is not installed."""
    if importlib.util.find_spec("sglang_router") is None:  # the bench extra
        if log is not None:
            log("  sglang-router not installed (pip install -e '.[bench]'): no sglang path")
        return None
    port = free_port()
    # its metrics server too on loopback and a free port (its defaults, 0.0.0.0:29000, took every interface, and a
    # second router on the machine, the other Python's suite in CI, failed to start)
    proc = stack.start(name, [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                              "--port", str(port), "--prometheus-host", "127.0.0.1",
                              "--prometheus-port", str(free_port()), "--policy", "cache_aware", "--log-level", "warn",
                              "--worker-urls", *engine_urls], ready_port=("127.0.0.1", port), ready_timeout=60)
    payload = {"model": model, "messages": [{"role": "user", "content": "ready?"}], "max_tokens": 1}
    deadline = time.monotonic() + 20.0
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=payload, timeout=5.0).status_code
        except httpx.HTTPError as e:
            last = e
        if last == 200:
            return proc, port
        time.sleep(0.2)
    raise StackError(f"{name}: SGLang's router did not serve a chat within 20 s (last: {last})")


def _start_native_noop(stack: Stack, upstream: str, log) -> tuple[int, int] | None:
    """bench/native_noop.js started under Node with the no-op's answers: (its port, its pid); None without Node."""
    node = shutil.which("node")
    if node is None:
        log("  no node on PATH: the floor runs without the native no-op processor (Debian's nodejs)")
        return None
    answers = stack.workdir / "native_noop.answers.json"
    answers.write_text(json.dumps(native_answers(upstream)))
    port = free_port()
    proc = stack.start("native_noop", [node, str(NATIVE_NOOP), str(port), str(answers)], ready_port=("127.0.0.1", port))
    return port, proc.popen.pid


def _envoy_answering(stack: Stack, name: str, port: int, pool: list[tuple[str, int]],
                     extproc_ports: list[int] | None, access_log: Path | None = None) -> None:
    """The shipped config whose chat route Envoy answers itself (FLOOR_ANSWER, an event stream) once its
    filters ran; ext_proc to `extproc_ports`, or none at all (None); its access log to `access_log`."""
    ports = extproc_ports or [1]
    config = render_envoy_config(listen_port=port, admin_port=free_port(), extproc_port=ports[0],
                                 more_extproc_ports=ports[1:], pool=pool)
    for route in envoy_routes(config):
        if route["match"].get("path") == "/v1/chat/completions":
            route.pop("route")
            route["direct_response"] = {"status": 200, "body": {"inline_string": FLOOR_ANSWER}}
            route["response_headers_to_add"] = [{"header": {"key": "content-type", "value": "text/event-stream"},
                                                 "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]
    if extproc_ports is None:
        hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != "envoy.filters.http.ext_proc"]
    if access_log is None:
        start_envoy(stack, name, config, port)
    else:
        start_envoy(stack, name, with_access_log(config, access_log), port, FLUSH_LOGS)


def with_access_log(config: dict, path: Path) -> dict:
    """`config` (a rendered envoy.yaml) with its listener's access log (ACCESS_LOG_FORMAT) written to `path`."""
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["access_log"] = [{"name": "envoy.access_loggers.file", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog", "path": str(path),
        "log_format": {"text_format_source": {"inline_string": ACCESS_LOG_FORMAT}}}}]
    return config


def _read_logs(logs: dict[str, Path], requests: int, wait_s: float = 5.0) -> dict[str, str]:
    """The access logs' text once Envoy wrote them out (FLUSH_LOGS): until each floor log holds its `paced`
    requests, at most `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        texts = {name: log.read_text() if log.exists() else "" for name, log in logs.items()}
        written = all(text.count("paced ") >= requests for name, text in texts.items() if name.startswith("floor"))
        if written or time.monotonic() > deadline:
            return texts
        time.sleep(0.2)


def extproc_timings(log: str) -> dict[str, dict[str, float | int | None]]:
    """Per phase (PHASE_HEADER) of an ACCESS_LOG_FORMAT log: medians of the ext_proc calls Envoy waited on, in us
    (the request headers' round trip, the request body's, all calls of the request together) and of the time from
    the request's first byte to the upstream request (None where no upstream was asked: Envoy answered)."""
    rows: dict[str, dict[str, list[int]]] = {}
    for line in log.splitlines():
        phase, upstream, state = (line.split(" ", 2) + ["", ""])[:3]
        if phase == "-":
            continue
        row = rows.setdefault(phase, {"headers_us": [], "body_us": [], "calls_us": [], "to_upstream_us": []})
        total = 0
        for part in state.split(","):
            kind, _, rest = part.partition(":")
            numbers = rest.split(":")
            if kind in ("rh", "sh", "rt", "st") and numbers[0].isdigit():  # headers/trailers: latency:status
                total += int(numbers[0])
                if kind == "rh":
                    row["headers_us"].append(int(numbers[0]))
            elif kind in ("rb", "sb") and len(numbers) > 1 and numbers[1].isdigit():  # calls:total latency:status
                total += int(numbers[1])
                if kind == "rb":
                    row["body_us"].append(int(numbers[1]))
        row["calls_us"].append(total)
        if upstream.isdigit():
            row["to_upstream_us"].append(int(upstream))
    return {phase: {**{k: (round(statistics.median(v)) if v else None) for k, v in row.items()},
                    "samples": len(row["calls_us"])} for phase, row in rows.items()}


async def _measure_floor(targets: dict[str, tuple[str, int]], pids: dict[str, list[int]], requests: int,
                         log) -> dict:
    """The floor's paths one request at a time, taken in turn (the order rotating); medians, each processor's
    added time over Envoy answering alone, and each processor's CPU per request (its processes' user + system
    time over the phase: background work such as engine scrapes included). Then the same paced (`paced`):
    FLOOR_PACE_S before every request, so that each path's processes wake from idle as through the engines."""
    paths = [p for p in FLOOR_PATHS if p in targets]
    clients = {p: Client(*targets[p]) for p in paths}
    ids = itertools.count(2 * 10**9)

    async def one_pass(phase: str, pause: float) -> tuple[dict[str, list[float]], dict[str, int]]:
        ttft: dict[str, list[float]] = {p: [] for p in paths}
        errors = dict.fromkeys(paths, 0)
        for k in range(requests):
            for p in paths[k % len(paths):] + paths[:k % len(paths)]:
                if pause:
                    await asyncio.sleep(pause)
                t, status = await clients[p].chat(body(next(ids)), phase)
                if status == 200:
                    ttft[p].append(t)
                else:
                    errors[p] += 1
        return ttft, errors
    try:
        for client in clients.values():
            for _ in range(40):
                await client.chat(body(next(ids)))
        cpu0 = {name: _cpu_seconds(ps) for name, ps in pids.items()}
        ttft, errors = await one_pass("floor", 0.0)
        cpu = {name: _cpu_seconds(ps) for name, ps in pids.items()}
        paced = await one_pass("paced", FLOOR_PACE_S)
    finally:
        for client in clients.values():
            await client.close()
    log(f"  processors alone (Envoy answering): {requests} requests per path, back to back and paced")
    out = summarize_floor(ttft, errors)
    out["paced"] = summarize_floor(*paced)
    out["paced"]["pause_s"] = FLOOR_PACE_S
    per_request: dict[str, int | None] = {}
    for name in pids:
        before, after = cpu0[name], cpu[name]
        per_request[name] = None if before is None or after is None else round((after - before) / max(1, requests) * 1e6)
    out["cpu_us_per_request"] = per_request
    return out


def summarize_floor(ttft: dict[str, list[float]], errors: dict[str, int]) -> dict:
    """Medians of the floor's paths and the processors' added time over Envoy answering alone."""
    p50 = {p: statistics.median(v) for p, v in ttft.items() if v}
    base = p50.get("envoy_answers")
    out: dict[str, Any] = {"envoy_answers_p50_ms": _ms(base) if base is not None else None,
                           "samples": len(ttft["envoy_answers"]), "errors": errors}
    for p in FLOOR_PATHS[1:]:
        if p in ttft:
            out[f"{p}_added_p50_ms"] = _ms(p50[p] - base) if p in p50 and base is not None else None
    if "noop" in p50 and "kvgate" in p50:
        out["kvgate_over_noop_ms"] = _ms(p50["kvgate"] - p50["noop"])
    return out


def _cpu_seconds(pids: list[int]) -> float | None:
    """User + system CPU seconds of the processes (Linux /proc); None where that is not readable."""
    total = 0.0
    try:
        for pid in pids:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    return total


def _envoy_only(stack: Stack, port: int, pool: list[tuple[str, int]]) -> None:
    """Envoy with the shipped config less its ext_proc filter; inference routes to the pool's round robin."""
    config = render_envoy_config(listen_port=port, admin_port=free_port(), extproc_port=1, pool=pool)
    cluster = next(c for c in config["static_resources"]["clusters"] if c["name"] == "pool")
    cluster.pop("load_balancing_policy")  # override_host needs kvgate's metadata; plain round robin here
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != "envoy.filters.http.ext_proc"]
    start_envoy(stack, "envoy_only", config, port)


def _envoy_nowait(stack: Stack, port: int, admin: int, extproc: int, pool: list[tuple[str, int]]) -> None:
    """The shipped config with Envoy 1.40's send_body_without_waiting_for_header_response (STREAMED request
    bodies only; Envoy then ignores every mode_override, so the response is not sent: as for an unwatched one)."""
    config = render_envoy_config(listen_port=port, admin_port=admin, extproc_port=extproc, pool=pool)
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")["typed_config"]
    ext["send_body_without_waiting_for_header_response"] = True
    ext["processing_mode"].update(request_body_mode="STREAMED", response_header_mode="SKIP")
    start_envoy(stack, "envoy_nowait", config, port)


def _expect_routed(url: str) -> None:
    r = httpx.post(url + "/v1/chat/completions", content=body(10**9), timeout=30,
                   headers={"content-type": "application/json"})
    if r.status_code != 200 or not r.headers.get("x-kvgate-pod"):
        raise StackError(f"the kvgate path did not route: {r.status_code} {r.text[:200]}")


def _messages_per_stream(admin_port: int) -> dict[str, float]:
    """Envoy's ext_proc messages per stream, each way (its admin stats)."""
    count = extproc_stats(admin_port)
    streams = count["streams_started"] or 1
    return {"sent": round(count["stream_msgs_sent"] / streams, 2), "received": round(count["stream_msgs_received"] / streams, 2)}


def _metric_sum(urls: list[str], name: str) -> float:
    return sum(metric(httpx.get(url, timeout=5).text, name) for url in urls)


def _round3(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def summarize(seq: Samples, load: Samples, quiet: Samples | None = None, **run: Any) -> dict:
    """Medians (and p90) per path and phase, each path's added time over `direct`, the added time per
    quarter of the run (its spread), and the target."""
    names = list(seq.ttft)  # the paths measured (native_noop only with Node)
    out: dict[str, Any] = {"paths": {p: {"errors": seq.errors[p] + load.errors[p]} for p in names}}
    for phase, samples in (("seq", seq.ttft), ("load", load.ttft)):
        direct = statistics.median(samples["direct"])
        for name in names:
            row = out["paths"][name]
            values = samples[name]
            p50 = statistics.median(values)
            row[f"{phase}_p50_ms"] = _ms(p50)
            row[f"{phase}_p90_ms"] = _ms(_pct(values, 0.9) or 0.0)
            row[f"{phase}_added_p50_ms"] = _ms(p50 - direct)
            row[f"{phase}_over_direct"] = round(p50 / direct, 3)
            row[f"{phase}_samples"] = len(values)
            # the same difference in each quarter of the run (the paths were interleaved, so each quarter
            # compares like with like): how far one number can be trusted
            quarters = []
            for q in range(4):
                part, ref = _quarter(values, q), _quarter(samples["direct"], q)
                if part and ref:
                    quarters.append(_ms(statistics.median(part) - statistics.median(ref)))
            row[f"{phase}_added_p50_ms_by_quarter"] = quarters
    paths = out["paths"]
    for phase in ("seq", "load"):
        for name in ("kvgate", "noop", "envoy_only"):
            out[f"{name}_{phase}_added_p50_ms"] = paths[name][f"{phase}_added_p50_ms"]
        out[f"kvgate_{phase}_added_over_noop_ms"] = round(paths["kvgate"][f"{phase}_p50_ms"]
                                                          - paths["noop"][f"{phase}_p50_ms"], 3)
        if "kvgate_grpcio" in paths:  # kvgate's own gRPC server against grpcio's, the same replicas otherwise
            out[f"kvgate_grpcio_{phase}_added_p50_ms"] = paths["kvgate_grpcio"][f"{phase}_added_p50_ms"]
            out[f"kvgate_{phase}_own_server_over_grpcio_ms"] = round(paths["kvgate"][f"{phase}_p50_ms"]
                                                                     - paths["kvgate_grpcio"][f"{phase}_p50_ms"], 3)
        if "native_noop" in paths:  # what any processor adds on this path: the floor under the target
            out[f"native_noop_{phase}_added_p50_ms"] = paths["native_noop"][f"{phase}_added_p50_ms"]
        if "sglang" in paths:  # the bake-off's peer, a router that is the proxy itself
            out[f"sglang_{phase}_added_p50_ms"] = paths["sglang"][f"{phase}_added_p50_ms"]
            out[f"kvgate_{phase}_added_over_sglang_ms"] = round(paths["kvgate"][f"{phase}_p50_ms"]
                                                                - paths["sglang"][f"{phase}_p50_ms"], 3)
    if quiet is not None and quiet.ttft["kvgate"] and quiet.ttft["direct"]:
        direct = statistics.median(quiet.ttft["direct"])
        out["idle"] = {"direct_p50_ms": _ms(direct), "kvgate_p50_ms": _ms(statistics.median(quiet.ttft["kvgate"])),
                       "kvgate_added_p50_ms": _ms(statistics.median(quiet.ttft["kvgate"]) - direct),
                       "samples": len(quiet.ttft["kvgate"]), "gap_s": IDLE_GAP_S,
                       "errors": quiet.errors["kvgate"]}
    for phase in ("seq", "load"):  # one message against two, side by side
        out[f"kvgate_{phase}_one_over_two_message_ms"] = round(paths["kvgate"][f"{phase}_p50_ms"]
                                                              - paths["kvgate_two"][f"{phase}_p50_ms"], 3)
    out["targets"] = {"kvgate_seq_added_p50_le_1.5ms": out["kvgate_seq_added_p50_ms"] <= TARGET_ADDED_SEQ_MS}
    out.update(run)
    return out


def _waited(waited: dict, name: str, phase: str) -> str:
    t = waited.get(name, {}).get(phase) or {}
    upstream = f" ({t['to_upstream_us']})" if t.get("to_upstream_us") is not None else ""
    label = f"{name.removeprefix('floor_')} {'one at a time' if phase == 'seq' else 'alone' if phase == 'floor' else phase}"
    return f"{label} {t.get('headers_us')} / {t.get('body_us')}{upstream}"


def _quarter(values: list[float], q: int) -> list[float]:
    n = len(values)
    return values[q * n // 4:(q + 1) * n // 4]


def table(r: dict) -> str:
    rows = [f"{'path':<11} {'TTFT p50 @1':>12} {'p90 @1':>8} {'added @1':>9} {'p50 @' + str(r['concurrency']):>9} "
            f"{'p90':>8} {'added':>8} {'ratio':>6} {'errors':>6}"]
    for name, p in r["paths"].items():
        rows.append(f"{name:<11} {p['seq_p50_ms']:>12.3f} {p['seq_p90_ms']:>8.3f} {p['seq_added_p50_ms']:>+9.3f} "
                    f"{p['load_p50_ms']:>9.3f} {p['load_p90_ms']:>8.3f} {p['load_added_p50_ms']:>+8.3f} "
                    f"{p['load_over_direct']:>6.2f} {p['errors']:>6}")
    met = "met" if r["targets"]["kvgate_seq_added_p50_le_1.5ms"] else "NOT met"
    rows.append(f"kvgate adds {r['kvgate_seq_added_p50_ms']:.3f} ms to TTFT p50 one request at a time "
                f"(target <= {TARGET_ADDED_SEQ_MS}: {met}); the no-op processor {r['noop_seq_added_p50_ms']:.3f} ms, "
                f"Envoy alone {r['envoy_only_seq_added_p50_ms']:.3f} ms; kvgate over the no-op: "
                f"{r['kvgate_seq_added_over_noop_ms']:.3f} ms @1, {r['kvgate_load_added_over_noop_ms']:.3f} ms "
                f"@{r['concurrency']}")
    if r.get("kvgate_grpcio_seq_added_p50_ms") is not None:
        rows.append(f"the same replicas on grpcio's gRPC server (kvgate_grpcio) add {r['kvgate_grpcio_seq_added_p50_ms']:.3f} "
                    f"ms @1; kvgate's own server against it {r['kvgate_seq_own_server_over_grpcio_ms']:+.3f} ms @1, "
                    f"{r['kvgate_load_own_server_over_grpcio_ms']:+.3f} ms @{r['concurrency']}")
    if r.get("native_noop_seq_added_p50_ms") is not None:
        rows.append(f"a processor without Python in the no-op's place (native_noop) adds "
                    f"{r['native_noop_seq_added_p50_ms']:.3f} ms @1: what any ext_proc processor adds on this path, "
                    f"on this machine")
    if r.get("sglang_seq_added_p50_ms") is not None:
        rows.append(f"SGLang's router (sglang, in Envoy's place) adds {r['sglang_seq_added_p50_ms']:.3f} ms @1, "
                    f"{r['sglang_load_added_p50_ms']:.3f} ms @{r['concurrency']}; kvgate over it "
                    f"{r['kvgate_seq_added_over_sglang_ms']:+.3f} ms @1, {r['kvgate_load_added_over_sglang_ms']:+.3f} ms "
                    f"@{r['concurrency']}")
    if r.get("kvgate_seq_one_over_two_message_ms") is not None:
        rows.append(f"one ext_proc message (the shipped routes) against two (kvgate_two): "
                    f"{r['kvgate_seq_one_over_two_message_ms']:+.3f} ms @1, "
                    f"{r['kvgate_load_one_over_two_message_ms']:+.3f} ms @{r['concurrency']}")
    if r.get("idle"):
        i = r["idle"]
        rows.append(f"after {i['gap_s']} s pauses ({i['samples']} requests): direct {i['direct_p50_ms']:.3f} ms, kvgate "
                    f"{i['kvgate_p50_ms']:.3f} ms, added {i['kvgate_added_p50_ms']:+.3f} ms")
    rows.append(f"inside kvgate, from the body to the answer (all phases after the warm-up, both replicas): mean "
                f"{r.get('kvgate_decision_mean_ms')} ms, of which tokenizing {r.get('kvgate_tokenize_mean_ms')} ms")
    rows.append(f"ext_proc messages per request (Envoy -> processor / back): {r.get('extproc_msgs_per_request')}")
    f = r.get("floor")
    if f and f.get("kvgate_added_p50_ms") is not None and f.get("noop_added_p50_ms") is not None:
        cpu = f.get("cpu_us_per_request") or {}
        rows.append(f"processors alone (Envoy answering after ext_proc, {f['samples']} requests each): no-op adds "
                    f"{f['noop_added_p50_ms']:.3f} ms, kvgate {f['kvgate_added_p50_ms']:.3f} ms "
                    f"({f['kvgate_over_noop_ms']:+.3f} over the no-op); CPU per request: no-op {cpu.get('noop')} us, "
                    f"kvgate {cpu.get('kvgate')} us (its replicas together)")
        if f.get("native_noop_added_p50_ms") is not None:
            rows.append(f"a processor without Python (native_noop: Node's HTTP/2 in C, answers made beforehand) adds "
                        f"{f['native_noop_added_p50_ms']:.3f} ms (CPU per request {cpu.get('native_noop')} us): what "
                        f"any ext_proc processor adds on this machine")
    elif f:
        rows.append(f"processors alone: a path without answers (failed requests per path: {f.get('errors')})")
    paced = (f or {}).get("paced") or {}
    if paced.get("kvgate_added_p50_ms") is not None and paced.get("noop_added_p50_ms") is not None:
        rows.append(f"processors alone, paced ({paced['pause_s'] * 1e3:.0f} ms before every request, as each path waits "
                    f"through the engines): no-op adds {paced['noop_added_p50_ms']:.3f} ms, kvgate "
                    f"{paced['kvgate_added_p50_ms']:.3f} ms"
                    + (f", native no-op {paced['native_noop_added_p50_ms']:.3f} ms"
                       if paced.get("native_noop_added_p50_ms") is not None else "")
                    + f" (Envoy answering alone {paced['envoy_answers_p50_ms']:.3f} ms)")
    waited = r.get("extproc_us")
    if waited:
        rows.append("ext_proc calls Envoy waited on, p50 us (request headers / request body; first byte to upstream): "
                    + "; ".join(_waited(waited, name, phase) for name, phase in (
                        ("kvgate", "seq"), ("noop", "seq"), ("floor_kvgate", "floor"), ("floor_noop", "floor"),
                        ("floor_native_noop", "floor"), ("floor_kvgate", "paced"), ("floor_noop", "paced"),
                        ("floor_native_noop", "paced")) if name in waited))
    rows.append(f"added @1 by quarter of the run: kvgate {r['paths']['kvgate']['seq_added_p50_ms_by_quarter']}, "
                f"no-op {r['paths']['noop']['seq_added_p50_ms_by_quarter']}")
    rows.append(f"(ms; {r['paths']['direct']['seq_samples']} requests per path one at a time, "
                f"{r['paths']['direct']['load_samples']} at {r['concurrency']} at once, the paths interleaved; "
                f"ratio: p50 at load over direct's)")
    return "\n".join(rows)


def main(args: argparse.Namespace) -> int:
    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        result = run(args.requests, args.concurrency, args.engines, log, idle=args.idle, replicas=args.replicas,
                     events=not args.no_events)
    except StackError as e:
        print(f"kvgate bench path: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result) if args.json else table(result), flush=True)
    return 0
