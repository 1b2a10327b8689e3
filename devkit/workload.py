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
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx

_WORDS = ("the model cache block prefix token engine router request stream latency replica gateway "
          "event index memory batch prompt answer question system user chat fleet pod metric shared "
          "history context window sequence attention layer decode prefill queue load balance score").split()


async def sse_events(r: httpx.Response) -> AsyncIterator[dict]:
    """The JSON of each `data:` event of a streamed response, as it arrives (the closing [DONE] left out)."""
    async for line in r.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


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
                async for chunk in sse_events(r):
                    if first is None:
                        first = time.monotonic() - t0
                    last = time.monotonic() - t0
                    events += 1
                    for choice in chunk.get("choices", []):
                        pieces.append(choice.get("delta", {}).get("content") or "")
            if first is None:
                raise RuntimeError("stream ended without data")
        except (httpx.HTTPError, RuntimeError, ValueError) as e:
            self._failed(results, e)
            # Start this user's conversation over: its history was not answered.
            self.histories.pop(user, None)
            return
        self._served(results, pod, first, last, events)
        self.record_answer(user, "".join(pieces))

    @staticmethod
    def _failed(results: Results, e: BaseException) -> None:
        results.errors += 1
        if len(results.error_samples) < 5:
            results.error_samples.append(str(e) or type(e).__name__)

    def _served(self, results: Results, pod: str, first: float, last: float, events: int) -> None:
        """A streamed answer's count, TTFT, SLO check (TPOT: the mean gap after the first event) and pod."""
        results.requests += 1
        results.ttft_s.append(first)
        tpot = (last - first) / (events - 1) if events > 1 else 0.0
        results.slo_met += first <= self.shape.slo_ttft_ms / 1000 and tpot <= self.shape.slo_tpot_ms / 1000
        results.pods[pod] = results.pods.get(pod, 0) + 1


# --- the agent mix -----------------------------------------------------------------------------------

APIS = ("chat", "responses", "messages")


@dataclass(frozen=True)
class AgentShape(WorkloadShape):
    """Agents: each group shares a system prompt and a tool list resent on every turn; each user speaks one of
    the three APIs (chat with tools, the Responses API continuing by `previous_response_id`, Anthropic
    messages), in that rotation."""

    tools: int = 6
    tool_words: int = 40  # each tool's description
    question_words: int = 20


class AgentWorkload(ChatWorkload):
    """The agent mix through Envoy, streamed: a chat user re-sends its history with the tools; a Responses user
    sends only its new input after the first turn (`previous_response_id`: the conversation is on the engine
    that answered it); a Messages user re-sends its history, Anthropic style. TTFT is the first token event."""

    def __init__(self, shape: AgentShape, model: str, seed: int = 0) -> None:
        super().__init__(shape, model, seed)
        self.agent_shape = shape
        rng = random.Random(seed + 1000)
        self.tool_sets = [[{"name": f"g{g}_tool{t}", "description": _text(rng, shape.tool_words),
                            "schema": {"type": "object", "properties": {"query": {"type": "string"}},
                                       "required": ["query"]}} for t in range(shape.tools)]
                          for g in range(shape.groups)]
        self.previous: dict[tuple[int, int], str] = {}  # a Responses user's last response id
        self.turns: dict[tuple[int, int], int] = {}

    def api_of(self, user: tuple[int, int]) -> str:
        return APIS[(user[0] * self.shape.users_per_group + user[1]) % len(APIS)]

    def request(self, user: tuple[int, int]) -> tuple[str, dict]:
        """The next turn of `user`'s conversation: (path, body)."""
        g = user[0]
        api = self.api_of(user)
        tools = self.tool_sets[g]
        turn = self.turns.get(user, 0)
        if turn >= self.shape.turns:
            turn = 0
            self.histories.pop(user, None)
            self.previous.pop(user, None)
        self.turns[user] = turn + 1
        question = _text(self.rng, self.shape.question_words)
        max_tokens = self.shape.max_tokens
        if api == "responses":
            body: dict = {"model": self.model, "instructions": self.systems[g], "input": question, "stream": True,
                          "max_output_tokens": max_tokens,
                          "tools": [{"type": "function", "name": t["name"], "description": t["description"],
                                     "parameters": t["schema"]} for t in tools]}
            previous = self.previous.get(user)
            if previous is not None:
                body["previous_response_id"] = previous
            return "/v1/responses", body
        history = self.histories.get(user) or []
        if api == "messages":
            history = history + [{"role": "user", "content": question}]
            self.histories[user] = history
            return "/v1/messages", {
                "model": self.model, "system": self.systems[g], "messages": history, "max_tokens": max_tokens,
                "stream": True, "tools": [{"name": t["name"], "description": t["description"],
                                           "input_schema": t["schema"]} for t in tools]}
        if not history:
            history = [{"role": "system", "content": self.systems[g]}]
        history = history + [{"role": "user", "content": question}]
        self.histories[user] = history
        return "/v1/chat/completions", {
            "model": self.model, "messages": history, "max_tokens": max_tokens, "stream": True,
            "tools": [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                        "parameters": t["schema"]}} for t in tools]}

    async def _one(self, client: httpx.AsyncClient, user: tuple[int, int], headers: dict, results: Results) -> None:
        path, body = self.request(user)
        api = self.api_of(user)
        t0 = time.monotonic()
        first: float | None = None
        last, events = 0.0, 0
        pieces: list[str] = []
        response_id = None
        try:
            async with client.stream("POST", path, json=body, headers=headers) as r:
                if r.status_code != 200:
                    await r.aread()
                    raise RuntimeError(f"{path}: HTTP {r.status_code}: {r.text[:200]}")
                pod = r.headers.get("x-kvgate-pod", "?")
                async for event in sse_events(r):
                    text = None
                    if api == "chat":
                        for choice in event.get("choices", []):
                            text = (choice.get("delta") or {}).get("content")
                    elif api == "responses":
                        if event.get("type") == "response.output_text.delta":
                            text = event.get("delta")
                        elif event.get("type") == "response.created":
                            response_id = event["response"]["id"]
                    elif event.get("type") == "content_block_delta":
                        text = (event.get("delta") or {}).get("text")
                    if text is None:
                        continue
                    if first is None:
                        first = time.monotonic() - t0
                    last = time.monotonic() - t0
                    events += 1
                    pieces.append(text)
            if first is None:
                raise RuntimeError(f"{path}: the stream ended without a token")
        except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as e:
            self._failed(results, e)
            self.histories.pop(user, None)  # start this user's conversation over
            self.previous.pop(user, None)
            self.turns.pop(user, None)
            return
        self._served(results, pod, first, last, events)
        answer = "".join(pieces)
        if api == "responses":
            if response_id is not None:
                self.previous[user] = response_id
        elif api == "messages":
            self.histories[user] = self.histories[user] + [{"role": "assistant", "content": answer}]
        else:
            self.record_answer(user, answer)


def workload_for(kind: str, concurrency: int, model: str, seed: int) -> ChatWorkload:
    """The demo's workload: `chat` (multi-turn chats sharing system prompts), `agent` (the agent mix) or `mix`
    (half the groups each)."""
    if kind == "chat":
        return ChatWorkload(WorkloadShape(concurrency=concurrency), model, seed=seed)
    if kind == "agent":
        return AgentWorkload(AgentShape(concurrency=concurrency), model, seed=seed)
    if kind == "mix":
        return MixedWorkload(concurrency, model, seed)
    raise ValueError(f"unknown workload {kind!r} (chat, agent, mix)")


class MixedWorkload(AgentWorkload):
    """Half the groups chat as ChatWorkload's users do (no tools), half are agents."""

    def __init__(self, concurrency: int, model: str, seed: int) -> None:
        super().__init__(AgentShape(concurrency=concurrency, groups=8), model, seed)

    def api_of(self, user: tuple[int, int]) -> str:
        if user[0] % 2 == 0:
            return "plain"
        return super().api_of(user)

    async def _one(self, client: httpx.AsyncClient, user: tuple[int, int], headers: dict, results: Results) -> None:
        if self.api_of(user) == "plain":
            await ChatWorkload._one(self, client, user, headers, results)
            return
        await super()._one(client, user, headers, results)
