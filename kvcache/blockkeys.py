"""kvgate's own block keys: a chained hash over each full block's token ids.

key[0] = step(root(model, lora), tokens[0:bs]); key[i] = step(key[i-1], tokens[i*bs:(i+1)*bs]),
where step(parent, block) = hash((parent, hash(block))) & KEY_MASK. Python's hash of a tuple of
ints is deterministic across processes (only str/bytes hashing is salted), so keys do not depend
on the engine's hash algorithm or seed. The root is derived from model and LoRA adapter with
blake2b, so the same tokens under another model or adapter get other keys. Keys live only in
memory: they need not be stable across Python versions.
"""
from __future__ import annotations

import hashlib
from functools import lru_cache

# 60 bits: a CPython int below 2**60 takes 32 bytes instead of 48, and 1M keys collide with
# probability ~1e-6.
KEY_MASK = (1 << 60) - 1


@lru_cache(maxsize=4096)
def root_key(model: str, lora: str | None) -> int:
    """The parent of a chain's first block for `model` and LoRA adapter `lora` (None: base model)."""
    scope = model.encode() + b"\0" + (b"\1" + lora.encode() if lora is not None else b"")
    return int.from_bytes(hashlib.blake2b(scope, digest_size=8).digest(), "big") & KEY_MASK


def block_keys(model: str, lora: str | None, token_ids: tuple[int, ...] | list[int], block_size: int) -> list[int]:
    """Keys of every full block of `token_ids`; a partial last block has none."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    k = root_key(model, lora)
    out = []
    for h in map(hash, zip(*[iter(token_ids)] * block_size)):
        k = hash((k, h)) & KEY_MASK
        out.append(k)
    return out
