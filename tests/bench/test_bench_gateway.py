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


def test_cold_script_makes_every_prompt_new_from_its_first_token(tmp_path) -> None:
    import json
    import re

    from bench.gateway import BODY, _cold_script

    script = tmp_path / "cold.lua"
    _cold_script(script)
    head, run, tail = re.search(r'\[\[(.*)\]\] \.\. "([0-9a-f]+)-" \.\. n \.\. \[\[(.*)\]\]', script.read_text()).groups()
    bodies = [json.loads(head + f"{run}-{n}" + tail) for n in (1, 2)]
    systems = [b["messages"][0]["content"] for b in bodies]
    assert systems[0] != systems[1] and systems[0].startswith(f"{run}-1 ")
    assert systems[0].endswith(BODY["messages"][0]["content"])  # the warm prompt's length, a new start
    assert bodies[0]["messages"][1:] == BODY["messages"][1:] and bodies[0]["model"] == BODY["model"]
    _cold_script(script)
    assert re.search(r'"([0-9a-f]+)-"', script.read_text()).group(1) != run  # a new run, new nonces


def test_summary_adds_each_replicas_event_share_to_its_cpu_per_request() -> None:
    from bench.gateway import summarize

    def gw(rps, p50, cpu=None, cold=None):
        return {"rps": rps, "p50_ms": p50, "p99_ms": p50 * 2, "cpu_us": cpu, "cold_rps": cold and rps / 2,
                "cold_p50_ms": cold, "cold_p99_ms": cold and cold * 2, "cold_cpu_us": cpu and cpu * 2, "errors": 0}

    med = {"direct": gw(4000, 0.2), "envoy_only": gw(2000, 0.5), "noop": gw(1000, 1.0, 400, 1.0),
           "kvsync": gw(950, 1.1, 420, 1.6), "kvsync_2rep": gw(900, 1.2, 500)}
    samples = {"kvsync": {"rps": [950]}, "noop": {"rps": [1000]}}
    r = summarize(med, samples, 30.0, 9, 10, rounds=1)
    assert r["kvsync_cpu_us_per_request_with_events"] == 450.0 and r["kvsync_cpu_over_noop"] == 1.12
    assert r["kvsync_2rep_cpu_us_per_request_with_events"] == 560.0  # both replicas follow the engine
    assert r["kvsync_added_p50_ms_vs_direct"] == 0.9 and r["kvsync_cold_added_p50_ms_vs_direct"] == 1.4
    assert r["targets"] == {"added_p50_warm_le_1ms": True, "added_p50_cold_le_1ms": False,
                            "cpu_per_request_le_1.2x_noop": True, "throughput_ge_0.9_noop": True}
    assert "kvsync_own_cpu_us_per_request" not in r  # no no-op answering kvgate's messages: nothing to subtract


def test_summary_says_what_kvgates_own_work_costs_and_what_the_cpu_target_leaves_it() -> None:
    from bench.gateway import summarize

    def gw(rps, p50, cpu):
        return {"rps": rps, "p50_ms": p50, "p99_ms": p50 * 2, "cpu_us": cpu, "cold_rps": rps, "cold_p50_ms": p50,
                "cold_p99_ms": p50, "cold_cpu_us": cpu, "errors": 0}

    med = {"direct": gw(4000, 0.2, None), "envoy_only": gw(2000, 0.5, None), "noop": gw(1000, 1.0, 600),
           "noop_bodies": gw(1000, 1.0, 650), "kvsync": gw(900, 1.3, 900), "kvsync_2rep": gw(800, 1.4, 1200)}
    r = summarize(med, {"kvsync": {"rps": [900]}, "noop": {"rps": [1000]}}, 40.0, 9, 10, rounds=1)
    assert r["kvsync_own_cpu_us_per_request"] == 250.0  # 900 - 650: beyond the same messages
    assert r["kvsync_own_cpu_us_allowed_by_target"] == 30.0  # 1.2 * 600 - 650 - 40
    assert r["kvsync_cpu_over_noop"] == round(940 / 600, 2) and not r["targets"]["cpu_per_request_le_1.2x_noop"]


def test_noop_with_bodies_watches_the_share_of_requests_kvgate_watches() -> None:
    """The no-op compared with kvgate must get the messages kvgate gets: kvgate watches a sample of
    responses (KVGATE_OBSERVE_SAMPLE) and tells Envoy to send nothing of the others, so the no-op does
    the same, with kvgate's own Sampler and override; without --bodies it never overrides."""
    import asyncio

    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from bench.noop_processor import NoopProcessor
    from plugin.config import Settings
    from plugin.observe import UNWATCHED

    headers = pb.ProcessingRequest(request_headers=pb.HttpHeaders(end_of_stream=False))

    async def answers(proc: NoopProcessor, streams: int) -> list:
        out = []
        for _ in range(streams):
            async def one():
                yield headers
            async for r in proc.Process(one(), None):
                out.append(r)
        return out

    got = asyncio.run(answers(NoopProcessor("127.0.0.1:1", bodies=True), 50))
    unwatched = [r for r in got if r.HasField("mode_override")]
    assert Settings.observe_sample == 0.1 and len(got) == 50 and len(unwatched) == 45
    assert all(r.mode_override == UNWATCHED for r in unwatched)
    plain = asyncio.run(answers(NoopProcessor("127.0.0.1:1"), 10))
    assert len(plain) == 10 and not any(r.HasField("mode_override") for r in plain)
