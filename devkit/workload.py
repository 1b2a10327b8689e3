"""A multi-turn chat workload with shared system prompts, driven through Envoy.

Groups share a long system prompt; each user of a group holds a conversation
that grows by one question and one answer per turn. This is the shape where
prefix-aware routing pays: every turn re-sends the whole history.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

_WORDS = ("the model cache block prefix token engine router request stream latency replica gateway "
          "event index memory batch prompt answer question system user chat fleet pod metric shared "
          "history context window sequence attention layer decode prefill queue load balance score").split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


@dataclass(frozen=True)
class WorkloadShape:
    groups: int = 6
    users_per_group: int = 4
    system_words: int = 150
    question_words: int = 30
    max_tokens: int = 24
    turns: int = 6  # a conversation restarts after this many turns
    concurrency: int = 8
    # every request's latency targets (sent as x-slo-ttft-ms / x-slo-tpot-ms; the slo strategy reads them)
    slo_ttft_ms: float = 150.0
    slo_tpot_ms: float = 30.0


@dataclass
class Results:
    ttft_s: list[float] = field(default_factory=list)
    requests: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    pods: dict[str, int] = field(default_factory=dict)
    slo_met: int = 0  # requests that met both their TTFT and TPOT targets

    @property
    def slo_attainment(self) -> float | None:
        return self.slo_met / self.requests if self.requests else None

    def percentile(self, q: float) -> float | None:
        if not self.ttft_s:
            return None
        data = sorted(self.ttft_s)
        return data[min(len(data) - 1, int(q * len(data)))]


class ChatWorkload:
    def __init__(self, shape: WorkloadShape, model: str, seed: int = 0) -> None:
        self.shape = shape
        self.model = model
        rng = random.Random(seed)
        self.systems = [f"You are assistant {g}. " + _text(rng, shape.system_words) for g in range(shape.groups)]
        self.rng = rng
        self.histories: dict[tuple[int, int], list[dict]] = {}

    def next_messages(self, user: tuple[int, int]) -> list[dict]:
        history = self.histories.get(user)
        if history is None or len(history) > 1 + 2 * self.shape.turns:
            history = [{"role": "system", "content": self.systems[user[0]]}]
        history = history + [{"role": "user", "content": _text(self.rng, self.shape.question_words)}]
        self.histories[user] = history
        return history

    def record_answer(self, user: tuple[int, int], answer: str) -> None:
        self.histories[user] = self.histories[user] + [{"role": "assistant", "content": answer}]

    async def run(self, base_url: str, duration_s: float, *, strategy: str | None = None,
                  progress: Callable[[Results, float], object] | None = None, max_requests: int | None = None) -> Results:
        """Send requests until `duration_s` passes (or `max_requests`), `concurrency` at a time."""
        results = Results()
        users = [(g, u) for g in range(self.shape.groups) for u in range(self.shape.users_per_group)]
        self.rng.shuffle(users)
        queue: asyncio.Queue[tuple[int, int]] = asyncio.Queue()
        for user in users:
            queue.put_nowait(user)
        headers = {"routing-strategy": strategy} if strategy else {}
        headers.update({"x-slo-ttft-ms": f"{self.shape.slo_ttft_ms:g}", "x-slo-tpot-ms": f"{self.shape.slo_tpot_ms:g}"})
        started = time.monotonic()
        deadline = started + duration_s
        sent = 0
        limits = httpx.Limits(max_connections=self.shape.concurrency * 2)
        async with httpx.AsyncClient(base_url=base_url, timeout=60.0, limits=limits) as client:

            async def worker() -> None:
                nonlocal sent
                while time.monotonic() < deadline and (max_requests is None or sent < max_requests):
                    sent += 1
                    user = await queue.get()
                    try:
                        await self._one(client, user, headers, results)
                    finally:
                        queue.put_nowait(user)
                    if progress is not None:
                        progress(results, time.monotonic() - started)

            await asyncio.gather(*(worker() for _ in range(self.shape.concurrency)))
        results.elapsed_s = time.monotonic() - started
        return results

    async def _one(self, client: httpx.AsyncClient, user: tuple[int, int], headers: dict, results: Results) -> None:
        messages = self.next_messages(user)
        body = {"model": self.model, "messages": messages, "stream": True, "max_tokens": self.shape.max_tokens}
        t0 = time.monotonic()
        first: float | None = None
        last, events = 0.0, 0
        pieces: list[str] = []
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
                if r.status_code != 200:
                    await r.aread()
                    raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
                pod = r.headers.get("x-kvgate-pod", "?")
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    if first is None:
                        first = time.monotonic() - t0
                    last = time.monotonic() - t0
                    events += 1
                    chunk = json.loads(line[6:])
                    for choice in chunk.get("choices", []):
                        pieces.append(choice.get("delta", {}).get("content") or "")
            if first is None:
                raise RuntimeError("stream ended without data")
        except (httpx.HTTPError, RuntimeError, ValueError) as e:
            results.errors += 1
            if len(results.error_samples) < 5:
                results.error_samples.append(str(e) or type(e).__name__)
            # Start this user's conversation over: its history was not answered.
            self.histories.pop(user, None)
            return
        results.requests += 1
        results.ttft_s.append(first)
        tpot = (last - first) / (events - 1) if events > 1 else 0.0
        results.slo_met += first <= self.shape.slo_ttft_ms / 1000 and tpot <= self.shape.slo_tpot_ms / 1000
        results.pods[pod] = results.pods.get(pod, 0) + 1
        self.record_answer(user, "".join(pieces))
