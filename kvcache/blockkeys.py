"""kvgate's own block keys: a chained polynomial hash over each full block's token ids.

key[-1] = root(model, lora); key[i] = (key[i-1] * MULT + hash(block_i)) mod 2**60, with block_i
the tuple of block i's token ids. Python's hash of a tuple of ints is deterministic across
processes (only str/bytes hashing is salted), so keys do not depend on the engine's hash algorithm
or seed. The root is derived from model and LoRA adapter with blake2b, so the same tokens under
another model or adapter get other keys. Keys live only in memory: they need not be stable across
Python versions.

The chain is Horner's rule, so a whole prompt's keys unroll without a Python loop:
key[i] = MULT**(i+1) * (root + sum_{m<=i} h_m * MULT**-(m+1)) mod 2**60 (MULT is odd, hence
invertible), which numpy evaluates with wrap-around uint64 arithmetic (2**60 divides 2**64).
Ingest computes the same keys one event at a time from the parent's key (`step`).
Collisions: for distinct prefixes two keys agree with probability about 2**-60 (1M keys: ~1e-6
for any pair in the index); the hash is not cryptographic, so crafted prompts could collide on
purpose. A false hit only sends a request to a pod that misses the cache.
"""
from __future__ import annotations

import hashlib
from functools import lru_cache
from typing import Sequence

import numpy as np

# 60 bits: below kvcache.table's reserved key values, and 32-byte ints where Python holds keys.
KEY_MASK = (1 << 60) - 1
MULT = 0x9E3779B97F4A7C15  # odd: invertible mod 2**64
_MULT_INV = pow(MULT, -1, 1 << 64)
_VECTOR_MIN_BLOCKS = 24  # below this a Python loop beats numpy's per-call overhead


@lru_cache(maxsize=4096)
def root_key(model: str, lora: str | None) -> int:
    """The parent of a chain's first block for `model` and LoRA adapter `lora` (None: base model)."""
    scope = model.encode() + b"\0" + (b"\1" + lora.encode() if lora is not None else b"")
    return int.from_bytes(hashlib.blake2b(scope, digest_size=8).digest(), "big") & KEY_MASK


def step(parent: int, block: tuple[int, ...]) -> int:
    """The key of `block` (its token ids) under the block keyed `parent`."""
    return (parent * MULT + hash(block)) & KEY_MASK


def block_keys(model: str, lora: str | None, token_ids: Sequence[int], block_size: int) -> list[int]:
    """Keys of every full block of `token_ids`; a partial last block has none."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return chain_keys(root_key(model, lora), token_ids, block_size)


def chain_keys(parent: int, token_ids: Sequence[int], block_size: int) -> list[int]:
    """Keys of every full block of `token_ids` under the block keyed `parent` (or a root key)."""
    n = len(token_ids) // block_size
    if n >= _VECTOR_MIN_BLOCKS:
        return chain_key_array(parent, token_ids, block_size).tolist()
    out = []
    k = parent
    for h in map(hash, zip(*[iter(token_ids)] * block_size)):
        k = (k * MULT + h) & KEY_MASK
        out.append(k)
    return out


def chain_key_array(parent: int, token_ids: Sequence[int], block_size: int) -> np.ndarray:
    """chain_keys as a uint64 array, computed without a Python loop over the blocks."""
    n = len(token_ids) // block_size
    fwd, inv = _powers(n)
    h = np.fromiter(map(hash, zip(*[iter(token_ids)] * block_size)), np.int64, n).view(np.uint64)
    h *= inv[1:n + 1]
    s = np.cumsum(h)
    s += np.uint64(parent)
    s *= fwd[1:n + 1]
    s &= np.uint64(KEY_MASK)
    return s


@lru_cache(maxsize=32)
def _powers_pow2(size: int) -> tuple[np.ndarray, np.ndarray]:
    fwd = np.empty(size + 1, np.uint64)
    inv = np.empty(size + 1, np.uint64)
    f = i = 1
    for e in range(size + 1):
        fwd[e], inv[e] = f, i
        f = f * MULT & 0xFFFFFFFFFFFFFFFF
        i = i * _MULT_INV & 0xFFFFFFFFFFFFFFFF
    fwd.flags.writeable = inv.flags.writeable = False
    return fwd, inv


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """MULT**e and MULT**-e mod 2**64 for e in 0..>=n, shared by every call."""
    return _powers_pow2(1 << max(n, 1).bit_length())
