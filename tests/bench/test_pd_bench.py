"""W11 (bench.routing_pd) in small: every request served under each policy, pd ahead of random pairing."""
from __future__ import annotations

import dataclasses

from bench.routing_pd import POLICIES, run, w11
from bench.routing_workloads import build


def test_w11_small_every_request_served_and_pd_keeps_more_prefill_hits():
    workload = build(dataclasses.replace(w11(), duration_s=2.0), 1)
    results = {p: run(workload, p, 1) for p in POLICIES}
    assert all(r.requests == len(workload.requests) for r in results.values())
    assert results["pd-always"].split_share == results["random-pair"].split_share == 1.0
    assert results["pd-never"].split_share == 0.0
    assert results["pd"].prefill_hit_rate > results["random-pair"].prefill_hit_rate
