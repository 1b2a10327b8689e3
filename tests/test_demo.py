"""`kvgate demo`: the whole stack from one command, and every process gone when it stops."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parent.parent


def _listening(url: str) -> bool:
    parts = urlsplit(url if "://" in url else "tcp://" + url)
    try:
        with socket.create_connection((parts.hostname, parts.port), timeout=0.5):
            return True
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_no_traffic_prints_one_line_and_stops_everything(sig):
    proc = subprocess.Popen([sys.executable, "-m", "plugin.cli", "demo", "--no-traffic", "--sims", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        line = proc.stdout.readline()
        info = json.loads(line)
        assert set(info) >= {"envoy_url", "metrics_url", "redis_url", "pods", "model"}
        assert len(info["pods"]) == 2
        assert all(set(p) >= {"name", "url", "model", "kv_events", "dp_size"} for p in info["pods"])
        assert [p["dp_size"] for p in info["pods"]] == [1, 2]  # the last engine has two data-parallel ranks
        dp_pod = next(p for p in httpx.get(info["debug_url"], timeout=10).json()["pods"] if p["name"] == "sim1")
        assert dp_pod["kv_events"]["dp_size"] == 2 and dp_pod["running_by_rank"] == [0, 0]
        r = httpx.post(info["envoy_url"] + "/v1/completions", json={"model": info["model"], "prompt": "hi",
                                                                    "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and r.headers["x-kvgate-pod"] in {p["name"] for p in info["pods"]}
        assert "kvgate_routed_requests_total" in httpx.get(info["metrics_url"], timeout=10).text
        addresses = [info["envoy_url"], info["metrics_url"]] + [p["url"] for p in info["pods"]]
        if info["redis_url"]:
            addresses.append(info["redis_url"].rsplit("/", 1)[0])
        assert all(_listening(a) for a in addresses)
        proc.send_signal(sig)
        assert proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while any(_listening(a) for a in addresses) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [a for a in addresses if _listening(a)], "a process of the demo outlived it"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_short_comparison_prints_the_json_summary():
    proc = subprocess.run([sys.executable, "-m", "plugin.cli", "demo", "--duration", "2", "--json", "--sims", "2",
                           "--strategies", "round-robin,kv-sync,slo"], capture_output=True, text=True, timeout=240,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result["strategies"]) == {"round-robin", "kv-sync", "slo"}
    for name, r in result["strategies"].items():
        assert set(r) >= {"hit_rate", "slo_attainment", "ttft_p50_ms", "ttft_p90_ms", "requests", "errors"}
        assert 0.0 <= r["slo_attainment"] <= 1.0
        assert r["requests"] > 0 and r["errors"] == 0, (name, r)
        assert 0.0 <= r["hit_rate"] <= 1.0 and r["ttft_p50_ms"] <= r["ttft_p90_ms"]
    assert "kv-sync" in proc.stderr  # progress was shown
    # The replicas tokenize locally with the sims' own files, verified first against the sims' /tokenize.
    assert set(result["tokenizer"]) == {"kvgate0", "kvgate1"}
    for gateway, models in result["tokenizer"].items():
        m = models["demo-model"]
        assert m["state"] == "serving" and "chat" in m["verified"], (gateway, m)
        assert m["served"]["local"] > 0 and m["checks"]["disagree"] == 0, (gateway, m)
