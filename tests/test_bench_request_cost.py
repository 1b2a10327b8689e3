"""`python -m bench.request_cost`: kvgate's own CPU per warm routed request, split by phase."""
from __future__ import annotations

from bench.request_cost import PHASES, measure


async def test_request_cost_routes_the_warm_prompt_to_its_holder_and_splits_its_cpu_without_overlap():
    r = await measure(requests=60, runs=2)
    # the index holds the prompt on pod0: the measured path is the warm kv-sync one, all 4 messages answered
    assert r["routed_to"] == "pod0" and r["messages"] == 4
    assert r["cpu_us_per_request"] == min(r["cpu_us_per_request_runs"]) > 0
    phases = r["phases_us"]
    assert set(phases) == set(PHASES) | {"decide_rest", "other"} and all(v >= 0 for v in phases.values())
    assert phases["pick"] > 0 and phases["parse_body"] > 0
    # the phases are disjoint: together they are the whole request (rounding apart)
    assert abs(sum(phases.values()) - r["cpu_us_per_request"]) <= 0.02 * r["cpu_us_per_request"] + 1.0


async def test_request_cost_unwatched_drives_envoys_two_messages_and_still_closes_the_observation():
    r = await measure(requests=60, runs=2, watched=False)
    assert r["routed_to"] == "pod0" and r["messages"] == 2
    phases = r["phases_us"]
    assert phases["response_headers"] == 0 and phases["response_body"] == 0
    assert phases["observation_close"] > 0 and phases["release"] > 0
