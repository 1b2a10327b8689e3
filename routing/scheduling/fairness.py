"""Per-user token fairness (AIBrix's `vtc-basic`, after the Virtual Token Counter of Sheng et al. 2024):
users who received little service lately are steered to the first pods in name order, heavy users
further along, so one heavy user's requests share their pods with each other rather than with everyone."""
from __future__ import annotations

import math
import time
from collections import OrderedDict
from typing import Callable, Sequence

from routing.pods import Pod
from routing.scheduling.scoring import PickContext, Scorer


class TokenCounter:
    """Tokens served per user over a sliding window, as an exponential decay with time constant `window_s`
    (AIBrix: 5 one-minute buckets). Every user decays at the same rate, so values are kept relative to a
    common origin and the total (for the mean) stays exact. At most `capacity` users (least recent dropped)."""

    def __init__(self, window_s: float = 300.0, capacity: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._tau = window_s
        self._capacity = capacity
        self._clock = clock
        self._origin = clock()
        self._users: OrderedDict[str, float] = OrderedDict()  # user -> tokens x e^((t - origin) / tau)
        self._total = 0.0

    def _scale(self, now: float) -> float:
        return math.exp((now - self._origin) / self._tau)

    def _rebase(self, now: float) -> None:
        # keep the stored values finite: move the origin to now
        f = 1.0 / self._scale(now)
        for user in self._users:
            self._users[user] *= f
        self._total *= f
        self._origin = now

    def add(self, user: str, tokens: float) -> None:
        now = self._clock()
        if now - self._origin > 50 * self._tau:
            self._rebase(now)
        value = tokens * self._scale(now)
        self._users[user] = self._users.get(user, 0.0) + value
        self._users.move_to_end(user)
        self._total += value
        if len(self._users) > self._capacity:
            self._total -= self._users.popitem(last=False)[1]

    def get(self, user: str) -> float:
        return self._users.get(user, 0.0) / self._scale(self._clock())

    def mean(self) -> float:
        return self._total / len(self._users) / self._scale(self._clock()) if self._users else 0.0


class TokenFairnessScorer(Scorer):
    """The user's (`user` header) tokens in the window over a bucket (the mean per user, at least
    `min_bucket` tokens, AIBrix's 1,000) give a position among the pods in name order, clamped to the last;
    a pod scores 1 at that position, falling linearly with its distance (0 at the far end). The request's
    prompt tokens join the user's count when picked. No user: nothing (the rest of the strategy decides)."""

    name = "vtc"
    needs_tokens = True

    def __init__(self, counter: TokenCounter | None = None, min_bucket: float = 1000.0) -> None:
        self.counter = counter or TokenCounter()
        self._min_bucket = min_bucket

    def score(self, ctx: PickContext, pods: Sequence[Pod]) -> dict[str, float]:
        user = ctx.request.user
        if not user:
            return {}
        ctx.state[self.name] = user
        ordered = sorted(p.name for p in pods)
        last = len(ordered) - 1
        if last == 0:
            return {ordered[0]: 1.0}
        bucket = max(self._min_bucket, self.counter.mean())
        position = min(self.counter.get(user) / bucket, float(last))
        return {name: 1.0 - abs(i - position) / last for i, name in enumerate(ordered)}

    def picked(self, ctx: PickContext, pod: Pod) -> None:
        user = ctx.state.get(self.name)
        if user:
            tokens = ctx.request.token_ids
            self.counter.add(user, len(tokens) if tokens else 0)
