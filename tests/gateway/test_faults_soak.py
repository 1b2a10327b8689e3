"""`kvgate bench soak` end to end, short: the real command, the whole stack, mixed traffic."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.soak import rss_mb

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.integration]


@pytest.mark.timeout(150)
def test_soak_command_runs_clean_for_2_seconds():
    proc = subprocess.run([sys.executable, "-m", "plugin.cli", "bench", "soak", "--duration", "2", "--warmup", "1",
                           "--concurrency", "4", "--json"], capture_output=True, text=True, timeout=140, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["ok"] and r["unexpected_errors"] == 0, r["error_samples"]
    assert r["counts_zero_at_end"] and r["end_state"]["in_flight_here"] == 0
    assert r["requests"] > 20
    # Every kind of traffic ran, the expected failures (hang-ups, malformed bodies) included.
    assert set(r["by_kind"]) == {"chat_stream", "completion", "completion_stream", "hang_up", "bad_body"}
    assert 0 < r["rss_start_mb"] <= r["rss_peak_mb"] and r["rss_growth_mb"] <= r["rss_growth_bound_mb"]
    assert r["processes_died"] == []


def test_soak_rejects_bad_arguments():
    proc = subprocess.run([sys.executable, "-m", "plugin.cli", "bench", "soak", "--duration", "0"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2 and "--duration" in proc.stderr


def test_rss_reads_this_process():
    import os
    assert 1 < rss_mb(os.getpid()) < 100_000
