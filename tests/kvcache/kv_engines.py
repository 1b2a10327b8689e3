"""What the ingest tests share: vLLM-faithful engines (kvcache.publisher) on free loopback ports,
a sink that records what reaches it, a harness fixture that closes what a test made, and waits on
state with a deadline (the waits and ports themselves come from tests/helpers.py)."""
from __future__ import annotations

import asyncio
import time

import pytest
from helpers import free_port, wait_until_async

from kvcache.events import BlockStored
from kvcache.ingest import SubscriberManager
from kvcache.metrics import KVEventMetrics
from kvcache.publisher import EventPublisher
from kvcache.sink import DecodedSink
from kvcache.stream import EndpointSpec, SubscriberOptions

GENERATIONS = ["0.23", "0.25", "0.33"]
FAST = SubscriberOptions(replay_timeout=0.3, reconnect_initial=0.05, reconnect_max=0.2,
                         heartbeat_interval=0.5, heartbeat_timeout=1.5)


class RecordingSink(DecodedSink):
    """Records every decoded event and drop, in order (declines raw batches: each is decoded)."""

    def __init__(self) -> None:
        self.log: list[tuple] = []

    def apply(self, pod, model, rank, events):
        for ev in events:
            self.log.append(("apply", pod, model, rank, ev))

    def drop(self, pod, rank):
        self.log.append(("drop", pod, rank))

    def hashes(self, pod="p", rank=0) -> list[int]:
        """First block hash of each applied event of (pod, rank): our events are numbered by it."""
        return [e[4].block_hashes[0] for e in self.log if e[0] == "apply" and e[1] == pod and e[3] == rank]

    def drops(self, pod="p", rank=0) -> int:
        return sum(1 for e in self.log if e == ("drop", pod, rank))

    def after_last_drop(self, pod="p", rank=0) -> list[int]:
        idx = max(i for i, e in enumerate(self.log) if e == ("drop", pod, rank))
        return [e[4].block_hashes[0] for e in self.log[idx + 1:] if e[0] == "apply" and e[1] == pod]


def ev(n: int) -> BlockStored:
    return BlockStored((n,), None, (n, n + 1), 2, None, "GPU", None)


class Engine:
    """One publisher with its endpoint spec."""

    def __init__(self, generation="0.33", replay=True, host="127.0.0.1", pod="p", rank=0, **kw):
        self.pub_port, self.replay_port = free_port(host), free_port(host) if replay else None
        fmt = (lambda p: f"tcp://[{host}]:{p}") if ":" in host else (lambda p: f"tcp://{host}:{p}")
        self.pub = EventPublisher(fmt(self.pub_port), fmt(self.replay_port) if replay else None,
                                  generation=generation, data_parallel_rank=rank, **kw)
        self.spec = EndpointSpec(pod, "m", host, self.pub_port, self.replay_port, rank)

    def publish(self, *ns: int) -> None:
        for n in ns:
            self.pub.publish([ev(n)])


@pytest.fixture
async def harness():
    made: list = []

    def make(sink=None, options=FAST):
        sink = sink or RecordingSink()
        metrics = KVEventMetrics()
        manager = SubscriberManager(sink, options, metrics)
        made.append(manager)
        return sink, manager

    engines: list[Engine] = []

    def engine(**kw) -> Engine:
        e = Engine(**kw)
        engines.append(e)
        return e

    yield make, engine
    for m in made:
        await m.aclose()
    for e in engines:
        e.pub.close()


def status(manager, rank=0, pod=None):
    return next(s for s in manager.status() if s["rank"] == rank and (pod is None or s["pod"] == pod))


def counter(manager, name: str, **labels: str) -> float:
    """The value of kvgate_kvevents_<name>_total{labels} (0 before the series exists)."""
    return manager.metrics.registry.get_sample_value(f"kvgate_kvevents_{name}_total", labels) or 0.0


async def subscribed(e: Engine, manager, pod="p", rank=0, timeout: float = 10.0) -> int:
    """Publish probe batches until one arrives live: an engine's PUB drops what it sends before the
    SUB's subscription has reached it (libzmq's PUB even takes it in lazily, on a later send), and
    what is not replayable (bad frames) would then be lost. Returns the seq the next batch gets."""
    def live() -> float:
        return manager.metrics.registry.get_sample_value(
            "kvgate_kvevents_batches_received_total", {"pod": pod, "rank": str(rank), "source": "live"}) or 0.0

    deadline = time.monotonic() + timeout
    seq = 0
    while True:
        seq = e.pub.publish([ev(1000 + seq)]) + 1
        probe_deadline = min(deadline, time.monotonic() + 0.5)
        while not live() and time.monotonic() < probe_deadline:
            await asyncio.sleep(0.01)
        if live():
            await wait_until_async(lambda seq=seq: status(manager, rank, pod)["last_seq"] == seq - 1)
            return seq
        assert time.monotonic() < deadline, "no batch ever arrived live"
