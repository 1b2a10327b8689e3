"""Engine profiles (routing.learning.profiles) and the slo strategy (routing.scheduling.slo) as units, on the real Router."""
from __future__ import annotations

import asyncio
import json
import random

import pytest

from routing.state.counts import LocalCounts
from routing.pods import Pod
from routing.learning.predictor import OutputPredictor
from routing.learning.profiles import EngineProfiles, GPUProfile
from routing.registry import PodRegistry
from routing.router import Router
from routing.scheduling.scoring import RouteRequest
from routing.scheduling.slo import Capacity, parse_targets
from helpers import Clock, prefill_counts, wait_until_async



def test_prefill_rate_is_learned_from_the_fastest_requests_queueing_cannot_lower_it():
    p = EngineProfiles(prefill_tokens_per_s=1000.0)
    assert p.prefill_rate("a") == 1000.0  # the prior
    p.observe("a", uncached_tokens=4000, ttft=0.5)  # 8000 tok/s
    p.observe("a", uncached_tokens=4000, ttft=2.0)  # queued behind others: slower, ignored by the max
    p.observe("a", uncached_tokens=10, ttft=0.001)  # too few tokens to say anything
    assert p.prefill_rate("a") == pytest.approx(8000 * 0.995, rel=1e-3)


def test_decode_step_is_a_line_in_running_requests():
    p = EngineProfiles()
    for n in range(1, 40):
        p.observe("a", tpot=0.008 + 0.0002 * n, running=n)
    assert p.step_time("a", 10) == pytest.approx(0.010, rel=0.01)
    assert p.step_time("a", 60) == pytest.approx(0.020, rel=0.01)
    assert p.step_time("b", 10) == pytest.approx(0.01 + 0.0005 * 10)  # unknown pod: the priors


PROFILE = {"gpu": "llama-a100", "cost": 1.0, "created": 1.7e9, "tputs": [[1, 1], [1, 1]],
           "indexes": [[128, 1024], [256, 4096]], "e2e": [[1, 1], [1, 1]],
           "ttft": [[0.05, 0.4], [0.06, 0.5]], "tpot": [[0.02, 0.03], [0.025, 0.035]], "slos": {}}


def test_gpu_profile_takes_precedence_for_its_deployments_pods():
    p = EngineProfiles()
    p.observe("llama-a100-5d8f-x2k", tpot=0.001, running=1)
    p.set_gpu_profile("llama", "llama-a100", GPUProfile.from_json(json.dumps(PROFILE)))
    # 4000 input tokens, 1000 output: nearest indexes 4096 and 1024 (log2)
    assert p.step_time("llama-a100-5d8f-x2k", 5, "llama", 4000, 1000) == 0.035
    assert p.prefill_rate("llama-a100-5d8f-x2k", "llama", 4000, 1000) == pytest.approx(4000 / 0.5)
    assert p.step_time("other-pod", 5, "llama", 4000, 1000) != 0.035  # not that deployment's pod


def test_bad_gpu_profile_is_refused_clearly():
    with pytest.raises(ValueError, match="ttft"):
        GPUProfile.from_json(json.dumps({**PROFILE, "ttft": [[0.1]]}))


@pytest.mark.integration
async def test_gpu_profiles_load_from_aibrix_keys_in_redis(redis_server):
    from redis.asyncio import Redis
    client = Redis.from_url(redis_server.url)
    try:
        await client.set("aibrix:profile_llama_llama-a100", json.dumps(PROFILE))
        await client.set("aibrix:profile_llama_broken", "{not json")
        p = EngineProfiles()
        assert await p.load_gpu_profiles(client) == 1
        assert p.gpu_profile("llama", "llama-a100-abc-def") is not None
    finally:
        await client.aclose()


def test_targets_parse_and_refuse_bad_values():
    assert parse_targets("m=500/50, *=2000/100") == {"m": (0.5, 0.05), "*": (2.0, 0.1)}
    for bad in ("m=500", "m=-1/5", "=1/2", "m=a/b"):
        with pytest.raises(ValueError, match="KVGATE_SLO_TARGETS"):
            parse_targets(bad)


def slo_router(pods, clock, targets=None):
    profiles = EngineProfiles(prefill_tokens_per_s=10_000.0, decode_base_s=0.01, decode_per_request_s=0.001)
    cap = Capacity(profiles, OutputPredictor(cold="input", rng=random.Random(0)), targets or {"*": (1.0, 0.05)},
                   clock=clock)
    counts = LocalCounts()
    return Router(PodRegistry(pods), default_strategy="slo", capacity=cap, counts=counts, seed=0), counts


PODS = [Pod("a", "10.0.0.1", 8000, "m"), Pod("b", "10.0.0.2", 8000, "m")]


async def test_slo_avoids_the_pod_with_queued_prefill_for_a_tight_ttft():
    clock = Clock(50.0)
    r, _ = slo_router(PODS, clock)
    first = await r.pick(RouteRequest("m", token_ids=list(range(8000))))  # 0.8 s of prefill queued there
    d = await r.pick(RouteRequest("m", token_ids=list(range(3000)), slo_ttft_s=0.5))
    assert d.pod.name != first.pod.name


async def test_a_long_prompt_leaves_the_fastest_lane_to_tight_requests_when_another_pod_meets_its_targets():
    clock = Clock(50.0)
    r, _ = slo_router(PODS, clock)
    doc = list(range(100_000, 105_000))  # 0.5 s of prefill at 10k tokens/s
    # no tighter target seen yet: the document takes the most headroom (either idle pod)
    await r.pick(RouteRequest("m", token_ids=list(range(200_000, 201_000)), request_id="q", slo_ttft_s=2.0))
    clock.t += 10.0  # that queue has drained
    chat = await r.pick(RouteRequest("m", token_ids=list(range(300)), request_id="c1", slo_ttft_s=0.3))
    # the chat's pod holds 300 queued tokens (30 ms), the other none: the fastest lane
    fast = "b" if chat.pod.name == "a" else "a"
    d = await r.pick(RouteRequest("m", token_ids=doc, request_id="d1", slo_ttft_s=2.0))
    assert d.pod.name == chat.pod.name  # most headroom alone would have taken the empty lane
    c2 = await r.pick(RouteRequest("m", token_ids=list(range(400, 700)), request_id="c2", slo_ttft_s=0.3))
    assert c2.pod.name == fast  # the next chat finds it free
    d2 = await r.pick(RouteRequest("m", token_ids=list(range(300_000, 318_000)), request_id="d2", slo_ttft_s=5.0))
    assert d2.pod.name == chat.pod.name  # 1.8 s more there: 2.33 s, within its 5 s
    # when only the fastest lane meets a document's target (2.83 s on the other), the document takes it
    d3 = await r.pick(RouteRequest("m", token_ids=doc, request_id="d3", slo_ttft_s=2.0))
    assert d3.pod.name == fast


async def test_without_tighter_traffic_a_long_prompt_takes_the_most_headroom():
    clock = Clock(50.0)
    r, _ = slo_router(PODS, clock)
    first = await r.pick(RouteRequest("m", token_ids=list(range(1000)), request_id="a1", slo_ttft_s=2.0))
    d = await r.pick(RouteRequest("m", token_ids=list(range(100_000, 105_000)), request_id="d", slo_ttft_s=2.0))
    assert d.pod.name != first.pod.name  # the emptier lane: no tighter request to keep it for


async def test_slo_meets_tpot_by_batch_size_with_most_headroom_else_least_violation():
    clock = Clock(50.0)
    r, counts = slo_router(PODS, clock)
    counts.add("a", 30)  # step 0.01 + 0.001 x 31 = 41 ms on a; b runs 5: 16 ms
    counts.add("b", 5)
    d = await r.pick(RouteRequest("m", token_ids=[5, 6, 7], slo_tpot_s=0.04))
    assert d.pod.name == "b"
    counts.add("b", 40)  # now neither meets 20 ms; a (31 running) violates less than b (46)
    d = await r.pick(RouteRequest("m", token_ids=[5, 6, 7], slo_tpot_s=0.02))
    assert d.pod.name == "a"


async def test_model_default_targets_apply_without_headers_and_headers_take_precedence():
    clock = Clock(50.0)
    r, counts = slo_router(PODS, clock, targets={"m": (1.0, 0.015), "*": (1.0, 1.0)})
    counts.add("a", 3)  # a: 14 ms per step with this request; b (10 running) 21 ms
    counts.add("b", 10)
    scorer = next(sc for st in r._strategies.values() for sc, _ in st.scorers if sc.name == "slo")
    await r.pick(RouteRequest("m", token_ids=[1]))
    assert scorer.last["a"][1] <= 0.015 < scorer.last["b"][1]
    got = {(await r.pick(RouteRequest("m", token_ids=[1]))).pod.name for _ in range(3)}
    assert got == {"a"}  # the default 15 ms: only a meets it
    cap = scorer.cap
    assert cap.targets_for("m", None, None) == (1.0, 0.015)
    assert cap.targets_for("m", 0.2, 0.05) == (0.2, 0.05)
    assert cap.targets_for("other", None, 0.03) == (1.0, 0.03)


async def test_prefill_queue_is_shared_by_replicas_and_leaves_at_the_first_token():
    clock = Clock(50.0)
    shared = LocalCounts()  # the prefill counts (Redis between replicas in a deployment)
    base = Capacity(EngineProfiles(prefill_tokens_per_s=10_000.0), OutputPredictor(cold="input"), {"*": (0.5, 1.0)},
                    clock=clock, prefill=shared)
    a_view, b_view = base.replica(), base.replica()
    ra = Router(PodRegistry(PODS), default_strategy="slo", capacity=a_view, seed=0)
    rb = Router(PodRegistry(PODS), default_strategy="slo", capacity=b_view, seed=0)
    doc = await ra.pick(RouteRequest("m", token_ids=list(range(8000)), request_id="doc"))
    assert shared.totals()[doc.pod.name] == 8000
    # replica b never routed the document, yet keeps a 300-token prompt off its 0.8 s queue
    chat = await rb.pick(RouteRequest("m", token_ids=list(range(300)), request_id="chat"))
    assert chat.pod.name != doc.pod.name
    clock.t += 0.2  # b reads the queue; 0.2 s later the document's prefill is that far along as far as b knows
    b_view.queued(doc.pod.name, shared.totals(), 10_000.0, clock.t)
    a_view.first_token("doc")  # the document's first token (seen by a, the replica that routed it)
    a_view.first_token("doc")  # idempotent
    assert shared.totals().get(doc.pod.name, 0) == 0
    clock.t += 0.1
    assert b_view.queued(doc.pod.name, shared.totals(), 10_000.0, clock.t) == 0.0


@pytest.mark.integration
async def test_prefill_queue_reaches_the_other_replica_through_redis(redis_server):
    async with prefill_counts(redis_server.url) as counts:
        clock = Clock(50.0)
        profiles = EngineProfiles(prefill_tokens_per_s=10_000.0)
        caps = [Capacity(profiles, OutputPredictor(cold="input"), {"*": (0.5, 1.0)}, clock=clock, prefill=c)
                for c in counts]
        ra, rb = (Router(PodRegistry(PODS), default_strategy="slo", capacity=cap, seed=0) for cap in caps)
        doc = await ra.pick(RouteRequest("m", token_ids=list(range(8000)), request_id="doc"))

        # each pick of b's starts a read of the others' shares in the background, for the next pick
        async def b_saw_the_document() -> bool:
            if counts[1].totals().get(doc.pod.name, 0) == 8000:
                return True
            await rb.pick(RouteRequest("m", token_ids=[1], request_id="probe"))
            caps[1].first_token("probe")
            return False
        await wait_until_async(b_saw_the_document, timeout=5.0, interval=0.01,
                               what="replica b to see the document's queued tokens")
        chat = await rb.pick(RouteRequest("m", token_ids=list(range(300)), request_id="chat"))
        assert chat.pod.name != doc.pod.name  # b keeps its chat off the 0.8 s queue a put there


def test_decision_carries_the_running_count_on_its_target_this_request_included():
    async def go():
        r, counts = slo_router(PODS, Clock(50.0))
        counts.add("a", 3)
        counts.add("b", 30)  # b's decode step misses the 50 ms target: a is picked
        return await r.pick(RouteRequest("m", token_ids=[1, 2, 3]))
    d = asyncio.run(go())
    assert (d.pod.name, d.running) == ("a", 4)


def test_head_of_the_queue_progress_counts_from_when_the_lane_moved():
    clock = Clock(50.0)
    shared = LocalCounts()
    cap = Capacity(EngineProfiles(), OutputPredictor(), clock=clock, prefill=shared)
    cap.queue("a", 5000, "r1")
    cap.queue("a", 3000, "r2")
    assert cap.queued("a", shared.totals(), 10_000.0, clock.t) == 8000  # the lane starts now
    clock.t += 0.2
    assert cap.queued("a", shared.totals(), 10_000.0, clock.t) == pytest.approx(6000)
    cap.first_token("r1")  # r1 prefilled: r2 at the head from now
    assert cap.queued("a", shared.totals(), 10_000.0, clock.t) == 3000
    clock.t += 1.0
    assert cap.queued("a", shared.totals(), 10_000.0, clock.t) == 0.0


VLLM_METRICS = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{model_name="m"}} {running}
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{model_name="m"}} 0
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_bucket{{le="+Inf",model_name="m"}} {n}
vllm:time_per_output_token_seconds_count{{model_name="m"}} {n}
vllm:time_per_output_token_seconds_sum{{model_name="m"}} {s}
"""


def test_decode_step_is_learned_from_vllms_own_inter_token_histogram():
    from routing.state.engine_metrics import parse_engine_metrics
    p = EngineProfiles()
    total_n = total_s = 0.0
    for i, running in enumerate([4, 4, 20, 20, 36, 36] * 3):
        n = 500.0
        total_n += n
        total_s += n * (0.008 + 0.0002 * running)  # this scrape interval's mean: the engine's step at that batch
        load = parse_engine_metrics(VLLM_METRICS.format(running=running, n=total_n, s=total_s), at=float(i))
        assert load.tpot == (pytest.approx(total_s), total_n)
        p.observe_engine("a", load)
    assert p.step_time("a", 20) == pytest.approx(0.012, rel=0.05)
    reset = parse_engine_metrics(VLLM_METRICS.format(running=5, n=10, s=0.1), at=99.0)
    p.observe_engine("a", reset)  # counters went back (a restart): no sample from that interval
    assert p.step_time("a", 20) == pytest.approx(0.012, rel=0.05)


def test_ttft_overhead_is_learned_as_a_line_in_running_from_what_slo_predicted():
    p = EngineProfiles(ttft_overhead_per_request_s=0.0, overhead_prior_weight=0.0)
    assert p.ttft_overhead("a", 4) == 0.0  # the prior
    for i in range(60):
        n = 1 + i % 8
        # slo predicted 30 ms of queue and prefill; the engine took 10 ms + 2 ms per running request more
        p.expect(f"r{i}", "a", 0.030, p.ttft_overhead("a", n))
        p.observe("a", ttft=0.030 + 0.010 + 0.002 * n, running=n, request_id=f"r{i}")
    assert p.ttft_overhead("a", 1) == pytest.approx(0.012, abs=1e-4)
    assert p.ttft_overhead("a", 8) == pytest.approx(0.026, abs=1e-4)
    mean, mean_abs, _ = p.ttft_error("a")
    assert mean > 0  # it under-predicted while learning ...
    for i in range(60, 400):
        n = 1 + i % 8
        p.expect(f"r{i}", "a", 0.030, p.ttft_overhead("a", n))
        p.observe("a", ttft=0.030 + 0.010 + 0.002 * n, running=n, request_id=f"r{i}")
    assert abs(p.ttft_error("a")[0]) < 1e-3  # ... and agrees once learned
    assert p.learned("a")["ttft_overhead_ms"] == {1: 12.0, 8: 26.0}


def test_ttft_overhead_learns_only_from_slo_predictions_served_where_routed():
    p = EngineProfiles(ttft_overhead_per_request_s=0.0, overhead_prior_weight=0.0)
    p.observe("a", ttft=0.5, running=1, request_id="other-strategy")  # no prediction: nothing learned
    p.expect("r1", "a", 0.01, 0.0)
    p.observe("b", ttft=0.5, running=1, request_id="r1")  # served by a fallback pod: nothing learned
    p.expect("r2", "a", 0.01, 0.0)
    p.done_request_count(None, "r2", "m", 0)  # ended without a response
    p.observe("a", ttft=0.5, running=1, request_id="r2")
    assert p.ttft_overhead("a", 1) == 0.0 and p.ttft_error("a") is None
    p.expect("r3", "a", 0.01, 0.0, target="a#1")  # a data-parallel rank: learned under the pod's name
    p.observe("a#1", ttft=0.03, running=1, request_id="r3")
    assert p.ttft_overhead("a", 1) == pytest.approx(0.02)


async def test_slo_adds_the_learned_ttft_overhead_and_tells_the_profiles_what_it_predicted():
    clock = Clock(50.0)
    cap_profiles = EngineProfiles(prefill_tokens_per_s=10_000.0, ttft_overhead_per_request_s=0.0, clock=clock)
    cap = Capacity(cap_profiles, OutputPredictor(cold="input", rng=random.Random(0)), {"*": (1.0, 0.05)}, clock=clock)
    r = Router(PodRegistry(PODS), default_strategy="slo", capacity=cap, counts=LocalCounts(), seed=0)
    for i in range(20):  # pod a: 300 ms more than queue and prefill explain, at any batch
        cap_profiles.expect(f"x{i}", "a", 0.0, 0.0)
        cap_profiles.observe("a", ttft=0.3, running=1 + i % 3, request_id=f"x{i}")
    # 1000 tokens: 0.1 s of prefill anywhere; a's overhead breaks a 0.3 s target, b's prior does not
    d = await r.pick(RouteRequest("m", token_ids=list(range(1000)), slo_ttft_s=0.3, request_id="q"))
    assert d.pod.name == "b"
    pod, target, work, over, uncached = cap_profiles._expected["q"]
    assert (pod, over, uncached) == ("b", 0.0, 1000) and work == pytest.approx(0.1)


async def test_where_no_slo_is_at_risk_slo_picks_as_kv_sync_and_where_one_is_by_headroom():
    """Both pods predicted within half of both targets: slo takes kv-sync's choice (the pod holding the prompt),
    not the one with the most TPOT headroom (the idle pod, which would prefill it all again); a TPOT target the
    holder's batch would break moves the request to the pod that meets it."""
    from kvcache.index import PrefixIndex
    from routing.scheduling.strategies import StrategyConfig
    from tests.routing.test_routing_kv_sync import Engines, family, prompt
    index, clock = PrefixIndex(), Clock(50.0)
    Engines(index).store("a", family(1))  # 640 tokens held on a
    profiles = EngineProfiles(prefill_tokens_per_s=10_000.0, decode_base_s=0.01, decode_per_request_s=0.001)
    cap = Capacity(profiles, OutputPredictor(cold="input", rng=random.Random(0)), {"*": (1.0, 0.1)}, clock=clock)
    counts = LocalCounts()
    registry = PodRegistry(PODS)
    slo = Router(registry, default_strategy="slo", capacity=cap, counts=counts, index=index, seed=0,
                 config=StrategyConfig(clock=clock))
    kv = Router(registry, default_strategy="kv-sync", counts=counts, index=index, seed=0,
                config=StrategyConfig(clock=clock))
    counts.add("a", 6)  # a: 17 ms a step with this request, b 11 ms: b has the most TPOT headroom
    tokens = prompt(family(1), 1)
    assert (await kv.pick(RouteRequest("m", token_ids=tokens))).pod.name == "a"
    d = await slo.pick(RouteRequest("m", token_ids=tokens))
    assert d.pod.name == "a"
    scorer = next(sc for st in slo._strategies.values() for sc, _ in st.scorers if sc.name == "slo")
    assert scorer.last["b"][1] < scorer.last["a"][1] <= 0.05  # both safe: kv-sync's scorers decided
    d = await slo.pick(RouteRequest("m", token_ids=tokens, slo_tpot_s=0.015))  # a's 18 ms now breaks it
    assert d.pod.name == "b"
