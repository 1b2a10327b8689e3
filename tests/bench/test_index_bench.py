"""`kvgate bench index` runs end to end on small fleets and reports every figure."""
from __future__ import annotations

import argparse
import json

import pytest

from bench import index as bench_index


def test_bench_index_json(capsys):
    parser = argparse.ArgumentParser()
    bench_index.add_arguments(parser)
    args = parser.parse_args(["--json", "--entries", "20000", "--pods", "8", "--queries", "20",
                              "--ingest-blocks", "3000"])
    assert bench_index.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("ingest_blocks_per_s", "match_p50_us", "match_p99_us", "bytes_per_entry"):
        assert out[key] > 0, key
    assert out["fleet_entries"] >= 20000
    assert out["match_blocks"] == 512  # the prompt is held entirely by one pod
    assert set(out["targets_met"]) >= {"ingest_blocks_per_s>=1e6", "match_p99_us<=200", "bytes_per_entry<=64"}


def test_bench_index_two_fleet_sizes_and_churn(capsys):
    """Several --pods are measured side by side (prefixed keys); --churn-entries adds the stall figures."""
    parser = argparse.ArgumentParser()
    bench_index.add_arguments(parser)
    args = parser.parse_args(["--json", "--entries", "10000", "--pods", "4,80", "--queries", "20",
                              "--ingest-blocks", "2000", "--churn-entries", "30000", "--churn-blocks", "8000"])
    assert bench_index.main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ingest_pods"] == 80
    for n in (4, 80):
        assert out[f"pods{n}_fleet_pods"] == n and out[f"pods{n}_match_blocks"] == 512
        assert f"pods{n}_match_p99_us<=200" in out["targets_met"]
    assert out["churn_evicted"] > 0 and out["churn_entries"] <= 30000
    by_pass = out["churn_longest_stall_by_pass_ms"]
    assert len(by_pass) == out["churn_passes"] == 3
    assert out["churn_longest_stall_ms"] == pytest.approx(sorted(by_pass)[1], abs=1e-3)  # the median pass's
    kinds = ("apply", "stats", "match", "drop", "remove_pod")
    assert 0 < out["churn_longest_apply_ms"] <= out["churn_longest_stall_max_ms"] == pytest.approx(
        max(out[f"churn_longest_{k}_ms"] for k in kinds)) == pytest.approx(max(by_pass), abs=1e-3)
    assert 0 < out["churn_repeat_match_p50_us"] <= out["churn_repeat_match_max_ms"] * 1e3
    assert "churn_longest_stall_ms<=2" in out["targets_met"] and "churn_loop_lag_p99_ms<=2" in out["targets_met"]
    # the loop beside the ingesting thread ticked, matched through the lock, and its lags are ordered
    assert out["churn_loop_ticks"] > 0 and 0 <= out["churn_loop_busy_matches"] <= out["churn_loop_ticks"]
    for name in ("churn_loop", "churn_loop_baseline"):
        assert 0 <= out[f"{name}_lag_p50_ms"] <= out[f"{name}_lag_p99_ms"] <= out[f"{name}_lag_max_ms"]
