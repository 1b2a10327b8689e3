"""kvgate's own block keys: a chained hash over each full block's token ids.

key[-1] = root(model, lora); key[i] = (key[i-1] * MULT + block_hash(block_i)) mod 2**60, where
block_hash mixes block i's token ids (as 64-bit two's complement) with a multiply-xorshift per
token and a finaliser (kvcache/csrc/blockkeys.c; `reference_chain_keys` below is the same function in
plain Python, for tests and readers). Keys do not depend on the engine's hash algorithm or seed,
nor on the Python process. The root is derived from model and LoRA adapter with blake2b, so the
same tokens under another model or adapter get other keys. A block with extra keys (a salt, media
items, prompt-embeds digests: what vLLM's hash carries besides tokens and adapter) has its key xor-ed
with their digest before the next block chains on it (`mixed_keys`), for events and requests alike
(`BlockExtras.per_block` gives a request's in the events' form).
Collisions: for distinct prefixes two keys agree with probability about 2**-60 (1M keys: ~1e-6
for any pair in the index); the hash is not cryptographic, so crafted prompts could collide on
purpose. A false hit only sends a request to a pod that misses the cache.
Token ids must be ints in [-2**63, 2**64): others raise TypeError or OverflowError.
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

from kvcache.native import native as _native

# 60 bits: below kvcache.table's reserved key values, and 32-byte ints where Python holds keys.
KEY_MASK = (1 << 60) - 1
MULT = 0x9E3779B97F4A7C15  # odd: invertible mod 2**64


@lru_cache(maxsize=4096)
def root_key(model: str, lora: str | None) -> int:
    """The parent of a chain's first block for `model` and LoRA adapter `lora` (None: base model)."""
    scope = model.encode() + b"\0" + (b"\1" + lora.encode() if lora is not None else b"")
    return int.from_bytes(hashlib.blake2b(scope, digest_size=8).digest(), "big") & KEY_MASK


def block_keys(model: str, lora: str | None, token_ids: Sequence[int], block_size: int) -> list[int]:
    """Keys of every full block of `token_ids`; a partial last block has none."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return chain_keys(root_key(model, lora), token_ids, block_size)


def chain_keys(parent: int, token_ids: Sequence[int], block_size: int) -> list[int]:
    """Keys of every full block of `token_ids` under the block keyed `parent` (or a root key)."""
    return array("Q", _native.chain_keys(parent, token_ids, block_size)).tolist()


_M64 = (1 << 64) - 1


def reference_chain_keys(parent: int, token_ids: Sequence[int], block_size: int) -> list[int]:
    """chain_keys in plain Python: the definition, spelled out (slow)."""
    out, k = [], parent
    for i in range(len(token_ids) // block_size):
        h = 0x243F6A8885A308D3 ^ block_size
        for t in token_ids[i * block_size:(i + 1) * block_size]:
            if not isinstance(t, int):
                raise TypeError(f"token ids must be ints, got {type(t).__name__}")
            if not -(1 << 63) <= t < 1 << 64:
                raise OverflowError("token id out of 64-bit range")
            h = (h ^ (t & _M64)) * 0xFF51AFD7ED558CCD & _M64
            h ^= h >> 32
        h ^= h >> 29
        h = h * 0xC4CEB9FE1A85EC53 & _M64
        h ^= h >> 32
        k = (k * MULT + h) & KEY_MASK
        out.append(k)
    return out


# --- extra keys: what an engine's block hash carries besides the tokens and the LoRA adapter ---------


@dataclass(frozen=True, slots=True)
class MediaItem:
    """One media item of a prompt as the engine hashes it: `identifier` (the client's `uuid` on the
    content part, else the engine's hash of the media, e.g. from its render endpoint), and the
    placeholder tokens it fills, prompt positions [offset, offset + length)."""
    identifier: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class BlockExtras:
    """What a request adds to its blocks' hashes besides token ids and the LoRA adapter (vLLM's
    generate_block_hash_extra_keys): the `cache_salt` (block 0, and through the chain every later
    block), media items (every block overlapping an item's placeholders). `opaque`: the request has
    extra keys kvgate cannot compute (prompt embeddings, media without a known identifier): no block
    of it is claimed anywhere."""
    cache_salt: str | None = None
    media: tuple[MediaItem, ...] = ()
    opaque: bool = False

    def __bool__(self) -> bool:
        return self.cache_salt is not None or bool(self.media) or self.opaque

    def per_block(self, block_size: int, n_blocks: int) -> dict[int, tuple]:
        """The extra keys of blocks 0..n_blocks-1 at `block_size`, in the form vLLM's events carry them
        (kvcache.events.BlockStored.extra_keys entries, the LoRA name left out): per block index with
        any, a tuple of media `(identifier, offset of the item's start from the block's start)` pairs in
        item order, then the salt (block 0 only)."""
        out: dict[int, list] = {}
        for item in self.media:
            if item.length <= 0:
                continue
            first = item.offset // block_size
            last = min((item.offset + item.length - 1) // block_size, n_blocks - 1)
            for b in range(first, last + 1):
                out.setdefault(b, []).append((item.identifier, item.offset - b * block_size))
        if self.cache_salt is not None and n_blocks > 0:
            out.setdefault(0, []).append(self.cache_salt)
        return {b: tuple(v) for b, v in out.items()}


def _canonical(v: Any) -> Any:
    """An extra key as a value whose repr is the same however it was decoded (lists -> tuples)."""
    if type(v) is list or type(v) is tuple:
        return tuple(_canonical(x) for x in v)
    return v


def extra_digest(entry: tuple) -> int:
    """A block's extra keys (the event form, LoRA name left out) as a number mixed into its key: the
    same for an engine's event and for the request side (kvcache.blockkeys.BlockExtras.per_block)."""
    d = hashlib.blake2b(repr(_canonical(entry)).encode(), digest_size=8).digest()
    return int.from_bytes(d, "big") & KEY_MASK or 1


def mixed_keys(parent: int, token_ids: Sequence[int], block_size: int, digests: dict[int, int]) -> array:
    """chain_keys of every full block under `parent`, block b's key mixed with digests[b] (xor) where
    given, before the next block chains on it."""
    n = len(token_ids) // block_size
    out = array("Q")
    k, start = parent, 0
    for b in sorted(digests):
        if b >= n:
            break
        if b > start:
            out.frombytes(_native.chain_keys(k, token_ids[start * block_size:b * block_size], block_size))
            k = out[-1]
        one = array("Q", _native.chain_keys(k, token_ids[b * block_size:(b + 1) * block_size], block_size))
        k = (one[0] ^ digests[b]) & KEY_MASK
        out.append(k)
        start = b + 1
    if start < n:
        out.frombytes(_native.chain_keys(k, token_ids[start * block_size:n * block_size], block_size))
    return out


def request_keys(root: int, token_ids: Sequence[int], block_size: int, extras: BlockExtras | None) -> array:
    """The keys of a request's full blocks under `root` (its model and adapter), with its extra keys mixed in
    as the engine's events carry them (BlockExtras.per_block)."""
    if not extras:
        return array("Q", _native.chain_keys(root, token_ids, block_size))
    n = len(token_ids) // block_size
    return mixed_keys(root, token_ids, block_size,
                      {b: extra_digest(e) for b, e in extras.per_block(block_size, n).items()})
