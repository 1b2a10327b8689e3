"""The named strategies: configurations of filters, weighted scorers and a picker.

  random         uniform among ready pods
  round-robin    ready pods in turn
  least-request  fewest running requests over every gateway (ties at random)
  prefix-cache   load guard; 3 x router-side prefix guess + 2 x load        (no events)
  kv-sync        load guard; 3 x estimated prefill wait + 2 x load: the event-fed index's
                 uncached prompt tokens per pod (GPU 1.0, CPU 0.8) plus the pod's prefill backlog

Engine-metric scorers (`queue`, `kv-util`) join a strategy through its weights, e.g.
`kv-sync:prefix=3,load=2,queue=1,kv-util=1` (see parse_weights).
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

from routing.approx import ApproxPrefixTable
from routing.engine_metrics import EngineMetrics
from routing.scorers import (ApproxPrefixScorer, KVUtilizationScorer, LoadScorer, PrecisePrefixScorer,
                             PrefillBacklog, PrefixSource, QueueScorer)
from routing.scoring import LoadGuard, MaxScorePicker, RandomPicker, RoundRobinPicker, Scorer, Strategy

NAMES = ("random", "round-robin", "least-request", "prefix-cache", "kv-sync")
WEIGHTED = ("least-request", "prefix-cache", "kv-sync")
SCORER_NAMES = ("load", "prefix", "approx-prefix", "queue", "kv-util")

DEFAULT_WEIGHTS: dict[str, dict[str, float]] = {
    "least-request": {"load": 1.0},
    "prefix-cache": {"approx-prefix": 3.0, "load": 2.0},
    "kv-sync": {"prefix": 3.0, "load": 2.0},
}


@dataclass(frozen=True)
class StrategyConfig:
    guard_abs_slack: int = 16  # KVGATE_ROUTING_GUARD_SLACK
    guard_rel_slack: float = 0.5  # KVGATE_ROUTING_GUARD_RATIO
    load_scale: float = 8.0  # running-count gap that costs a full load point
    approx_block_size: int = 16  # KVGATE_PREFIX_CACHE_BLOCK_SIZE
    approx_capacity: int = 200_000  # KVGATE_PREFIX_CACHE_BLOCKS
    medium_weights: Mapping[str, float] = field(default_factory=lambda: {"GPU": 1.0, "CPU": 0.8})
    weights: Mapping[str, Mapping[str, float]] = field(default_factory=dict)  # KVGATE_ROUTING_WEIGHTS
    # kv-sync's prefill backlog estimate drains at this nominal engine prefill speed, tokens/s (the
    # `kvgate sim` engine's; bench routing gave the same W1/W2 results with half or twice the rate)
    prefill_tokens_per_s: float = 10_000.0
    clock: Callable[[], float] = time.monotonic  # the backlog's clock (the routing benchmark's is virtual)


def parse_weights(text: str, source: str = "KVGATE_ROUTING_WEIGHTS") -> dict[str, dict[str, float]]:
    """`strategy:scorer=w,scorer=w;strategy:...` -> per strategy, weights laid over its defaults (0 removes a scorer)."""
    out: dict[str, dict[str, float]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, sep, body = part.partition(":")
        name = name.strip()
        if not sep or name not in WEIGHTED:
            raise ValueError(f"{source}: {part!r}: expected <strategy>:<scorer>=<weight>,... "
                             f"with strategy one of {', '.join(WEIGHTED)}")
        weights: dict[str, float] = {}
        for item in filter(None, (i.strip() for i in body.split(","))):
            scorer, eq, value = item.partition("=")
            scorer = scorer.strip()
            if not eq or scorer not in SCORER_NAMES:
                raise ValueError(f"{source}: {item!r}: expected <scorer>=<weight>, scorer one of "
                                 f"{', '.join(SCORER_NAMES)}")
            try:
                w = float(value)
            except ValueError:
                raise ValueError(f"{source}: {item!r}: weight is not a number") from None
            if not 0 <= w < float("inf"):
                raise ValueError(f"{source}: {item!r}: weight must be >= 0")
            weights[scorer] = w
        out[name] = weights
    return out


def build_strategies(config: StrategyConfig, rng: random.Random, *, index: PrefixSource | None = None,
                     engines: EngineMetrics | None = None) -> dict[str, Strategy]:
    """Every strategy that can run with what is given (`kv-sync` needs the index)."""
    approx = ApproxPrefixScorer(ApproxPrefixTable(config.approx_block_size, config.approx_capacity))

    def scorer(name: str, strategy: str) -> Scorer:
        if name == "load":
            return LoadScorer(config.load_scale)
        if name == "approx-prefix":
            return approx
        if name == "prefix":
            if index is None:
                raise ValueError(f"{strategy}: scorer 'prefix' needs the prefix index")
            return PrecisePrefixScorer(index, config.medium_weights,
                                       backlog=PrefillBacklog(config.prefill_tokens_per_s, config.clock))
        if engines is None:
            raise ValueError(f"{strategy}: scorer {name!r} needs engine metrics scraping (interval > 0)")
        return QueueScorer(engines) if name == "queue" else KVUtilizationScorer(engines)

    guard = LoadGuard(config.guard_abs_slack, config.guard_rel_slack)
    out = {
        "random": Strategy("random", RandomPicker(rng)),
        "round-robin": Strategy("round-robin", RoundRobinPicker()),
    }
    for name in WEIGHTED:
        if name == "kv-sync" and index is None:
            continue
        weights = {**DEFAULT_WEIGHTS[name], **config.weights.get(name, {})}
        scorers = tuple((scorer(s, name), w) for s, w in weights.items() if w > 0)
        filters = (guard,) if name != "least-request" else ()
        out[name] = Strategy(name, MaxScorePicker(rng), scorers, filters)
    return out
