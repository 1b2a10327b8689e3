"""`kvgate bench watch`: what watching a response costs the request and kvgate, three ways through the shipped stack.

The stack is `kvgate bench path`'s (a real Envoy with envoy/envoy.yaml, two `kvgate serve` replicas sharing
redis-server, kv-sync, local tokenizer, simulated engines publishing KV events), the engines taking no time to
the first token and TPOT_MS per token, so what differs is the path. Three Envoys with the shipped config, each
in front of the same two replicas (KVGATE_OBSERVE_SAMPLE=1: a request in two messages is always watched):
- `unwatched`: one message, nothing of the response sent to kvgate (runtime key kvgate.watch_percent 0);
- `own_stream`: two messages, and the response's headers and every chunk through kvgate in the request's own
  stream, each waited on by Envoy (kvgate.one_message_percent 0, kvgate.watch_percent 0): watching as kvgate did
  before the watched routes (requests with SLO targets included);
- `watch_stream`: one message, the response sent to kvgate on a stream of its own that Envoy never waits on
  (kvgate.watch_percent 100; plugin/watch.py), read by either replica.
Per request, as a bare HTTP/1.1 client sees it: the time to the first token and the time per output token (the
mean gap between the chunks carrying tokens), one request at a time with the paths interleaved request by
request, then `--concurrency` clients at once, burst by burst. Then the CPU per request on each path, both
kvgate replicas' and that path's Envoy's (the paths one after another, the same requests at `--concurrency`,
CPU from /proc, until every response's end is accounted). Checked on the way: every watched response's end reached the replica that routed
it (kvgate_watch_waits_total ended), none expired, and kvgate's metrics saw each path's tokens.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import shutil
import statistics
import sys
import time
from typing import Any

import httpx

from bench.gateway import extproc_stats, metric, start_envoy
from bench.path import _TENANTS, MODEL, Client, _cpu_seconds, _pct, start_replicas
from devkit.stack import Stack, StackError, free_port, render_envoy_config

PATHS = ("unwatched", "own_stream", "watch_stream")
# the Envoy runtime keys of each path: (kvgate.one_message_percent, kvgate.watch_percent)
KEYS = {"unwatched": (100, 0), "own_stream": (0, 0), "watch_stream": (100, 100)}
TPOT_MS = 2
TOKENS = 16
SIM_ARGS = ["--ttft-overhead-ms", "0", "--prefill-ms-per-token", "0", "--tpot-ms", str(TPOT_MS),
            "--tpot-ms-per-seq", "0"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--requests", type=int, default=200,
                   help="requests per path one at a time, at load and in the CPU phase (default 200)")
    p.add_argument("--concurrency", type=int, default=8, help="clients at once (default 8)")


def body(n: int) -> bytes:
    """Request `n`: a streamed chat of TOKENS tokens, tenant n % 4, a user message no other request has."""
    return json.dumps({"model": MODEL, "stream": True, "max_tokens": TOKENS, "messages": [
        {"role": "system", "content": _TENANTS[n % len(_TENANTS)]},
        {"role": "user", "content": f"Question {n}: how much does watching cost?"}]}).encode()


async def chat(client: Client, payload: bytes) -> tuple[int, float | None, float | None]:
    """One streamed chat: (status, seconds to the first token, mean seconds between token chunks after it)."""
    tokens: list[float] = []
    status, started, first, _ = await client.timed_chat(payload, tokens=tokens)
    if first is None:
        return status, None, None
    gap = (tokens[-1] - tokens[0]) / (len(tokens) - 1) if len(tokens) > 1 else None
    return status, first - started, gap


class Samples:
    def __init__(self) -> None:
        self.ttft: dict[str, list[float]] = {p: [] for p in PATHS}
        self.tpot: dict[str, list[float]] = {p: [] for p in PATHS}
        self.errors = dict.fromkeys(PATHS, 0)

    def add(self, path: str, status: int, ttft: float | None, tpot: float | None) -> None:
        if status != 200 or ttft is None:
            self.errors[path] += 1
            return
        self.ttft[path].append(ttft)
        if tpot is not None:
            self.tpot[path].append(tpot)


async def _latency(ports: dict[str, int], requests: int, concurrency: int, ids: itertools.count,
                   log) -> tuple[Samples, Samples]:
    seq_clients = {p: Client("127.0.0.1", ports[p]) for p in PATHS}
    load_clients = {p: [Client("127.0.0.1", ports[p]) for _ in range(concurrency)] for p in PATHS}
    seq, load = Samples(), Samples()
    try:
        for path in PATHS:  # warm up: the tokenizer verified, connections open
            for _ in range(20):
                await chat(seq_clients[path], body(next(ids)))
        for k in range(requests):
            for path in PATHS[k % 3:] + PATHS[:k % 3]:
                seq.add(path, *await chat(seq_clients[path], body(next(ids))))
        log(f"  one at a time: {requests} requests per path")

        async def worker(path: str, client: Client, n: int) -> None:
            for _ in range(n):
                load.add(path, *await chat(client, body(next(ids))))
        per_client = max(1, requests // concurrency // 5)
        for k in range(5):
            for path in PATHS[k % 3:] + PATHS[:k % 3]:
                await asyncio.gather(*(worker(path, c, per_client) for c in load_clients[path]))
        log(f"  {concurrency} at once: {len(load.ttft['unwatched'])} requests per path")
    finally:
        for c in (*seq_clients.values(), *(c for cs in load_clients.values() for c in cs)):
            await c.close()
    return seq, load


async def _cpu(port: int, requests: int, concurrency: int, ids: itertools.count) -> None:
    clients = [Client("127.0.0.1", port) for _ in range(concurrency)]

    async def worker(client: Client, n: int) -> None:
        for _ in range(n):
            await chat(client, body(next(ids)))
    try:
        await asyncio.gather(*(worker(c, requests // concurrency) for c in clients))
    finally:
        for c in clients:
            await c.close()


def _sum(urls: list[str], name: str, **labels: str) -> float:
    return sum(metric(httpx.get(url, timeout=5).text, name, **labels) for url in urls)


def run(requests: int, concurrency: int, log) -> dict:
    if not shutil.which("redis-server"):
        raise StackError("redis-server not found (Debian package redis-server; ./dev setup installs it)")
    with Stack() as stack:
        pods = stack.engines(2, model=MODEL, extra=SIM_ARGS)
        pods_file = stack.pods_file(pods)
        redis_url = stack.redis()[1]
        grpc_ports, http_ports, procs = start_replicas(stack, pods_file, redis_url, 2, {"KVGATE_OBSERVE_SAMPLE": "1"})
        pool = [("127.0.0.1", p["port"]) for p in pods]
        ports = {path: free_port() for path in PATHS}
        admins = {path: free_port() for path in PATHS}
        for path, (one_message, watch) in KEYS.items():
            start_envoy(stack, f"envoy_{path}", render_envoy_config(
                listen_port=ports[path], admin_port=admins[path], extproc_port=grpc_ports[0],
                more_extproc_ports=grpc_ports[1:], pool=pool, one_message_percent=one_message,
                watch_percent=watch), ports[path])
        urls = [f"http://127.0.0.1:{p}/metrics" for p in http_ports]
        pids = [p.popen.pid for p in procs]
        ids = itertools.count()
        seq, load = asyncio.run(_latency(ports, requests, concurrency, ids, log))
        envoys = {p.name: p.popen.pid for p in stack.procs if p.name.startswith("envoy_")}
        cpu: dict[str, float | None] = {}
        envoy_cpu: dict[str, float | None] = {}
        for path in PATHS:
            observed = _sum(urls, "kvgate_requests_observed_total")
            before, envoy_before = _cpu_seconds(pids), _cpu_seconds([envoys[f"envoy_{path}"]])
            asyncio.run(_cpu(ports[path], requests, concurrency, ids))
            sent = requests // concurrency * concurrency
            if path != "unwatched":  # every response's end accounted (a watch stream's trails the request)
                deadline = time.monotonic() + 30
                while _sum(urls, "kvgate_requests_observed_total") < observed + sent and time.monotonic() < deadline:
                    time.sleep(0.05)
            after, envoy_after = _cpu_seconds(pids), _cpu_seconds([envoys[f"envoy_{path}"]])
            cpu[path] = None if before is None or after is None else round((after - before) / sent * 1e6)
            envoy_cpu[path] = (None if envoy_before is None or envoy_after is None
                               else round((envoy_after - envoy_before) / sent * 1e6))
            log(f"  CPU: {path}, {sent} requests at {concurrency} at once")
        messages = {path: {"routing": extproc_stats(admins[path]), "watch": extproc_stats(admins[path], "kvgate_watch")}
                    for path in PATHS}
        checks = {"watch_waits_ended": _sum(urls, "kvgate_watch_waits_total", outcome="ended"),
                  "watch_waits_expired": _sum(urls, "kvgate_watch_waits_total", outcome="expired"),
                  "watch_words_through_redis": _sum(urls, "kvgate_watch_words_total", word="e", outcome="sent"),
                  "watch_words_local": _sum(urls, "kvgate_watch_words_total", word="e", outcome="local"),
                  "observed": {s: _sum(urls, "kvgate_requests_observed_total", source=s)
                               for s in ("usage", "counted", "none", "unsampled")}}
    return summarize(seq, load, cpu, envoy_cpu, requests=requests, concurrency=concurrency, checks=checks,
                     extproc_msgs_per_request={path: _per_request(m) for path, m in messages.items()})


def _per_request(m: dict[str, dict[str, int]]) -> dict[str, float]:
    """Envoy's ext_proc messages per request, sent to kvgate and answered, on the routing filter's streams and on
    the watch filter's (which opens one per watched request and waits for no answer)."""
    requests = m["routing"]["streams_started"] or 1
    return {f"{filt}_{way}": round(m[filt][f"stream_msgs_{way}"] / requests, 2)
            for filt in ("routing", "watch") for way in ("sent", "received")}


def _ms(values: list[float], q: float | None = None) -> float | None:
    if not values:
        return None
    return round((statistics.median(values) if q is None else _pct(values, q) or 0.0) * 1e3, 3)


def summarize(seq: Samples, load: Samples, cpu: dict[str, float | None], envoy_cpu: dict[str, float | None],
              **run: Any) -> dict:
    out: dict[str, Any] = {"paths": {}, **run}
    for path in PATHS:
        row: dict[str, Any] = {"errors": seq.errors[path] + load.errors[path], "cpu_us_per_request": cpu.get(path),
                               "envoy_cpu_us_per_request": envoy_cpu.get(path)}
        for phase, s in (("seq", seq), ("load", load)):
            row[f"{phase}_ttft_p50_ms"] = _ms(s.ttft[path])
            row[f"{phase}_ttft_p90_ms"] = _ms(s.ttft[path], 0.9)
            row[f"{phase}_tpot_p50_ms"] = _ms(s.tpot[path])
            row[f"{phase}_tpot_p90_ms"] = _ms(s.tpot[path], 0.9)
        out["paths"][path] = row
    base = out["paths"]["unwatched"]
    for path in ("own_stream", "watch_stream"):  # what watching adds, side by side in this run
        row = out["paths"][path]
        row["added_over_unwatched_ms"] = {k: None if row[k] is None or base[k] is None else round(row[k] - base[k], 3)
                                          for k in ("seq_ttft_p50_ms", "seq_tpot_p50_ms", "load_ttft_p50_ms",
                                                    "load_tpot_p50_ms")}
    return out


def table(r: dict) -> str:
    lines = [f"kvgate bench watch: {r['requests']} requests per path, {r['concurrency']} at once at load; "
             f"engines {TPOT_MS} ms per token, {TOKENS} tokens",
             "| path | TTFT p50 / p90 one at a time (ms) | TPOT p50 / p90 one at a time (ms) | TTFT p50 / p90 at load "
             "| TPOT p50 / p90 at load | CPU per request, kvgate / Envoy (us) | errors |",
             "|---|---|---|---|---|---|---|"]
    for path, row in r["paths"].items():
        lines.append(f"| {path} | {row['seq_ttft_p50_ms']} / {row['seq_ttft_p90_ms']} | {row['seq_tpot_p50_ms']} / "
                     f"{row['seq_tpot_p90_ms']} | {row['load_ttft_p50_ms']} / {row['load_ttft_p90_ms']} | "
                     f"{row['load_tpot_p50_ms']} / {row['load_tpot_p90_ms']} | {row['cpu_us_per_request']} / "
                     f"{row['envoy_cpu_us_per_request']} | "
                     f"{row['errors']} |")
    for path in ("own_stream", "watch_stream"):
        added = r["paths"][path]["added_over_unwatched_ms"]
        lines.append(f"{path} over unwatched (p50 ms): " + ", ".join(f"{k} {v:+}" if v is not None else f"{k} -"
                                                                     for k, v in added.items()))
    if "extproc_msgs_per_request" in r:
        lines.append("ext_proc messages per request (routing filter sent/answered, watch filter sent/answered): " + "; ".join(
            f"{path} {m['routing_sent']}/{m['routing_received']}, {m['watch_sent']}/{m['watch_received']}"
            for path, m in r["extproc_msgs_per_request"].items()))
    lines.append(f"checks: {json.dumps(r['checks'])}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        result = run(args.requests, args.concurrency, log)
    except StackError as e:
        print(f"kvgate bench watch: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result) if args.json else table(result), flush=True)
    return 0
