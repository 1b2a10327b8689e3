"""`kvgate demo`: the whole stack from one command, supervised: stop signals at any moment end with
every child process gone, an engine that exits leaves the others serving."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from helpers import wait_until

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def _state(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, None once it is gone (a zombie counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state, ppid = stat.rsplit(")", 1)[1].split()[:2]
    return None if state == "Z" else (state, int(ppid))


def _children(pid: int) -> dict[int, str]:
    """Live child processes of `pid`: pid -> command line."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            st = _state(int(d.name))
            if st is not None and st[1] == pid:
                try:
                    out[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    pass
    return out


class Demo:
    """`kvgate demo` in a subprocess: its stderr in a file, its children watched from the start (so a
    child started in the middle of the shutdown is seen too)."""

    def __init__(self, tmp_path: Path, *args: str, background_job: bool = False) -> None:
        self.err_path = tmp_path / "demo.err"
        argv = [sys.executable, "-m", "plugin.cli", "demo", *args]
        with open(self.err_path, "w") as err:
            if background_job:
                # As a script's background job: the shell starts it with SIGINT (and SIGQUIT) ignored.
                pidfile = tmp_path / "demo.pid"
                self.proc = subprocess.Popen(["sh", "-c", '"$@" & echo $! > "$0"; wait $!', str(pidfile), *argv],
                                             stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO)
                self.pid = int(wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), timeout=10))
            else:
                self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO)
                self.pid = self.proc.pid
        self.seen: dict[int, str] = {}
        self._watch = threading.Thread(target=self._watch_children, daemon=True)
        self._watch.start()

    def _watch_children(self) -> None:
        while self.proc.poll() is None:
            self.seen.update(_children(self.pid))
            time.sleep(0.01)

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def info(self) -> dict:
        return json.loads(self.proc.stdout.readline())

    def send(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def child(self, fragment: str) -> int:
        return next(pid for pid, cmd in _children(self.pid).items() if fragment in cmd)

    def finish(self, timeout: float = 30) -> int:
        """The demo's exit status, once it exited; asserts every child it ever had is gone."""
        try:
            code = self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        self._watch.join(5)
        assert self.seen, "no child process was ever seen"
        survivors = {pid: cmd for pid, cmd in self.seen.items() if _state(pid) is not None}
        for pid in survivors:  # leave nothing behind, then fail
            subprocess.run(["kill", "-9", str(pid)], check=False)
        assert not survivors, f"children of the demo outlived it: {survivors}\n{self.stderr()[-3000:]}"
        drop_stack_logs(self.stderr())
        return code


def drop_stack_logs(stderr: str) -> None:
    """The stack directory a demo that passed named ("logs in ..."): removed (the demo keeps it for its user)."""
    m = re.search(r"logs in (\S+?)\)", stderr)
    if m:
        path = Path(m.group(1))
        if path.parent == Path(tempfile.gettempdir()) and path.name.startswith("kvgate-stack-"):
            shutil.rmtree(path, ignore_errors=True)


def test_no_traffic_serves_then_sigint_stops_everything(tmp_path):
    """On the hybrid model shape, which reaches the engines: kvgate learns their two KV cache groups."""
    demo = Demo(tmp_path, "--no-traffic", "--sims", "2", "--model-shape", "hybrid")
    info = demo.info()
    assert set(info) >= {"envoy_url", "metrics_url", "redis_url", "pods", "model"}
    assert info["model_shape"] == "hybrid"
    assert len(info["pods"]) == 2
    assert all(set(p) >= {"name", "url", "model", "kv_events", "dp_size"} for p in info["pods"])
    assert [p["dp_size"] for p in info["pods"]] == [1, 2]  # the last engine has two data-parallel ranks
    dp_pod = next(p for p in httpx.get(info["debug_url"], timeout=10).json()["pods"] if p["name"] == "sim1")
    assert dp_pod["kv_events"]["dp_size"] == 2 and dp_pod["running_by_rank"] == [0, 0]
    r = httpx.post(info["envoy_url"] + "/v1/completions", json={"model": info["model"], "prompt": "hi " * 40,
                                                                "max_tokens": 2}, timeout=30)  # blocks to store
    assert r.status_code == 200 and r.headers["x-kvgate-pod"] in {p["name"] for p in info["pods"]}
    assert "kvgate_routed_requests_total" in httpx.get(info["metrics_url"], timeout=10).text

    def groups() -> dict:
        return httpx.get(info["debug_url"], timeout=10).json()["index"]["kv_cache_groups"].get(info["model"], {})
    learned = wait_until(lambda: len(groups().get("groups", {})) == 2 and groups(), timeout=10, detail=groups)
    assert [(g["kind"], g["sliding_window"]) for _, g in sorted(learned["groups"].items())] == [
        ("sliding_window", 128), ("full_attention", None)]
    n = len(_children(demo.pid))
    assert n == 2 + 1 + 2 + 1, _children(demo.pid)  # engines, redis, kvgate replicas, envoy
    demo.send(signal.SIGINT)
    assert demo.finish() == 0


def test_stop_signals_during_startup_stop_everything(tmp_path):
    """SIGTERM, twice, once the first children are starting."""
    demo = Demo(tmp_path, "--no-traffic", "--sims", "2", "--gateways", "1")
    assert wait_until(lambda: demo.seen, timeout=20, interval=0.005)
    demo.send(signal.SIGTERM)
    demo.send(signal.SIGTERM)
    assert demo.finish() == 0, demo.stderr()
    assert "SIGTERM: stopping" in demo.stderr()


_MISTAKEN_STOP = """
import os, signal, sys, time
from devkit import demo
from plugin import cli

def start(*args, **kwargs):
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # the handler raises the stop here
        time.sleep(10)
    except Exception:
        if sys.argv[1] == "swallow":  # code that takes any failure for its own and goes on
            return {"pods": []}
        # as threading.Thread.start does: `except Exception`, then a KeyError of its own
        raise KeyError("the bookkeeping the interruption cut short")

demo._start = start
sys.exit(cli.main(["demo", "--no-traffic"]))
"""


def test_a_stop_that_library_code_turns_into_another_error_still_stops_cleanly():
    """The stop signal's exception lands wherever the demo is, library code included, and some of it
    catches Exception (threading.Thread.start cleans up and can then fail on its own bookkeeping). The
    fresh-clone CI of 9591840 saw test_stop_signals_during_startup_stop_everything end with status 1.
    Whatever surfaces once a stop signal came is the stop: status 0 (--no-traffic), reported as such; and
    a stop swallowed on the way still stops the demo once it supervises its stack."""
    def run(mode: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", _MISTAKEN_STOP, mode], capture_output=True, text=True,
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)

    raised = run("raise")
    assert raised.returncode == 0, raised.stderr
    assert "SIGTERM: stopping" in raised.stderr and "KeyError" in raised.stderr, raised.stderr
    swallowed = run("swallow")
    assert swallowed.returncode == 0, swallowed.stderr
    assert "SIGTERM: stopping" in swallowed.stderr, swallowed.stderr


def test_second_and_third_signals_only_hurry_the_shutdown(tmp_path):
    """SIGTERM, SIGTERM at once, then SIGINT once a first child has exited: every child gone."""
    demo = Demo(tmp_path, "--no-traffic", "--sims", "2", "--gateways", "1")
    demo.info()
    before = set(_children(demo.pid))
    demo.send(signal.SIGTERM)
    demo.send(signal.SIGTERM)
    wait_until(lambda: demo.proc.poll() is not None or len(set(_children(demo.pid)) & before) < len(before),
               timeout=10, interval=0.005)
    if demo.proc.poll() is None:
        demo.send(signal.SIGINT)
    assert demo.finish() == 0


def test_sigint_stops_a_demo_started_as_a_background_job(tmp_path):
    """A script's `kvgate demo &` runs with SIGINT ignored; `kill -INT` stops it all the same, in the
    middle of its traffic, and a second SIGINT while it stops only hurries that."""
    demo = Demo(tmp_path, "--duration", "60", "--sims", "1", "--gateways", "1", "--strategies", "round-robin",
                background_job=True)
    assert wait_until(lambda: "round-robin" in demo.stderr() and "requests" in demo.stderr(), timeout=60,
                      detail=demo.stderr)
    demo.send(signal.SIGINT)
    assert wait_until(lambda: "SIGINT: stopping" in demo.stderr(), timeout=10, detail=demo.stderr)
    demo.send(signal.SIGINT)
    assert demo.finish() == 130


def test_an_engine_exit_is_reported_and_the_others_keep_serving(tmp_path):
    """Then a kvgate replica exits: the demo stops, saying why."""
    demo = Demo(tmp_path, "--no-traffic", "--sims", "2", "--gateways", "2")
    info = demo.info()
    subprocess.run(["kill", "-9", str(demo.child("--name sim0"))], check=True)
    assert wait_until(lambda: "engine sim0 exited" in demo.stderr(), timeout=10, detail=demo.stderr)
    assert "keeps serving on sim1" in demo.stderr()

    def served_by_sim1() -> bool:
        rs = [httpx.post(info["envoy_url"] + "/v1/completions", timeout=30,
                         json={"model": info["model"], "prompt": f"after {i}", "max_tokens": 1}) for i in range(4)]
        return all(r.status_code == 200 and r.headers["x-kvgate-pod"] == "sim1" for r in rs)
    assert wait_until(served_by_sim1, timeout=20, interval=0.2)
    assert demo.proc.poll() is None, demo.stderr()

    replica = next(pid for pid, cmd in _children(demo.pid).items() if "plugin.cli serve" in cmd)
    subprocess.run(["kill", "-9", str(replica)], check=True)
    assert demo.finish() == 1
    assert "exited (status -9); the demo cannot serve without it, stopping the stack" in demo.stderr()


def test_short_comparison_prints_the_json_summary():
    proc = subprocess.run([sys.executable, "-m", "plugin.cli", "demo", "--duration", "1", "--slices", "2", "--json",
                           "--sims", "2", "--strategies", "round-robin,kv-sync,slo"], capture_output=True, text=True,
                          timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    drop_stack_logs(proc.stderr)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result["strategies"]) == {"round-robin", "kv-sync", "slo"}
    for name, r in result["strategies"].items():
        assert set(r) >= {"hit_rate", "slo_attainment", "ttft_p50_ms", "ttft_p90_ms", "requests", "errors"}
        assert 0.0 <= r["slo_attainment"] <= 1.0
        assert r["requests"] > 0 and r["errors"] == 0, (name, r)
        assert 0.0 <= r["hit_rate"] <= 1.0 and r["ttft_p50_ms"] <= r["ttft_p90_ms"]
    # what kvgate believed cached, beside the engines' real hits: only strategies that look up prefixes (a
    # number only when the replicas' counters of looked-up blocks moved in the strategy's slices). Not more
    # than 0: one second on a loaded machine may route only first visits (the fresh-clone CI of c329133: TTFT
    # p50 373 ms, no hit on the engines and none believed); here ~45 requests a strategy and ~30% believed.
    assert result["strategies"]["round-robin"]["believed_hit_rate"] is None
    for name in ("kv-sync", "slo"):
        believed = result["strategies"][name]["believed_hit_rate"]
        assert believed is not None and 0.0 <= believed <= 1.0, result["strategies"][name]
    assert "kv-sync" in proc.stderr  # progress was shown
    # The replicas tokenize locally with the sims' own files, verified first against the sims' /tokenize.
    assert set(result["tokenizer"]) == {"kvgate0", "kvgate1"}
    for gateway, models in result["tokenizer"].items():
        m = models["demo-model"]
        assert m["state"] == "serving" and "chat" in m["verified"], (gateway, m)
        assert m["served"]["local"] > 0 and m["checks"]["disagree"] == 0, (gateway, m)
    # slo's TTFT predictions met their observed TTFTs: each replica's profiles say how far off they were
    learned = [p for pods in result["slo_model"].values() for p in pods.values() if p["ttft_error_ms"] is not None]
    assert learned and all(p["ttft_samples"] > 0 for p in learned), result["slo_model"]


def test_model_shape_option_reaches_the_sims_command_line():
    """`kvgate demo --model-shape hybrid` parses, and the engines' options it makes are ones `kvgate sim`
    takes as that shape; dense is the default, a shape the demo does not offer is refused."""
    from devkit.demo import sim_args
    from plugin.cli import build_parser
    from sim.cli import add_arguments, options_from_args
    import argparse

    def demo_args(*argv: str) -> argparse.Namespace:
        return build_parser(["demo"]).parse_args(["demo", *argv])

    assert demo_args().model_shape == "dense"
    sim = argparse.ArgumentParser()
    add_arguments(sim)
    for shape in ("dense", "hybrid"):
        assert demo_args("--model-shape", shape).model_shape == shape
        options = options_from_args(sim.parse_args(sim_args(shape)))
        assert options.model_shape == shape and options.engine.block_size == 16
    with pytest.raises(SystemExit):
        demo_args("--model-shape", "mamba-hybrid")
    with pytest.raises(ValueError, match="model shape"):
        sim_args("mamba-hybrid")


def test_believed_counters_read_kvgates_prefix_blocks():
    from devkit.demo import _believed_counters

    text = ('# TYPE kvgate_prefix_blocks_total counter\n'
            'kvgate_prefix_blocks_total{kind="total"} 40.0\n'
            'kvgate_prefix_blocks_total{kind="cached"} 25.0\n'
            'kvgate_prefix_blocks_created{kind="total"} 1.7e9\n')
    assert _believed_counters(text) == (40.0, 25.0)
    assert _believed_counters("") == (0.0, 0.0)


def test_slices_alternate_the_strategies_order_so_none_always_runs_first():
    from devkit.demo import slice_order

    assert slice_order(["a", "b"], 3) == [(0, "a"), (0, "b"), (1, "b"), (1, "a"), (2, "a"), (2, "b")]
    assert slice_order(["a", "b", "c"], 1) == [(0, "a"), (0, "b"), (0, "c")]


_EXITING = """
import sys, time
from devkit.demo import _StopSignals
signals = _StopSignals()
signals.install()
signals.stopping = True  # as in the demo's shutdown: a signal only hurries it
if sys.argv[1] == "ignore":
    signals.ignore()  # what the demo does once every child is gone
print("ready", flush=True)
time.sleep(0.3)  # exiting under a hail of SIGINTs, interpreter finalisation included
"""


def test_a_stop_signal_while_the_demo_exits_does_not_kill_it():
    """The third signal of test_second_and_third_signals_only_hurry_the_shutdown can land while the demo's
    interpreter finalises, which puts back SIGINT's default action: the process died of it (status -2)
    after its children were all gone. Once they are, the demo ignores stop signals. Here a process in the
    demo's shutdown state exits while SIGINTs keep coming; with the handlers left in place (`keep`) the
    same hail kills it (checked, so the hail is known to reach the window: 20 of 20 runs here)."""
    rounds = 5

    def exit_status(mode: str) -> int:
        proc = subprocess.Popen([sys.executable, "-c", _EXITING, mode], stdout=subprocess.PIPE, cwd=REPO,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        while proc.poll() is None:
            try:
                os.kill(proc.pid, signal.SIGINT)
            except ProcessLookupError:
                break
        return proc.wait()

    assert [exit_status("ignore") for _ in range(rounds)] == [0] * rounds
    assert any(exit_status("keep") == -signal.SIGINT for _ in range(rounds))  # up to the first one killed
