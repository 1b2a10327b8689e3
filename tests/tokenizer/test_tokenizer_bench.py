"""`kvgate bench tokenizer --json` runs end to end on a tiny workload and finds no mismatch; once verified,
the local path makes no request wait for /tokenize."""
from __future__ import annotations

import json
import subprocess
import sys

REQUIRED = {"remote_cold_ms", "remote_cached_ms", "local_cold_ms", "local_cached_ms", "cache_hit_rate",
            "verified_cold_ms", "verified_cached_ms", "verified_waited_calls_per_request"}


def test_bench_json_has_the_required_fields() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "plugin.cli", "bench", "tokenizer", "--json", "--server", "stub", "--conversations", "3",
         "--turns", "3", "--system-lines", "10", "--message-lines", "1", "--repeat", "1", "--concurrency", "2"],
        capture_output=True, text=True, timeout=90,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert REQUIRED <= result.keys()
    assert result["requests"] == 9 and result["mismatches"] == 0
    assert 0.5 < result["cache_hit_rate"] < 1.0
    assert result["verified_waited_calls_per_request"] == 0  # verified in the warm-up: no request waits for /tokenize
