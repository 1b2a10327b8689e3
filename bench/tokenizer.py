"""`kvgate bench tokenizer`: cost per request, remote vs local, cold vs cached.

Workload: multi-turn chats sharing one system prompt; request k of a conversation
carries its whole history. The remote side is a real HTTP server on loopback in
its own process (devkit.tokenizer_stub: vLLM's /tokenize shapes, LocalTokenizer
inside; or, by default, the simulated engine `kvgate sim`), reached through
RemoteTokenizer. "Cold" is no cache ("local plain": the local tokenizer without its word-cached
encoder, tokenizer.wordcache); "cached" is
CachedTokenizer starting empty on the same workload; "verified" is the gateway's
default with tokenizer files (VerifiedTokenizer: local tokens once verified against
the server, a 5% background sample still sent to it). Every answer is checked
against the uncached remote one.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from tokenizer import testdata
from devkit.build_testdata import corpus
from tokenizer.cache import CachedTokenizer
from tokenizer.local import LocalBackend, LocalTokenizer
from tokenizer.remote import RemoteOptions, RemoteTokenizer
from tokenizer.segments import Segmenter
from tokenizer.types import ChatInput, Tokenizer
from tokenizer.verified import VerifiedTokenizer, VerifyOptions

MODEL = "bench-model"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=8, help="user turns per conversation")
    parser.add_argument("--system-lines", type=int, default=60, help="lines of generated text in the system prompt")
    parser.add_argument("--message-lines", type=int, default=4, help="lines per user or assistant message")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--server", choices=("sim", "stub"), default="sim",
                        help="the /tokenize server: the simulated engine (default) or devkit.tokenizer_stub")
    parser.add_argument("--repeat", type=int, default=5, help="passes per path; the median pass is reported")
    parser.add_argument("--concurrency", type=int, default=16, help="requests in flight for the throughput pass")


@dataclass(frozen=True, slots=True)
class Run:
    name: str
    mean_ms: float
    p50_ms: float
    p99_ms: float
    outputs: list[list[int]]


def workload(conversations: int, turns: int, system_lines: int, message_lines: int, seed: int) -> list[ChatInput]:
    """Requests in arrival order: turn by turn, conversations interleaved."""
    lines = iter(corpus(seed=seed, lines=system_lines + 2 * conversations * turns * message_lines + 1))
    take = lambda n: "\n".join(next(lines) for _ in range(n))  # noqa: E731
    system = {"role": "system", "content": take(system_lines)}
    histories = [[system] for _ in range(conversations)]
    requests = []
    for _ in range(turns):
        for history in histories:
            history.append({"role": "user", "content": take(message_lines)})
            requests.append(ChatInput(messages=tuple(history)))
            history.append({"role": "assistant", "content": take(message_lines)})  # the engine's reply, unseen before
    random.Random(seed).shuffle(requests[: len(histories)])  # first turns in a mixed order
    return requests


async def measure(name: str, tokenize: Callable[[ChatInput], Awaitable[list[int]]], requests: list[ChatInput]) -> Run:
    times = []
    outputs = []
    for item in requests:
        t0 = time.perf_counter()
        outputs.append(await tokenize(item))
        times.append((time.perf_counter() - t0) * 1000)
    times.sort()
    return Run(name, statistics.fmean(times), times[len(times) // 2], times[min(len(times) - 1, int(len(times) * 0.99))], outputs)


async def throughput(tokenize: Callable[[ChatInput], Awaitable[list[int]]], requests: list[ChatInput], concurrency: int) -> float:
    """Wall-clock ms per request with `concurrency` requests in flight, in arrival order."""
    queue = iter(requests)

    async def worker() -> None:
        for item in queue:
            await tokenize(item)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    return (time.perf_counter() - t0) * 1000 / len(requests)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(port: int, kind: str = "stub") -> subprocess.Popen:
    if kind == "sim":
        cmd = [sys.executable, "-m", "plugin.cli", "sim", "--port", str(port), "--model", MODEL, "--no-kv-events",
               "--tokenizer", str(testdata.path())]
    else:
        cmd = [sys.executable, "-m", "devkit.tokenizer_stub", "--port", str(port), "--model", MODEL]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("the /tokenize server exited at start-up")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("the /tokenize server did not start within 30 s")


def _verified_cached(remote: RemoteTokenizer, local: LocalTokenizer, segmenters: dict) -> CachedTokenizer:
    """As plugin.app wires it: pieces only for verified shapes, their answers sampled."""
    verified = VerifiedTokenizer(remote, local=local, options=VerifyOptions(verify_requests=3))
    return CachedTokenizer(verified, segmenters=segmenters, registry=CollectorRegistry(), trust=verified.trusts,
                           observe=verified.observe)


async def _bench(args: argparse.Namespace, url: str) -> dict:
    local = LocalTokenizer.from_path(testdata.path())
    segmenters = {MODEL: Segmenter.from_local(local)}
    requests = workload(args.conversations, args.turns, args.system_lines, args.message_lines, args.seed)
    warmup = workload(2, 2, 5, 1, args.seed + 1)
    options = RemoteOptions(total_timeout_s=30, attempt_timeout_s=10)
    verified_registry = CollectorRegistry()

    def remote_calls() -> float:
        return verified_registry.get_sample_value("kvgate_tokenizer_remote_attempts_total", {"outcome": "ok"}) or 0.0

    # (two of them also read for their own counters below)
    cache_over_remote = CachedTokenizer(
        RemoteTokenizer({MODEL: url}, options=options), segmenters=segmenters, registry=CollectorRegistry()
    )
    # What the gateway runs with KVGATE_TOKENIZER=auto and the files: local tokens, verified against the server
    # (during the warm-up), with the default background sample; alone, and behind the whole-request cache.
    verified_tok = VerifiedTokenizer(RemoteTokenizer({MODEL: url}, options=options, registry=verified_registry),
                                      local=local, options=VerifyOptions(verify_requests=3))
    backends: dict[str, Tokenizer] = {
        "remote cold": RemoteTokenizer({MODEL: url}, options=options),
        "remote cached": cache_over_remote,
        "local cold": LocalBackend({MODEL: local}),
        # the same without the word-cached encoder (tokenizer.wordcache): every text through the tokenizers library
        "local plain": LocalBackend({MODEL: LocalTokenizer(local.hf, fast=False)}),
        "local cached": CachedTokenizer(LocalBackend({MODEL: local}), segmenters=segmenters, registry=CollectorRegistry()),
        "verified cold": verified_tok,
        "verified cached": _verified_cached(RemoteTokenizer({MODEL: url}, options=options), local, segmenters),
    }

    async def reset(backend: Tokenizer) -> None:
        for item in warmup:  # connection set up, template compiled: not what "cold" means here
            await backend.tokenize(MODEL, item)
        inner = backend._inner if isinstance(backend, CachedTokenizer) else backend
        if isinstance(inner, VerifiedTokenizer):
            await inner.settle()  # verified on the warm-up requests, as a running gateway would be
        if isinstance(backend, CachedTokenizer):
            backend.clear()

    # Paths take turns pass by pass, so a burst of load from elsewhere on the machine hits them alike.
    passes: dict[str, list[Run]] = {name: [] for name in backends}
    rates: dict[str, list[float]] = {name: [] for name in backends}
    hit_ratio = 0.0
    verified_calls: list[float] = []
    verified_waited: list[int] = []
    for _ in range(max(1, args.repeat)):
        for name, backend in backends.items():
            await reset(backend)
            before = (cache_over_remote.tokens_cached, cache_over_remote.tokens_total) if name == "remote cached" else None
            calls = remote_calls()
            waited = verified_tok.status()[MODEL]["served"]["remote"] if name == "verified cold" else 0
            passes[name].append(await measure(name, functools.partial(backend.tokenize, MODEL), requests))
            if name == "verified cold":
                await verified_tok.settle()
                verified_calls.append(remote_calls() - calls)  # all /tokenize calls, background samples included
                verified_waited.append(verified_tok.status()[MODEL]["served"]["remote"] - waited)  # ones a request waited for
            if before is not None:  # this pass's share (the cache's counters never go back)
                total = cache_over_remote.tokens_total - before[1]
                hit_ratio = (cache_over_remote.tokens_cached - before[0]) / total if total else 0.0
        for name, backend in backends.items():
            await reset(backend)
            rates[name].append(await throughput(functools.partial(backend.tokenize, MODEL), requests, args.concurrency))
    for backend in backends.values():
        await backend.aclose()
    median = {name: sorted(p, key=lambda r: r.mean_ms)[len(p) // 2] for name, p in passes.items()}
    per_request = {name: statistics.median(r) for name, r in rates.items()}
    remote_cold, remote_cached, local_cold, local_plain, local_cached, verified_cold, verified_cached = (
        median[n] for n in backends)
    runs = [remote_cold, remote_cached, local_cold, local_plain, local_cached, verified_cold, verified_cached]
    mismatches = sum(
        1 for ps in passes.values() for r in ps for got, want in zip(r.outputs, remote_cold.outputs) if got != want
    )
    tokens = [len(o) for o in remote_cold.outputs]
    return {
        "requests": len(requests),
        "mean_tokens_per_request": round(statistics.fmean(tokens), 1),
        "max_tokens_per_request": max(tokens),
        "remote_cold_ms": round(remote_cold.mean_ms, 3),
        "remote_cached_ms": round(remote_cached.mean_ms, 3),
        "local_cold_ms": round(local_cold.mean_ms, 3),
        "local_plain_cold_ms": round(local_plain.mean_ms, 3),
        "word_cache_speedup": round(local_plain.mean_ms / local_cold.mean_ms, 2),
        "local_cached_ms": round(local_cached.mean_ms, 3),
        "remote_speedup": round(remote_cold.mean_ms / remote_cached.mean_ms, 2),
        "local_speedup": round(local_cold.mean_ms / local_cached.mean_ms, 2),
        "cache_hit_rate": round(hit_ratio, 4),
        "verified_cold_ms": round(verified_cold.mean_ms, 3),
        "verified_cached_ms": round(verified_cached.mean_ms, 3),
        # /tokenize calls per measured request on the verified path: those a request waited for (none once
        # verified), and all of them (the background sample, 5% by default).
        "verified_waited_calls_per_request": round(statistics.fmean(verified_waited) / len(requests), 4),
        "verified_remote_calls_per_request": round(statistics.fmean(verified_calls) / len(requests), 4),
        "mismatches": mismatches,
        "concurrency": args.concurrency,
        "remote_cold_throughput_ms": round(per_request["remote cold"], 3),
        "remote_cached_throughput_ms": round(per_request["remote cached"], 3),
        "runs": {r.name: {"mean_ms": round(r.mean_ms, 3), "p50_ms": round(r.p50_ms, 3), "p99_ms": round(r.p99_ms, 3),
                          "throughput_ms": round(per_request[r.name], 3)} for r in runs},
    }


def main(args: argparse.Namespace) -> int:
    port = _free_port()
    server = _start_server(port, args.server)
    try:
        result = asyncio.run(_bench(args, f"http://127.0.0.1:{port}"))
        result["server"] = args.server
    finally:
        server.terminate()
        server.wait(timeout=10)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"/tokenize server: {args.server}; {result['requests']} chat requests, {result['mean_tokens_per_request']} tokens on average "
              f"(max {result['max_tokens_per_request']}); per-request cost:")
        print(f"{'path':<15}{'mean ms':>10}{'p50 ms':>10}{'p99 ms':>10}{f'ms/req @{args.concurrency}':>14}")
        for name, r in result["runs"].items():
            print(f"{name:<15}{r['mean_ms']:>10.3f}{r['p50_ms']:>10.3f}{r['p99_ms']:>10.3f}{r['throughput_ms']:>14.3f}")
        print(f"verified path: /tokenize calls per request: {result['verified_waited_calls_per_request']} waited for, "
              f"{result['verified_remote_calls_per_request']} in all (background samples)")
        print(f"word-cached encoder vs the tokenizers library alone (local cold): {result['word_cache_speedup']}x")
        print(f"cached vs cold: remote {result['remote_speedup']}x, local {result['local_speedup']}x; "
              f"tokens served from cache {result['cache_hit_rate']:.1%}; mismatches {result['mismatches']}")
    return 0 if result["mismatches"] == 0 else 1
