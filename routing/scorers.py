"""The scorers: each gives every candidate pod 0..1, higher is better."""
from __future__ import annotations

from typing import Mapping, Protocol, Sequence

from routing.approx import ApproxPrefixTable
from routing.engine_metrics import EngineMetrics
from routing.pods import Pod
from routing.scoring import PickContext


class PrefixMatchLike(Protocol):
    blocks: int
    by_medium: Mapping[str, int]
    total_blocks: int


class PrefixSource(Protocol):
    """What `kv-sync` needs of kvcache.index.PrefixIndex."""

    def match(self, model: str, lora: str | None, token_ids: Sequence[int],
              pods: Sequence[str]) -> Mapping[str, PrefixMatchLike]: ...

    def stats(self) -> dict: ...


def _relative(values: Mapping[str, float], scale: float) -> dict[str, float]:
    """1 for the smallest value, falling linearly with the gap; a gap of `scale` or the
    spread (whichever is larger) gives 0, so small differences weigh little."""
    if not values:
        return {}
    least = min(values.values())
    span = max(max(values.values()) - least, scale)
    return {k: 1.0 - (v - least) / span for k, v in values.items()}


class LoadScorer:
    """Fewer running requests (over every gateway, picks not yet finished included) is better."""

    name = "load"
    needs_tokens = False

    def __init__(self, scale: float = 8.0) -> None:
        self._scale = scale

    def score(self, ctx: PickContext, pods: Sequence[Pod]) -> dict[str, float]:
        return _relative({p.name: float(ctx.running.get(p.name, 0)) for p in pods}, self._scale)

    def picked(self, ctx: PickContext, pod: Pod) -> None:
        return None


class PrecisePrefixScorer:
    """Leading prompt blocks a pod holds per the event-fed index, over the prompt's blocks;
    blocks on slower media weigh less (GPU 1.0, CPU 0.8 by default)."""

    name = "prefix"
    needs_tokens = True

    def __init__(self, index: PrefixSource, medium_weights: Mapping[str, float] | None = None,
                 other_medium_weight: float = 0.8) -> None:
        self._index = index
        weights = {m.upper(): w for m, w in (medium_weights or {"GPU": 1.0, "CPU": 0.8}).items()}
        self._ranked = sorted(weights.items(), key=lambda kv: -kv[1])
        self._floor = min([other_medium_weight, *weights.values()])

    def weighted_blocks(self, blocks: int, by_medium: Mapping[str, int]) -> float:
        # Credit blocks to the best medium holding them first; what is left counts at the lowest weight.
        if blocks <= 0:
            return 0.0
        score = 0.0
        covered = 0
        for medium, w in self._ranked:
            n = min(by_medium.get(medium, 0), blocks - covered)
            if n > 0:
                score += n * w
                covered += n
        return score + (blocks - covered) * self._floor

    def score(self, ctx: PickContext, pods: Sequence[Pod]) -> dict[str, float]:
        tokens = ctx.request.token_ids
        if not tokens:
            return {}
        matches = self._index.match(ctx.base_model, ctx.lora, tokens, [p.name for p in pods])
        out: dict[str, float] = {}
        for p in pods:
            m = matches.get(p.name)
            if m is None:
                continue
            ctx.total_blocks = max(ctx.total_blocks, m.total_blocks)
            ctx.matched[p.name] = m.blocks
            if m.total_blocks > 0:
                out[p.name] = self.weighted_blocks(m.blocks, m.by_medium or {}) / m.total_blocks
        return out

    def picked(self, ctx: PickContext, pod: Pod) -> None:
        return None


class ApproxPrefixScorer:
    """Leading prompt blocks this gateway already sent to a pod, over the prompt's blocks."""

    name = "approx-prefix"
    needs_tokens = True

    def __init__(self, table: ApproxPrefixTable) -> None:
        self.table = table
        self._pending: tuple[int, list[int]] | None = None

    def score(self, ctx: PickContext, pods: Sequence[Pod]) -> dict[str, float]:
        tokens = ctx.request.token_ids
        if not tokens:
            return {}
        keys = self.table.block_keys(ctx.base_model, ctx.lora, tokens)
        self._pending = (id(ctx), keys)
        if not keys:
            return {}
        matched = self.table.match(keys, [p.name for p in pods])
        ctx.total_blocks = len(keys)
        ctx.matched.update(matched)
        return {name: n / len(keys) for name, n in matched.items()}

    def picked(self, ctx: PickContext, pod: Pod) -> None:
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == id(ctx):  # score() and picked() run back to back, no await
            self.table.record(pending[1], pod.name)


class QueueScorer:
    """Fewer requests waiting in the engine's queue (scraped) is better; unknown pods score 0.5."""

    name = "queue"
    needs_tokens = False

    def __init__(self, engines: EngineMetrics, scale: float = 4.0) -> None:
        self._engines = engines
        self._scale = scale

    def score(self, ctx: PickContext, pods: Sequence[Pod]) -> dict[str, float]:
        known = {}
        for p in pods:
            load = self._engines.get(p.name)
            if load is not None:
                known[p.name] = load.waiting
        out = dict.fromkeys((p.name for p in pods), 0.5)
        out.update(_relative(known, self._scale))
        return out

    def picked(self, ctx: PickContext, pod: Pod) -> None:
        return None


class KVUtilizationScorer:
    """More free KV cache in the engine (scraped) is better: 1 - usage; unknown pods score 0.5."""

    name = "kv-util"
    needs_tokens = False

    def __init__(self, engines: EngineMetrics) -> None:
        self._engines = engines

    def score(self, ctx: PickContext, pods: Sequence[Pod]) -> dict[str, float]:
        out = {}
        for p in pods:
            load = self._engines.get(p.name)
            out[p.name] = 0.5 if load is None or load.kv_usage is None else 1.0 - load.kv_usage
        return out

    def picked(self, ctx: PickContext, pod: Pod) -> None:
        return None
