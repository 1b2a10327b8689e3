"""`kvgate bench bakeoff`: kvgate as shipped against SGLang's model gateway, on the same engines, as a user feels it.

Issue 26's comparison, run end to end: three simulated engines (the demo's timing: 5 ms before the first token,
0.1 ms per prompt token not cached, 2 ms per output token; KV events with replay), and in front of them, by
turns on the same engines,
- `kv-sync` and `slo`: kvgate as shipped (a real Envoy with envoy/envoy.yaml, two `kvgate serve` replicas sharing
  redis-server, the local tokenizer), the strategy named per request (the `routing-strategy` header);
- `sglang`: SGLang's model gateway (PyPI's sglang-router, a bench dependency) with `--policy cache_aware` and its
  published defaults (cache_threshold 0.3, balance thresholds 64 and 1.5, its tree's eviction), started afresh
  for every run so no run inherits another's tree.
The workload is a multi-turn chat (WORKLOAD): tenants drawn Zipf-popular, each with a ~1,200-token system prompt;
each conversation 2-4 turns, every turn resending the whole history, a think time between turns; 8 conversations
at a time; every request streamed. Each run sends the same plan (seeded per repetition) through each router,
the engines' prefix caches emptied before it, the routers' order alternating from one repetition to the next.
Scenarios (SCENARIOS): `steady` (every prompt fits the fleet's caches), `evicting` (the fleet holds about half of
the plan's distinct prompt tokens), `flush-random` and `flush-rotate` (one engine's prefix cache reset every
FLUSH_EVERY requests sent: the engine drawn at random, seeded, or the engines in turn; vLLM takes a reset only
while no request runs on the engine, so it lands at the engine's first idle moment).
Per router and scenario: the engines' own prefix-cache hit rate over the run (vllm:prefix_cache_hits over
queries), time to first token (mean, p50, p90: from the request sent to the first chunk carrying a token, read by
the same client for every router), requests per engine (the engine's x-sim-name header), errors, and the
router's CPU per request (kvgate: both replicas and Envoy; SGLang: its process). Targets (issue 26, here on
the live stack): in each scenario kv-sync's TTFT mean, p50 and p90 <= SGLang's and its hit rate >= SGLang's
- 0.5 point.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import math
import random
import shutil
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.path import _cpu_seconds, _pct, start_replicas, start_sglang
from devkit.demo import BLOCK_SIZE, _engine_counters, _reset_caches
from devkit.stack import Proc, Stack, StackError, free_port
from devkit.workload import _text, sse_events

MODEL = "bakeoff-model"
ROUTERS = ("kv-sync", "slo", "sglang")
KVGATE_ROUTERS = ("kv-sync", "slo")
SCENARIOS = ("steady", "evicting", "flush-random", "flush-rotate")
FLUSH_EVERY = 20
ENGINES = 3  # the fleet: simulated engines per scenario
FLUSH_RETRY_S, FLUSH_PATIENCE_S = 0.05, 5.0  # a refused reset (requests running) asked again until it lands
STEADY_BLOCKS = 4096  # per engine: 65,536 tokens, more than any plan's distinct prompt tokens
# the demo's engine timing (devkit.demo), so TTFT is prefill of what is not cached plus the batch's decode
SIM_ARGS = ["--block-size", str(BLOCK_SIZE), "--ttft-overhead-ms", "5", "--prefill-ms-per-token", "0.1",
            "--tpot-ms", "2"]
TOKENS_PER_WORD = 2.75  # devkit.workload's words under the engines' tokenizer (tokenizer/testdata), measured


@dataclass(frozen=True)
class Workload:
    tenants: int = 12
    zipf: float = 1.0  # tenant k drawn with weight 1 / (k + 1) ** zipf
    system_words: int = 440  # ~1,200 tokens
    question_words: int = 30
    max_tokens: int = 24
    turns: tuple[int, int] = (2, 4)
    think_s: tuple[float, float] = (0.1, 0.4)
    conversations_at_once: int = 8


WORKLOAD = Workload()


@dataclass(frozen=True)
class Conversation:
    tenant: int
    questions: tuple[str, ...]
    thinks: tuple[float, ...]


@dataclass(frozen=True)
class Plan:
    systems: tuple[str, ...]
    conversations: tuple[Conversation, ...]
    requests: int

    def distinct_prompt_tokens(self, w: Workload) -> int:
        """About how many distinct prompt tokens the plan sends (each system prompt once, each turn's
        question and answer once), by TOKENS_PER_WORD."""
        used = {c.tenant for c in self.conversations}
        words = sum(len(self.systems[t].split()) for t in used)
        words += sum(len(c.questions) * w.question_words for c in self.conversations)
        return int(words * TOKENS_PER_WORD + sum(len(c.questions) for c in self.conversations) * w.max_tokens)


def make_plan(seed: int, requests: int, w: Workload = WORKLOAD) -> Plan:
    """Conversations until `requests` turns in all: a tenant by Zipf, 2-4 questions, think times."""
    rng = random.Random(seed)
    systems = tuple(f"You are assistant {t} of tenant {t}. " + _text(rng, w.system_words) for t in range(w.tenants))
    weights = [1 / (k + 1) ** w.zipf for k in range(w.tenants)]
    conversations, n = [], 0
    while n < requests:
        turns = min(rng.randint(*w.turns), requests - n)
        tenant = rng.choices(range(w.tenants), weights)[0]
        conversations.append(Conversation(tenant, tuple(_text(rng, w.question_words) for _ in range(turns)),
                                          tuple(rng.uniform(*w.think_s) for _ in range(turns))))
        n += turns
    return Plan(systems, tuple(conversations), n)


@dataclass
class RunResult:
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)  # per request: the mean gap between its token chunks
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    flushes: int = 0
    flush_errors: int = 0  # resets an engine did not take
    system_missed: int = 0  # requests whose engine held not even their system prompt
    history_lost: int = 0  # later turns whose engine held their system prompt but not the turns before
    tenants: dict[int, Counter] = field(default_factory=dict)  # tenant -> its requests per engine
    queries: float = 0.0  # the engines' prefix-cache counters over the run
    hits: float = 0.0
    cpu_s: float | None = None


class Flusher:
    """Every FLUSH_EVERY requests sent, one engine's prefix cache reset: `order` names which, in turn, at the
    engine's first moment without running requests (vLLM resets no sooner). A reset the engine did not take (an
    error, or still refused after FLUSH_PATIENCE_S) is counted in `result.flush_errors`, not in `flushes`."""

    def __init__(self, engine_urls: list[str], order: list[int] | None, result: RunResult) -> None:
        self.urls, self.order, self.result = engine_urls, order, result
        self.sent = 0
        self.tasks: list[asyncio.Task] = []

    def sending(self, client: httpx.AsyncClient) -> None:
        self.sent += 1
        if self.order is None or self.sent % FLUSH_EVERY:
            return
        url = self.urls[self.order[(self.sent // FLUSH_EVERY - 1) % len(self.order)]]
        self.tasks.append(asyncio.create_task(self._reset(client, url)))

    async def _reset(self, client: httpx.AsyncClient, url: str) -> None:
        """vLLM refuses a reset while requests run on the engine (409; so does the sim): asked again every
        FLUSH_RETRY_S until the engine takes it, at most FLUSH_PATIENCE_S."""
        deadline = time.monotonic() + FLUSH_PATIENCE_S
        while True:
            try:
                status = (await client.post(url + "/reset_prefix_cache")).status_code
            except httpx.HTTPError:
                status = 0
            if status == 200:
                self.result.flushes += 1
                return
            if status != 409 or time.monotonic() > deadline:
                self.result.flush_errors += 1
                return
            await asyncio.sleep(FLUSH_RETRY_S)

    async def settle(self) -> None:
        await asyncio.gather(*self.tasks)


async def _turn(client: httpx.AsyncClient, url: str, messages: list[dict], headers: dict[str, str],
                w: Workload, result: RunResult) -> tuple[str, int, int, str] | None:
    """One streamed chat; its TTFT and engine recorded; (the answer's text, prompt tokens, cached prompt tokens
    by the engine's usage, the engine), or None where it failed."""
    body = {"model": MODEL, "messages": messages, "stream": True, "max_tokens": w.max_tokens,
            "stream_options": {"include_usage": True}}
    pieces: list[str] = []
    usage: dict = {}
    started = time.perf_counter()
    first = last = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                await r.aread()
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
            engine = r.headers.get("x-sim-name", "?")
            async for chunk in sse_events(r):
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    text = choice.get("delta", {}).get("content")
                    if text:
                        last = time.perf_counter() - started
                        if first is None:
                            first = last
                        pieces.append(text)
        if first is None:
            raise RuntimeError("the stream carried no token")
        prompt, cached = usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {})["cached_tokens"]
    except (httpx.HTTPError, RuntimeError, ValueError, KeyError, TypeError) as e:
        result.errors += 1
        if len(result.error_samples) < 3:
            result.error_samples.append(str(e) or type(e).__name__)
        return None
    result.ttft_s.append(first)
    if len(pieces) > 1 and last is not None:
        result.tpot_s.append((last - first) / (len(pieces) - 1))
    return "".join(pieces), prompt, cached, engine


async def drive(base_url: str, headers: dict[str, str], plan: Plan, w: Workload, engine_urls: list[str],
                flush_order: list[int] | None) -> RunResult:
    """The plan's conversations through `base_url`, `w.conversations_at_once` at a time."""
    result = RunResult()
    pending = list(reversed(plan.conversations))
    limits = httpx.Limits(max_connections=w.conversations_at_once * 2)
    async with httpx.AsyncClient(timeout=60.0, limits=limits) as client:
        flusher = Flusher(engine_urls, flush_order, result)

        async def conversation_worker() -> None:
            while pending:
                c = pending.pop()
                messages = [{"role": "system", "content": plan.systems[c.tenant]}]
                first_prompt = last_prompt = 0
                for turn, (question, think) in enumerate(zip(c.questions, c.thinks)):
                    messages.append({"role": "user", "content": question})
                    flusher.sending(client)
                    answered = await _turn(client, base_url + "/v1/chat/completions", messages, headers, w, result)
                    if answered is None:
                        break  # the conversation's history was not answered: it ends here
                    answer, prompt, cached, engine = answered
                    result.tenants.setdefault(c.tenant, Counter())[engine] += 1
                    if turn == 0:
                        first_prompt = prompt
                    # the system prompt is most of a first turn's prompt; a later turn's history is the turn
                    # before's whole prompt (less its last partial block)
                    if cached < first_prompt // 2:
                        result.system_missed += 1
                    elif turn and cached < last_prompt - BLOCK_SIZE:
                        result.history_lost += 1
                    last_prompt = prompt
                    messages.append({"role": "assistant", "content": answer})
                    await asyncio.sleep(think)

        await asyncio.gather(*(conversation_worker() for _ in range(w.conversations_at_once)))
        await flusher.settle()
    return result


def _start_sglang(stack: Stack, engine_urls: list[str], run: int) -> tuple[Proc, str]:
    started = start_sglang(stack, engine_urls, f"sglang{run}", model=MODEL)
    if started is None:
        raise StackError("sglang-router is not installed (pip install -e '.[bench]'): the bake-off's peer")
    return started[0], f"http://127.0.0.1:{started[1]}"


async def _wait_served(url: str, headers: dict[str, str], timeout: float = 20.0) -> None:
    """A router answers a one-token chat (SGLang activates its workers after it listens)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "ready?"}], "max_tokens": 1}
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5.0) as client:
        while True:
            try:
                r = await client.post(url + "/v1/chat/completions", json=body, headers=headers)
                if r.status_code == 200:
                    return
                why = f"HTTP {r.status_code}: {r.text[:200]}"
            except httpx.HTTPError as e:
                why = str(e) or type(e).__name__
            if time.monotonic() > deadline:
                raise StackError(f"{url} did not answer a chat within {timeout:.0f} s ({why})")
            await asyncio.sleep(0.2)


def engine_blocks(scenario: str, plans: list[Plan], w: Workload, engines: int) -> int:
    """Blocks per engine: STEADY_BLOCKS, or for `evicting` half the largest plan's distinct prompt tokens
    over the fleet."""
    if scenario != "evicting":
        return STEADY_BLOCKS
    tokens = max(p.distinct_prompt_tokens(w) for p in plans)
    return max(64, math.ceil(tokens / 2 / BLOCK_SIZE / engines))


def flush_order(scenario: str, seed: int, engines: int, requests: int) -> list[int] | None:
    if not scenario.startswith("flush"):
        return None
    if scenario == "flush-rotate":
        return list(range(engines))
    rng = random.Random(1000 + seed)
    return [rng.randrange(engines) for _ in range(requests // FLUSH_EVERY + 1)]


def run_scenario(scenario: str, routers: list[str], plans: list[Plan], w: Workload, log,
                 kvgate_env: dict[str, str] | None = None, replicas: int = 2) -> dict[str, list[RunResult]]:
    blocks = engine_blocks(scenario, plans, w, ENGINES)
    out: dict[str, list[RunResult]] = {r: [] for r in routers}
    with Stack() as stack:
        pods = stack.engines(ENGINES, model=MODEL, extra=[*SIM_ARGS, "--num-blocks", str(blocks)])
        engine_urls = [f"http://127.0.0.1:{p['port']}" for p in pods]
        pool = [("127.0.0.1", p["port"]) for p in pods]
        envoy_url, kvgate_pids = "", []
        if any(r in KVGATE_ROUTERS for r in routers):
            _, redis_url = stack.redis()
            grpc_ports, _, procs = start_replicas(stack, stack.pods_file(pods), redis_url, replicas, kvgate_env)
            listen = free_port()
            envoy = stack.envoy(listen_port=listen, extproc_port=grpc_ports[0], more_extproc_ports=grpc_ports[1:],
                                pool=pool)
            envoy_url = f"http://127.0.0.1:{listen}"
            kvgate_pids = [p.popen.pid for p in procs] + [envoy.popen.pid]
            for r in routers:
                if r in KVGATE_ROUTERS:
                    asyncio.run(_wait_served(envoy_url, {"routing-strategy": r}))
        log(f"bakeoff {scenario}: {ENGINES} engines of {blocks} blocks of {BLOCK_SIZE} tokens")
        for rep, plan in enumerate(plans):
            order = routers if rep % 2 == 0 else routers[::-1]
            for router in order:
                asyncio.run(_reset_caches(engine_urls))
                time.sleep(0.3)  # the engines' cache-cleared events reach kvgate's index
                sglang = None
                if router == "sglang":
                    sglang, url = _start_sglang(stack, engine_urls, rep)
                    asyncio.run(_reset_caches(engine_urls))  # the readiness chat's blocks
                    headers, pids = {}, [sglang.popen.pid]
                else:
                    url, headers, pids = envoy_url, {"routing-strategy": router}, kvgate_pids
                before, cpu_before = asyncio.run(_engine_counters(engine_urls)), _cpu_seconds(pids)
                result = asyncio.run(drive(url, headers, plan, w, engine_urls,
                                           flush_order(scenario, rep, ENGINES, plan.requests)))
                after, cpu_after = asyncio.run(_engine_counters(engine_urls)), _cpu_seconds(pids)
                result.queries, result.hits = after[0] - before[0], after[1] - before[1]
                if cpu_before is not None and cpu_after is not None:
                    result.cpu_s = cpu_after - cpu_before
                if sglang is not None:
                    sglang.stop()
                out[router].append(result)
                log(f"  {scenario} run {rep + 1} {router:<7} {len(result.ttft_s)} requests, {result.errors} errors, "
                    f"hit {_ratio(result.hits, result.queries):.1%}, TTFT p50 {_ms(_pct(result.ttft_s, 0.5))} ms")
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1e3, 2)


def summarize_router(runs: list[RunResult]) -> dict[str, Any]:
    ttft = [t for r in runs for t in r.ttft_s]
    tpot = [t for r in runs for t in r.tpot_s]
    queries, hits = sum(r.queries for r in runs), sum(r.hits for r in runs)
    engines = sum((c for r in runs for c in r.tenants.values()), Counter())  # every answered request's engine
    cpu = [r.cpu_s for r in runs]
    served = len(ttft)
    return {
        "requests": served, "errors": sum(r.errors for r in runs),
        "error_samples": [s for r in runs for s in r.error_samples][:3],
        "hit_rate": round(_ratio(hits, queries), 4),
        "hit_rate_runs": [round(_ratio(r.hits, r.queries), 4) for r in runs],
        "ttft_mean_ms": _ms(statistics.fmean(ttft)) if ttft else None,
        "ttft_p50_ms": _ms(_pct(ttft, 0.5)), "ttft_p90_ms": _ms(_pct(ttft, 0.9)),
        "tpot_p50_ms": _ms(_pct(tpot, 0.5)), "tpot_p90_ms": _ms(_pct(tpot, 0.9)),
        "engines": dict(sorted(engines.items())),
        "flushes": sum(r.flushes for r in runs), "flush_errors": sum(r.flush_errors for r in runs),
        "system_missed": sum(r.system_missed for r in runs), "history_lost": sum(r.history_lost for r in runs),
        # how a router keeps a tenant together: the share of the requests on each tenant's busiest engine
        "tenant_home_share": round(_ratio(sum(max(c.values()) for r in runs for c in r.tenants.values()),
                                          sum(sum(c.values()) for r in runs for c in r.tenants.values())), 4),
        "router_cpu_ms_per_request": (round(sum(c for c in cpu if c is not None) / served * 1e3, 3)
                                      if served and None not in cpu else None),
    }


def targets(scenarios: dict[str, dict[str, dict]]) -> dict[str, bool]:
    """Issue 26's, on the live stack: kv-sync's TTFT mean, p50, p90 <= SGLang's; hit rate >= SGLang's - 0.5 point."""
    out = {}
    for name, routers in scenarios.items():
        ours, theirs = routers.get("kv-sync"), routers.get("sglang")
        if not ours or not theirs or not ours["requests"] or not theirs["requests"]:
            continue
        for m in ("ttft_mean_ms", "ttft_p50_ms", "ttft_p90_ms"):
            out[f"{name}: kv-sync {m} <= sglang's"] = ours[m] <= theirs[m]
        out[f"{name}: kv-sync hit_rate >= sglang's - 0.5 point"] = ours["hit_rate"] >= theirs["hit_rate"] - 0.005
    return out


def run(scenarios: list[str], routers: list[str], requests: int, reps: int, log, w: Workload = WORKLOAD,
        kvgate_env: dict[str, str] | None = None, replicas: int = 2) -> dict:
    if "sglang" in routers and importlib.util.find_spec("sglang_router") is None:
        raise StackError("sglang-router is not installed (a bench dependency: ./dev setup installs it)")
    if any(r in KVGATE_ROUTERS for r in routers) and not shutil.which("redis-server"):
        raise StackError("redis-server not found (Debian package redis-server; ./dev setup installs it)")
    plans = [make_plan(seed, requests, w) for seed in range(1, reps + 1)]
    started = time.monotonic()
    out: dict[str, dict[str, dict]] = {}
    for scenario in scenarios:
        results = run_scenario(scenario, routers, plans, w, log, kvgate_env, replicas)
        out[scenario] = {r: summarize_router(runs) for r, runs in results.items()}
        for summary in out[scenario].values():  # each tenant's first request finds its system prompt nowhere
            summary["system_missed_floor"] = sum(len({c.tenant for c in p.conversations}) for p in plans)
    return {"scenarios": out, "engine_blocks": {s: engine_blocks(s, plans, w, ENGINES) for s in scenarios},
            "kvgate_env": kvgate_env or {}, "kvgate_replicas": replicas, "requests_per_run": requests, "reps": reps, "flush_every": FLUSH_EVERY,
            "workload": {"tenants": w.tenants, "zipf": w.zipf, "system_words": w.system_words,
                         "turns": list(w.turns), "think_s": list(w.think_s),
                         "conversations_at_once": w.conversations_at_once, "max_tokens": w.max_tokens},
            "targets": targets(out), "seconds": round(time.monotonic() - started, 1)}


def table(result: dict) -> str:
    lines = [f"bakeoff: {result['reps']} runs of {result['requests_per_run']} streamed chats per router and scenario, "
             f"{result['workload']['conversations_at_once']} conversations at a time ({result['seconds']:.0f} s)",
             f"  {'scenario':<13} {'router':<7} {'hit %':>6} {'mean':>7} {'p50':>7} {'p90':>7} {'TPOT':>5}  {'errors':>6} "
             f"{'CPU/req':>8} {'sys':>4} {'hist':>4} {'home':>5}  requests per engine"]
    floor = next((s["system_missed_floor"] for routers in result["scenarios"].values() for s in routers.values()), None)
    for name, routers in result["scenarios"].items():
        for router, s in routers.items():
            cpu = s["router_cpu_ms_per_request"]
            lines.append(f"  {name:<13} {router:<7} {s['hit_rate'] * 100:6.1f} {s['ttft_mean_ms'] or 0:7.1f} "
                         f"{s['ttft_p50_ms'] or 0:7.1f} {s['ttft_p90_ms'] or 0:7.1f} {s['tpot_p50_ms'] or 0:5.2f}  {s['errors']:>6} "
                         f"{'-' if cpu is None else f'{cpu:.2f}':>8} {s['system_missed']:>4} {s['history_lost']:>4} {s['tenant_home_share']:5.2f}  "
                         + " / ".join(str(n) for n in s["engines"].values()))
    lines.append(f"  (TTFT in ms: mean, p50, p90; TPOT: p50 of each request's mean gap between token chunks, ms; CPU: the router's processes over the run, ms per request; sys: requests whose engine "
                 f"held not even their system prompt, of which {floor} were their tenant's first in the run; hist: later turns "
                 "that lost the turns before; home: the share of each tenant's requests on its busiest engine)")
    for what, ok in result["targets"].items():
        lines.append(f"  target {what}: {'met' if ok else 'MISSED'}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--scenario", action="append", choices=SCENARIOS,
                   help=f"a scenario to run (repeatable; default all: {', '.join(SCENARIOS)})")
    p.add_argument("--router", action="append", choices=ROUTERS,
                   help=f"a router to run (repeatable; default all: {', '.join(ROUTERS)})")
    p.add_argument("--requests", type=int, default=168, help="streamed chats per run (default 168)")
    p.add_argument("--reps", type=int, default=3, help="runs per router and scenario, each its own plan (default 3)")
    p.add_argument("--conversations", type=int, default=WORKLOAD.conversations_at_once,
                   help=f"conversations at a time (default {WORKLOAD.conversations_at_once}, the issue's; more loads "
                        "the engines)")
    p.add_argument("--replicas", type=int, default=2, help="kvgate replicas behind Envoy (default 2, as shipped)")
    p.add_argument("--kvgate-env", action="append", default=[], metavar="KVGATE_X=VALUE",
                   help="a setting of both kvgate replicas beyond the shipped ones (repeatable), to compare variants")


def main(args: argparse.Namespace) -> int:
    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if min(args.requests, args.reps, args.conversations, args.replicas) < 1:
        print("kvgate bench bakeoff: --requests, --reps, --conversations and --replicas must be at least 1",
              file=sys.stderr)
        return 2
    routers = [r for r in ROUTERS if r in (args.router or ROUTERS)]
    env = dict(item.partition("=")[::2] for item in args.kvgate_env)
    if any(not k.startswith("KVGATE_") for k in env):
        print("kvgate bench bakeoff: --kvgate-env takes KVGATE_X=VALUE", file=sys.stderr)
        return 2
    try:
        result = run(args.scenario or list(SCENARIOS), routers, args.requests, args.reps, log,
                     dataclasses.replace(WORKLOAD, conversations_at_once=args.conversations), kvgate_env=env,
                     replicas=args.replicas)
    except StackError as e:
        print(f"kvgate bench bakeoff: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result) if args.json else table(result), flush=True)
    return 0
