"""`kvgate bench request`: kvgate's own CPU per routed request, warm and cold, split by phase."""
from __future__ import annotations

import argparse

from bench.request_cost import PHASES, main, measure


async def test_request_cost_routes_the_warm_prompt_to_its_holder_and_splits_its_cpu_without_overlap():
    r = await measure(requests=60, runs=2, watched=True)
    # the index holds the prompt on pod0: the measured path is the warm kv-sync one, all 4 messages answered
    assert r["routed_to"] == "pod0" and r["messages_per_request"] == 4
    assert r["tokens_from_cache_share"] == 1.0
    assert r["cpu_us_per_request"] == min(r["cpu_us_per_request_runs"]) > 0
    phases = r["phases_us"]
    assert set(phases) == set(PHASES) | {"decide_rest", "other"} and all(v >= 0 for v in phases.values())
    assert phases["pick"] > 0 and phases["parse_body"] > 0
    # the phases are disjoint: together they are the whole request (rounding apart)
    assert abs(sum(phases.values()) - r["cpu_us_per_request"]) <= 0.02 * r["cpu_us_per_request"] + 1.0


async def test_request_cost_unwatched_drives_envoys_two_messages_and_still_closes_the_observation():
    r = await measure(requests=60, runs=2, watched=False)
    assert r["routed_to"] == "pod0" and r["messages_per_request"] == 2
    phases = r["phases_us"]
    assert phases["response_headers"] == 0 and phases["response_body"] == 0
    assert phases["observation_close"] > 0 and phases["release"] > 0


async def test_request_cost_default_sample_gets_the_response_messages_of_one_request_in_ten():
    r = await measure(requests=100, runs=1)
    assert r["messages_per_request"] == 2.2  # Envoy sends the response's two messages for the watched tenth only


async def test_request_cost_cold_prompts_are_new_to_the_tokenizer_cache_and_the_index():
    r = await measure(requests=60, runs=2, watched=False, cold=True)
    assert r["tokens_from_cache_share"] < 0.1  # only the shared question's tokens come from the cache
    assert r["phases_us"]["tokens"] > 0 and r["messages_per_request"] == 2


def test_bench_request_prints_warm_and_cold(capsys):
    assert main(argparse.Namespace(requests=30, runs=1, watched=False, unwatched=True, json=False)) == 0
    out = capsys.readouterr().out
    assert "warm" in out and "cold" in out and "us per request" in out and "pick" in out


async def test_bench_all_renders_warm_and_cold_side_by_side():
    from bench.all import render

    r = {"warm": await measure(requests=20, runs=1), "cold": await measure(requests=20, runs=1, cold=True),
         "observe": "default sample"}
    table = render("request", r)
    assert table.startswith("| measure | warm | cold |")
    assert f"| cpu_us_per_request | {r['warm']['cpu_us_per_request']:.4g} |" in table
    assert "| phase: pick (us) |" in table and "| phase: tokens (us) |" in table
