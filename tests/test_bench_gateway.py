"""`kvgate bench gateway`'s parsing of wrk and of process CPU (the benchmark itself needs wrk and Envoy: run by hand)."""
from __future__ import annotations

import os

from bench.gateway import _cpu_s, parse_wrk

WRK_OUT = """Running 5s test @ http://127.0.0.1:40123/v1/chat/completions
  1 threads and 16 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     9.61ms    3.02ms  41.20ms   81.33%
    Req/Sec     1.67k   120.51     1.90k    72.00%
  Latency Distribution
     50%    9.12ms
     75%   10.80ms
     90%   12.95ms
     99%  512.00us
  8341 requests in 5.01s, 2.10MB read
  Non-2xx or 3xx responses: 3
Requests/sec:   1664.87
Transfer/sec:    429.23KB
"""


def test_parse_wrk_reads_rate_count_latency_and_errors() -> None:
    r = parse_wrk(WRK_OUT)
    assert r == {"rps": 1664.87, "requests": 8341, "p50_ms": 9.12, "p99_ms": 0.512, "non_2xx": 3, "socket_errors": ""}
    bad = parse_wrk("unable to connect to 127.0.0.1:1 Connection refused\n")
    assert bad is None


def test_cpu_seconds_of_a_live_and_a_missing_process() -> None:
    mine = _cpu_s(os.getpid())
    sum(i * i for i in range(200_000))  # some CPU time to see
    assert mine is not None and _cpu_s(os.getpid()) >= mine > 0
    assert _cpu_s(2**22 + 7) is None  # above the kernel's pid limit: no such process
