"""The routing benchmark on a tiny workload: determinism, the event path into the real index,
the report's JSON shape, the plot."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from routing.strategies import StrategyConfig

from bench import routing as bench
from bench import routing_workloads as workloads
from bench.routing_sim import ORACLE, Policy, run, ttft_floor
from sim.engine import EngineConfig

REPO = Path(__file__).resolve().parent.parent

TINY = workloads.Shape(name="T", groups=6, prompts_per_group=3, context_tokens=96, question_tokens=40,
                       output_tokens=20, pods=3, capacity_ratio=0.73, peak_load=0.2, ramp=(0.3, 1.0),
                       stage_s=0.6)


@pytest.fixture(scope="module")
def tiny() -> workloads.Workload:
    return workloads.build(TINY, seed=7)


def test_workload_is_a_function_of_shape_and_seed(tiny):
    again = workloads.build(TINY, seed=7)
    other = workloads.build(TINY, seed=8)
    assert again == tiny
    assert other.requests != tiny.requests
    assert len(tiny.requests) > 20
    arrivals = [r.arrival for r in tiny.requests]
    assert arrivals == sorted(arrivals)
    assert tiny.working_set_blocks == 6 * (96 // 16) + 6 * 3 * (136 // 16 - 96 // 16)
    assert 0 < tiny.compulsory_hit_rate < 1


@pytest.mark.parametrize("policy", [Policy("kv-sync@delay50ms+loss1%", "kv-sync", 0.05, 0.01),
                                    Policy("prefix-cache", "prefix-cache"), Policy(ORACLE, ORACLE)])
def test_same_seed_same_numbers(tiny, policy):
    a = run(tiny, policy, seed=3)
    b = run(tiny, policy, seed=3)
    assert a == b
    assert a.requests == len(tiny.requests)


def test_index_is_fed_by_decoded_events(tiny):
    r = run(tiny, Policy("kv-sync", "kv-sync"), seed=1)
    assert r.batches_published > 0
    assert r.batches_decoded == r.batches_published and r.batches_lost == 0
    assert r.index_stats["entries"] > 0
    assert r.index_stats["block_sizes"] == {"sim-model": workloads.BLOCK_SIZE}
    assert r.index_stats["skipped"] == {} and r.decode_skipped == {}  # every event decoded and applied cleanly


def test_bad_policies_are_refused():
    for bad in (dict(delay_s=-1), dict(loss=1.0), dict(gateways=0)):
        with pytest.raises(ValueError):
            Policy("x", "kv-sync", **bad)


def test_lost_batches_never_reach_the_index(tiny):
    r = run(tiny, Policy("lossy", "kv-sync", delay_s=0.5, loss=0.3), seed=1)
    assert r.batches_lost > 0
    assert r.batches_decoded + r.batches_lost == r.batches_published
    assert r.requests == len(tiny.requests)


def test_no_policy_beats_the_compulsory_miss_bound(tiny):
    floor = ttft_floor(tiny)
    assert len(floor) == len(tiny.requests) and floor.min() > 0
    for p in bench.policies():
        r = run(tiny, p, seed=2)
        assert r.hit_rate <= tiny.compulsory_hit_rate + 1e-9, p.name
        assert r.ttft_p90_s >= np.percentile(floor, 90) - 1e-12, p.name
        assert r.max_over_mean_running >= 1.0
        assert 0 < r.ttft_p50_s <= r.ttft_p90_s <= r.ttft_p99_s and r.ttft_mean_s > 0


def test_report_json_shape_and_plot(tmp_path):
    chosen = (Policy("random", "random"), Policy("kv-sync", "kv-sync"), Policy(ORACLE, ORACLE))
    report = json.loads(json.dumps(bench.run_all([TINY], seeds=2, jobs=1, chosen=chosen)))
    pols = report["workloads"]["T"]["policies"]
    assert list(pols) == ["random", "kv-sync", ORACLE]
    for m in pols.values():
        assert set(bench.METRICS) <= set(m)
        assert all(isinstance(m[k], float) for k in bench.METRICS)
    assert report["workloads"]["T"]["seeds"] == 2
    assert "T: kv-sync hit rate within 5 points of oracle" in report["targets"]
    assert "random" in bench.format_table(report)
    png = tmp_path / "r.png"
    bench.plot(report, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_arguments():
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--quick", "--json", "--plot", "", "--workload", "W2"])
    assert args.quick and args.json and args.plot == "" and args.workload == ["W2"]
    assert bench.strategy_config(args).guard_abs_slack == StrategyConfig().guard_abs_slack
    bad = p.parse_args(["--seeds", "0"])
    assert bench.main(bad) == 2
    bad = p.parse_args(["--weights", "kv-sync:nope=1"])
    assert bench.main(bad) == 2
    custom = p.parse_args(["--guard-slack", "16", "--weights", "kv-sync:load=1"])
    cfg = bench.strategy_config(custom)
    assert cfg.guard_abs_slack == 16 and cfg.weights == {"kv-sync": {"load": 1.0}}


def test_gateway_replicas_share_counts_and_index(tiny):
    one = run(tiny, Policy("kv-sync", "kv-sync"), seed=4)
    four = run(tiny, Policy("kv-sync@4gw", "kv-sync", gateways=4), seed=4)
    assert four.requests == one.requests == len(tiny.requests)
    assert four.batches_decoded == four.batches_published > 0
    assert four == run(tiny, Policy("kv-sync@4gw", "kv-sync", gateways=4), seed=4)


def test_oracle_mirror_equals_the_engine_cache(tiny):
    from bench.routing_sim import _CacheMirror, engine_config
    from sim.engine import EngineModel

    engine = EngineModel(engine_config(tiny))
    mirror = _CacheMirror(["p"])
    for r in tiny.requests:  # every request on one engine: evictions happen
        engine.add_request(r.req_id, r.token_ids, r.max_tokens, r.arrival)
        for batch in engine.drain_events():
            mirror.apply("p", batch)
    t = tiny.requests[-1].arrival
    while (nxt := engine.next_event_time()) is not None:
        t = nxt
        engine.advance(t)
    for batch in engine.drain_events():
        mirror.apply("p", batch)
    assert mirror.held["p"] == engine.cached_block_hashes()
    assert engine.metrics().cached_blocks > 0
    last = tiny.requests[-1].token_ids  # released last, so not evicted
    assert mirror.hit_tokens(last)["p"] == (len(last) - 1) // workloads.BLOCK_SIZE * workloads.BLOCK_SIZE
    assert mirror.hit_tokens(tuple(range(5, 200)))["p"] == 0


def test_ttft_floor_counts_only_prefixes_seen_before():
    a = tuple(range(1000, 1040))  # 2 full blocks + 8 tokens
    b = a[:16] + tuple(range(5000, 5024))  # shares a's first block
    reqs = tuple(workloads.Request(f"r{i}", t, toks, 4) for i, (t, toks) in enumerate([(0.0, a), (1.0, a), (2.0, b)]))
    wl = workloads.Workload(shape=TINY, seed=0, requests=reqs, working_set_blocks=4, blocks_per_pod=64,
                            compulsory_hit_rate=0.0)
    c = EngineConfig()
    want = [c.ttft_overhead_s + c.prefill_s_per_token * n for n in (40, 40 - 32, 40 - 16)]
    assert ttft_floor(wl) == pytest.approx(want)
    # a prompt of exactly 2 blocks repeated: its last block is recomputed (the last token always is)
    reqs = tuple(workloads.Request(f"r{i}", float(i), a[:32], 4) for i in range(2))
    wl = workloads.Workload(shape=TINY, seed=0, requests=reqs, working_set_blocks=2, blocks_per_pod=64,
                            compulsory_hit_rate=0.0)
    assert ttft_floor(wl)[1] == pytest.approx(c.ttft_overhead_s + c.prefill_s_per_token * 16)


def test_ratio_targets_report_what_any_router_could_attain():
    pol = {name: {"ttft_p90_s": v, "hit_rate": 0.9} for name, v in
           (("random", 2.0), ("prefix-cache", 0.03), ("kv-sync", 0.02), ("kv-sync@delay500ms+loss1%", 0.025))}
    t = bench.targets({"workloads": {"W1": {"policies": pol, "ttft_p90_floor_s": 0.015}}})
    pc = t["W1: TTFT p90 prefix-cache / kv-sync >= 3"]
    assert pc == {"value": 1.5, "met": False, "attainable": 2.0}
    assert t["W1: TTFT p90 random / kv-sync >= 20"]["met"] is True


def test_policies_run_behind_the_shipped_replica_count_and_the_prefix_ones_behind_others_too():
    shipped = yaml.safe_load_all((REPO / "envoy" / "gateway" / "kvgate.yaml").read_text())
    replicas = [d["spec"]["replicas"] for d in shipped if d and d.get("kind") == "Deployment"]
    assert replicas == [bench.DEFAULT_GATEWAYS]  # the benchmark's default is what the manifests deploy
    by_name = {p.name: p for p in bench.policies()}
    assert all(p.gateways == bench.DEFAULT_GATEWAYS for n, p in by_name.items() if "gw" not in n and n != ORACLE)
    for n in bench.OTHER_GATEWAYS:
        assert by_name[f"prefix-cache@{n}gw"].gateways == by_name[f"kv-sync@{n}gw"].gateways == n
    one = {p.name: p for p in bench.policies(1)}
    assert one["kv-sync"].gateways == 1 and "kv-sync@1gw" not in one and "kv-sync@4gw" in one
    assert len({p.name for p in bench.policies()}) == len(bench.policies())


def test_comparisons_at_other_replica_counts_are_reported_beside_the_targets():
    pol = {name: {"ttft_p90_s": v, "hit_rate": 0.9} for name, v in
           (("prefix-cache@1gw", 0.02), ("kv-sync@1gw", 0.02), ("prefix-cache@4gw", 1.0), ("kv-sync@4gw", 0.02))}
    report = {"workloads": {"W1": {"policies": pol, "ttft_p90_floor_s": 0.02}}}
    c = bench.comparisons(report)
    assert c == {"W1: TTFT p90 prefix-cache@1gw / kv-sync@1gw": {"value": 1.0, "attainable": 1.0},
                 "W1: TTFT p90 prefix-cache@4gw / kv-sync@4gw": {"value": 50.0, "attainable": 50.0}}
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    assert p.parse_args([]).gateways == bench.DEFAULT_GATEWAYS
    assert bench.main(p.parse_args(["--gateways", "0"])) == 2


def test_engine_metric_scorers_read_the_simulated_engines(tiny):
    from bench.routing_sim import _EngineLoads
    from sim.engine import EngineModel
    engine = EngineModel(EngineConfig(num_blocks=64, max_num_seqs=1))
    engine.add_request("a", list(range(40)), 4, now=0.0)
    engine.add_request("b", list(range(50, 90)), 4, now=0.0)  # waits: one sequence at a time
    loads = _EngineLoads({"p": engine})
    load = loads.get("p")
    assert (load.running, load.waiting) == (1.0, 1.0) and 0 < load.kv_usage <= 1
    assert loads.get("other") is None and not loads.unreachable("p")
    cfg = StrategyConfig(weights={"kv-sync": {"queue": 1.0, "kv-util": 1.0}})
    first = run(tiny, Policy("kv-sync", "kv-sync"), seed=3, strategy_config=cfg)
    assert first.requests == len(tiny.requests)
    assert first == run(tiny, Policy("kv-sync", "kv-sync"), seed=3, strategy_config=cfg)
