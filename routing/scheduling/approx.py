"""The router-side prefix guess (`prefix-cache`): which pods this gateway sent each prompt
block to, without any event from the engines. An LRU of chained block keys -> pods.

It is the approximate baseline: it cannot know what an engine evicted, and it only sees
this gateway's own decisions.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence

from kvcache.blockkeys import BlockExtras


class ApproxPrefixTable:
    def __init__(self, block_size: int = 16, capacity: int = 200_000) -> None:
        if block_size < 1 or capacity < 1:
            raise ValueError("block_size and capacity must be positive")
        self.block_size = block_size
        self.capacity = capacity
        self._keys: OrderedDict[int, set[str]] = OrderedDict()

    def block_keys(self, model: str, lora: str | None, token_ids: Sequence[int],
                   extras: BlockExtras | None = None) -> list[int]:
        """One key per full block, each chained on the previous so equal keys mean equal prefixes; with
        `extras`, what the engine hashes besides the tokens (salt, media) enters them too, and a prompt
        whose extras cannot be known has no keys (guessed cached nowhere)."""
        keys: list[int] = []
        if extras is not None and extras.opaque:
            return keys
        prev = hash((model, lora, extras.cache_salt if extras is not None else None))
        per = extras.per_block(self.block_size, len(token_ids) // self.block_size) if extras else {}
        for i, block in enumerate(zip(*[iter(token_ids)] * self.block_size)):  # full blocks only
            extra = per.get(i) if per else None
            prev = hash((prev, block)) if extra is None else hash((prev, block, extra))
            keys.append(prev)
        return keys

    def match(self, keys: Sequence[int], pods: Iterable[str]) -> dict[str, int]:
        """Per pod, how many leading keys it was sent."""
        alive = set(pods)
        out = dict.fromkeys(alive, 0)
        for key in keys:
            holders = self._keys.get(key)
            if not holders:
                break
            alive &= holders
            if not alive:
                break
            for p in alive:
                out[p] += 1
        return out

    def record(self, keys: Sequence[int], pod: str) -> None:
        for key in keys:
            holders = self._keys.get(key)
            if holders is None:
                self._keys[key] = {pod}
            else:
                holders.add(pod)
                self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def forget_pod(self, pod: str) -> None:
        for key in [k for k, holders in self._keys.items() if pod in holders]:
            holders = self._keys[key]
            holders.discard(pod)
            if not holders:
                del self._keys[key]

    def __len__(self) -> int:
        return len(self._keys)
