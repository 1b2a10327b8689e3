"""The one cost model (routing.scheduling.cost) and what it learns (routing.learning.profiles): decay,
re-exploration, and kv-sync on the model (its `ttft` scorer alone) packing while load costs nothing and spreading
once it does, on the real Router."""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from routing.learning.predictor import OutputPredictor
from routing.learning.profiles import EngineProfiles
from routing.pods import Pod
from routing.registry import PodRegistry
from routing.router import Router
from routing.scheduling.cost import TTFTEstimate, TTFTScorer
from routing.scheduling.scoring import RouteRequest
from routing.scheduling.slo import Capacity
from routing.scheduling.strategies import StrategyConfig
from helpers import Clock

PROMPT = list(range(1000))  # 62 blocks of 16 and 8 tokens


def teach_overhead(p: EngineProfiles, pod: str, seconds: float, running: int, n: int, start: int = 0) -> None:
    """`n` responses on `pod` whose TTFT was `seconds` more than the queue and prefill predicted."""
    for i in range(start, start + n):
        p.expect(f"{pod}{i}", pod, 0.02, p.ttft_overhead(pod, running))
        p.observe(pod, ttft=0.02 + seconds, running=running, request_id=f"{pod}{i}")


def test_recent_observations_weigh_more():
    p = EngineProfiles(ttft_overhead_per_request_s=0.0, decay=0.9, overhead_prior_weight=0.0, clock=Clock(0.0))
    teach_overhead(p, "a", 0.300, running=4, n=20)
    assert p.ttft_overhead("a", 4) == pytest.approx(0.300)
    teach_overhead(p, "a", 0.010, running=4, n=40, start=20)  # the engine got faster: the old samples fade
    assert p.ttft_overhead("a", 4) == pytest.approx(0.010, abs=0.005)


def test_a_bad_early_overhead_drifts_back_to_the_prior_while_nothing_reobserves_it():
    """A bad start (1,744 ms at 8 running, as the demo's slo once learned) sends traffic away from the pod, so
    nothing would correct it; unobserved, it drifts back to the prior by half every explore_s."""
    clock = Clock(100.0)
    p = EngineProfiles(ttft_overhead_s=0.005, ttft_overhead_per_request_s=0.0, explore_s=30.0,
                       overhead_prior_weight=0.0, clock=clock)
    teach_overhead(p, "a", 1.744, running=8, n=3)
    assert p.ttft_overhead("a", 8) == pytest.approx(1.744)
    clock.t += 30.0
    assert p.ttft_overhead("a", 8) == pytest.approx(0.005 + (1.744 - 0.005) / 2)
    clock.t += 300.0
    assert p.ttft_overhead("a", 8) == pytest.approx(0.005, abs=0.002)
    # tried again, it learns what it sees now, from the drifted estimate
    teach_overhead(p, "a", 0.005, running=8, n=1, start=10)
    assert p.ttft_overhead("a", 8) < 0.9


def test_a_slow_rate_heals_the_same_way_and_a_fresh_one_does_not_drift():
    clock = Clock(0.0)
    p = EngineProfiles(prefill_tokens_per_s=10_000.0, explore_s=10.0, clock=clock)
    p.observe("a", uncached_tokens=1000, ttft=1.0)  # 1,000 tokens/s: one slow response (a bad start)
    assert p.prefill_rate("a") == pytest.approx(1000.0)
    clock.t += 10.0
    assert p.prefill_rate("a") == pytest.approx(5500.0)
    clock.t += 200.0
    assert p.prefill_rate("a") == pytest.approx(10_000.0, rel=1e-3)
    p.observe("b", uncached_tokens=4000, ttft=0.5)  # observed now: the learned rate as it is
    assert p.prefill_rate("b") == 8000.0


@dataclass
class Served:
    """What the tracker hands the profiles for a completed request (plugin.observe.Observation's fields)."""

    pod: str
    uncached_tokens: int
    ttft: float
    tpot: float | None = None
    running_at_start: int = 1


def test_the_prefill_rate_learns_only_from_uncached_counts_the_cost_model_read():
    """`./dev demo`: every strategy's responses taught the rate, each with the uncached count its Decision
    carried: random's the whole prompt (it looks up nothing), prefix-cache's its own guess. Those prompts
    were mostly cached at the engine, so their tokens / TTFT reached 45,000 tokens/s; the decaying maximum
    kept it, the learned rates ended at 19,000-41,000 against the engines' 10,000 (slo's own responses never
    above 9,537), and slo under-predicted every prefill by half."""
    p = EngineProfiles(prefill_tokens_per_s=10_000.0, clock=Clock(0.0))
    # another strategy's request: its 1000-token prompt counted uncached, 900 tokens were cached: 15 ms
    p.done_request_trace(Served("a", 1000, 0.015), "other", "m", 1000, 10, 0)
    assert p.prefill_rate("a") == 10_000.0
    # slo's: the index said 800 of its 1000 tokens uncached there; 800 tokens took 95 ms
    p.expect("r1", "a", 0.08, 0.0, uncached=800)
    p.done_request_trace(Served("a", 1000, 0.095), "r1", "m", 1000, 10, 0)
    assert p.prefill_rate("a") == pytest.approx(800 / 0.095)
    # a caller that knows its count (the pd handoff's prefill leg) teaches it directly
    p.observe("b", uncached_tokens=1000, ttft=0.125)
    assert p.prefill_rate("b") == pytest.approx(8000.0)


def test_one_cold_first_response_does_not_make_the_overhead_estimate():
    """`./dev demo`: kvgate0's first slo response from sim0 came 119 ms after its predicted prefill (a cold
    start; the pod's later ones 9-20 ms). Learned from that one sample, sim0's overhead was 119 ms, every
    other pod's ~25, and slo sent sim0 4 requests in the next 9.5 s. The prior counts as a few samples, so one
    sample moves the estimate only part of the way, and the truth takes over within a few more."""
    p = EngineProfiles(ttft_overhead_s=0.005, ttft_overhead_per_request_s=0.001, clock=Clock(0.0))
    teach_overhead(p, "a", 0.119, running=1, n=1)
    assert p.ttft_overhead("a", 1) < 0.040
    teach_overhead(p, "a", 0.015, running=1, n=10, start=1)
    assert p.ttft_overhead("a", 1) == pytest.approx(0.015, abs=0.006)
    assert p.learned("a")["ttft_samples"] == pytest.approx(11, abs=0.5)  # the prior's weight is no sample


def test_a_true_overhead_is_still_learned_and_the_prior_weighs_nothing_once_it_is():
    p = EngineProfiles(ttft_overhead_s=0.005, ttft_overhead_per_request_s=0.001, clock=Clock(0.0))
    teach_overhead(p, "a", 0.300, running=4, n=5)
    assert p.ttft_overhead("a", 4) > 0.150  # most of the way after 5 samples
    teach_overhead(p, "a", 0.300, running=4, n=35, start=5)
    assert p.ttft_overhead("a", 4) == pytest.approx(0.300, rel=0.1)
    teach_overhead(p, "a", 0.300, running=4, n=400, start=40)
    assert p.ttft_overhead("a", 4) == pytest.approx(0.300, rel=0.01)


def test_the_overhead_is_not_extrapolated_past_the_largest_batch_observed():
    p = EngineProfiles(ttft_overhead_per_request_s=0.0, overhead_prior_weight=0.0, clock=Clock(0.0))
    teach_overhead(p, "a", 0.010, running=1, n=1)
    teach_overhead(p, "a", 0.050, running=2, n=1, start=1)  # two samples: a slope of 40 ms per request
    assert p.ttft_overhead("a", 2) == pytest.approx(0.050, rel=0.05)
    assert p.ttft_overhead("a", 8) == pytest.approx(p.ttft_overhead("a", 2))  # not 0.29 s


def test_without_observations_the_prior_counts_each_running_request():
    p = EngineProfiles(ttft_overhead_s=0.002, ttft_overhead_per_request_s=0.001)
    assert p.ttft_overhead("a", 1) == pytest.approx(0.003)
    assert p.ttft_overhead("a", 9) == pytest.approx(0.011)
    est = TTFTEstimate(rate=10_000.0, queued=500.0, uncached=1500.0, overhead=0.004)
    assert (est.work_s, est.ttft_s) == (pytest.approx(0.2), pytest.approx(0.204))


@dataclass
class Match:
    blocks: int
    by_medium: dict
    total_blocks: int = 62


class HeldBy:
    """An index in which `pod` holds every block of PROMPT but the last."""

    def __init__(self, pod: str) -> None:
        self.pod = pod

    def match(self, model, lora, token_ids, pods):
        return {p: Match(62 if p == self.pod else 0, {"GPU": 62} if p == self.pod else {}) for p in pods}

    def block_size(self, model):
        return 16


# kv-sync on the model alone (KVGATE_ROUTING_WEIGHTS="kv-sync:ttft=3,prefix=0,load=0")
ON_THE_MODEL = {"kv-sync": {"ttft": 3.0, "prefix": 0.0, "load": 0.0}}


def kv_sync(clock: Clock, profiles: EngineProfiles) -> Router:
    cap = Capacity(profiles, OutputPredictor(rng=random.Random(0)), clock=clock)
    reg = PodRegistry([Pod(n, f"10.0.0.{i + 1}", 8000, "m") for i, n in enumerate("ab")])
    return Router(reg, default_strategy="kv-sync", index=HeldBy("a"), capacity=cap, seed=0,
                  config=StrategyConfig(clock=clock, weights=ON_THE_MODEL))


async def test_kv_sync_packs_while_load_costs_nothing_and_spreads_once_it_does():
    clock = Clock(0.0)
    profiles = EngineProfiles(prefill_tokens_per_s=10_000.0, clock=clock)
    r = kv_sync(clock, profiles)
    for pod in "ab":  # both engines observed: 5 ms of overhead whatever their batch (up to 12 running)
        for running in (1, 12):
            teach_overhead(profiles, pod, 0.005, running=running, n=5, start=running * 10)
    r._counts.add("a", 8)  # a runs 8 more requests than b, and its prefill lane is free
    d = await r.pick(RouteRequest("m", PROMPT, request_id="q1"))
    assert d.pod.name == "a"  # packed: b would prefill the whole prompt, 0.1 s, a only its last 8 tokens
    # a's lane fills: this gateway sent it 3,000 uncached tokens the engine has not prefilled yet
    ttft = next(sc for sc, _ in r._strategies["kv-sync"].scorers if isinstance(sc, TTFTScorer))
    ttft.backlog.add("a", 3000)
    d = await r.pick(RouteRequest("m", PROMPT, request_id="q2"))
    assert d.pod.name == "b"  # 0.3 s of queue on a against 0.1 s of prefill on b (and 0.1 s for the copy)
    clock.t += 1.0  # a's lane drains
    # the batch on a costs time now: its responses came 400 ms late at 9 running
    teach_overhead(profiles, "a", 0.400, running=9, n=30, start=100)
    d = await r.pick(RouteRequest("m", PROMPT, request_id="q3"))
    assert d.pod.name == "b"


async def test_kv_sync_tells_the_profiles_what_it_predicted_so_responses_teach_the_overhead():
    clock = Clock(0.0)
    profiles = EngineProfiles(prefill_tokens_per_s=10_000.0, ttft_overhead_per_request_s=0.0,
                              overhead_prior_weight=0.0, clock=clock)
    r = kv_sync(clock, profiles)
    d = await r.pick(RouteRequest("m", PROMPT, request_id="q"))
    assert d.pod.name == "a"
    profiles.observe("a", ttft=0.0508, running=1, request_id="q")  # 8 tokens predicted: 0.8 ms; 50 ms more seen
    assert profiles.ttft_overhead("a", 1) == pytest.approx(0.050)


def test_the_scrape_shows_what_the_cost_model_expects_of_each_known_pod_and_how_far_it_was_off():
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from routing.metrics import CostModelCollector
    clock = Clock(0.0)
    profiles = EngineProfiles(prefill_tokens_per_s=10_000.0, ttft_overhead_s=0.0, ttft_overhead_per_request_s=0.001,
                              overhead_prior_weight=0.0, clock=clock)
    pods = ["a", "b"]
    registry = CollectorRegistry()
    CostModelCollector(profiles, lambda: pods, registry)

    def scrape() -> dict[tuple, float]:
        return {(s.name, *sorted(s.labels.items())): s.value
                for f in text_string_to_metric_families(generate_latest(registry).decode()) for s in f.samples}

    before = scrape()  # nothing observed: every known pod at the priors, no error yet
    assert before[("kvgate_cost_model_prefill_tokens_per_second", ("pod", "a"))] == 10_000.0
    assert before[("kvgate_cost_model_ttft_overhead_seconds", ("pod", "b"), ("running", "8"))] == pytest.approx(0.008)
    assert before[("kvgate_cost_model_decode_step_seconds", ("pod", "a"), ("running", "1"))] == \
        pytest.approx(profiles.step_time("a", 1))
    assert not any(k[0] == "kvgate_cost_model_ttft_error_seconds" for k in before)
    # a's responses came 300 ms later than the prior predicted, at 4 running
    teach_overhead(profiles, "a", 0.300, running=4, n=20)
    after = scrape()
    overhead = ("kvgate_cost_model_ttft_overhead_seconds", ("pod", "a"), ("running", "1"))
    assert after[overhead] == pytest.approx(profiles.ttft_overhead("a", 1))
    assert after[overhead] > before[overhead] + 0.2
    error = profiles.ttft_error("a")
    assert error is not None and error[0] > 0.0  # late: observed minus predicted
    assert after[("kvgate_cost_model_ttft_error_seconds", ("pod", "a"), ("stat", "mean"))] == pytest.approx(error[0])
    assert after[("kvgate_cost_model_ttft_error_seconds", ("pod", "a"), ("stat", "mean_abs"))] == pytest.approx(error[1])
    assert not any(k[0] == "kvgate_cost_model_ttft_error_seconds" and ("pod", "b") in k for k in after)
    pods.remove("a")  # a pod gone from discovery leaves the scrape, whatever was learned of it
    assert {dict(k[1:])["pod"] for k in scrape()} == {"b"}


def test_mean_output_is_the_windows_mean_bucket():
    pred = OutputPredictor(rng=random.Random(0), clock=Clock(0.0))
    assert pred.mean_output("m") is None
    pred.add("m", 1000, 100)  # bucket 2**7
    pred.add("m", 1000, 400)  # bucket 2**9
    assert pred.mean_output("m") == pytest.approx((128 + 512) / 2)
    assert pred.mean_output("other") is None


def test_admission_wait_is_zero_until_requests_wait_then_one_finish_each():
    import time
    from routing.scheduling.scoring import PickContext
    from routing.scheduling.scorers import AdmissionWait
    from routing.state.engine_metrics import EngineLoad, EngineMetrics
    reg = PodRegistry([Pod(n, f"10.0.0.{i + 1}", 8000, "m") for i, n in enumerate("ab")])
    engines = EngineMetrics(reg, interval_s=60)
    now = time.monotonic()
    engines.put("a", EngineLoad(waiting=0, running=60, kv_usage=0.5, at=now))
    engines.put("b", EngineLoad(waiting=2, running=8, kv_usage=0.9, at=now))
    wait = AdmissionWait(engines, lambda pod, running: 0.01, lambda model: 100.0)
    ctx = PickContext(request=RouteRequest("m"), base_model="m", lora=None, running={})
    a, b = reg.pods()
    assert wait(ctx, a) == 0.0  # 60 running, nothing waiting: a batch slot is free
    # 2 waiting and this one: the 3rd of 8 running requests, spread over their 1 s outputs, finishes after 3/9 s
    assert wait(ctx, b) == pytest.approx(3 * 0.01 * 100 / 9)
    assert AdmissionWait(engines, lambda pod, running: 0.01, lambda model: None)(ctx, b) == pytest.approx(
        3 * 0.01 * 128 / 9)  # no output history yet: the default output length
    # an engine waiting for KV blocks behind one long running request: the one waiting and this one, two
    # finishes, the first half an output away (2 / 2 outputs; the old running-only estimate said 2)
    engines.put("b", EngineLoad(waiting=1, running=1, kv_usage=0.95, at=now))
    assert wait(ctx, b) == pytest.approx(2 * 0.01 * 100 / 2)


def test_prefix_scorer_counts_a_holders_wait_beyond_the_prefill_of_what_it_holds():
    """Leaving the pod that holds 992 of the prompt's 1000 tokens costs their prefill again elsewhere (and
    the eviction of as much there): its wait to be admitted counts only beyond that; a pod holding nothing
    pays its whole wait."""
    import time
    from routing.scheduling.scoring import PickContext
    from routing.scheduling.scorers import AdmissionWait, PrecisePrefixScorer, PrefillBacklog
    from routing.state.engine_metrics import EngineLoad, EngineMetrics
    reg = PodRegistry([Pod(n, f"10.0.0.{i + 1}", 8000, "m") for i, n in enumerate("abc")])
    engines = EngineMetrics(reg, interval_s=60)
    wait = AdmissionWait(engines, lambda pod, running: 0.01, lambda model: 10.0)  # an output: 0.1 s
    scorer = PrecisePrefixScorer(HeldBy("a"), backlog=PrefillBacklog(10_000, clock=Clock(0.0)), admission=wait,
                                 tokens_per_s=10_000)
    a, b, c = reg.pods()

    def scores(waiting_a: int, waiting_c: int = 0) -> dict[str, float]:
        now = time.monotonic()
        engines.put("a", EngineLoad(waiting=waiting_a, running=1, kv_usage=0.95, at=now))
        engines.put("b", EngineLoad(waiting=0, running=1, kv_usage=0.5, at=now))
        engines.put("c", EngineLoad(waiting=waiting_c, running=1, kv_usage=0.5, at=now))
        ctx = PickContext(request=RouteRequest("m", PROMPT), base_model="m", lora=None, running={})
        return scorer.score(ctx, [a, b, c])

    # 4 waiting on a: 5 finishes x 0.01 s x 10 / 2 = 0.25 s, 2,500 tokens' prefill at 10k tokens/s; a:
    # 2 x 8 + (2,500 - 992) = 1,524 < b: 2 x 1,000 (counted in full, 2 x 8 + 2,500 would have sent it to b)
    s = scores(waiting_a=4)
    assert s["a"] == 1.0 and s["b"] < 1.0, s
    s = scores(waiting_a=6)  # 3,500 tokens: a: 16 + 2,508 = 2,524 > 2,000
    assert s["b"] == 1.0 and s["a"] < 1.0, s
    s = scores(waiting_a=0, waiting_c=4)  # c holds nothing: its whole wait counts (2,000 + 2,500 against b's 2,000)
    assert s["a"] == 1.0 and s["b"] - s["c"] == pytest.approx(2_500 / 4_484), s


async def test_kv_sync_prices_a_full_batch_against_the_prompts_prefill():
    """The default kv-sync (`prefix` scorer) with engine metrics and profiles: the pod holding the prompt keeps
    it while its engine has a free slot, whatever it runs; once requests wait there for a slot longer than
    the prompt's prefill elsewhere takes, the request goes elsewhere."""
    import time
    from routing.state.engine_metrics import EngineLoad, EngineMetrics
    clock = Clock(0.0)
    reg = PodRegistry([Pod(n, f"10.0.0.{i + 1}", 8000, "m") for i, n in enumerate("ab")])
    engines = EngineMetrics(reg, interval_s=60)
    cap = Capacity(EngineProfiles(prefill_tokens_per_s=10_000.0, clock=clock),
                   OutputPredictor(rng=random.Random(0), clock=clock), clock=clock)
    for _ in range(5):
        cap.predictor.add("m", 1000, 100)
    r = Router(reg, default_strategy="kv-sync", index=HeldBy("a"), engines=engines, capacity=cap, seed=0,
               config=StrategyConfig(clock=clock))
    engines.put("a", EngineLoad(waiting=0, running=12, kv_usage=0.5, at=time.monotonic()))
    engines.put("b", EngineLoad(waiting=0, running=0, kv_usage=0.1, at=time.monotonic()))
    assert (await r.pick(RouteRequest("m", PROMPT, request_id="q1"))).pod.name == "a"
    # a full batch with 10 waiting: 11 finishes x 42 ms (the prior step at 64) x 128 / 65 = 0.9 s, 0.8 s beyond
    # the prefill of the 992 tokens a holds, against 0.1 s of prefill on b
    engines.put("a", EngineLoad(waiting=10, running=64, kv_usage=0.99, at=time.monotonic()))
    assert (await r.pick(RouteRequest("m", PROMPT, request_id="q2"))).pod.name == "b"
