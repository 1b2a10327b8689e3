"""`kvgate serve`'s start-up: what it leaves for the garbage collector."""
from __future__ import annotations

import gc
import weakref

from plugin.serve import settle_heap


class _Node:
    pass


def test_settle_heap_collects_garbage_then_freezes_what_lives() -> None:
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # a cycle: only the collector frees it
    dead = weakref.ref(a)
    del a, b
    kept = [_Node() for _ in range(100)]
    try:
        frozen = settle_heap()
        assert dead() is None  # garbage was collected before freezing, not kept forever
        assert frozen == gc.get_freeze_count() and len(gc.get_objects()) < frozen // 10
        assert not any(obj is kept for obj in gc.get_objects())  # frozen objects are out of the collector's passes
    finally:
        gc.unfreeze()
    assert any(obj is kept for obj in gc.get_objects())


def test_sigterm_drains_and_a_second_signal_stops_at_once() -> None:
    import signal

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from devkit.stack import Stack
    from helpers import free_ports, wait_until

    with Stack() as stack:
        grpc_port, http_port, engine_port = free_ports(3)
        env = {"KVGATE_PODS": f"p0=127.0.0.1:{engine_port}/m", "KVGATE_GRPC_PORT": str(grpc_port),
               "KVGATE_HTTP_PORT": str(http_port), "KVGATE_DRAIN_DELAY_S": "60", "KVGATE_DRAIN_TIMEOUT_S": "60"}
        proc = stack.kvgate(env=env, grpc_port=grpc_port)  # returns once readiness is SERVING
        proc.popen.send_signal(signal.SIGTERM)
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            def status(service: str) -> int:
                return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status

            wait_until(lambda: status("readiness") == health_pb2.HealthCheckResponse.NOT_SERVING, timeout=10)
            # draining: no longer ready, still alive and still running (the drain delay is a minute)
            assert status("readiness") == health_pb2.HealthCheckResponse.NOT_SERVING
            assert status("liveness") == health_pb2.HealthCheckResponse.SERVING
        assert proc.popen.poll() is None
        proc.popen.send_signal(signal.SIGINT)  # the second signal: stop now
        assert proc.popen.wait(15) == 0
