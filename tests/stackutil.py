"""Helpers shared by the integration tests (real processes on loopback)."""
from __future__ import annotations

import socket
import sys
import time

from plugin.stack import Proc, Stack, free_port


def wait_until(predicate, timeout: float = 15.0, interval: float = 0.05):
    """Poll `predicate` until it returns something true, at most `timeout` s; returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def start_canary(stack: Stack) -> tuple[Proc, int]:
    """An HTTP server outside discovery: nothing a client sends may ever reach it."""
    port = free_port()
    proc = stack.start("canary", [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                       ready_port=("127.0.0.1", port))
    return proc, port


def canary_hits(proc: Proc) -> int:
    """Requests the canary has logged so far, whatever their method (`"PUT /x HTTP/1.1" 501 -`)."""
    text = proc.log_path.read_text(errors="replace")
    return sum(1 for line in text.splitlines() if "HTTP/1" in line)


def refused_port() -> tuple[socket.socket, int]:
    """A loopback port that refuses connections for as long as the returned socket stays open: bound,
    never listening, so no later free_port() can hand it to another server (an engine that is down)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock, sock.getsockname()[1]
