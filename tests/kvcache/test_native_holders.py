"""Holders, the background passes and eviction (kvcache/csrc/holders.c): more than 64 pod-ranks
(holder bitmasks of several words) match exactly, recency survives the uint32 clock wrapping, the
maintenance pass clamps ages so old keys stay oldest, and eviction spreads its deletions over the table
when many keys are equally old."""
from __future__ import annotations

import random

from kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvcache.index import PrefixIndex


def test_more_than_64_pod_ranks_match_exactly():
    bs = 2
    tokens = tuple(range(20))  # 10 blocks
    ix = PrefixIndex()
    pods = [f"p{i}" for i in range(70)]
    for i, pod in enumerate(pods):  # pod i holds the first i % 10 + 1 blocks; p66.. also on CPU
        n = i % 10 + 1
        hashes = tuple(range(1000, 1000 + n))
        ix.apply(pod, "m", 0, [BlockStored(hashes, None, tokens[:n * bs], bs, None, "GPU")])
        if i >= 66:
            ix.apply(pod, "m", 0, [BlockStored(hashes, None, tokens[:n * bs], bs, None, "CPU")])
    assert ix.stats()["entries"] == sum(i % 10 + 1 for i in range(70)) + sum(i % 10 + 1 for i in range(66, 70))
    got = ix.match("m", None, list(tokens), pods)
    assert {p: r.blocks for p, r in got.items()} == {p: i % 10 + 1 for i, p in enumerate(pods)}
    assert got["p67"].by_medium == {"GPU": 8, "CPU": 8} and got["p3"].by_medium == {"GPU": 4}
    ix.apply("p68", "m", 0, [BlockRemoved((1002,), "GPU"), BlockRemoved((1004,), "CPU")])
    ix.apply("p65", "m", 0, [BlockRemoved((1001,), "GPU")])
    got = ix.match("m", None, list(tokens), ["p68", "p65", "p64", "p1"])
    assert got["p68"].blocks == 9 and got["p68"].by_medium == {"GPU": 2, "CPU": 4}
    assert (got["p65"].blocks, got["p64"].blocks, got["p1"].blocks) == (1, 5, 2)
    ix.apply("p69", "m", 0, [AllBlocksCleared()])
    ix.remove_pod("p66")
    got = ix.match("m", None, list(tokens), ["p69", "p66", "p67"])
    assert [r.blocks for r in got.values()] == [0, 0, 8]
    assert ix.stats()["entries"] == sum(i % 10 + 1 for i in range(66)) - 1 + 8 * 2 + 9 * 2 - 2


def test_eviction_keeps_recently_matched_keys_across_the_clock_wrapping():
    ix = PrefixIndex(max_entries=55)
    ix._core.tick = 2**32 - 6  # the uint32 clock wraps within the test: stamps compare by age
    prompts = [tuple(range(1000 * i, 1000 * i + 40)) for i in range(6)]  # 10 blocks of 4 each
    for i, toks in enumerate(prompts[:5]):
        ix.apply("a", "m", 0, [BlockStored(tuple(range(100 * i, 100 * i + 10)), None, toks, 4)])
    ix.match("m", None, list(prompts[0]), ["a"])
    ix.apply("a", "m", 0, [BlockStored(tuple(range(500, 510)), None, prompts[5], 4)])
    assert ix.stats()["entries"] <= 55 and ix._core.tick < 1000
    held = [ix.match("m", None, list(p), ["a"])["a"].blocks for p in prompts]
    assert held[0] == 10 and held[5] == 10 and held[1] < 10
    ix.match("m", None, list(prompts[0]), ["a"])
    ix.apply("a", "m", 0, [BlockStored(tuple(range(600, 610)), None, tuple(range(9000, 9040)), 4)])
    assert ix.match("m", None, list(prompts[0]), ["a"])["a"].blocks == 10  # matched since: kept
    assert ix.stats()["entries"] <= 55 and ix.stats()["evicted_entries"] == 70 - ix.stats()["entries"]
    ix._core.check()


def test_maintenance_clamps_ages_so_old_keys_stay_oldest():
    """A key left alone for more than 2**31 ticks would look new again if ages wrapped: the
    background pass clamps them, so it is still evicted first."""
    ix = PrefixIndex(max_entries=20)
    ix.apply("a", "m", 0, [BlockStored(tuple(range(10)), None, tuple(range(40)), 4)])  # old
    for _ in range(7):  # 7 x 2**29 ticks pass, batches keep arriving
        ix._core.tick = (ix._core.tick + 2**29) % 2**32  # every key ages by 2**29
        ix.apply("b", "m", 0, [])
    ix.apply("a", "m", 0, [BlockStored(tuple(range(100, 110)), None, tuple(range(500, 540)), 4)])  # new
    ix._core.tick = (ix._core.tick + 2**29) % 2**32  # the old keys' unclamped age is 2**32 now: 0
    ix.apply("a", "m", 0, [BlockStored(tuple(range(200, 205)), None, tuple(range(900, 920)), 4)])  # over the bound
    held = [ix.match("m", None, list(p), ["a"])["a"].blocks
            for p in (range(40), range(500, 540), range(900, 920))]
    assert held[1:] == [10, 5] and held[0] < 10
    ix._core.check()


def test_eviction_spreads_over_the_table_when_many_keys_are_equally_old():
    """At the bound every store evicts, and the sweep must spread its deletions over the table as the
    stores spread theirs, even when a third of the keys share one age (a 500-block prefill is one
    event, one tick). A sweep that dropped every such key near its cursor crawled while the stores
    filled the rest of the table into one probe run of ~10k keys: every lookup walked it."""
    rng = random.Random(5)
    bound, bs, h = 20_000, 2, 0
    ix = PrefixIndex(max_entries=bound)

    def store(i: int, n: int) -> None:
        nonlocal h
        tokens = tuple(rng.randrange(50_000) for _ in range(n * bs))
        ix.apply(f"p{i % 8}", "m", 0, [BlockStored(tuple(range(h, h + n)), None, tokens, bs)])
        h += n

    for i in range(bound // 500):
        store(i, 500)
    worst = (0.0, 0)
    for i in range(2 * bound // 8):  # the bound twice over, 8 blocks an event
        store(i, 8)
        if i % 100 == 0:
            for cap, live, total, longest in ix._core.probes():
                assert live <= 0.75 * cap
                worst = max(worst[0], total / live), max(worst[1], longest)
    assert ix.stats()["entries"] == bound
    assert worst[0] < 2 and worst[1] < 200, worst  # fresh tables at this load: ~0.8 and ~50
    ix._core.check()
