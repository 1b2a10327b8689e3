"""Helpers shared by the integration tests (real processes on loopback)."""
from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import httpx
import pytest

from devkit.stack import Proc, Stack, free_port, wait_for_port


# kvgate's environment in the test stacks: SIGTERM stops it at once. The drain delay (3 s by default) is
# for a load balancer to see readiness turn NOT_SERVING; no test but the drain's own needs it, and every
# stop of a stack or restart of a kvgate would wait it out. Tests of the drain set their own delay.
QUICK_STOP = {"KVGATE_DRAIN_DELAY_S": "0"}


def wait_until(predicate, timeout: float = 15.0, interval: float = 0.05):
    """Poll `predicate` until it returns something true, at most `timeout` s; returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


async def wait_until_async(predicate, timeout: float = 15.0, interval: float = 0.02):
    """wait_until for a test on the event loop: polls with asyncio.sleep, so the loop's tasks run."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(interval)
    return predicate()


def make_tls_certs(workdir: Path, name: str = "test", ca: tuple[Path, Path] | None = None) -> dict[str, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it, both as strict X.509 verification
    (Python 3.13's default contexts, VERIFY_X509_STRICT) wants them: the CA with basicConstraints
    CA:TRUE (critical), keyUsage keyCertSign (critical) and a subject key identifier; the server's
    with a SAN, serverAuth, and subject and authority key identifiers. `ca` (cert, key): sign with
    that CA instead of a new one. Returns the paths: ca, ca_key, cert, key."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    if ca is None:
        ca = (workdir / f"{name}-ca.pem", workdir / f"{name}-ca.key")
        ca_ext = workdir / f"{name}-ca.cnf"
        ca_ext.write_text(f"[req]\ndistinguished_name = dn\nprompt = no\n[dn]\nCN = kvgate {name} CA\n"
                          "[v3]\nbasicConstraints = critical, CA:TRUE\nkeyUsage = critical, keyCertSign, cRLSign\n"
                          "subjectKeyIdentifier = hash\n")
        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-config", str(ca_ext), "-extensions", "v3",
            "-keyout", str(ca[1]), "-out", str(ca[0]))
    cert, key, csr = (workdir / f"{name}-server.{ext}" for ext in ("pem", "key", "csr"))
    ext = workdir / f"{name}-server.cnf"
    ext.write_text("basicConstraints = critical, CA:FALSE\nkeyUsage = critical, digitalSignature, keyEncipherment\n"
                   "extendedKeyUsage = serverAuth\nsubjectAltName = IP:127.0.0.1\n"
                   "subjectKeyIdentifier = hash\nauthorityKeyIdentifier = keyid\n")
    run("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(csr))
    run("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial", "-days", "2",
        "-extfile", str(ext), "-out", str(cert))
    return {"ca": ca[0], "ca_key": ca[1], "cert": cert, "key": key}


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


class GatewayEnv:
    """The integration stack's common part: `kvgate serve` and Envoy in front of pods a subclass
    started, a canary outside discovery, and a client through Envoy. A subclass's __init__ starts its
    engines (and Redis, ...) on `self.stack`, then calls `start_gateway`; `on_close` registers what
    else must be released at the end (sockets, threads)."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self._closers: list[Callable[[], object]] = []

    def start_gateway(self, pods: list[dict], env: dict[str, str], client_timeout: float = 30) -> None:
        """kvgate over `pods` (a pods file), then Envoy in front of it with every pod in its pool (the
        override_host policy picks only among those)."""
        self.pods = pods
        self.pods_file = self.stack.pods_file(pods)
        self.canary, self.canary_port = start_canary(self.stack)
        self.grpc_port, self.http_port = free_port(), free_port()
        self.kvgate_env = {"KVGATE_PODS_FILE": str(self.pods_file), "KVGATE_GRPC_PORT": str(self.grpc_port),
                           "KVGATE_HTTP_PORT": str(self.http_port), **QUICK_STOP, **env}
        self.kvgate = self.stack.kvgate(env=self.kvgate_env, grpc_port=self.grpc_port)
        wait_for_port("127.0.0.1", self.http_port, timeout=10)
        self.listen = free_port()
        self.envoy = self.stack.envoy(listen_port=self.listen, extproc_port=self.grpc_port,
                                      pool=[(p["address"], p["port"]) for p in pods])
        self.url = f"http://127.0.0.1:{self.listen}"
        self.client = httpx.Client(base_url=self.url, timeout=client_timeout)
        self.on_close(self.client.close)

    def on_close(self, fn: Callable[[], object]) -> None:
        self._closers.append(fn)

    def close(self) -> None:
        for fn in reversed(self._closers):
            fn()

    # --- kvgate's view --------------------------------------------------------------------
    def debug(self) -> dict:
        return httpx.get(f"http://127.0.0.1:{self.http_port}/debug", timeout=5).json()

    def debug_text(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.http_port}/debug", timeout=5).text

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.http_port}/metrics", timeout=5).text

    def counts_are_zero(self) -> bool:
        d = self.debug()
        return d["in_flight_here"] == 0 and all(p["running"] == 0 for p in d["pods"])

    def canary_hits(self) -> int:
        return canary_hits(self.canary)

    def restart_kvgate(self, **overrides: str) -> None:
        """kvgate again, with its settings and `overrides`; returns once both its ports listen."""
        self.kvgate = self.stack.restart(self.kvgate, env={**self.kvgate_env, **overrides},
                                         ready_port=("127.0.0.1", self.grpc_port))
        wait_for_port("127.0.0.1", self.http_port, timeout=10)


def stack_fixture(make: Callable[[Stack], GatewayEnv]):
    """The module-scoped fixture of an integration module: `env = stack_fixture(Env)`. One stack per
    module, stopped whatever happens; the logs of kvgate and Envoy are printed if a process died."""

    @pytest.fixture(scope="module")
    def env():
        with Stack() as stack:
            e = make(stack)
            try:
                yield e
            finally:
                e.close()
                dead = [p.name for p in stack.procs if not p.alive()]
                if dead:
                    print(f"stack processes not running at the end: {dead}", e.kvgate.log_tail(), e.envoy.log_tail())

    return env


class RedisServer:
    """A real redis-server on a free loopback port, without persistence; `kill` and `start` again
    keep the port (a restart loses every key)."""

    def __init__(self, password: str | None = None) -> None:
        self.port = free_port()
        self.password = password
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(5)
            self.proc = None
