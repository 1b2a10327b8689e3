"""A prompt's family: the prompts that share it past the opening most prompts of its model begin with.

Prompts of one deployment share an opening: a chat template's first tokens (17 in `kvgate bench bakeoff`'s,
Llama 3's with its knowledge-cutoff and date lines runs past two blocks), a preamble every tenant sends. Every
engine soon holds it, so it tells tenants apart no more than it tells engines apart: keyed on a prompt's first
block, every tenant of such a deployment was one family. The family is keyed on the first block past the
opening instead, the opening learnt from the model's recent prompts (SharedOpening).
"""
from __future__ import annotations

from collections import deque
from typing import Sequence


class SharedOpening:
    """Per model, how many leading blocks most of its recent prompts share: over the last `window` prompts,
    the deepest run of a prompt's blocks that at least `share` of them begin with, at most `max_blocks` deep.
    Until `least` prompts are in, nothing is known (None).

    Why a share and not all of them: one prompt without the template (a raw completion, a client of its own)
    would make the opening nothing. Why not less: one tenant sending more than `share` of the requests has
    its system prompt taken as the opening for its own prompts (each of its conversations a family, spread
    by load, as a tenant that large must be), while every other tenant's opening is still the shared one."""

    def __init__(self, window: int = 32, share: float = 0.75, max_blocks: int = 32, least: int = 8,
                 models: int = 64) -> None:
        if not (window >= least >= 1 and 0.0 < share <= 1.0 and max_blocks >= 1 and models >= 1):
            raise ValueError("need window >= least >= 1, 0 < share <= 1, max_blocks >= 1, models >= 1")
        self.window, self.share, self.max_blocks, self.least = window, share, max_blocks, least
        self._models = models
        self._seen: dict[str, tuple[deque[Sequence[int]], dict[int, int]]] = {}  # model -> (prompts, key counts)

    def depth(self, model: str, keys: Sequence[int]) -> int | None:
        """The opening's length in blocks as it stands for this prompt (`keys`: its leading block keys, chained,
        at least max_blocks of them where it has that many), then counts the prompt in."""
        seen = self._seen.get(model)
        if seen is None:
            if len(self._seen) >= self._models:
                self._seen.clear()
            seen = self._seen[model] = (deque(), {})
        prompts, counts = seen
        mine = keys[:self.max_blocks]
        depth = None
        if len(prompts) >= self.least:
            need = self.share * len(prompts)
            depth = 0
            for key in mine:
                if counts.get(key, 0) < need:
                    break
                depth += 1
        prompts.append(mine)
        for key in mine:
            counts[key] = counts.get(key, 0) + 1
        if len(prompts) > self.window:
            for key in prompts.popleft():
                left = counts[key] - 1
                if left:
                    counts[key] = left
                else:
                    del counts[key]
        return depth
