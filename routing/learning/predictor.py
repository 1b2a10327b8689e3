"""Output-length prediction from what past requests produced (AIBrix's output predictor, as its
contract reads; the implementation is kvgate's own).

Per model, a sliding window (default 240 s, advanced in steps of 10 s) counts completed requests by
(input bucket, output bucket), where a bucket is log2(tokens) rounded (0 for 0 or 1 token), up to
2^20 tokens (about 1M; longer counts in the last bucket). `predict(model, input_tokens)` draws an
output bucket at random within the request's input bucket, weighted by the counts, and answers its
token count 2^bucket. With no history for that input bucket, the cold-start rule answers:
`optimistic` 1, `random` uniform 1..max output, `input` the input length, `pessimistic` the max output.

Shared across gateway replicas through Redis (`PredictorSync`): each replica adds its new counts to
one hash per (model, step) (`kvgate:outlen:<model>:<step start>`, fields `<in>:<out>`, expiring after
the window) and reads every hash of the window back each step, so all replicas draw from the sum.
"""
from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from functools import lru_cache
from typing import Any, Callable

from routing.background import BackgroundLoop
from routing.learning.tracking import Tracker

log = logging.getLogger(__name__)

COLD_RULES = ("optimistic", "random", "input", "pessimistic")
MAX_TOKENS = 1 << 20
KEY = "kvgate:outlen:{model}:{t}"


@lru_cache(maxsize=1 << 16)  # every completed request asks again for the same few token counts
def bucket(tokens: int, buckets: int) -> int:
    b = int(round(math.log2(tokens))) if tokens > 1 else 0
    return b if b < buckets else buckets - 1


class _ModelWindow:
    """One model's counts: per step a dict (in, out) -> n; `sums` the window's total per input bucket."""

    def __init__(self, buckets: int) -> None:
        self.buckets = buckets
        self.totals: dict[tuple[int, int], int] = {}  # over the window, local and shared
        self.by_input = [0] * buckets
        self.steps: dict[int, dict[tuple[int, int], int]] = {}  # step start -> counts (this replica's)
        self.shared: dict[tuple[int, int], int] = {}  # counts read from Redis (other replicas included)

    def add(self, step: int, key: tuple[int, int], n: int = 1) -> None:
        counts = self.steps.get(step)
        if counts is None:
            counts = self.steps[step] = {}
        counts[key] = counts.get(key, 0) + n
        self.totals[key] = self.totals.get(key, 0) + n
        self.by_input[key[0]] += n

    def expire(self, oldest: int) -> None:
        for step in [s for s in self.steps if s < oldest]:
            for key, n in self.steps.pop(step).items():
                self._drop(key, n)

    def _drop(self, key: tuple[int, int], n: int) -> None:
        left = self.totals.get(key, 0) - n
        if left > 0:
            self.totals[key] = left
        else:
            self.totals.pop(key, None)
        self.by_input[key[0]] = max(0, self.by_input[key[0]] - n)

    def replace_shared(self, shared: dict[tuple[int, int], int], local_unsent: dict[tuple[int, int], int]) -> None:
        """Redis's sum over the window (this replica's flushed counts included), plus what is not yet sent."""
        self.totals = dict(shared)
        for key, n in local_unsent.items():
            self.totals[key] = self.totals.get(key, 0) + n
        self.by_input = [0] * self.buckets
        for (i, _), n in self.totals.items():
            self.by_input[i] += n


class OutputPredictor(Tracker):
    """Per model sliding windows of (input, output) token buckets; also a RequestTracker (learns on done)."""

    def __init__(self, *, window_s: float = 240.0, step_s: float = 10.0, max_tokens: int = MAX_TOKENS,
                 cold: str = "optimistic", max_output: int = 4096, rng: random.Random | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        if cold not in COLD_RULES:
            raise ValueError(f"cold-start rule {cold!r}: expected one of {', '.join(COLD_RULES)}")
        self.window_s, self.step_s = window_s, step_s
        self.buckets = int(math.ceil(math.log2(max_tokens + 1)))
        self.cold, self.max_output = cold, max_output
        self._rng = rng or random.Random()
        self._clock = clock
        self._models: dict[str, _ModelWindow] = {}
        self.shared = False  # True once PredictorSync manages the totals
        self._next_advance = 0.0

    def _step(self, now: float) -> int:
        return int(now // self.step_s * self.step_s)

    def _window(self, model: str) -> _ModelWindow:
        w = self._models.get(model)
        if w is None:
            w = self._models[model] = _ModelWindow(self.buckets)
        return w

    def advance(self, now: float | None = None) -> None:
        """Drop the steps that left the window (called by add and predict: once per step at most)."""
        now = self._clock() if now is None else now
        if now < self._next_advance:
            return
        self._next_advance = self._step(now) + self.step_s
        oldest = self._step(now) - int(self.window_s) + int(self.step_s)
        for w in self._models.values():
            if w.steps and min(w.steps) < oldest:
                if self.shared:  # totals come from Redis; local steps only age out of the unsent set
                    for s in [s for s in w.steps if s < oldest]:
                        del w.steps[s]
                else:
                    w.expire(oldest)

    def add(self, model: str, input_tokens: int, output_tokens: int, now: float | None = None) -> None:
        now = self._clock() if now is None else now
        if now >= self._next_advance:
            self.advance(now)
        w = self._models.get(model) or self._window(model)
        w.add(self._step(now), (bucket(input_tokens, self.buckets), bucket(output_tokens, self.buckets)))

    def has_history(self, model: str, input_tokens: int) -> bool:
        self.advance()
        w = self._models.get(model)
        return w is not None and w.by_input[bucket(input_tokens, self.buckets)] > 0

    def predict(self, model: str, input_tokens: int) -> int:
        self.advance()
        w = self._models.get(model)
        b = bucket(input_tokens, self.buckets)
        total = w.by_input[b] if w is not None else 0
        if w is None or total <= 0:
            return self._cold(input_tokens)
        cursor = self._rng.randrange(total)
        get = w.totals.get
        for out in range(self.buckets):
            n = get((b, out), 0)
            if cursor < n:
                return 1 << out
            cursor -= n
        return 1 << (self.buckets - 1)

    def mean_output(self, model: str) -> float | None:
        """The mean output length over the model's window (bucket values, log2-rounded), None before any."""
        self.advance()
        w = self._models.get(model)
        if w is None:
            return None
        n = total = 0
        for (_, out), count in w.totals.items():
            n += count
            total += count << out
        return total / n if n > 0 else None

    def _cold(self, input_tokens: int) -> int:
        if self.cold == "random":
            return self._rng.randint(1, self.max_output)
        if self.cold == "input":
            return max(1, input_tokens)
        if self.cold == "pessimistic":
            return self.max_output
        return 1

    # --- RequestTracker: completed requests feed the window (starts and ends without usage: nothing) ----
    def done_request_trace(self, ctx: Any, request_id: str, model: str, input_tokens: int, output_tokens: int,
                           term: int) -> None:
        if output_tokens > 0:
            self.add(model, input_tokens, output_tokens)


class PredictorSync(BackgroundLoop):
    """Shares an OutputPredictor's counts through Redis: every step, this replica's new counts are added
    to the step's hash and the window's hashes are read back as the predictor's totals."""

    def __init__(self, predictor: OutputPredictor, redis_client: Any) -> None:
        self.p = predictor
        self._redis = redis_client
        self._sent: dict[tuple[str, int], dict[tuple[int, int], int]] = {}  # (model, step) -> counts sent
        self._task: asyncio.Task | None = None
        predictor.shared = True

    async def sync_once(self, now: float | None = None) -> None:
        p = self.p
        now = p._clock() if now is None else now
        p.advance(now)
        ttl = int(p.window_s + 2 * p.step_s)
        pipe = self._redis.pipeline(transaction=False)
        sent: list[tuple[str, int, dict]] = []
        for model, w in p._models.items():
            for step, counts in w.steps.items():
                done = self._sent.setdefault((model, step), {})
                delta = {k: n - done.get(k, 0) for k, n in counts.items() if n > done.get(k, 0)}
                if delta:
                    key = KEY.format(model=model, t=step)
                    for (i, o), n in delta.items():
                        pipe.hincrby(key, f"{i}:{o}", n)
                    pipe.expire(key, ttl)
                    sent.append((model, step, delta))
        if sent:
            await pipe.execute()
            for model, step, delta in sent:
                done = self._sent[(model, step)]
                for k, n in delta.items():
                    done[k] = done.get(k, 0) + n
        oldest = p._step(now) - int(p.window_s) + int(p.step_s)
        self._sent = {k: v for k, v in self._sent.items() if k[1] >= oldest}
        # read the window back: every model some replica wrote
        steps = range(oldest, p._step(now) + 1, int(p.step_s))
        models: set[str] = set(p._models)
        async for raw in self._redis.scan_iter(match="kvgate:outlen:*", count=1000):
            key = raw.decode() if isinstance(raw, bytes) else raw
            models.add(key[len("kvgate:outlen:"):].rsplit(":", 1)[0])
        pipe = self._redis.pipeline(transaction=False)
        order = [(m, s) for m in sorted(models) for s in steps]
        for m, s in order:
            pipe.hgetall(KEY.format(model=m, t=s))
        replies = await pipe.execute()
        merged: dict[str, dict[tuple[int, int], int]] = {m: {} for m in models}
        for (m, _), reply in zip(order, replies):
            tot = merged[m]
            for f, v in (reply or {}).items():
                f = f.decode() if isinstance(f, bytes) else f
                i_text, _, o_text = f.partition(":")
                try:
                    k = (min(int(i_text), p.buckets - 1), min(int(o_text), p.buckets - 1))
                    tot[k] = tot.get(k, 0) + int(v)
                except ValueError:
                    continue
        for m, tot in merged.items():
            w = p._window(m)
            unsent: dict[tuple[int, int], int] = {}
            for step, counts in w.steps.items():
                done = self._sent.get((m, step), {})
                for k, n in counts.items():
                    if n > done.get(k, 0):
                        unsent[k] = unsent.get(k, 0) + n - done.get(k, 0)
            w.replace_shared(tot, unsent)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.p.step_s)
            try:
                await self.sync_once()
            except Exception as e:
                log.warning("sharing output-length history through Redis failed: %s", e)

