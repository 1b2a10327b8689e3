"""`kvgate demo`: the whole stack on loopback, then a workload per strategy, compared.

Starts simulated engines (publishing KV events; the last one data-parallel with two ranks
behind one port, which kvgate routes to rank by rank), redis-server when installed
(else the embedded in-process counts), `kvgate serve` and a real Envoy; drives
a multi-turn chat workload through Envoy per strategy, in slices alternating between
the strategies (A B, B A, ...: on a shared machine a strategy run alone meets a load the
others never see; single runs differed by tens of points of SLO attainment), and prints,
per strategy, the prefix cache hit rate (from the engines' own /metrics) beside the share kvgate
believed cached (its replicas' kvgate_prefix_blocks_total), SLO attainment, TTFT p50/p90, requests/s
and errors; then how far the slo strategy's TTFT predictions
were from the observed TTFTs (each replica's /debug `profiles`). `--model-shape hybrid` gives the
engines a gpt-oss-like pair of KV cache groups (sliding window with sparse retention, full attention).
Every process it starts is stopped on exit, Ctrl-C included.

Supervision: SIGINT and SIGTERM both stop the demo, however it was started (a shell
starts a script's background job with SIGINT ignored; the demo installs its own handler
regardless). The first stop signal unwinds it; one arriving while the stack is being
stopped only hurries that (SIGKILL instead of waiting for the SIGTERMs), and the stop
always ends with every child process gone. With --no-traffic, an engine that exits is
reported and the stack keeps serving on the others (kvgate routes around an engine
whose /metrics stopped answering); Envoy, Redis or a kvgate replica exiting stops the
demo, with the reason.
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
from typing import Callable

import httpx

from devkit.stack import Stack, StackError, free_port
from devkit.workload import Results, workload_for
from routing.scheduling.strategies import NAMES as STRATEGIES

# The comparison the demo runs by default (README's table): kvgate's own and AIBrix's basic ones; any other
# name (`--strategies least-latency,session-affinity`, say) on request
DEFAULT_STRATEGIES = ("random", "round-robin", "least-request", "prefix-cache", "kv-sync", "slo")
from tokenizer import testdata

# With --pd (a P/D fleet): pd beside two aggregated strategies (which serve on the decode engines).
PD_DEFAULT = ["least-request", "kv-sync", "pd"]
MODEL = "demo-model"
MODEL_SHAPES = ("dense", "hybrid")  # of sim.shapes.MODEL_SHAPES, the ones the demo offers
BLOCK_SIZE = 16  # the sims' KV block size: kvgate's believed cached blocks times this are tokens


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
    p.add_argument("--strategies", default=None,
                   help=f"comma-separated strategies to compare (default {','.join(DEFAULT_STRATEGIES)}; with --pd "
                        f"{','.join(PD_DEFAULT)}; any of {', '.join(STRATEGIES)})")
    p.add_argument("--pd", action="store_true",
                   help="a prefill/decode fleet: 2 prefill + 2 decode engines (--sims and --dp-size are ignored), "
                        "the pd strategy beside aggregated ones (which serve on the decode engines only)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    p.add_argument("--workload", choices=("chat", "agent", "mix"), default="chat",
                   help="chat: multi-turn chats sharing system prompts; agent: agents resending a tool list every "
                        "turn over the three APIs (chat with tools, the Responses API continuing by "
                        "previous_response_id, Anthropic messages); mix: half the groups each (default chat)")
    p.add_argument("--slices", type=int, default=4,
                   help="run each strategy's traffic in this many slices, alternating between the strategies on "
                        "the same stack so they see the same machine load (default 4; 1: one run per strategy)")
    p.add_argument("--external", metavar="URL",
                   help="drive traffic at an existing gateway (e.g. docker-compose's Envoy) instead of starting one")
    p.add_argument("--engines", metavar="URL,...", default="",
                   help="with --external: the engines whose /metrics give the hit rate")
    p.add_argument("--model-shape", choices=MODEL_SHAPES, default="dense",
                   help="the simulated engines' KV cache groups: dense (one full-attention group) or hybrid "
                        "(gpt-oss-like: group 0 a 128-token sliding window with vLLM's sparse retention, group 1 "
                        "full attention) (default dense)")


@dataclass
class Engine:
    name: str
    url: str
    kv_events: str


# Small caches, so a strategy that scatters a group's conversations over every engine evicts them.
_SIM_ARGS = ["--num-blocks", "512", "--block-size", str(BLOCK_SIZE), "--ttft-overhead-ms", "5",
             "--prefill-ms-per-token", "0.1", "--tpot-ms", "2"]


def sim_args(model_shape: str) -> list[str]:
    """The `kvgate sim` options of the demo's engines for a model shape (sim.shapes: the hybrid shape's
    window and retention are the sim's defaults, vLLM's: 128 tokens, sparse)."""
    if model_shape not in MODEL_SHAPES:
        raise ValueError(f"model shape must be one of {', '.join(MODEL_SHAPES)}, got {model_shape!r}")
    return [*_SIM_ARGS, "--model-shape", model_shape]


def _start(stack: Stack, n_sims: int, n_gateways: int, log, dp_size: int = 1, model_shape: str = "dense",
           pd: bool = False) -> dict:
    if pd:  # two prefill engines, two decode engines (kvgate runs the prefill legs: routing.pd, plugin.pd)
        pods = stack.engines(4, model=MODEL, extra=sim_args(model_shape))
        for p, role in zip(pods, ("prefill", "prefill", "decode", "decode")):
            p["role"] = role
    else:
        pods = stack.engines(n_sims, model=MODEL, extra=sim_args(model_shape), dp=[1] * (n_sims - 1) + [dp_size])
    engines = [Engine(p["name"], f"http://127.0.0.1:{p['port']}", f"tcp://127.0.0.1:{p['kv_events']['pub_port']}")
               for p in pods]
    for p in pods:
        kv = p["kv_events"]
        dp = kv.get("dp_size", 1)
        ranks = f", {dp} data-parallel ranks on ports + rank" if dp > 1 else ""
        role = f", role {p['role']}" if "role" in p else ""
        log(f"  engine {p['name']} on :{p['port']} (KV events :{kv['pub_port']}, replay :{kv['replay_port']}{ranks}"
            f"{role})")
    pods_file = stack.pods_file(pods)
    redis_url = ""
    if shutil.which("redis-server"):
        _, redis_url = stack.redis()
        log(f"  redis-server at {redis_url}")
    else:
        log("  redis-server not installed: running counts stay in process")
    grpc_ports, http_ports, replicas = [], [], []
    for g in range(n_gateways):  # started together, then waited for
        grpc_port, http_port = free_port(), free_port()
        env = {"KVGATE_PODS_FILE": str(pods_file), "KVGATE_GRPC_PORT": str(grpc_port),
               "KVGATE_HTTP_PORT": str(http_port), "KVGATE_REDIS_URL": redis_url,
               "KVGATE_ROUTING_STRATEGY": "kv-sync", "KVGATE_GATEWAY_ID": f"kvgate{g}",
               # The sims' own tokenizer files: kvgate tokenizes locally once its tokens match the sims' /tokenize.
               "KVGATE_TOKENIZER_PATH": str(testdata.path()),
               # The demo stops its whole stack at once: no load balancer to drain for (3 s per stop otherwise).
               "KVGATE_DRAIN_DELAY_S": "0"}
        replicas.append(stack.kvgate(env=env, grpc_port=grpc_port, name=f"kvgate{g}", wait=False))
        grpc_ports.append(grpc_port)
        http_ports.append(http_port)
    for g, (proc, grpc_port, http_port) in enumerate(zip(replicas, grpc_ports, http_ports)):
        stack.ready(proc, ("127.0.0.1", grpc_port))
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
            "model": MODEL, "model_shape": model_shape}


def _sum_samples(text: str, first: str, second: str) -> tuple[float, float]:
    """The sums of the samples whose line starts with `first`, and with `second`, in a /metrics text."""
    a = b = 0.0
    for line in text.splitlines():
        if line.startswith(first):
            a += float(line.rsplit(" ", 1)[1])
        elif line.startswith(second):
            b += float(line.rsplit(" ", 1)[1])
    return a, b


def _prefix_counters(text: str) -> tuple[float, float]:
    """(queries, hits) prompt tokens of one engine's prefix cache (vLLM's counters)."""
    return _sum_samples(text, "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")


def _believed_counters(text: str) -> tuple[float, float]:
    """(total, cached) prompt blocks of the requests one kvgate replica routed (kvgate_prefix_blocks_total):
    cached are those it believed the chosen pod held."""
    return _sum_samples(text, 'kvgate_prefix_blocks_total{kind="total"}', 'kvgate_prefix_blocks_total{kind="cached"}')


async def _scraped(urls: list[str], read: Callable[[str], tuple[float, float]]) -> tuple[float, float]:
    """`read` of each /metrics of `urls`, summed (engines: their prefix caches; replicas: what each routed)."""
    async with httpx.AsyncClient(timeout=5.0) as client:
        answers = await asyncio.gather(*(client.get(u + "/metrics") for u in urls))
    a = b = 0.0
    for r in answers:
        x, y = read(r.text)
        a, b = a + x, b + y
    return a, b


async def _engine_counters(urls: list[str]) -> tuple[float, float]:
    return await _scraped(urls, _prefix_counters)


async def _gateway_counters(gateways: list[str]) -> tuple[float, float]:
    return await _scraped(gateways, _believed_counters)


async def _reset_caches(urls: list[str]) -> None:
    async with httpx.AsyncClient(timeout=5.0) as client:
        await asyncio.gather(*(client.post(u + "/reset_prefix_cache") for u in urls))


def _merge(total: Results, part: Results) -> None:
    total.ttft_s += part.ttft_s
    total.requests += part.requests
    total.errors += part.errors
    total.error_samples += part.error_samples[:max(0, 5 - len(total.error_samples))]
    total.elapsed_s += part.elapsed_s
    total.slo_met += part.slo_met
    for pod, n in part.pods.items():
        total.pods[pod] = total.pods.get(pod, 0) + n


def slice_order(strategies: list[str], slices: int) -> list[tuple[int, str]]:
    """(slice, strategy) in the order they run: every strategy once per slice, the order reversed every
    other slice (A B, B A, A B, ...), so no strategy always runs first on a fresh cache or last on a
    machine the previous one left busy."""
    out = []
    for k in range(slices):
        order = strategies if k % 2 == 0 else strategies[::-1]
        out += [(k, s) for s in order]
    return out


async def _compare(envoy_url: str, engine_urls: list[str], strategies: list[str], duration: float,
                   concurrency: int, log, slices: int = 1, gateways: list[str] | None = None,
                   workload_kind: str = "chat") -> dict[str, dict]:
    """Each strategy gets `duration` seconds of traffic, in `slices` slices alternating between the
    strategies on the same stack (so all of them see the same machine load over the run); each slice
    starts from empty prefix caches and sends its slice's traffic (the same for every strategy).
    With `gateways` (the kvgate replicas' base URLs) and engines: what kvgate believed cached beside the
    engines' real hits (a strategy that looks up no prefix believes nothing: None)."""
    out: dict[str, dict] = {}
    totals = {s: Results() for s in strategies}
    counters = {s: [0.0, 0.0] for s in strategies}
    believed = {s: [0.0, 0.0] for s in strategies}  # prompt blocks routed, of which believed cached
    gateways = gateways if engine_urls else []
    part_s = duration / slices
    for k, strategy in slice_order(strategies, slices):
        if engine_urls:
            await _reset_caches(engine_urls)
            await asyncio.sleep(0.3)  # let the cache-cleared events reach the index
            before = await _engine_counters(engine_urls)
        if gateways:
            believed_before = await _gateway_counters(gateways)
        workload = workload_for(workload_kind, concurrency, MODEL, seed=1 + k)
        last = [0.0]
        done_s = totals[strategy].elapsed_s

        def progress(res: Results, elapsed: float, strategy: str = strategy, last: list[float] = last,
                     done_s: float = done_s) -> None:  # bound now: each slice's own
            if elapsed - last[0] >= 2.0:
                last[0] = elapsed
                log(f"  {strategy:<14} {done_s + elapsed:5.1f}/{duration:.0f} s  "
                    f"{totals[strategy].requests + res.requests} requests, {totals[strategy].errors + res.errors} errors")

        part = await workload.run(envoy_url, part_s, strategy=strategy, progress=progress)
        _merge(totals[strategy], part)
        if engine_urls:
            after = await _engine_counters(engine_urls)
            counters[strategy][0] += after[0] - before[0]
            counters[strategy][1] += after[1] - before[1]
        if gateways:
            believed_after = await _gateway_counters(gateways)
            believed[strategy][0] += believed_after[0] - believed_before[0]
            believed[strategy][1] += believed_after[1] - believed_before[1]
    for strategy in strategies:
        res = totals[strategy]
        hit_rate = believed_rate = None
        if engine_urls:
            dq, dh = counters[strategy]
            hit_rate = dh / dq if dq else 0.0
            # believed cached tokens over the same denominator as the real rate: the prompt tokens the
            # engines looked up (so the two differ by what kvgate got wrong, not by partial blocks)
            if gateways and believed[strategy][0] and dq:
                believed_rate = believed[strategy][1] * BLOCK_SIZE / dq
        p50, p90 = res.percentile(0.5), res.percentile(0.9)
        out[strategy] = {
            "hit_rate": None if hit_rate is None else round(hit_rate, 4),
            "believed_hit_rate": None if believed_rate is None else round(believed_rate, 4),
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

    def pct(v):
        return "-" if v is None else format(v * 100, ".1f") + "%"

    lines = [f"{'strategy':<14} {'hit rate':>9} {'believed':>9} {'SLO met':>8} {'TTFT p50 ms':>12} {'TTFT p90 ms':>12} "
             f"{'req/s':>7} {'requests':>9} {'errors':>7}"]
    for name, r in results.items():
        lines.append(f"{name:<14} {pct(r['hit_rate']):>9} {pct(r.get('believed_hit_rate')):>9} "
                     f"{pct(r.get('slo_attainment')):>8} {f(r['ttft_p50_ms'], '12.1f')} "
                     f"{f(r['ttft_p90_ms'], '12.1f')} {r['requests_per_s']:7.1f} {r['requests']:9d} {r['errors']:7d}")
    return "\n".join(lines)


async def _pd_modes(gateways: list[str]) -> dict[str, float]:
    """How the pd strategy served its requests over every replica (kvgate_pd_requests_total by mode)."""
    out: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=5.0) as client:
        answers = await asyncio.gather(*(client.get(g + "/metrics") for g in gateways), return_exceptions=True)
    for r in answers:
        if isinstance(r, httpx.Response) and r.status_code == 200:
            for line in r.text.splitlines():
                if line.startswith('kvgate_pd_requests_total{mode="'):
                    mode = line.split('"', 2)[1]
                    out[mode] = out.get(mode, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def _slo_model(gateways: list[str]) -> dict[str, dict]:
    """Each replica's learned engine profiles from its /debug: per pod the TTFT overhead and how far slo's
    TTFT predictions were off (observed - predicted)."""
    async with httpx.AsyncClient(timeout=5.0) as client:
        answers = await asyncio.gather(*(client.get(g + "/debug") for g in gateways), return_exceptions=True)
    out = {}
    for i, r in enumerate(answers):
        if isinstance(r, httpx.Response) and r.status_code == 200:
            out[f"kvgate{i}"] = r.json().get("profiles", {})
    return out


def _slo_model_lines(model: dict[str, dict]) -> list[str]:
    lines = []
    for gateway, pods in model.items():
        for pod, p in sorted(pods.items()):
            err = p.get("ttft_error_ms")
            if not err:
                continue
            over = p.get("ttft_overhead_ms", {})
            lines.append(f"{gateway} {pod}: slo TTFT observed - predicted {err['mean']:+.1f} ms "
                         f"(mean |error| {err['mean_abs']:.1f} ms, {p.get('ttft_samples', 0):g} samples); "
                         f"learned overhead {over.get('1', over.get(1, 0)):.1f} ms at 1 running, "
                         f"{over.get('8', over.get(8, 0)):.1f} ms at 8")
    return lines


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


class _StopSignals:
    """SIGINT and SIGTERM: the first raises _Stop where the demo runs (unwinding to the stack's
    shutdown), or, while traffic runs on an event loop, cancels its main task (an exception raised
    in the middle of a task would end that task only); any later one, once `stopping` is set, only
    sets `hurry`. _Stop can land in library code that catches Exception and raises something else
    (threading.Thread.start does): once `stopping` is set, main() takes any exception for the stop."""

    def __init__(self) -> None:
        self.stopping = False
        self.hurry = False
        self.reason = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None

    def install(self) -> None:
        # Explicitly, for SIGINT too: a background job of a script starts with SIGINT ignored, and
        # Python then installs no handler of its own.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def ignore(self) -> None:
        """From now on stop signals are ignored. Python's finalisation puts back the default action of a
        signal it handled (a SIGINT then kills the process, status -2) but leaves an ignored one ignored."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)

    def _on_signal(self, signum, frame) -> None:
        if self.stopping:
            self.hurry = True
            return
        self.stopping = True
        self.reason = signal.Signals(signum).name
        task, loop = self._task, self._loop
        if task is not None and loop is not None and not task.done():
            task.cancel()
            loop.call_soon_threadsafe(lambda: None)  # wake the loop if it waits in select()
            return
        raise _Stop(self.reason)

    def run(self, coro):
        """asyncio.run(coro), a stop signal cancelling it; raises _Stop if one did."""
        async def main():
            self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
            try:
                return await coro
            finally:
                self._task = None

        try:
            result = asyncio.run(main())
        except asyncio.CancelledError:
            if not self.stopping:
                raise
        if self.stopping:
            raise _Stop(self.reason)
        return result


def _supervise(stack: Stack, engines: set[str], log, signals: _StopSignals) -> int:
    """Until a stop signal: report engines that exit (the others keep serving); return 1 when
    something else (Envoy, Redis, a kvgate replica) or the last engine exits."""
    gone: set[str] = set()
    while True:
        if signals.stopping:  # its _Stop landed in code that swallowed it
            raise _Stop(signals.reason)
        for proc in stack.procs:
            if proc.name in gone or proc.alive():
                continue
            gone.add(proc.name)
            status = proc.popen.returncode
            if proc.name not in engines:
                log(f"kvgate demo: {proc.name} exited (status {status}); the demo cannot serve without it, "
                    f"stopping the stack")
                return 1
            left = sorted(engines - gone)
            if not left:
                log(f"kvgate demo: engine {proc.name} exited (status {status}), the last one; stopping the stack")
                return 1
            log(f"kvgate demo: engine {proc.name} exited (status {status}); kvgate routes around it, "
                f"the stack keeps serving on {', '.join(left)}")
        time.sleep(0.2)


def main(args: argparse.Namespace) -> int:
    chosen = args.strategies if args.strategies is not None else ",".join(PD_DEFAULT if args.pd else DEFAULT_STRATEGIES)
    strategies = [s for s in chosen.split(",") if s]
    if args.gateways < 1 or args.sims < 1 or args.dp_size < 1 or args.slices < 1:
        print("kvgate demo: --gateways, --sims, --dp-size and --slices must be at least 1", file=sys.stderr)
        return 2
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        print(f"kvgate demo: unknown strategy {unknown[0]!r}; known: {', '.join(STRATEGIES)}", file=sys.stderr)
        return 2

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.external:
        engines = [u for u in args.engines.split(",") if u]
        results = asyncio.run(_compare(args.external, engines, strategies, args.duration, args.concurrency, log,
                                       args.slices, workload_kind=args.workload))
        print(json.dumps({"strategies": results}) if args.json else _table(results), flush=True)
        return 0

    signals = _StopSignals()
    signals.install()
    stack = Stack()
    try:
        fleet = "2 prefill + 2 decode" if args.pd else str(args.sims)
        log(f"kvgate demo: starting {fleet} engines ({args.model_shape} model shape), kvgate and Envoy on "
            f"loopback (logs in {stack.workdir})")
        info = _start(stack, args.sims, args.gateways, log, args.dp_size, args.model_shape, pd=args.pd)
        if args.no_traffic:
            print(json.dumps(info), flush=True)
            return _supervise(stack, {p["name"] for p in info["pods"]}, log, signals)
        what = {"chat": "multi-turn chat", "agent": "agent (tools; chat, responses, messages)",
                "mix": "chat and agent"}[args.workload]
        log(f"kvgate demo: {args.duration:.0f} s of {what} traffic per strategy: {', '.join(strategies)}")
        results = signals.run(_compare(info["envoy_url"], [p["url"] for p in info["pods"]], strategies,
                                       args.duration, args.concurrency, log, args.slices, info["gateways"],
                                       workload_kind=args.workload))
        tokenizer = asyncio.run(_tokenizer_status(info["gateways"]))
        slo_model = asyncio.run(_slo_model(info["gateways"]))
        pd_modes = asyncio.run(_pd_modes(info["gateways"])) if "pd" in strategies else {}
        if args.json:
            print(json.dumps({"strategies": results, "tokenizer": tokenizer, "slo_model": slo_model,
                              **({"pd_modes": pd_modes} if pd_modes else {})}), flush=True)
        else:
            print(_table(results), flush=True)
            if pd_modes:
                print("\npd served its requests: " + ", ".join(f"{m} {n:.0f}" for m, n in sorted(pd_modes.items()))
                      + " (hit rate: every engine's counters, a decode leg's lookup of its prompt included; "
                      "aggregated strategies serve on the decode engines only)", flush=True)
            print(f"\nhit rate: prompt tokens served from the engines' prefix caches (their own /metrics); "
                  f"believed: the blocks kvgate believed the chosen engine held (kvgate_prefix_blocks_total, "
                  f"summed over the replicas) times {BLOCK_SIZE} tokens, over the same prompt tokens "
                  f"({args.model_shape} model shape; '-': the strategy looks up no prefix).", flush=True)
            if any(_slo_model_lines(slo_model)):
                print("\n" + "\n".join(_slo_model_lines(slo_model)), flush=True)
            print("\n" + "\n".join(_tokenizer_lines(tokenizer)), flush=True)
        return 0
    except _Stop as e:
        log(f"kvgate demo: {e}: stopping (another stop signal stops it at once)")
        return 130 if not args.no_traffic else 0
    except Exception as e:
        if signals.stopping:  # the stop's exception, turned into another by the code it landed in
            log(f"kvgate demo: {signals.reason}: stopping (another stop signal stops it at once; where the "
                f"signal landed it became {type(e).__name__}: {e})")
            return 130 if not args.no_traffic else 0
        if isinstance(e, StackError):
            log(f"kvgate demo: {e}")
            return 1
        raise
    finally:
        while True:
            try:
                signals.stopping = True  # from here on a signal only hurries the shutdown
                stack.close(hurry=lambda: signals.hurry)
                break
            except _Stop:  # the first signal came just before `stopping` was set: stop all the same
                continue
        signals.ignore()  # every child is gone: a late signal must not kill the exiting interpreter
