"""`kvgate bench soak --duration S`: the whole stack on loopback (simulated engines, Redis,
`kvgate serve`, a real Envoy) under mixed traffic for S seconds.

Traffic, `--concurrency` clients at a time: multi-turn streaming chats sharing system prompts,
non-streaming and streaming completions, and, as expected outcomes that must not disturb
anything, clients that hang up mid-stream and malformed bodies (400). At the end it reports:
unexpected errors (must be zero), kvgate's resident memory (VmRSS from /proc) after warm-up, at
the middle and at the end (growth must stay under `--max-rss-growth-mb`), and whether every
running count went back to zero (from kvgate's /debug). Exit status 1 when any check fails.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from devkit.stack import Stack, StackError, free_port, wait_for_port

MODEL = "soak-model"
_WORDS = ("cache block prefix token engine router request stream latency replica gateway event index memory "
          "batch prompt answer question system user chat fleet pod metric shared history context").split()
# Bounded on purpose: growth above this much plus slack is not a cache filling up.
_TOKENIZER_CACHE_MB = 32


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (default 600)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--concurrency", type=int, default=8, help="clients in flight (default 8)")
    p.add_argument("--sims", type=int, default=2, help="simulated engines (default 2)")
    p.add_argument("--warmup", type=float, default=None,
                   help="seconds of traffic before the first RSS reading (default: 10%% of the duration, 2..30 s)")
    p.add_argument("--max-rss-growth-mb", type=float, default=_TOKENIZER_CACHE_MB + 64.0,
                   help=f"largest accepted RSS growth of kvgate after warm-up (default {_TOKENIZER_CACHE_MB + 64}: "
                        f"its {_TOKENIZER_CACHE_MB} MiB tokenizer cache plus slack)")
    p.add_argument("--seed", type=int, default=0)


def rss_mb(pid: int) -> float:
    """Resident set size of a process, from /proc/PID/status (VmRSS, kB)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)  # kind -> finished as expected
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)

    def error(self, kind: str, what: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 10:
            self.error_samples.append(f"{kind}: {what[:200]}")


class Traffic:
    """One client's loop: picks a kind of request by weight and checks its outcome."""

    KINDS = (("chat_stream", 5), ("completion", 3), ("completion_stream", 2), ("hang_up", 1), ("bad_body", 1))

    def __init__(self, client: httpx.AsyncClient, tally: Tally, seed: int) -> None:
        self.client, self.tally = client, tally
        self.rng = random.Random(seed)
        self.systems = [f"You are assistant {g}. " + self._text(300) for g in range(4)]
        self.history: list[dict] = []

    def _text(self, n: int) -> str:
        return " ".join(self.rng.choice(_WORDS) for _ in range(n))

    async def run(self, deadline: float) -> None:
        kinds = [kind for kind, _ in self.KINDS]
        weights = [weight for _, weight in self.KINDS]
        while time.monotonic() < deadline:
            kind = self.rng.choices(kinds, weights)[0]
            try:
                await getattr(self, kind)()
                self.tally.outcomes[kind] += 1
            except (httpx.HTTPError, AssertionError, ValueError, KeyError) as e:
                self.tally.error(kind, f"{type(e).__name__}: {e}")

    async def _stream(self, path: str, body: dict) -> str:
        t0 = time.monotonic()
        first = None
        last = ""
        async with self.client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                raise AssertionError(f"HTTP {r.status_code}: {r.text[:200]}")
            pieces = []
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                last = line
                if line == "data: [DONE]":
                    continue
                first = first or time.monotonic() - t0
                for choice in json.loads(line[6:]).get("choices", []):
                    pieces.append(choice.get("delta", {}).get("content") or choice.get("text") or "")
        assert last == "data: [DONE]", "stream ended without [DONE]"
        self.tally.ttft_s.append(first or 0.0)
        return "".join(pieces)

    async def chat_stream(self) -> None:
        if not self.history or len(self.history) > 9:
            self.history = [{"role": "system", "content": self.rng.choice(self.systems)}]
        self.history.append({"role": "user", "content": self._text(30)})
        answer = await self._stream("/v1/chat/completions", {"model": MODEL, "messages": self.history,
                                                             "max_tokens": 16, "stream": True})
        self.history.append({"role": "assistant", "content": answer})

    async def completion(self) -> None:
        r = await self.client.post("/v1/completions", json={
            "model": MODEL, "prompt": self.rng.choice(self.systems) + self._text(20), "max_tokens": 8})
        assert r.status_code == 200, f"HTTP {r.status_code}: {r.text[:200]}"
        assert r.json()["choices"][0]["text"]

    async def completion_stream(self) -> None:
        await self._stream("/v1/completions", {"model": MODEL, "prompt": self._text(80), "max_tokens": 12,
                                               "stream": True})

    async def hang_up(self) -> None:
        """A client that leaves mid-stream: expected, and its count must still come back to zero."""
        body = {"model": MODEL, "prompt": self._text(40), "max_tokens": 200, "stream": True}
        async with self.client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, f"HTTP {r.status_code}"
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    break

    async def bad_body(self) -> None:
        body = self.rng.choice((b"{nope", b"[]", b'{"model": 1}', b'{"model": "soak-model", "prompt": [-1]}'))
        r = await self.client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, f"HTTP {r.status_code} for a malformed body"


@dataclass
class SoakStack:
    envoy_url: str
    http_url: str
    kvgate_pid: int


def start_stack(stack: Stack, sims: int) -> SoakStack:
    pods = stack.engines(sims, model=MODEL, extra=["--num-blocks", "2048", "--tpot-ms", "4", "--ttft-overhead-ms", "3"])
    pods_file = stack.pods_file(pods)
    redis_url = stack.redis()[1] if shutil.which("redis-server") else ""
    grpc_port, http_port = free_port(), free_port()
    kvgate = stack.kvgate(env={"KVGATE_PODS_FILE": str(pods_file), "KVGATE_GRPC_PORT": str(grpc_port),
                               "KVGATE_HTTP_PORT": str(http_port), "KVGATE_REDIS_URL": redis_url,
                               "KVGATE_TOKENIZER_CACHE_MB": str(_TOKENIZER_CACHE_MB)}, grpc_port=grpc_port)
    wait_for_port("127.0.0.1", http_port, timeout=15)
    listen = free_port()
    stack.envoy(listen_port=listen, extproc_port=grpc_port, pool=[("127.0.0.1", p["port"]) for p in pods])
    return SoakStack(f"http://127.0.0.1:{listen}", f"http://127.0.0.1:{http_port}", kvgate.popen.pid)


async def _counts_zero(http_url: str, timeout: float = 15.0) -> tuple[bool, dict]:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5) as c:
        while True:
            d = (await c.get(f"{http_url}/debug")).json()
            running = {p["name"]: p["running"] for p in d["pods"]}
            zero = d["in_flight_here"] == 0 and not any(running.values())
            if zero or time.monotonic() > deadline:
                return zero, {"in_flight_here": d["in_flight_here"], "running": running,
                              "index_entries": d["index"].get("entries")}
            await asyncio.sleep(0.2)


async def soak(s: SoakStack, duration: float, concurrency: int, warmup: float, seed: int,
               log=lambda msg: None) -> dict:
    tally = Tally()
    samples: list[tuple[float, float]] = []
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(base_url=s.envoy_url, timeout=60.0, limits=limits) as client:
        start = time.monotonic()
        deadline = start + warmup + duration
        clients = [asyncio.create_task(Traffic(client, tally, seed * 1000 + i).run(deadline))
                   for i in range(concurrency)]
        await asyncio.sleep(warmup)
        t_start = time.monotonic()
        samples.append((0.0, rss_mb(s.kvgate_pid)))
        every = max(1.0, duration / 20)
        while time.monotonic() < deadline:
            await asyncio.sleep(min(every, max(0.0, deadline - time.monotonic())))
            samples.append((time.monotonic() - t_start, rss_mb(s.kvgate_pid)))
            log(f"  {samples[-1][0]:6.0f}/{duration:.0f} s  {sum(tally.outcomes.values())} requests, "
                f"{tally.errors} unexpected errors, kvgate RSS {samples[-1][1]:.1f} MiB")
        await asyncio.gather(*clients)
        elapsed = time.monotonic() - t_start
    zero, end_state = await _counts_zero(s.http_url)
    rss_start, rss_end = samples[0][1], samples[-1][1]
    rss_mid = min(samples, key=lambda x: abs(x[0] - elapsed / 2))[1]
    ttft = sorted(tally.ttft_s)
    pct = (lambda q: round(ttft[min(len(ttft) - 1, int(q * len(ttft)))] * 1e3, 2) if ttft else None)
    total = sum(tally.outcomes.values())
    return {
        "duration_s": round(elapsed, 1), "warmup_s": warmup, "concurrency": concurrency,
        "requests": total, "requests_per_s": round(total / elapsed, 1) if elapsed else 0.0,
        "by_kind": dict(tally.outcomes), "unexpected_errors": tally.errors, "error_samples": tally.error_samples,
        "ttft_p50_ms": pct(0.5), "ttft_p99_ms": pct(0.99),
        "rss_start_mb": round(rss_start, 1), "rss_mid_mb": round(rss_mid, 1), "rss_end_mb": round(rss_end, 1),
        "rss_peak_mb": round(max(v for _, v in samples), 1), "rss_growth_mb": round(rss_end - rss_start, 1),
        "rss_growth_second_half_mb": round(rss_end - rss_mid, 1),
        "counts_zero_at_end": zero, "end_state": end_state,
    }


def _table(r: dict, bound: float) -> str:
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(r["by_kind"].items()))
    return "\n".join([
        f"soak: {r['duration_s']} s after {r['warmup_s']} s warm-up, {r['concurrency']} clients",
        f"requests            {r['requests']} ({r['requests_per_s']}/s): {kinds}",
        f"unexpected errors   {r['unexpected_errors']}" + (f"  e.g. {r['error_samples'][:3]}" if r["error_samples"] else ""),
        f"TTFT p50 / p99      {r['ttft_p50_ms']} / {r['ttft_p99_ms']} ms",
        f"kvgate RSS          start {r['rss_start_mb']} MiB, middle {r['rss_mid_mb']}, end {r['rss_end_mb']}, "
        f"peak {r['rss_peak_mb']}",
        f"RSS growth          {r['rss_growth_mb']} MiB (second half {r['rss_growth_second_half_mb']}; bound {bound})",
        f"counts zero at end  {r['counts_zero_at_end']}  {r['end_state']}",
    ])


def main(args: argparse.Namespace) -> int:
    if args.duration <= 0 or args.concurrency < 1 or args.sims < 1:
        print("kvgate bench soak: --duration must be > 0, --concurrency and --sims >= 1", file=sys.stderr)
        return 2
    warmup = args.warmup if args.warmup is not None else min(30.0, max(2.0, args.duration / 10))

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    stack = Stack()
    try:
        log(f"kvgate bench soak: starting the stack (logs in {stack.workdir})")
        s = start_stack(stack, args.sims)
        result = asyncio.run(soak(s, args.duration, args.concurrency, warmup, args.seed, log))
        dead = [p.name for p in stack.procs if not p.alive()]
    except StackError as e:
        log(f"kvgate bench soak: {e}")
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        stack.close()
    result["processes_died"] = dead
    result["rss_growth_bound_mb"] = args.max_rss_growth_mb
    result["ok"] = (result["unexpected_errors"] == 0 and result["counts_zero_at_end"] and not dead
                    and result["rss_growth_mb"] <= args.max_rss_growth_mb)
    print(json.dumps(result) if args.json else _table(result, args.max_rss_growth_mb), flush=True)
    return 0 if result["ok"] else 1
