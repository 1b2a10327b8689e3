"""Model shapes the simulated engine can take: its KV cache groups, as vLLM forms them for such a model
(one group per kind of attention layer, group 0 the kind of the model's first layer), and the retention
of the sliding-window and mamba groups' blocks (vLLM's `prefix_cache_retention_interval`).

- dense: one full-attention group of the engine's block size.
- hybrid (gpt-oss-like): group 0 sliding window (`sliding_window` tokens, default 128), group 1 full
  attention, both of the engine's block size.
- mamba-hybrid (Qwen3-Next-, Jamba-like): group 0 full attention of the engine's block size, group 1 mamba
  with blocks MAMBA_BLOCK_FACTOR times larger (vLLM gives mamba groups larger blocks).
Retention: sparse (vLLM's default since 0.29, interval 0: only blocks that can serve a hit keep a hash) or
dense (interval None: every block).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from sim.engine import EngineConfig, GroupSpec

MAMBA_BLOCK_FACTOR = 4
DEFAULT_SLIDING_WINDOW = 128


def _dense(block_size: int, window: int) -> tuple[GroupSpec, ...]:
    return (GroupSpec("full_attention", block_size),)


def _hybrid(block_size: int, window: int) -> tuple[GroupSpec, ...]:
    return (GroupSpec("sliding_window", block_size, sliding_window=window), GroupSpec("full_attention", block_size))


def _mamba_hybrid(block_size: int, window: int) -> tuple[GroupSpec, ...]:
    return (GroupSpec("full_attention", block_size), GroupSpec("mamba", block_size * MAMBA_BLOCK_FACTOR))


MODEL_SHAPES: dict[str, Callable[[int, int], tuple[GroupSpec, ...]]] = {
    "dense": _dense, "hybrid": _hybrid, "mamba-hybrid": _mamba_hybrid,
}
RETENTIONS: dict[str, int | None] = {"sparse": 0, "dense": None}


def check(shape: str | None, retention: str | None, sliding_window: int) -> None:
    """ValueError naming the bad option."""
    if shape is not None and shape not in MODEL_SHAPES:
        raise ValueError(f"model_shape must be one of {', '.join(MODEL_SHAPES)}, got {shape!r}")
    if retention is not None and retention not in RETENTIONS:
        raise ValueError(f"retention must be one of {', '.join(RETENTIONS)}, got {retention!r}")
    if type(sliding_window) is not int or sliding_window < 1:
        raise ValueError(f"sliding_window must be an int >= 1, got {sliding_window!r}")


def shaped(config: EngineConfig, shape: str | None, retention: str | None,
           sliding_window: int = DEFAULT_SLIDING_WINDOW) -> EngineConfig:
    """`config` with the groups of `shape` (at its block size) and the retention named; None leaves that part
    of `config` as it is."""
    check(shape, retention, sliding_window)
    changes: dict[str, object] = {}
    if shape is not None:
        changes["groups"] = MODEL_SHAPES[shape](config.block_size, sliding_window)
    if retention is not None:
        changes["retention_interval"] = RETENTIONS[retention]
    if not changes:
        return config
    return replace(config, **changes)  # type: ignore[arg-type]
