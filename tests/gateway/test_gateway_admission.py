"""Admission through the whole request path: a real Envoy spreading its ext_proc streams over two
`kvgate serve` replicas that share a real redis-server, in front of two simulated engines serving a
base model and a LoRA adapter of it (two models competing for the same pods). Each engine reports
the most requests it ever held at once (`sim:requests_live_peak`), so a limit broken by the two
replicas together shows on the engine itself."""
from __future__ import annotations

import shutil
import threading
import time

import httpx
import pytest

from bench.gateway import metric
from devkit.stack import Stack, wait_for_port
from helpers import (GatewayEnv, envoy_pool, free_port, join_all, stack_fixture, start_kvgate, start_threads,
                     wait_until)

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")]

BIG, SMALL = "big", "small"  # the base model and its adapter, on both engines
LIMIT = 2  # running requests per pod (KVGATE_ADMISSION_MAX_RUNNING): capacity 2 pods x 2 = 4
WAIT_S = 4.0  # KVGATE_ADMISSION_MAX_WAIT_S: 2x the burst's ~2 s drain (a loaded machine), under Envoy's 5 s message_timeout
TPOT_MS = 20


class Env(GatewayEnv):
    def __init__(self, stack: Stack):
        super().__init__(stack)
        pods = stack.engines(2, model=BIG, extra=["--lora", SMALL, "--tpot-ms", str(TPOT_MS),
                                                  "--ttft-overhead-ms", "1"])
        for p in pods:
            p["lora"] = [SMALL]
        self.sims = {p["name"]: p["port"] for p in pods}
        _, redis_url = stack.redis()
        pods_file = stack.pods_file(pods)
        self.replicas = [start_kvgate(stack, pods_file, {
            "KVGATE_REDIS_URL": redis_url, "KVGATE_GATEWAY_ID": f"kvgate{g}",
            "KVGATE_ROUTING_STRATEGY": "least-request", "KVGATE_ADMISSION_MAX_RUNNING": str(LIMIT),
            "KVGATE_ADMISSION_MAX_WAIT_S": str(WAIT_S), "KVGATE_ADMISSION_RETRY_AFTER_S": "1"},
            name=f"kvgate{g}", wait=False) for g in range(2)]
        for r in self.replicas:
            stack.ready(r.proc, ("127.0.0.1", r.grpc_port))
            wait_for_port("127.0.0.1", r.http_port, timeout=10)
        self.kvgate = self.replicas[0].proc
        listen = free_port()
        self.envoy = stack.envoy(listen_port=listen, extproc_port=self.replicas[0].grpc_port,
                                 more_extproc_ports=[r.grpc_port for r in self.replicas[1:]], pool=envoy_pool(pods))
        wait_for_port("127.0.0.1", listen, timeout=10)
        self.url = f"http://127.0.0.1:{listen}"

    def peaks(self) -> dict[str, float]:
        """Per engine, the most requests it held at once since it started."""
        out = {}
        for name, port in self.sims.items():
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            out[name] = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                            if line.startswith("sim:requests_live_peak{"))
        return out

    def waiting(self) -> int:
        """Requests waiting in the replicas' admission queues for room on a pod, now."""
        return sum(r.debug()["admission"]["waiting"] for r in self.replicas)

    def running(self) -> float:
        total = 0.0
        for port in self.sims.values():
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            total += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                         if line.startswith("vllm:num_requests_running{"))
        return total


env = stack_fixture(Env)


def _send(url: str, model: str, max_tokens: int, out: list, i: int, stop: threading.Event | None = None) -> None:
    """One streamed completion: (model, status, Retry-After, sent at, first byte at, body), monotonic times;
    `stop` set: the client hangs up at its next chunk (the body is what came until then)."""
    sent = time.monotonic()
    first = None
    try:
        with httpx.Client(base_url=url, timeout=30) as client, client.stream(
                "POST", "/v1/completions", json={"model": model, "prompt": f"request {i} of {model}",
                                                 "max_tokens": max_tokens, "stream": True}) as r:
            chunks = []
            for chunk in r.iter_bytes():
                if first is None:
                    first = time.monotonic()
                chunks.append(chunk)
                if stop is not None and stop.is_set():
                    break
            out[i] = (model, r.status_code, r.headers.get("retry-after"), sent, first, b"".join(chunks))
    except httpx.HTTPError as e:  # lost: the assertions name it
        out[i] = (model, f"lost: {e!r}", None, sent, None, b"")


def _burst(url: str, requests: list[tuple[str, int]], out: list, offset: int = 0,
           stop: threading.Event | None = None) -> list[threading.Thread]:
    return start_threads(_send, [(url, model, n, out, offset + i, stop) for i, (model, n) in enumerate(requests)])


def test_burst_of_3x_capacity_never_puts_a_pod_past_its_limit_loses_nothing_and_takes_models_in_turn(env):
    """12 requests (3x the 4 the pods may run): 4 of the base model that fill the pods and hold them, then 4 more
    of it (40 tokens, ~0.8 s) that wait, then 4 of the adapter (5 tokens) behind them; once all 8 wait, the
    holders hang up. First come, first served would start the adapter's 4 after every base request; the
    per-model queues take them in turn. (The holders hold until then, however slowly the machine brings the
    others to the queues: holders of ~2 s once finished first on a loaded CI machine, the base waiters then
    admitted at once and never all waiting.)"""
    out: list = [None] * 12
    hang_up = threading.Event()

    def state() -> str:  # for a failure: each replica's admission, the engines' running, the answers so far
        return (f"admission {[r.debug()['admission'] for r in env.replicas]}, running {env.running()}, "
                f"answers {[o[:3] if o else None for o in out]}")
    holders = _burst(env.url, [(BIG, int(30_000 / TPOT_MS))] * 4, out, stop=hang_up)
    try:
        assert wait_until(lambda: env.running() >= 4, timeout=10, detail=state)  # the pods are full: the rest wait
        big = _burst(env.url, [(BIG, 40)] * 4, out, offset=4)
        assert wait_until(lambda: env.waiting() >= 4, timeout=10, detail=state)  # the base model's waiters first
        small = _burst(env.url, [(SMALL, 5)] * 4, out, offset=8)
        assert wait_until(lambda: env.waiting() >= 8, timeout=WAIT_S / 2, detail=state)  # then the adapter's
    finally:
        hang_up.set()
    join_all(holders + big + small)
    assert all(o is not None for o in out), out
    statuses = [o[1] for o in out]
    assert all(s in (200, 429) for s in statuses), statuses  # served or told to come back: none lost
    for _model, status, retry_after, _, _, body in out:
        if status == 429:
            assert retry_after == "1" and b"rate_limit_exceeded" in body
    assert statuses.count(200) >= 8, statuses  # the holders, and the waiters admitted within the 4 s allowed
    assert max(env.peaks().values()) <= LIMIT, env.peaks()  # counted over both replicas
    # Turns: the last base request to start started after at least 2 of the adapter's (first come,
    # first served: after none of them). Start ~ first byte: its wait, then a 1 ms prefill.
    started = {i: o[4] for i, o in enumerate(out) if o[1] == 200}
    last_big = max(started[i] for i in range(8) if i in started)
    t0 = min(o[3] for o in out)
    timeline = sorted((round(o[4] - t0, 3), o[0], round(o[3] - t0, 3)) for o in out if o[4] is not None)
    # (The message is a string: pytest shortens a list's repr, and a failure under load needs the whole timeline.)
    assert sum(1 for i in range(8, 12) if i in started and started[i] < last_big) >= 2, (
        f"(first byte s, model, sent s) of each served request: {timeline}; statuses {statuses}")


def test_full_pods_answer_429_with_retry_after_once_the_wait_is_over(env):
    """The holders keep the pods full (up to 30 s of tokens each) until both waiters have their answer, then
    hang up: however late the waiters reach kvgate on a loaded machine, no room opens while they wait.
    (This is the module's last test: the engines may still be finishing the holders' requests after it.)"""
    out: list = [None] * 6
    hang_up = threading.Event()
    holders = _burst(env.url, [(BIG, int(30_000 / TPOT_MS))] * 4, out, stop=hang_up)
    assert wait_until(lambda: env.running() >= 4, timeout=10)
    extra = _burst(env.url, [(SMALL, 4), (BIG, 4)], out, offset=4)
    join_all(extra)
    hang_up.set()
    for _model, status, retry_after, sent, first, body in out[4:]:
        assert status == 429 and retry_after == "1", (status, body)
        assert first - sent >= WAIT_S * 0.9  # answered after the wait, not at once
        assert b'"code": "admission_timeout"' in body or b'"code":"admission_timeout"' in body
    join_all(holders)
    assert [o[1] for o in out[:4]] == [200] * 4
    assert max(env.peaks().values()) <= LIMIT
    # Each replica's /metrics: the two answered 429 counted as timed out, with their wait (summed over both).
    timed_out = sum(metric(r.metrics(), "kvgate_admission_requests_total", outcome="timed_out") for r in env.replicas)
    waited = sum(metric(r.metrics(), "kvgate_admission_wait_seconds_total") for r in env.replicas)
    assert timed_out >= 2 and waited >= 2 * WAIT_S * 0.9, (timed_out, waited)
