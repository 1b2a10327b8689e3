"""`kvgate bench index` runs end to end on a small fleet and reports every figure."""
from __future__ import annotations

import argparse
import json

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
