"""vLLM's KV event payload (msgpack), every generation in docs/vllm-kv-events.md.

Decoding accepts array-shaped events (vLLM <= 0.23), map-shaped events
(>= 0.24), 2- or 3-element and map-shaped batches; what it does not recognise
is skipped and counted, never fatal. Encoding reproduces byte for byte what
msgspec writes for vLLM's structs in a chosen generation.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack

from kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEvent

GENERATIONS = ("0.23", "0.25", "0.33")

# Skip reasons reported in DecodedBatch.skipped.
UNKNOWN_TAG = "unknown_tag"
UNKNOWN_FIELD = "unknown_field"
MALFORMED_EVENT = "malformed_event"


class WireError(ValueError):
    """The payload is not a KV event batch at all (not msgpack, wrong shape)."""


@dataclass(frozen=True, slots=True)
class DecodedBatch:
    batch: EventBatch  # recognised events only, in order
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count


class _Malformed(Exception):
    pass


_HASH_TYPES = frozenset((int, bytes))
_OPT_HASH_TYPES = frozenset((int, bytes, type(None)))
_OPT_INT = frozenset((int, type(None)))
_OPT_STR = frozenset((str, type(None)))
_OPT_TUPLE = frozenset((tuple, type(None)))
_NONES = (None,) * 16

# Fields a map event may carry that we know but do not model (newer vLLM releases).
_STORED_KNOWN = frozenset((
    "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
    "locality", "ownership", "session_id", "lookahead_token_ids",
))
_REMOVED_KNOWN = frozenset(("type", "block_hashes", "medium", "group_idx", "locality", "ownership"))
_REMOVED_PLAIN = frozenset(("type", "block_hashes", "medium"))
_CLEARED_KNOWN = frozenset(("type",))
_STORED_ARRAY_FIELDS = 11  # fields after the tag in vLLM 0.23
_REMOVED_ARRAY_FIELDS = 3


def _builder(cls: type[BlockStored] | type[BlockRemoved]) -> Callable[..., Any]:
    """Build a frozen slots dataclass positionally without its __init__ (which sets each field
    through object.__setattr__): the decoder validates every field itself."""
    setters = [getattr(cls, name).__set__ for name in cls.__slots__]
    new = object.__new__
    if len(setters) == 3:
        s0, s1, s2 = setters

        def build3(a: Any, b: Any, c: Any) -> Any:
            o: Any = new(cls)
            s0(o, a)
            s1(o, b)
            s2(o, c)
            return o
        return build3

    def build(*values: Any) -> Any:
        o: Any = new(cls)
        for setter, v in zip(setters, values):
            setter(o, v)
        return o
    return build


_new_stored = _builder(BlockStored)
_new_removed = _builder(BlockRemoved)
assert BlockStored.__slots__[:4] == ("block_hashes", "parent_block_hash", "token_ids", "block_size")
assert BlockRemoved.__slots__ == ("block_hashes", "medium", "group_idx")


def _check_hashes(h: Any) -> None:
    if type(h) is not tuple:
        raise _Malformed
    if len(h) == 1:
        t = type(h[0])
        if t is not int and t is not bytes:
            raise _Malformed
    elif not _HASH_TYPES.issuperset(map(type, h)):
        raise _Malformed


def _stored(h: Any, parent: Any, tokens: Any, block_size: Any, lora_id: Any, medium: Any,
            lora_name: Any, extra_keys: Any, group_idx: Any, kind: Any, window: Any,
            lookahead: Any = None) -> BlockStored:
    _check_hashes(h)
    if type(tokens) is not tuple or type(block_size) is not int or block_size <= 0:
        raise _Malformed
    n = len(tokens)
    if n != len(h) * block_size and (n % block_size or len(h) > n // block_size):
        raise _Malformed  # fewer hashes than blocks is a sparse store (kvcache.events.BlockStored.token_ids)
    if (type(parent) not in _OPT_HASH_TYPES or type(lora_id) not in _OPT_INT
            or type(medium) not in _OPT_STR or type(lora_name) not in _OPT_STR
            or type(extra_keys) not in _OPT_TUPLE or type(group_idx) not in _OPT_INT
            or type(kind) not in _OPT_STR or type(window) not in _OPT_INT or type(lookahead) not in _OPT_TUPLE):
        raise _Malformed
    return _new_stored(h, parent, tokens, block_size, lora_id, medium, lora_name, extra_keys,
                       group_idx, kind, window, lookahead or None)


def _removed(h: Any, medium: Any, group_idx: Any) -> BlockRemoved:
    _check_hashes(h)
    if type(medium) not in _OPT_STR or type(group_idx) not in _OPT_INT:
        raise _Malformed
    return _new_removed(h, medium, group_idx)


def _stored_array(ev: tuple, skipped: dict) -> BlockStored:
    n = len(ev) - 1
    if n < 4:
        raise _Malformed
    if n > _STORED_ARRAY_FIELDS:
        _count(skipped, UNKNOWN_FIELD, n - _STORED_ARRAY_FIELDS)
        return _stored(*ev[1:_STORED_ARRAY_FIELDS + 1])
    return _stored(*ev[1:], *_NONES[:_STORED_ARRAY_FIELDS - n])


def _removed_array(ev: tuple, skipped: dict) -> BlockRemoved:
    n = len(ev) - 1
    if n < 1:
        raise _Malformed
    if n > _REMOVED_ARRAY_FIELDS:
        _count(skipped, UNKNOWN_FIELD, n - _REMOVED_ARRAY_FIELDS)
    medium = ev[2] if n > 1 else None
    group_idx = ev[3] if n > 2 else None
    return _removed(ev[1], medium, group_idx)


def _cleared_array(ev: tuple, skipped: dict) -> AllBlocksCleared:
    if len(ev) > 1:
        _count(skipped, UNKNOWN_FIELD, len(ev) - 1)
    return _CLEARED


def _count_unknown(ev: dict, known: frozenset, skipped: dict) -> None:
    if not known.issuperset(ev):
        extra = len(ev.keys() - known)
        if extra:
            _count(skipped, UNKNOWN_FIELD, extra)


def _stored_map(ev: dict, skipped: dict) -> BlockStored:
    _count_unknown(ev, _STORED_KNOWN, skipped)
    g = ev.get
    if "block_hashes" not in ev or "token_ids" not in ev or "block_size" not in ev:
        raise _Malformed
    return _stored(ev["block_hashes"], g("parent_block_hash"), ev["token_ids"], ev["block_size"],
                   g("lora_id"), g("medium"), g("lora_name"), g("extra_keys"), g("group_idx"),
                   g("kv_cache_spec_kind"), g("kv_cache_spec_sliding_window"), g("lookahead_token_ids"))


def _removed_map(ev: dict, skipped: dict) -> BlockRemoved:
    if not _REMOVED_KNOWN.issuperset(ev):
        _count_unknown(ev, _REMOVED_KNOWN, skipped)
    try:
        h = ev["block_hashes"]
    except KeyError:
        raise _Malformed from None
    return _removed(h, ev.get("medium"), ev.get("group_idx"))


def _cleared_map(ev: dict, skipped: dict) -> AllBlocksCleared:
    _count_unknown(ev, _CLEARED_KNOWN, skipped)
    return _CLEARED


def _count(skipped: dict, reason: str, n: int = 1) -> None:
    skipped[reason] = skipped.get(reason, 0) + n


_CLEARED = AllBlocksCleared()
_ARRAY: dict[Any, Callable[[tuple, dict], KVEvent]] = {
    "BlockStored": _stored_array, "BlockRemoved": _removed_array, "AllBlocksCleared": _cleared_array,
}
_MAP: dict[Any, Callable[[dict, dict], KVEvent]] = {
    "BlockStored": _stored_map, "BlockRemoved": _removed_map, "AllBlocksCleared": _cleared_map,
}


_FLOAT64, _FLOAT32 = struct.Struct(">d"), struct.Struct(">f")


def batch_ts(payload: bytes) -> float | None:
    """The batch's own timestamp (the engine's clock, unix s) read from its first bytes without decoding it:
    vLLM's array form `[ts, events(, rank)]` with a float ts; None for any other form."""
    if len(payload) < 6 or payload[0] not in (0x92, 0x93):
        return None
    kind = payload[1]
    if kind == 0xCB and len(payload) >= 10:
        return _FLOAT64.unpack_from(payload, 2)[0]
    if kind == 0xCA:
        return _FLOAT32.unpack_from(payload, 2)[0]
    return None


def decode_batch(payload: bytes) -> DecodedBatch:
    """Decode one batch payload. Raises WireError only when the batch itself is unusable."""
    try:
        # use_list=False: arrays stay tuples, no per-token Python work.
        obj = msgpack.unpackb(payload, use_list=False, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise WireError(f"payload is not valid msgpack: {e}") from None
    if type(obj) is tuple:
        if len(obj) < 2:
            raise WireError(f"batch array has {len(obj)} elements, expected [ts, events(, rank)]")
        ts, events = obj[0], obj[1]
        rank = obj[2] if len(obj) > 2 else None
    elif type(obj) is dict:
        if "ts" not in obj or "events" not in obj:
            raise WireError("batch map lacks 'ts' or 'events'")
        ts, events, rank = obj["ts"], obj["events"], obj.get("data_parallel_rank")
    else:
        raise WireError(f"batch is a msgpack {type(obj).__name__}, expected an array or a map")
    if type(ts) not in (float, int):
        raise WireError(f"batch ts is {type(ts).__name__}, expected a number")
    if type(events) is not tuple:
        raise WireError(f"batch events is {type(events).__name__}, expected an array")
    if rank is not None and type(rank) is not int:
        raise WireError(f"batch data_parallel_rank is {type(rank).__name__}, expected an int or nil")

    skipped: dict[str, int] = {}
    out: list[KVEvent] = []
    append = out.append
    fn: Callable[[Any, dict], KVEvent] | None
    for ev in events:
        t = type(ev)
        try:
            if t is dict:
                tag = ev.get("type")
                if tag == "BlockRemoved" and _REMOVED_PLAIN.issuperset(ev):  # vLLM's one-per-evicted-block event
                    h, medium = ev.get("block_hashes"), ev.get("medium")
                    if (type(h) is tuple and len(h) == 1 and type(h[0]) is int
                            and (medium is None or type(medium) is str)):
                        append(_new_removed(h, medium, None))
                        continue
                fn = _MAP.get(tag)
            elif t is tuple and ev:
                fn = _ARRAY.get(ev[0])
            else:
                _count(skipped, MALFORMED_EVENT)
                continue
        except TypeError:  # an unhashable tag
            fn = None
        if fn is None:
            _count(skipped, UNKNOWN_TAG)
            continue
        try:
            append(fn(ev, skipped))
        except (_Malformed, TypeError):
            _count(skipped, MALFORMED_EVENT)
    return DecodedBatch(EventBatch(float(ts), tuple(out), rank), skipped)


# --- encoding -------------------------------------------------------------

def _stored_as_array(e: BlockStored) -> list:
    return ["BlockStored", e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.lora_id,
            e.medium, e.lora_name, e.extra_keys, e.group_idx, e.kv_cache_spec_kind,
            e.kv_cache_spec_sliding_window]


def _stored_as_map(e: BlockStored) -> dict:
    # msgspec omit_defaults: fields without a default are always written.
    m = {"type": "BlockStored", "block_hashes": e.block_hashes, "parent_block_hash": e.parent_block_hash,
         "token_ids": e.token_ids, "block_size": e.block_size, "lora_id": e.lora_id, "medium": e.medium,
         "lora_name": e.lora_name}
    if e.extra_keys is not None:
        m["extra_keys"] = e.extra_keys
    if e.group_idx is not None:
        m["group_idx"] = e.group_idx
    if e.kv_cache_spec_kind is not None:
        m["kv_cache_spec_kind"] = e.kv_cache_spec_kind
    if e.kv_cache_spec_sliding_window is not None:
        m["kv_cache_spec_sliding_window"] = e.kv_cache_spec_sliding_window
    if e.lookahead_token_ids is not None:
        m["lookahead_token_ids"] = e.lookahead_token_ids
    return m


def _removed_as_map(e: BlockRemoved) -> dict:
    m: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": e.block_hashes, "medium": e.medium}
    if e.group_idx is not None:
        m["group_idx"] = e.group_idx
    return m


def _as_array(e: KVEvent) -> list:
    if type(e) is BlockStored:
        return _stored_as_array(e)
    if type(e) is BlockRemoved:
        return ["BlockRemoved", e.block_hashes, e.medium, e.group_idx]
    if type(e) is AllBlocksCleared:
        return ["AllBlocksCleared"]
    raise TypeError(f"not a KV event: {e!r}")


def _as_map(e: KVEvent) -> dict:
    if type(e) is BlockStored:
        return _stored_as_map(e)
    if type(e) is BlockRemoved:
        return _removed_as_map(e)
    if type(e) is AllBlocksCleared:
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV event: {e!r}")


# 0.25 and 0.33 differ only in fields we do not model (locality, ownership, session_id), which
# hold their defaults and are omitted, and lookahead_token_ids (written when set, 0.33 only).
_ENCODERS: dict[str, Callable[[KVEvent], Any]] = {"0.23": _as_array, "0.25": _as_map, "0.33": _as_map}


def encode_batch(batch: EventBatch, generation: str) -> bytes:
    """The payload vLLM `generation` publishes for `batch` (the batch stays an array)."""
    try:
        enc = _ENCODERS[generation]
    except KeyError:
        raise ValueError(f"unknown vLLM generation {generation!r}; expected one of {GENERATIONS}") from None
    return msgpack.packb([float(batch.ts), [enc(e) for e in batch.events], batch.data_parallel_rank],
                         use_bin_type=True)
