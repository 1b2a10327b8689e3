"""`kvgate events`: tail an engine's KV events, replayed then live."""
from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import time

import pytest

from kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvcache.publisher import EventPublisher
from plugin import events_cmd
from helpers import free_ports

KEYS = {"seq", "ts", "dp_rank", "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_name",
        "medium", "replayed"}


def run(*argv: str) -> tuple[int, list[str]]:
    parser = argparse.ArgumentParser()
    events_cmd.add_arguments(parser)
    out = io.StringIO()
    code = events_cmd.main(parser.parse_args(list(argv)), out=out)
    return code, out.getvalue().splitlines()


@pytest.fixture(params=["0.23", "0.33"])
def engine(request):
    pub_port, replay_port = free_ports(2)
    pub = EventPublisher(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}",
                         generation=request.param, data_parallel_rank=2)
    yield pub, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}"
    pub.close()


def test_json_lines_from_replay(engine):
    pub, endpoint, replay = engine
    raw = bytes(range(32))
    pub.publish([BlockStored((2**64 - 1, 5), -3, (1, 2, 3, 4), 2, None, "GPU", "ad")], ts=12.5)
    pub.publish([BlockRemoved((raw,), "CPU"), AllBlocksCleared()], ts=13.0)
    code, lines = run("--endpoint", endpoint, "--replay-endpoint", replay, "--json", "--count", "3", "--timeout", "5")
    assert code == 0
    recs = [json.loads(line) for line in lines]
    assert [set(r) for r in recs] == [KEYS] * 3
    assert recs[0] == {"seq": 0, "ts": 12.5, "dp_rank": 2, "type": "BlockStored", "block_hashes": [2**64 - 1, 5],
                       "parent_block_hash": -3, "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_name": "ad",
                       "medium": "GPU", "replayed": True}
    assert recs[1]["block_hashes"] == [raw.hex()] and recs[1]["type"] == "BlockRemoved" and recs[1]["seq"] == 1
    assert recs[2]["type"] == "AllBlocksCleared" and recs[2]["block_hashes"] == []


def test_from_seq_skips_older_batches(engine):
    pub, endpoint, replay = engine
    for n in range(4):
        pub.publish([BlockRemoved((n,))])
    code, lines = run("--endpoint", endpoint, "--replay-endpoint", replay, "--from-seq", "2", "--json",
                      "--timeout", "0.5")
    assert code == 0
    assert [json.loads(line)["seq"] for line in lines] == [2, 3]


def test_nothing_received_exits_1(engine):
    _, endpoint, _ = engine
    assert run("--endpoint", endpoint, "--timeout", "0.2") == (1, [])


def test_from_seq_needs_a_replay_endpoint(engine):
    _, endpoint, _ = engine
    assert run("--endpoint", endpoint, "--from-seq", "3")[0] == 2


def test_live_events_through_the_kvgate_command(engine):
    pub, endpoint, _ = engine
    proc = subprocess.Popen([sys.executable, "-m", "plugin.cli", "events", "--endpoint", endpoint, "--count", "2",
                             "--timeout", "20"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        n = 0
        while proc.poll() is None and n < 2000:  # live only: publish until the tail has seen two
            pub.publish([BlockStored((n,), None, (7,), 1)])
            n += 1
            time.sleep(0.01)
        out, err = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    lines = out.splitlines()
    assert len(lines) == 2
    assert all(" BlockStored hashes=[" in line and "block_size=1" in line and "rank=2" in line for line in lines)
    assert "(replayed)" not in out


def test_long_replay_is_printed_whole(engine):
    pub, endpoint, replay = engine
    n = 3000  # more than vLLM's ROUTER queues for one peer
    for i in range(n):
        pub.publish([BlockRemoved((i,))])
    code, lines = run("--endpoint", endpoint, "--replay-endpoint", replay, "--json", "--count", str(n),
                      "--timeout", "30")
    assert code == 0
    assert [json.loads(line)["seq"] for line in lines] == list(range(n))


def test_a_replay_reply_whose_tail_was_dropped_is_asked_again_from_where_it_stopped():
    """A ROUTER past its high-water mark drops the rest of a reply, its end marker included: a slow reader then hears
    nothing more. What was printed stands and the replay is asked again from the next seq (the fresh-clone CI of
    052a1bb, on a loaded machine, printed 2,000 of 3,000 and stopped). And a first answer that comes late is waited
    for."""
    import threading

    import zmq

    from kvcache.events import EventBatch
    from kvcache.wire import encode_batch

    pub_port, replay_port = free_ports(2)
    n, cut = 3000, 1500
    payloads = [encode_batch(EventBatch(1.0, (BlockRemoved((i,)),), 0), "0.33") for i in range(n)]
    asked: list[int] = []
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"tcp://127.0.0.1:{replay_port}")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if not router.poll(50):
                continue
            client, _, start = router.recv_multipart()
            first = int.from_bytes(start, "big")
            asked.append(first)
            if first == 0:
                time.sleep(1.5)  # a busy engine answers late (the fresh-clone CI of 0c090e1: none within 1 s)
            last = cut if first < cut else n  # the first reply breaks off after `cut`, its tail and end lost
            for seq in range(first, last):
                router.send_multipart((client, b"", seq.to_bytes(8, "big"), payloads[seq]))
            if last == n:
                router.send_multipart((client, b"", b"\xff" * 8, b""))
    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        started = time.monotonic()
        code, lines = run("--endpoint", f"tcp://127.0.0.1:{pub_port}", "--replay-endpoint",
                          f"tcp://127.0.0.1:{replay_port}", "--json", "--count", str(n), "--timeout", "20")
    finally:
        stop.set()
        server.join(5)
        router.close(linger=0)
        ctx.term()
    # Asked again from where the reply broke off (cut). Beside three busy loops a reply (this test's thread
    # sending it) also paused past the reply timeout in 5 runs of 16 and was asked again from where it stopped
    # (asked [0, 1500, 2500], [0, 1000, 1500]): what the command should do; nothing printed twice or missed.
    assert code == 0 and asked[0] == 0 and cut in asked and asked == sorted(set(asked)), asked
    assert [json.loads(line)["seq"] for line in lines] == list(range(n))
    assert time.monotonic() - started < 10  # asked again after one reply timeout, not left to the --timeout
