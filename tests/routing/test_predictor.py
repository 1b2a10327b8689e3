"""Output-length prediction (routing.learning.predictor): log2 buckets, the sliding window, weighted draws,
cold-start rules, and sharing between two replicas through a real redis-server."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from routing.learning.predictor import OutputPredictor, PredictorSync, bucket
from helpers import Clock



def test_buckets_are_rounded_log2_capped_at_1m_tokens():
    p = OutputPredictor()
    assert p.buckets == 21
    assert [bucket(n, 21) for n in (0, 1, 2, 3, 5, 6, 1000, 1 << 20, 10 ** 9)] == [0, 0, 1, 2, 2, 3, 10, 20, 20]


def test_predict_draws_within_the_input_bucket_weighted_by_frequency():
    clock = Clock(1000.0)
    p = OutputPredictor(rng=random.Random(1), clock=clock)
    for _ in range(300):
        p.add("m", 1000, 64)
    for _ in range(100):
        p.add("m", 1000, 512)
    p.add("m", 8, 2)  # another input bucket: never drawn for 1000-token inputs
    draws = Counter(p.predict("m", 1100) for _ in range(4000))
    assert set(draws) == {64, 512}
    assert 0.70 < draws[64] / 4000 < 0.80
    assert p.predict("m", 8) == 2


@pytest.mark.parametrize("rule, expect", [("optimistic", {1}), ("input", {300}), ("pessimistic", {4096})])
def test_cold_start_rules(rule, expect):
    p = OutputPredictor(cold=rule, rng=random.Random(0))
    assert {p.predict("m", 300) for _ in range(20)} == expect


def test_random_cold_start_is_within_max_output_and_varies():
    p = OutputPredictor(cold="random", max_output=100, rng=random.Random(0))
    got = [p.predict("m", 300) for _ in range(200)]
    assert min(got) >= 1 and max(got) <= 100 and len(set(got)) > 20


def test_unknown_cold_rule_is_refused():
    with pytest.raises(ValueError, match="cold-start"):
        OutputPredictor(cold="hopeful")


def test_window_slides_every_step_and_forgets_after_the_window():
    clock = Clock(1000.0)
    p = OutputPredictor(window_s=240, step_s=10, clock=clock)
    p.add("m", 100, 32)
    clock.t += 120
    p.add("m", 100, 1024)
    clock.t += 125  # 245 s after the first: its step left the window, the second's has not
    assert {p.predict("m", 100) for _ in range(50)} == {1024}
    clock.t += 240
    p.advance()
    assert not p.has_history("m", 100) and p.predict("m", 100) == 1  # cold again


@pytest.mark.integration
async def test_two_replicas_share_history_through_redis(redis_server):
    from redis.asyncio import Redis
    clock = Clock(5000.0)
    a = OutputPredictor(clock=clock, rng=random.Random(1))
    b = OutputPredictor(clock=clock, rng=random.Random(2))
    ra, rb = Redis.from_url(redis_server.url), Redis.from_url(redis_server.url)
    try:
        sa, sb = PredictorSync(a, ra), PredictorSync(b, rb)
        for _ in range(30):
            a.add("m", 2000, 256)
        for _ in range(10):
            b.add("m", 2000, 16)
        await sa.sync_once()
        await sb.sync_once()
        await sa.sync_once()
        for p in (a, b):
            draws = Counter(p.predict("m", 2000) for _ in range(2000))
            assert set(draws) == {256, 16}
            assert 0.68 < draws[256] / 2000 < 0.82  # 30 of 40, whichever replica saw them
        await sa.sync_once()  # syncing again does not count anything twice
        assert a._models["m"].by_input[11] == 40
        clock.t += 300  # the window has passed: both forget
        await sa.sync_once()
        assert not a.has_history("m", 2000)
    finally:
        await ra.aclose()
        await rb.aclose()
