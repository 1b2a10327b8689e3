"""bench ingest's publisher process: the protocol `kvgate bench gateway` and `bench ingest` drive it by."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import zmq

from helpers import free_ports

REPO = Path(__file__).resolve().parents[2]


def test_publisher_reports_the_batches_sent_and_the_last_seq_a_subscriber_saw() -> None:
    pub_port, replay_port = free_ports(2)
    proc = subprocess.Popen([sys.executable, "-m", "bench.ingest", "--publish", str(pub_port), str(replay_port)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        assert proc.stdout.readline().strip() == "ready"
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"tcp://127.0.0.1:{pub_port}")
        seqs: list[int] = []
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        for _ in range(50):  # a slow joiner: publish until the subscription is in place
            proc.stdin.write("200 0.05\n")
            proc.stdin.flush()
            _, count, last = proc.stdout.readline().split()
            assert int(count) == 10
            while poller.poll(200):
                seqs.append(int.from_bytes(sub.recv_multipart()[1], "big"))
            if seqs:
                break
        assert seqs and seqs[-1] == int(last)  # the last seq it reports is the last one published
    finally:
        sub.close(0)
        ctx.term()
        proc.stdin.close()
        proc.wait(10)


def test_coalesce_help_states_kvgates_own_default() -> None:
    import argparse

    from bench.ingest import add_arguments
    from plugin.config import VARIABLES

    class Recording(argparse.ArgumentParser):
        """Keeps the actions add_argument returns (argparse's public way to a declared argument)."""
        actions: list[argparse.Action] = []

        def add_argument(self, *args, **kwargs) -> argparse.Action:
            action = super().add_argument(*args, **kwargs)
            self.actions.append(action)
            return action

    parser = Recording()
    add_arguments(parser)
    (action,) = [a for a in parser.actions if "--coalesce" in a.option_strings]
    (var,) = [v for v in VARIABLES if v.env == "KVGATE_KV_EVENTS_COALESCE_S"]
    assert action.help.endswith(f"kvgate's own, {var.default:g})")
