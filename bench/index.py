"""`kvgate bench index`: the prefix index's ingest rate, match latency and bytes per entry.

- ingest: realistic vLLM 0.33 batches (prefill chunks, decode blocks, one BlockRemoved per
  evicted block) encoded once with kvcache.wire, then applied as the subscriber does
  (PrefixIndex.apply_payload: bytes to tables in one native pass, decode_batch + apply for a
  batch it declines), timed on one core; blocks/s counts stored plus removed blocks. For
  reference: the general path on every batch (decode_batch to typed events + apply), and its
  two halves.
- fleet: 64 pods, each holding 8k-token conversations (512 blocks of 16) that start with one of a
  few shared system prompts, some conversations on two pods; about 1M (block, pod) entries.
- match: p50/p99 of match() for an 8k-token prompt that one pod holds entirely, all 64 pods
  candidates (the walk cannot stop early), 64 different prompts in turn (cold caches); wall
  clock and this process's CPU time (the machine is shared). Throughputs are per CPU second.
- stats_cpu_ms: one stats() call on the fleet (it counts blocks per pod: for debug snapshots).
- bytes per entry: tracemalloc'd size of the index after building the fleet / entries (numpy
  registers its arrays with tracemalloc, so the index's tables are counted);
  `fleet_table_bytes` is the tables' own size as the index reports it, a cross-check.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import time
import tracemalloc
from array import array

from kvcache.events import BlockRemoved, BlockStored, EventBatch
from kvcache.index import PrefixIndex

BLOCK = 16
MODEL = "bench-model"
M64 = (1 << 64) - 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument("--entries", type=int, default=1_000_000, help="(block, pod) entries in the fleet")
    parser.add_argument("--pods", type=int, default=64, help="pods in the fleet")
    parser.add_argument("--queries", type=int, default=3000, help="match() calls timed")
    parser.add_argument("--ingest-blocks", type=int, default=1_000_000, help="blocks ingested when timing ingest")
    parser.add_argument("--seed", type=int, default=1)


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    """n random token ids below 65536."""
    return tuple(array("H", rng.randbytes(2 * n)))[:n] if n else ()


def _engine_hashes(parent: int | None, tokens: tuple[int, ...]) -> list[int]:
    """Stand-in for vLLM's uint64 block hashes: any chained 64-bit function of the prefix."""
    out, h = [], parent or 0
    for i in range(0, len(tokens), BLOCK):
        h = hash((h, tokens[i:i + BLOCK], 7)) & M64
        out.append(h)
    return out


def _stored(parent: int | None, tokens: tuple[int, ...]) -> tuple[BlockStored, int]:
    hashes = _engine_hashes(parent, tokens)
    return BlockStored(tuple(hashes), parent, tokens, BLOCK, None, "GPU", None), hashes[-1]


def _ingest_batches(n_blocks: int, rng: random.Random) -> tuple[list[EventBatch], int]:
    """One engine's stream: 32 running requests per step; prefill in chunks of 32 blocks, then
    one block per 16 decode steps; once its 20k-block cache is full, one BlockRemoved per block."""
    capacity, batches, total = 20_000, [], 0
    cached: list[int] = []  # engine hashes, oldest first
    evict_from = 0
    reqs: list[list] = []  # [parent hash, prefill blocks left, decode steps]
    while total < n_blocks:
        while len(reqs) < 32:
            reqs.append([None, rng.randrange(8, 128), 0])
        events: list = []
        for r in reqs:
            if r[1] > 0:
                n = min(32, r[1])
                r[1] -= n
            else:
                r[2] += 1
                if r[2] % BLOCK:
                    continue
                n = 1
            ev, r[0] = _stored(r[0], _tokens(rng, n * BLOCK))
            events.append(ev)
            cached.extend(ev.block_hashes)
            total += n
        reqs = [r for r in reqs if r[1] > 0 or r[2] < 256]
        while len(cached) - evict_from > capacity:
            events.append(BlockRemoved((cached[evict_from],), "GPU"))
            evict_from += 1
            total += 1
        if events:  # vLLM publishes no batch for a step without events
            batches.append(EventBatch(time.time(), tuple(events), 0))
    return batches, total


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of fn(); GC off meanwhile."""
    gc.collect()
    gc.disable()
    try:
        w, c = time.perf_counter(), time.process_time()
        fn()
        return time.perf_counter() - w, time.process_time() - c
    finally:
        gc.enable()


def bench_ingest(n_blocks: int, seed: int) -> dict:
    try:
        from kvcache.wire import decode_batch, encode_batch
    except ImportError:  # wire.py not there yet
        return {"ingest_blocks_per_s": None, "ingest_note": "kvcache.wire missing"}
    batches, total = _ingest_batches(n_blocks, random.Random(seed))
    payloads = [encode_batch(b, "0.33") for b in batches]

    def both() -> None:  # the subscriber's path: the native one-pass apply, the decoder when it declines
        ix = PrefixIndex(max_entries=10_000_000)
        for p in payloads:
            if ix.apply_payload("pod-0", MODEL, 0, p) is None:
                ix.apply("pod-0", MODEL, 0, decode_batch(p).batch.events)

    def general() -> None:  # every batch decoded to typed events, then applied
        ix = PrefixIndex(max_entries=10_000_000)
        for p in payloads:
            ix.apply("pod-0", MODEL, 0, decode_batch(p).batch.events)

    def decode_only() -> None:
        for p in payloads:
            decode_batch(p)

    decoded = [decode_batch(p).batch.events for p in payloads]

    def index_only() -> None:
        ix = PrefixIndex(max_entries=10_000_000)
        for events in decoded:
            ix.apply("pod-0", MODEL, 0, events)

    wall, cpu = _timed(both)
    _, cpu_general = _timed(general)
    _, cpu_decode = _timed(decode_only)
    _, cpu_index = _timed(index_only)
    return {"ingest_blocks_per_s": total / cpu, "ingest_wall_blocks_per_s": total / wall,
            "ingest_general_path_blocks_per_s": total / cpu_general,
            "ingest_decode_only_blocks_per_s": total / cpu_decode,
            "ingest_index_only_blocks_per_s": total / cpu_index,
            "ingest_blocks": total, "ingest_events": sum(len(e) for e in decoded), "ingest_batches": len(payloads)}


def _conversation(system: tuple[int, ...], seed: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return system + _tokens(rng, 512 * BLOCK - len(system))


def _build_fleet(ix: PrefixIndex, pods: list[str], entries: int,
                 systems: list[tuple[int, ...]]) -> list[tuple[str, int]]:
    """Conversations of 512 blocks, each starting with one of `systems`, on one pod (one in eight
    also on a second pod)."""
    held: list[tuple[str, int]] = []  # (pod, conversation seed)
    seed = applied = 0
    # stats() counts blocks per pod too: ask it only once the blocks applied (an upper bound on
    # the entries) reach the target, then every 8 conversations
    while applied < entries or seed % 8 or ix.stats()["entries"] < entries:
        seed += 1
        tokens = _conversation(systems[seed % len(systems)], seed)
        owners = [pods[seed % len(pods)]]
        if seed % 8 == 0:
            owners.append(pods[(seed * 7 + 3) % len(pods)])
        parent, events = None, []
        for i in range(0, len(tokens), 32 * BLOCK):  # prefill chunks of 32 blocks
            ev, parent = _stored(parent, tokens[i:i + 32 * BLOCK])
            events.append(ev)
        for pod in owners:
            ix.apply(pod, MODEL, 0, events)
        applied += len(owners) * len(tokens) // BLOCK
        held.append((owners[0], seed))
    return held


def bench_fleet(n_pods: int, entries: int, queries: int, seed: int) -> dict:
    rng = random.Random(seed)
    pods = [f"pod-{i}" for i in range(n_pods)]
    systems = [_tokens(rng, 32 * BLOCK) for _ in range(8)]
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    ix = PrefixIndex(max_entries=entries * 2)
    held = _build_fleet(ix, pods, entries, systems)
    gc.collect()
    # everything allocated and still alive: the index, plus `held` (~100 bytes per 512 blocks)
    index_bytes = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    t0 = time.process_time()
    stats = ix.stats()
    stats_ms = (time.process_time() - t0) * 1e3

    prompts = [_conversation(systems[s % len(systems)], s) + (1, 2, 3) for _, s in rng.sample(held, min(64, len(held)))]
    wall, cpu = [], []
    touch_cpu = 0.0
    gc.collect()
    gc.disable()
    try:
        for q in range(queries):
            prompt = prompts[q % len(prompts)]
            w, c = time.perf_counter(), time.process_time()
            res = ix.match(MODEL, None, prompt, pods)
            wall.append(time.perf_counter() - w)
            cpu.append(time.process_time() - c)
            if q % 16 == 15:  # live traffic applies events often: that moves matched keys to most recent
                c = time.process_time()
                ix.apply("pod-0", MODEL, 0, ())
                touch_cpu += time.process_time() - c
    finally:
        gc.enable()
    best = max(r.blocks for r in res.values())
    wall.sort()
    cpu.sort()
    t0 = time.perf_counter()
    ix.remove_pod(pods[0])
    remove_ms = (time.perf_counter() - t0) * 1e3
    p50, p99 = len(wall) // 2, int(len(wall) * 0.99)
    return {
        "fleet_pods": n_pods,
        "fleet_entries": stats["entries"],
        "fleet_keys": sum(stats["keys_by_medium"].values()),
        "fleet_engine_hashes": stats["engine_hashes"],
        "bytes_per_entry": index_bytes / stats["entries"],
        "fleet_table_bytes": stats.get("table_bytes"),
        "bytes_per_key": index_bytes / sum(stats["keys_by_medium"].values()),
        "entries_per_key": stats["entries"] / sum(stats["keys_by_medium"].values()),
        "match_blocks": best,
        "match_p50_us": wall[p50] * 1e6,
        "match_p99_us": wall[p99] * 1e6,
        "match_cpu_p50_us": cpu[p50] * 1e6,
        "match_cpu_p99_us": cpu[p99] * 1e6,
        "match_recency_cpu_us": touch_cpu / queries * 1e6,
        "remove_pod_ms": remove_ms,
        "stats_cpu_ms": stats_ms,
    }


def main(args: argparse.Namespace) -> int:
    out: dict = {"load_avg_1m_before": os.getloadavg()[0]}  # a shared machine skews wall times
    out.update(bench_ingest(args.ingest_blocks, args.seed))
    out.update(bench_fleet(args.pods, args.entries, args.queries, args.seed))
    out["targets_met"] = {
        "ingest_blocks_per_s>=1e6": (out.get("ingest_blocks_per_s") or 0) >= 1e6,
        "match_p99_us<=200": out["match_p99_us"] <= 200,
        "match_cpu_p99_us<=200": out["match_cpu_p99_us"] <= 200,
        "bytes_per_entry<=64": out["bytes_per_entry"] <= 64,
    }
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{'metric':36} {'value':>14}")
    for k, v in out.items():
        if k == "targets_met":
            for t, ok in v.items():
                print(f"{'target ' + t:36} {'met' if ok else 'NOT met':>14}")
            continue
        print(f"{k:36} {v:>14,.1f}" if isinstance(v, float) else f"{k:36} {v!s:>14}")
    return 0
