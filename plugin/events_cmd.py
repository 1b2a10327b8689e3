"""`kvgate events`: tail one engine's KV events (replayed history first, then live)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TextIO

import zmq

from kvcache.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, EventBatch, KVEvent
from kvcache.wire import WireError, decode_batch

_END_SEQ = b"\xff" * 8
_REPLAY_TIMEOUT_S = 1.0  # silence within a reply that ends it (asked again from the next seq if it had batches)
_REPLAY_FIRST_S = 5.0  # the wait for a reply's first frame: a busy engine (or machine) answers late, not never


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", required=True, help="engine PUB endpoint, e.g. tcp://10.0.0.5:5557")
    parser.add_argument("--replay-endpoint", help="engine replay endpoint, e.g. tcp://10.0.0.5:5558")
    parser.add_argument("--from-seq", type=int, default=None,
                        help="replay from this seq first (default 0 when --replay-endpoint is given)")
    parser.add_argument("--json", action="store_true", help="one JSON object per event")
    parser.add_argument("--count", type=int, default=None, help="exit after this many events")
    parser.add_argument("--timeout", type=float, default=None, help="exit after this many seconds")


def _hash(h: BlockHash | None) -> int | str | None:
    return h.hex() if isinstance(h, bytes) else h


def _record(seq: int, batch: EventBatch, ev: KVEvent, replayed: bool) -> dict:
    rec: dict = {"seq": seq, "ts": batch.ts, "dp_rank": batch.data_parallel_rank, "type": type(ev).__name__,
                 "block_hashes": [], "parent_block_hash": None, "token_ids": None, "block_size": None,
                 "lora_name": None, "medium": None, "replayed": replayed}
    if isinstance(ev, BlockStored):
        rec.update(block_hashes=[_hash(h) for h in ev.block_hashes], parent_block_hash=_hash(ev.parent_block_hash),
                   token_ids=list(ev.token_ids), block_size=ev.block_size, lora_name=ev.lora_name, medium=ev.medium)
    elif isinstance(ev, BlockRemoved):
        rec.update(block_hashes=[_hash(h) for h in ev.block_hashes], medium=ev.medium)
    return rec


def _line(rec: dict) -> str:
    parts = [f"seq={rec['seq']}", f"rank={rec['dp_rank']}", rec["type"]]
    if rec["type"] != AllBlocksCleared.__name__:
        parts.append("hashes=[" + ",".join(str(h) for h in rec["block_hashes"]) + "]")
    if rec["type"] == BlockStored.__name__:
        parts += [f"parent={rec['parent_block_hash']}", f"block_size={rec['block_size']}",
                  f"tokens={len(rec['token_ids'])}", f"lora={rec['lora_name'] or '-'}"]
    if rec["medium"] is not None:
        parts.append(f"medium={rec['medium']}")
    if rec["replayed"]:
        parts.append("(replayed)")
    return " ".join(parts)


class _Tail:
    def __init__(self, args: argparse.Namespace, out: TextIO) -> None:
        self.args = args
        self.out = out
        self.printed = 0
        self.deadline = None if args.timeout is None else time.monotonic() + args.timeout

    def done(self) -> bool:
        return self.args.count is not None and self.printed >= self.args.count

    def left_ms(self) -> int | None:
        return None if self.deadline is None else max(0, int((self.deadline - time.monotonic()) * 1000))

    def emit(self, seq: int, payload: bytes, replayed: bool) -> None:
        try:
            decoded = decode_batch(payload)
        except WireError as e:
            print(f"seq={seq}: undecodable batch skipped: {e}", file=sys.stderr)
            return
        for reason, n in decoded.skipped.items():
            print(f"seq={seq}: skipped {n} ({reason})", file=sys.stderr)
        for ev in decoded.batch.events:
            if self.done():
                return
            rec = _record(seq, decoded.batch, ev, replayed)
            print(json.dumps(rec) if self.args.json else _line(rec), file=self.out, flush=True)
            self.printed += 1


def _replay(ctx: zmq.Context, tail: _Tail, endpoint: str, start: int) -> int | None:
    """Print what the engine still holds from `start`; returns the last seq printed.
    vLLM's ROUTER drops replies beyond 1000 queued: a reply with a hole, or one that went silent before its end
    (the dropped part was its tail), is asked again from the next seq."""
    last, stalls = None, 0
    while stalls < 3:
        before = last
        last, hole = _replay_once(ctx, tail, endpoint, start if last is None else last + 1, last)
        if not hole:
            break
        stalls = stalls + 1 if last == before else 0
    return last


def _replay_once(ctx: zmq.Context, tail: _Tail, endpoint: str, start: int,
                 last: int | None) -> tuple[int | None, bool]:
    """One replay request: (last seq printed, whether the reply broke off: at a hole, or silent after some batches
    and before its end marker)."""
    heard = False
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IPV6, 1)
    dealer.setsockopt(zmq.RCVHWM, 100_000)
    try:
        dealer.connect(endpoint)
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        while not tail.done():
            wait = (_REPLAY_TIMEOUT_S if heard else _REPLAY_FIRST_S) * 1000
            left = tail.left_ms()
            if not dealer.poll(wait if left is None else min(wait, left)):
                if heard and tail.left_ms() != 0:
                    return last, True  # its tail was dropped: ask for the rest
                print(f"replay from {endpoint}: no (complete) answer", file=sys.stderr)
                break
            frames = dealer.recv_multipart()
            if len(frames) not in (3, 4) or len(frames[-2]) != 8:
                print(f"replay: unexpected reply of {len(frames)} frames", file=sys.stderr)
                continue
            if frames[-2] == _END_SEQ:
                break
            seq = int.from_bytes(frames[-2], "big")
            if last is not None and seq > last + 1:
                return last, True
            tail.emit(seq, frames[-1], replayed=True)
            last, heard = seq, True
        return last, False
    finally:
        dealer.close(linger=0)


def main(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = sys.stdout if out is None else out
    if args.from_seq is not None and args.replay_endpoint is None:
        print("kvgate events: --from-seq needs --replay-endpoint", file=sys.stderr)
        return 2
    tail = _Tail(args, out)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.IPV6, 1)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(args.endpoint)  # before replay, so live batches meanwhile are queued
        last = None
        if args.replay_endpoint is not None:
            last = _replay(ctx, tail, args.replay_endpoint, args.from_seq or 0)
        while not tail.done():
            left = tail.left_ms()
            if left == 0 or not sub.poll(left):
                break
            frames = sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                print(f"unexpected live message of {len(frames)} frames", file=sys.stderr)
                continue
            seq = int.from_bytes(frames[1], "big")
            if last is not None and seq <= last:
                continue  # already printed from replay
            last = None
            tail.emit(seq, frames[2], replayed=False)
    except KeyboardInterrupt:
        pass
    finally:
        sub.close(linger=0)
        ctx.term()
    return 0 if tail.printed else 1
