"""A KV event publisher that behaves on the wire like vLLM's ZmqEventPublisher.

PUB socket for live batches `[topic, seq (8 bytes BE), payload]`, plus a
ROUTER that replays the last `buffer_steps` payloads with the framing of the
chosen generation. Used by the simulated engine and by tests, which also get
hooks to lose messages on purpose, send garbage and restart the "engine".
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable

import zmq

from kvcache.events import EventBatch, KVEvent
from kvcache.wire import GENERATIONS, encode_batch

log = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8  # -1 as a signed 64-bit big-endian number
_REPLAY_POLL_MS = 50


def replay_has_topic(generation: str) -> bool:
    """vLLM 0.26 and later put the topic frame in replay replies."""
    major, minor = (int(x) for x in generation.split(".")[:2])
    return (major, minor) >= (0, 26)


def _bind(sock: zmq.Socket, endpoint: str) -> None:
    # A restarted publisher rebinds ports whose listeners zmq closes asynchronously.
    for _ in range(50):
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE:
                raise
            time.sleep(0.02)
    sock.bind(endpoint)


class EventPublisher:
    """One engine's (one DP rank's) KV event sockets. Thread-safe `publish`.

    `endpoint` / `replay_endpoint` are bound (e.g. "tcp://127.0.0.1:5557",
    "tcp://[::1]:5557"; port 0 is not supported, pick a free port).
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *, generation: str = "0.33",
                 topic: str = "", buffer_steps: int = 10_000, hwm: int = 100_000,
                 data_parallel_rank: int = 0) -> None:
        if generation not in GENERATIONS:
            raise ValueError(f"unknown vLLM generation {generation!r}; expected one of {GENERATIONS}")
        if buffer_steps < 1:
            raise ValueError("buffer_steps must be >= 1")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.generation = generation
        self.data_parallel_rank = data_parallel_rank
        self._topic = topic.encode("utf-8")
        self._buffer_steps = buffer_steps
        self._hwm = hwm
        self._ctx = zmq.Context()
        self._lock = threading.Lock()
        self._drop: set[int] = set()
        self._pub: zmq.Socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._start()

    # --- lifecycle --------------------------------------------------------

    def _start(self) -> None:
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=self._buffer_steps)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.IPV6, 1)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(self._hwm)
        _bind(self._pub, self.endpoint)
        self._stop.clear()
        if self.replay_endpoint is not None:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.IPV6, 1)
            router.setsockopt(zmq.LINGER, 0)
            _bind(router, self.replay_endpoint)
            self._thread = threading.Thread(target=self._serve_replay, args=(router,),
                                            name="kv-replay", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Close the sockets, as an engine that exits does. `start()` brings it back."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        with self._lock:
            if self._pub is not None:
                self._pub.close(linger=0)
                self._pub = None

    def start(self) -> None:
        """A new engine process on the same endpoints: seq from 0, empty replay buffer."""
        with self._lock:
            if self._pub is None:
                self._start()

    def restart(self) -> None:
        self.stop()
        self.start()

    def close(self) -> None:
        self.stop()
        self._ctx.term()

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- publishing -------------------------------------------------------

    def publish(self, events: Iterable[KVEvent], ts: float | None = None) -> int:
        """Publish one batch; returns its seq."""
        batch = EventBatch(time.time() if ts is None else ts, tuple(events), self.data_parallel_rank)
        return self.publish_payload(encode_batch(batch, self.generation))

    def publish_payload(self, payload: bytes) -> int:
        """Publish already-encoded (or deliberately broken) payload bytes as the next batch."""
        with self._lock:
            if self._pub is None:
                raise RuntimeError("publisher is stopped")
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
            if seq in self._drop:
                self._drop.discard(seq)  # lost on the way: only replay can recover it
            else:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            return seq

    def drop_next(self, count: int = 1) -> None:
        """Test hook: the next `count` batches get a seq and enter the buffer but are not sent live."""
        with self._lock:
            self._drop.update(range(self._seq, self._seq + count))

    def resend(self, seq: int) -> None:
        """Test hook: deliver a buffered batch live a second time (a duplicate)."""
        with self._lock:
            if self._pub is None:
                raise RuntimeError("publisher is stopped")
            payload = next(p for s, p in self._buffer if s == seq)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))

    def send_raw(self, frames: list[bytes]) -> None:
        """Test hook: send arbitrary frames on the PUB socket (no seq consumed)."""
        with self._lock:
            if self._pub is None:
                raise RuntimeError("publisher is stopped")
            self._pub.send_multipart(frames)

    # --- replay -----------------------------------------------------------

    def _serve_replay(self, router: zmq.Socket) -> None:
        with_topic = replay_has_topic(self.generation)
        try:
            while not self._stop.is_set():
                if not router.poll(_REPLAY_POLL_MS):
                    continue
                frames = router.recv_multipart()
                if len(frames) != 3 or len(frames[2]) != 8:
                    log.warning("invalid replay request (%d frames)", len(frames))
                    continue
                client, _, start = frames
                start_seq = int.from_bytes(start, "big")
                with self._lock:
                    held = [(s, p) for s, p in self._buffer if s >= start_seq]
                for seq, payload in held:
                    if with_topic:
                        router.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
                    else:
                        router.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
                if with_topic:
                    router.send_multipart((client, b"", b"", END_SEQ, b""))
                else:
                    router.send_multipart((client, b"", END_SEQ, b""))
        finally:
            router.close(linger=0)
