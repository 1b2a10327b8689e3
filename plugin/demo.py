"""`kvgate demo`: the whole stack on loopback, then one workload run per strategy.

Starts simulated engines (publishing KV events; the last one data-parallel with two ranks
behind one port, which kvgate routes to rank by rank), redis-server when installed
(else the embedded in-process counts), `kvgate serve` and a real Envoy; drives
a multi-turn chat workload through Envoy once per strategy and prints, per
strategy, the prefix cache hit rate (from the engines' own /metrics), TTFT p50/p90,
requests/s and errors. Every process it starts is stopped on exit, Ctrl-C included.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import sys
import time
from dataclasses import dataclass

import httpx

from plugin.stack import Stack, StackError, free_port
from plugin.workload import ChatWorkload, Results, WorkloadShape
from routing.strategies import NAMES as STRATEGIES
from tokenizer import testdata

MODEL = "demo-model"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=20.0, help="seconds of traffic per strategy (default 20)")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end instead of tables")
    p.add_argument("--no-traffic", action="store_true",
                   help="start the stack, print one JSON line with its addresses, run until SIGINT/SIGTERM")
    p.add_argument("--sims", type=int, default=3, help="simulated engines (default 3)")
    p.add_argument("--dp-size", type=int, default=2,
                   help="data-parallel ranks of the last engine (default 2; 1: every engine has one rank)")
    p.add_argument("--gateways", type=int, default=2,
                   help="kvgate replicas behind Envoy, sharing counts through Redis (default 2, as in production)")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated strategies to compare")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    p.add_argument("--external", metavar="URL",
                   help="drive traffic at an existing gateway (e.g. docker-compose's Envoy) instead of starting one")
    p.add_argument("--engines", metavar="URL,...", default="",
                   help="with --external: the engines whose /metrics give the hit rate")


@dataclass
class Engine:
    name: str
    url: str
    kv_events: str


# Small caches, so a strategy that scatters a group's conversations over every engine evicts them.
_SIM_ARGS = ["--num-blocks", "512", "--block-size", "16", "--ttft-overhead-ms", "5",
             "--prefill-ms-per-token", "0.1", "--tpot-ms", "2"]


def _start(stack: Stack, n_sims: int, n_gateways: int, log, dp_size: int = 1) -> dict:
    pods = stack.engines(n_sims, model=MODEL, extra=_SIM_ARGS, dp=[1] * (n_sims - 1) + [dp_size])
    engines = [Engine(p["name"], f"http://127.0.0.1:{p['port']}", f"tcp://127.0.0.1:{p['kv_events']['pub_port']}")
               for p in pods]
    for p in pods:
        kv = p["kv_events"]
        dp = kv.get("dp_size", 1)
        ranks = f", {dp} data-parallel ranks on ports + rank" if dp > 1 else ""
        log(f"  engine {p['name']} on :{p['port']} (KV events :{kv['pub_port']}, replay :{kv['replay_port']}{ranks})")
    pods_file = stack.pods_file(pods)
    redis_url = ""
    if shutil.which("redis-server"):
        _, redis_url = stack.redis()
        log(f"  redis-server at {redis_url}")
    else:
        log("  redis-server not installed: running counts stay in process")
    grpc_ports, http_ports = [], []
    for g in range(n_gateways):
        grpc_port, http_port = free_port(), free_port()
        env = {"KVGATE_PODS_FILE": str(pods_file), "KVGATE_GRPC_PORT": str(grpc_port),
               "KVGATE_HTTP_PORT": str(http_port), "KVGATE_REDIS_URL": redis_url,
               "KVGATE_ROUTING_STRATEGY": "kv-sync", "KVGATE_GATEWAY_ID": f"kvgate{g}",
               # The sims' own tokenizer files: kvgate tokenizes locally once its tokens match the sims' /tokenize.
               "KVGATE_TOKENIZER_PATH": str(testdata.path())}
        stack.kvgate(env=env, grpc_port=grpc_port, name=f"kvgate{g}")
        grpc_ports.append(grpc_port)
        http_ports.append(http_port)
        log(f"  kvgate serve #{g}: ext_proc :{grpc_port}, metrics http://127.0.0.1:{http_port}/metrics")
    listen = free_port()
    stack.envoy(listen_port=listen, extproc_port=grpc_ports[0], more_extproc_ports=grpc_ports[1:],
                pool=[("127.0.0.1", int(e.url.rsplit(":", 1)[1])) for e in engines])
    log(f"  envoy on http://127.0.0.1:{listen} (ext_proc streams spread over {n_gateways} kvgate replicas)")
    http_port = http_ports[0]
    return {"envoy_url": f"http://127.0.0.1:{listen}", "metrics_url": f"http://127.0.0.1:{http_port}/metrics",
            "debug_url": f"http://127.0.0.1:{http_port}/debug", "redis_url": redis_url,
            "gateways": [f"http://127.0.0.1:{p}" for p in http_ports],
            "pods": [{"name": e.name, "url": e.url, "model": MODEL, "kv_events": e.kv_events,
                      "dp_size": p["kv_events"].get("dp_size", 1)} for e, p in zip(engines, pods)],
            "model": MODEL}


def _prefix_counters(text: str) -> tuple[float, float]:
    queries = hits = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:prefix_cache_queries_total"):
            queries += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:prefix_cache_hits_total"):
            hits += float(line.rsplit(" ", 1)[1])
    return queries, hits


async def _engine_counters(urls: list[str]) -> tuple[float, float]:
    async with httpx.AsyncClient(timeout=5.0) as client:
        texts = await asyncio.gather(*(client.get(u + "/metrics") for u in urls))
    q = h = 0.0
    for r in texts:
        dq, dh = _prefix_counters(r.text)
        q, h = q + dq, h + dh
    return q, h


async def _reset_caches(urls: list[str]) -> None:
    async with httpx.AsyncClient(timeout=5.0) as client:
        await asyncio.gather(*(client.post(u + "/reset_prefix_cache") for u in urls))


async def _compare(envoy_url: str, engine_urls: list[str], strategies: list[str], duration: float,
                   concurrency: int, log) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for strategy in strategies:
        if engine_urls:
            await _reset_caches(engine_urls)
            await asyncio.sleep(0.3)  # let the cache-cleared events reach the index
            before = await _engine_counters(engine_urls)
        workload = ChatWorkload(WorkloadShape(concurrency=concurrency), MODEL, seed=1)
        last = [0.0]

        def progress(res: Results, elapsed: float) -> None:
            if elapsed - last[0] >= 2.0:
                last[0] = elapsed
                log(f"  {strategy:<14} {elapsed:5.1f}/{duration:.0f} s  {res.requests} requests, {res.errors} errors")

        res = await workload.run(envoy_url, duration, strategy=strategy, progress=progress)
        hit_rate = None
        if engine_urls:
            after = await _engine_counters(engine_urls)
            dq, dh = after[0] - before[0], after[1] - before[1]
            hit_rate = dh / dq if dq else 0.0
        p50, p90 = res.percentile(0.5), res.percentile(0.9)
        out[strategy] = {
            "hit_rate": None if hit_rate is None else round(hit_rate, 4),
            "ttft_p50_ms": None if p50 is None else round(p50 * 1000, 2),
            "ttft_p90_ms": None if p90 is None else round(p90 * 1000, 2),
            "slo_attainment": None if res.slo_attainment is None else round(res.slo_attainment, 4),
            "requests": res.requests,
            "requests_per_s": round(res.requests / res.elapsed_s, 2) if res.elapsed_s else 0.0,
            "errors": res.errors,
            "pods": res.pods,
        }
        if res.error_samples:
            log(f"  {strategy}: first errors: {res.error_samples[:3]}")
    return out


def _table(results: dict[str, dict]) -> str:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = [f"{'strategy':<14} {'hit rate':>9} {'SLO met':>8} {'TTFT p50 ms':>12} {'TTFT p90 ms':>12} {'req/s':>7} "
             f"{'requests':>9} {'errors':>7}"]
    for name, r in results.items():
        hit = None if r["hit_rate"] is None else r["hit_rate"] * 100
        slo = None if r.get("slo_attainment") is None else r["slo_attainment"] * 100
        lines.append(f"{name:<14} {f(hit, '8.1f')}% {f(slo, '7.1f')}% {f(r['ttft_p50_ms'], '12.1f')} "
                     f"{f(r['ttft_p90_ms'], '12.1f')} {r['requests_per_s']:7.1f} {r['requests']:9d} {r['errors']:7d}")
    return "\n".join(lines)


async def _tokenizer_status(gateways: list[str]) -> dict[str, dict]:
    """Each replica's tokenizer paths from its /debug: per model, verified or not, requests served each way."""
    async with httpx.AsyncClient(timeout=5.0) as client:
        answers = await asyncio.gather(*(client.get(g + "/debug") for g in gateways), return_exceptions=True)
    out = {}
    for i, r in enumerate(answers):
        if isinstance(r, httpx.Response) and r.status_code == 200:
            out[f"kvgate{i}"] = r.json().get("tokenizer", {}).get("models", {})
    return out


def _tokenizer_lines(status: dict[str, dict]) -> list[str]:
    lines = []
    for gateway, models in status.items():
        for model, m in models.items():
            lines.append(f"{gateway} {model}: tokenizer {m['state']} (verified: {', '.join(m['verified']) or '-'}; "
                         f"{m['served']['local']} tokenized locally, {m['served']['remote']} by the engine, "
                         f"{m['checks']['disagree']} disagreements)")
    return lines


class _Stop(Exception):
    pass


def _raise_stop(signum, frame):  # SIGTERM behaves like Ctrl-C: unwind, stopping every process
    raise _Stop()


def main(args: argparse.Namespace) -> int:
    strategies = [s for s in args.strategies.split(",") if s]
    if args.gateways < 1 or args.sims < 1 or args.dp_size < 1:
        print("kvgate demo: --gateways, --sims and --dp-size must be at least 1", file=sys.stderr)
        return 2
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        print(f"kvgate demo: unknown strategy {unknown[0]!r}; known: {', '.join(STRATEGIES)}", file=sys.stderr)
        return 2

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.external:
        engines = [u for u in args.engines.split(",") if u]
        results = asyncio.run(_compare(args.external, engines, strategies, args.duration, args.concurrency, log))
        print(json.dumps({"strategies": results}) if args.json else _table(results), flush=True)
        return 0

    signal.signal(signal.SIGTERM, _raise_stop)
    stack = Stack()
    try:
        log(f"kvgate demo: starting {args.sims} engines, kvgate and Envoy on loopback (logs in {stack.workdir})")
        info = _start(stack, args.sims, args.gateways, log, args.dp_size)
        if args.no_traffic:
            print(json.dumps(info), flush=True)
            signal.signal(signal.SIGINT, _raise_stop)
            while all(p.alive() for p in stack.procs):
                time.sleep(0.5)
            dead = [p.name for p in stack.procs if not p.alive()]
            log(f"kvgate demo: {', '.join(dead)} exited; stopping the stack")
            return 1
        log(f"kvgate demo: {args.duration:.0f} s of multi-turn chat traffic per strategy: {', '.join(strategies)}")
        results = asyncio.run(_compare(info["envoy_url"], [p["url"] for p in info["pods"]], strategies,
                                       args.duration, args.concurrency, log))
        tokenizer = asyncio.run(_tokenizer_status(info["gateways"]))
        if args.json:
            print(json.dumps({"strategies": results, "tokenizer": tokenizer}), flush=True)
        else:
            print(_table(results), flush=True)
            print("\nhit rate: prompt tokens served from the engines' prefix caches (their own /metrics).",
                  flush=True)
            print("\n" + "\n".join(_tokenizer_lines(tokenizer)), flush=True)
        return 0
    except (KeyboardInterrupt, _Stop):
        log("kvgate demo: stopping")
        return 130 if not args.no_traffic else 0
    except StackError as e:
        log(f"kvgate demo: {e}")
        return 1
    finally:
        stack.close()
