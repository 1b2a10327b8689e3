"""The contract between the ingest path and the index it feeds: `EventSink`, every method the
streams (kvcache.stream) call on it, and what its raw-batch methods answer.

kvcache.index.PrefixIndex implements it whole. A sink that only takes decoded events (a test's
recorder, a tool) subclasses `DecodedSink`, which declines every raw batch so each one is decoded
(kvcache.wire) and handed to `apply`. Every call comes from one thread at a time, under the
ingest lock (kvcache.locking.IndexLock), and one (pod, rank)'s batches arrive in order.
"""
from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import NamedTuple, Protocol, runtime_checkable

from kvcache.events import KVEvent


class BatchApplied(NamedTuple):
    """What apply_payload applied: events by type."""
    stored: int
    removed: int


class RunApplied(NamedTuple):
    """What apply_run applied: `batches` in order from the first, their events by type and their
    decode-and-apply time; `error`, when set, is the exception of the batch after them, which
    failed part-way (its state is no longer trusted)."""
    batches: int
    stored: int
    removed: int
    seconds: float
    error: BaseException | None


@runtime_checkable
class EventSink(Protocol):
    """What the ingest path calls, the whole of it. The raw-batch methods may decline (None, or a run
    of 0 batches): the stream then takes the next slower path, down to decode_batch + apply."""

    def apply(self, pod: str, model: str, rank: int, events: Sequence[KVEvent]) -> None:
        """Apply one (pod, rank)'s decoded events, in order."""

    def drop(self, pod: str, rank: int) -> None:
        """Forget what (pod, rank) holds: its stream can no longer be trusted."""

    def apply_payload(self, pod: str, model: str, rank: int, payload: bytes) -> BatchApplied | None:
        """Decode and apply one raw batch (vLLM's msgpack bytes) in one pass; None: not taken, the
        caller decodes it and calls apply()."""

    def split_payload(self, payload: bytes, max_blocks: int) -> list[bytes] | None:
        """A large raw batch cut into parts of at most `max_blocks` blocks, which apply_payload takes
        one by one (one hold of the lock each); None: apply it whole."""

    def apply_run(self, pod: str, model: str, rank: int, messages: list, start: int, seq: int, max_batches: int,
                  max_events: int, bounds: array, counts: array, max_blocks: int = 0) -> RunApplied:
        """Apply live (seq, payload) messages[start:] while they are the batches `seq`, `seq` + 1, ...,
        in one call (one hold of the lock); the messages it stops before take the per-batch path. Each
        batch's apply time is counted into `counts` at bisect_left(bounds, seconds)."""


_NOTHING = RunApplied(0, 0, 0, 0.0, None)


class DecodedSink:
    """Base of a sink that takes decoded events only: it declines every raw batch, so each is decoded
    and handed to `apply`. Subclasses implement apply and drop."""

    def apply(self, pod: str, model: str, rank: int, events: Sequence[KVEvent]) -> None:
        raise NotImplementedError

    def drop(self, pod: str, rank: int) -> None:
        raise NotImplementedError

    def apply_payload(self, pod: str, model: str, rank: int, payload: bytes) -> BatchApplied | None:
        return None

    def split_payload(self, payload: bytes, max_blocks: int) -> list[bytes] | None:
        return None

    def apply_run(self, pod: str, model: str, rank: int, messages: list, start: int, seq: int, max_batches: int,
                  max_events: int, bounds: array, counts: array, max_blocks: int = 0) -> RunApplied:
        return _NOTHING
