"""`kvgate bench ingest`: what following live KV events costs a running `kvgate serve`.

Publisher processes (one per engine, each a vLLM-faithful `kvcache.publisher.EventPublisher`)
send one-block batches at a fixed rate to a real `kvgate serve` that routes nothing. The
figure is kvgate's CPU time (user + system, from /proc, every thread of the process) per
batch: over the publishing window, minus what the same process uses idle over an equal
window measured just before (discovery polls, engine scrapes). The run waits until kvgate
has applied the last batch of every engine (`/debug`'s last_seq), so every batch counted
was ingested.

    python -m bench.ingest --publish PUB_PORT REPLAY_PORT   # the publisher (internal)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import IO

import httpx

from plugin.config import Settings
from devkit.stack import Stack, StackError, free_port

MODEL = "bench-model"
BLOCK_SIZE = 16
TARGET_US = 30.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--engines", type=int, default=3, help="publishing engines (default 3)")
    p.add_argument("--rate", type=float, default=333.0, help="one-block batches per second per engine (default 333: ~1000/s in all)")
    p.add_argument("--seconds", type=float, default=10.0, help="seconds of publishing (default 10)")
    p.add_argument("--coalesce", type=float, default=None, metavar="S",
                   help=f"kvgate's KVGATE_KV_EVENTS_COALESCE_S (default: kvgate's own, {Settings.kv_events_coalesce_s:g})")
    p.add_argument("--publish", nargs=2, type=int, metavar=("PUB_PORT", "REPLAY_PORT"), help=argparse.SUPPRESS)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _threads_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds per kind of thread of a process: the event loop's (`main`), libzmq's I/O threads
    (`zmq_io`) and every other (`other`: the ingest thread, gRPC's pollers)."""
    out = {"main": 0.0, "zmq_io": 0.0, "other": 0.0}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            comm = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # a thread that ended meanwhile
            continue
        kind = "main" if task.name == str(pid) else "zmq_io" if comm.startswith("ZMQbg/IO") else "other"
        out[kind] += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def _publisher(pub_port: int, replay_port: int) -> int:
    """Wait for a line `RATE SECONDS` on stdin, publish, print the batches sent; repeat until EOF."""
    from kvcache.events import BlockStored
    from kvcache.publisher import EventPublisher

    pub = EventPublisher(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", hwm=1_000_000)
    print("ready", flush=True)
    n = 0
    last = -1  # seq of the last batch published (seqs start at 0)
    try:
        for line in sys.stdin:
            rate, seconds = (float(x) for x in line.split())
            count = int(rate * seconds)
            start = time.perf_counter()
            for i in range(count):
                wait = start + i / rate - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                # a chain of 32 blocks, then a new one: each batch one BlockStored of one block
                parent = n if n % 32 else None
                n += 1
                last = pub.publish([BlockStored((n,), parent, tuple(range(n * BLOCK_SIZE, (n + 1) * BLOCK_SIZE)),
                                                BLOCK_SIZE, None, "GPU", None)])
            print(f"sent {count} {last}", flush=True)
    finally:
        pub.close()
    return 0


def _last_seqs(http: str) -> dict[str, int | None]:
    try:
        subs = httpx.get(f"{http}/debug", timeout=5).json().get("subscriptions") or []
    except httpx.TransportError:  # the HTTP port opens just after the gRPC one
        return {}
    return {s["pod"]: s["last_seq"] for s in subs if s.get("connected")}


def run(engines: int, rate: float, seconds: float, log, coalesce: float | None = None) -> dict:
    import subprocess

    with Stack() as stack:
        pubs: list[tuple[subprocess.Popen[str], IO[str], IO[str]]] = []  # each publisher, its stdin and stdout
        pods = []
        for i in range(engines):
            pub_port, replay_port = free_port(), free_port()
            proc = subprocess.Popen([sys.executable, "-m", "bench.ingest", "--publish", str(pub_port),
                                     str(replay_port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                    cwd=str(Path(__file__).resolve().parent.parent))
            assert proc.stdin is not None and proc.stdout is not None  # both are PIPEs
            pubs.append((proc, proc.stdin, proc.stdout))
            if proc.stdout.readline().strip() != "ready":
                raise StackError("publisher did not start")
            pods.append({"name": f"engine{i}", "address": "127.0.0.1", "port": free_port(), "model": MODEL,
                         "kv_events": {"pub_port": pub_port, "replay_port": replay_port}})
        try:
            grpc_port, http_port = free_port(), free_port()
            kvgate = stack.kvgate(env={"KVGATE_PODS_FILE": str(stack.pods_file(pods)),
                                       "KVGATE_GRPC_PORT": str(grpc_port), "KVGATE_HTTP_PORT": str(http_port),
                                       "KVGATE_LOG_LEVEL": "warning",
                                       **({"KVGATE_KV_EVENTS_COALESCE_S": str(coalesce)} if coalesce is not None else {})},
                                  grpc_port=grpc_port)
            http = f"http://127.0.0.1:{http_port}"
            deadline = time.monotonic() + 30
            while len(_last_seqs(http)) < engines:
                if time.monotonic() > deadline:
                    raise StackError("kvgate did not connect to every publisher")
                time.sleep(0.1)
            pid = kvgate.popen.pid
            # Warm-up: a second of traffic (first-time allocations, index tables growing).
            for _, stdin, _ in pubs:
                stdin.write(f"{rate} 1\n")
                stdin.flush()
            for _, _, stdout in pubs:
                stdout.readline()
            time.sleep(0.5)
            idle_window = min(seconds, 5.0)
            c0, t0 = _cpu_s(pid), time.monotonic()
            time.sleep(idle_window)
            idle_per_s = (_cpu_s(pid) - c0) / (time.monotonic() - t0)

            c0, t0, th0 = _cpu_s(pid), time.monotonic(), _threads_cpu_s(pid)
            for _, stdin, _ in pubs:
                stdin.write(f"{rate} {seconds}\n")
                stdin.flush()
            sent, last = 0, {}
            for i, (_, _, stdout) in enumerate(pubs):
                _, count, seq = stdout.readline().split()
                sent += int(count)
                last[f"engine{i}"] = int(seq)
            deadline = time.monotonic() + 60
            while _last_seqs(http) != last:
                if time.monotonic() > deadline:
                    raise StackError(f"kvgate did not apply every batch: {_last_seqs(http)} != {last}")
                time.sleep(0.05)
            wall = time.monotonic() - t0
            cpu = _cpu_s(pid) - c0
            th1 = _threads_cpu_s(pid)
            status = httpx.get(f"{http}/debug", timeout=5).json()["subscriptions"]
        finally:
            for proc, stdin, _ in pubs:
                stdin.close()
                proc.wait(10)
    lost = sum(s["missed_batches"] + s["drops"] for s in status)
    per_batch = (cpu - idle_per_s * wall) / sent * 1e6
    return {
        "engines": engines, "rate_per_engine": rate, "seconds": seconds, "coalesce_s": coalesce, "batches": sent,
        "kvgate_cpu_s": round(cpu, 3), "idle_cpu_per_s": round(idle_per_s, 4),
        "cpu_us_per_batch": round(per_batch, 1), "cpu_us_per_batch_raw": round(cpu / sent * 1e6, 1),
        "cores_following": round((cpu - idle_per_s * wall) / wall, 3),
        # raw (idle included), by thread: where the microseconds go
        "cpu_us_per_batch_by_thread": {k: round((th1[k] - th0[k]) / sent * 1e6, 1) for k in th0},
        "lost_or_dropped": lost, "target_us_per_batch": TARGET_US, "met": per_batch <= TARGET_US and not lost,
    }


def table(r: dict) -> str:
    return "\n".join([
        f"{r['engines']} engines x {r['rate_per_engine']:.0f} one-block batches/s for {r['seconds']:.0f} s: "
        f"{r['batches']} batches",
        f"kvgate serve CPU: {r['kvgate_cpu_s']:.2f} s ({r['idle_cpu_per_s'] * 1e3:.1f} ms/s when idle)",
        f"CPU per batch: {r['cpu_us_per_batch']:.1f} us net of idle ({r['cpu_us_per_batch_raw']:.1f} us raw), "
        f"{r['cores_following']:.3f} cores following; target <= {r['target_us_per_batch']:.0f} us: "
        f"{'met' if r['met'] else 'MISSED'}; lost or dropped: {r['lost_or_dropped']}",
        "by thread (us per batch, raw): " + ", ".join(f"{k} {v:.1f}" for k, v in r["cpu_us_per_batch_by_thread"].items()),
    ])


def main(args: argparse.Namespace) -> int:
    try:
        result = run(args.engines, args.rate, args.seconds, lambda m: print(m, file=sys.stderr, flush=True),
                     args.coalesce)
    except StackError as e:
        print(f"kvgate bench ingest: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result) if args.json else table(result), flush=True)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    ns = parser.parse_args()
    if ns.publish:
        sys.exit(_publisher(*ns.publish))
    sys.exit(main(ns))
