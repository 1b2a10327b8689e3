"""Typed KV cache events, as published by vLLM engines.

A block hash is opaque: an int (possibly negative before vLLM 0.10.2, uint64
since) or 32 raw bytes. Only the engine that published it can interpret it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

BlockHash = Union[int, bytes]


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    # flat: len(block_hashes) * block_size ids; more when a group with sparse retention (vLLM 0.29+)
    # skipped blocks: the ids of every new full block, hashed or not (vLLM issue 44451)
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None  # "GPU", "CPU", ...; None means GPU (pre-0.10.2)
    lora_name: str | None = None
    extra_keys: tuple | None = None  # one entry per block (a tuple or None), 0.17+
    group_idx: int | None = None  # KV cache group, 0.20+
    kv_cache_spec_kind: str | None = None  # e.g. "full_attention", 0.22+
    kv_cache_spec_sliding_window: int | None = None  # 0.22+
    lookahead_token_ids: tuple[int, ...] | None = None  # 0.33: tokens after the blocks their hashes cover


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None
