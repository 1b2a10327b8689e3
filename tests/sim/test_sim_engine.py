"""The simulated engine's model: prefix reuse, LRU eviction, events, timing, reset (virtual clock)."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from sim.engine import Completion, EngineConfig, EngineModel

BS = 4


def config(**kw) -> EngineConfig:
    base = dict(block_size=BS, num_blocks=64, max_num_seqs=8, ttft_overhead_s=0.010, prefill_s_per_token=0.001,
                tpot_base_s=0.010, tpot_per_seq_s=0.002)
    base.update(kw)
    return EngineConfig(**base)


def run_idle(engine: EngineModel) -> list[Completion]:
    done = []
    while (t := engine.next_event_time()) is not None:
        done += engine.advance(t)
    return done


def events(engine: EngineModel) -> list:
    return [e for batch in engine.drain_events() for e in batch.events]


def test_prefix_reuse_counts_full_leading_blocks() -> None:
    e = EngineModel(config())
    shared = list(range(100, 132))  # 8 blocks
    e.add_request("a", shared + [1, 2, 3], 4, now=0.0)
    (a,) = run_idle(e)
    assert a.cached_tokens == 0
    e.add_request("b", shared + [7, 8, 9, 10, 11], 4, now=1.0)
    (b,) = run_idle(e)
    assert b.cached_tokens == 32
    m = e.metrics()
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (35 + 37, 32)
    # A prompt differing in its first token shares nothing.
    e.add_request("c", [0] + shared[1:], 4, now=2.0)
    (c,) = run_idle(e)
    assert c.cached_tokens == 0


def test_prefix_hits_answers_for_several_engines_as_prefix_hit_does_each() -> None:
    shared = list(range(100, 132))  # 8 blocks
    a, b, c = EngineModel(config()), EngineModel(config()), EngineModel(config())
    other_seed = EngineModel(config(hash_seed="other"))  # hashes its own way: asked apart
    a.add_request("x", shared[:16] + [1], 4, now=0.0)
    b.add_request("y", shared + [2], 4, now=0.0)
    other_seed.add_request("z", shared + [3], 4, now=0.0)
    engines = [a, b, c, other_seed]
    salted = shared[:8] + [7]
    for prompt in (shared + [9], shared[:12], [5], salted):
        assert a.prefix_hits(engines, prompt) == [e.prefix_hit(prompt) for e in engines]
    assert a.prefix_hits(engines, shared + [9]) == [16, 32, 0, 32]
    assert c.prefix_hits(engines, salted, cache_salt="s") == [0, 0, 0, 0]
    assert a.prefix_hits(engines, []) == [0, 0, 0, 0]


def test_a_request_admitted_while_another_prefills_its_prefix_hits_it() -> None:
    # vLLM caches a scheduled request's full prompt blocks when it allocates them, before its forward pass
    # (KVCacheManager.allocate_slots -> cache_blocks); their BlockStored leave after the step that computed them
    e = EngineModel(config())
    shared = list(range(100, 132))  # 8 blocks
    e.add_request("a", shared + [1, 2, 3], 4, now=0.0)
    assert events(e) == []  # a is prefilling (35 ms): its blocks are cached, not announced
    assert e.prefix_hit(shared + [7]) == 32 and e.prefix_hit(shared + [7], announced=True) == 0
    assert len(e.unannounced_block_hashes()) == 8
    e.add_request("b", shared + [7, 8, 9, 10, 11], 4, now=0.001)
    done = {c.req_id: c for c in run_idle(e)}
    assert done["b"].cached_tokens == 32
    assert done["b"].first_token_time == pytest.approx(0.035 + 0.005 + 0.010)  # after a's prefill, its own 5 tokens
    stored = [ev for ev in events(e) if isinstance(ev, BlockStored)]
    assert len(stored[0].block_hashes) == 8 and stored[0].parent_block_hash is None  # a's, first
    assert stored[1].parent_block_hash == stored[0].block_hashes[-1]  # b's own block, chained on a's
    assert not e.unannounced_block_hashes()


def test_blocks_cached_at_admission_are_announced_if_the_request_is_aborted_and_never_if_flushed() -> None:
    e = EngineModel(config())
    shared = list(range(100, 132))
    e.add_request("a", shared + [1], 4, now=0.0)
    assert e.abort("a", now=0.001)
    stored = [ev for ev in events(e) if isinstance(ev, BlockStored)]
    assert sum(len(ev.block_hashes) for ev in stored) == 8 == len(e.cached_block_hashes())  # cached: announced
    e.add_request("b", list(range(500, 532)) + [1], 4, now=1.0)
    b_prompt = e.unannounced_block_hashes()
    assert len(b_prompt) == 8
    assert e.reset_prefix_cache(now=1.001, force=True)
    assert events(e) == [AllBlocksCleared()] and not e.unannounced_block_hashes()
    run_idle(e)  # b's prompt blocks were made private by the reset: never announced, never hit
    assert not any(set(ev.block_hashes) & b_prompt for ev in events(e) if isinstance(ev, BlockStored))
    assert e.prefix_hit(list(range(500, 532)) + [2]) == 0


def test_fully_cached_prompt_still_computes_its_last_token() -> None:
    e = EngineModel(config())
    prompt = list(range(16))  # exactly 4 blocks
    e.add_request("a", prompt, 2, now=0.0)
    run_idle(e)
    e.add_request("b", prompt, 2, now=1.0)
    (b,) = run_idle(e)
    assert b.cached_tokens == 12


def test_output_blocks_are_cached_and_reused_by_the_next_turn() -> None:
    e = EngineModel(config())
    prompt = list(range(10))
    e.add_request("a", prompt, 11, now=0.0)
    (a,) = run_idle(e)
    # KV exists for prompt + output minus the last sampled token: 20 tokens, 5 blocks.
    stored = [ev for ev in events(e) if isinstance(ev, BlockStored)]
    assert sum(len(ev.block_hashes) for ev in stored) == 5
    assert stored[-1].token_ids[-1] == a.output_token_ids[-2]
    e.add_request("b", prompt + list(a.output_token_ids) + [5, 6], 2, now=1.0)
    (b,) = run_idle(e)
    assert b.cached_tokens == 20


def test_same_prompt_same_output_and_deterministic_runs() -> None:
    def run() -> tuple[list[Completion], list]:
        e = EngineModel(config())
        rng = random.Random(7)
        for i in range(20):
            e.add_request(f"r{i}", [rng.randrange(50) for _ in range(rng.randrange(1, 30))], rng.randrange(1, 12),
                          now=i * 0.01)
        return run_idle(e), e.drain_events()

    first, second = run(), run()
    assert first == second
    e = EngineModel(config())
    e.add_request("x", [1, 2, 3], 6, now=0.0)
    e.add_request("y", [1, 2, 3], 6, now=0.0)
    x, y = run_idle(e)
    assert x.output_token_ids == y.output_token_ids
    assert len(x.output_token_ids) == 6
    assert set(x.output_token_ids) <= set(config().output_token_ids)


def test_timing_formula() -> None:
    c = config()
    e = EngineModel(c)
    e.add_request("a", list(range(20)), 5, now=1.0)
    (a,) = run_idle(e)
    assert a.ttft == pytest.approx(c.ttft_overhead_s + 20 * c.prefill_s_per_token)
    assert a.finish_time - a.first_token_time == pytest.approx(4 * (c.tpot_base_s + c.tpot_per_seq_s * 1))
    # The same prompt again: only its last block's tokens are uncached.
    e.add_request("b", list(range(20)), 1, now=2.0)
    (b,) = run_idle(e)
    assert b.cached_tokens == 16
    assert b.ttft == pytest.approx(c.ttft_overhead_s + 4 * c.prefill_s_per_token)
    assert b.finish_time == b.first_token_time


def test_prefills_queue_and_decode_slows_with_the_batch() -> None:
    c = config()
    e = EngineModel(c)
    e.add_request("a", list(range(100, 110)), 9, now=0.0)
    e.add_request("b", list(range(200, 210)), 9, now=0.0)
    a, b = run_idle(e)
    prefill = 10 * c.prefill_s_per_token
    assert a.ttft == pytest.approx(c.ttft_overhead_s + prefill)
    assert b.ttft == pytest.approx(c.ttft_overhead_s + 2 * prefill)  # waited for a's prefill
    solo, duo = c.tpot_base_s + c.tpot_per_seq_s, c.tpot_base_s + 2 * c.tpot_per_seq_s
    # a decodes alone for one step, then b joins at the next step boundary and both run at the batch-2 pace.
    assert a.finish_time - a.first_token_time == pytest.approx(solo + 7 * duo)
    assert b.finish_time == pytest.approx(a.finish_time + solo)


def test_max_num_seqs_and_waiting() -> None:
    e = EngineModel(config(max_num_seqs=2))
    for i in range(5):
        e.add_request(f"r{i}", [i, i + 1, i + 2], 3, now=0.0)
    m = e.metrics()
    assert (m.running, m.waiting) == (2, 3)
    assert m.kv_usage > 0
    done = run_idle(e)
    assert [d.req_id for d in done] == [f"r{i}" for i in range(5)]
    m = e.metrics()
    assert (m.running, m.waiting, m.kv_usage, m.requests_finished) == (0, 0, 0.0, 5)


def test_lru_evicts_oldest_released_tail_first_and_never_referenced_blocks() -> None:
    e = EngineModel(config(num_blocks=8))
    # a: 8 prompt tokens + 1 output -> needs 3 blocks, caches 2.
    e.add_request("a", list(range(0, 8)), 1, now=0.0)
    e.add_request("b", list(range(100, 108)), 1, now=0.0)
    run_idle(e)
    stored = [ev for ev in events(e) if isinstance(ev, BlockStored)]
    a_keys, b_keys = stored[0].block_hashes, stored[1].block_hashes
    assert e.cached_block_hashes() == {*a_keys, *b_keys}
    # A long request holds 4 blocks while running; c then needs 3 of the 4 cached ones.
    e.add_request("long", list(range(300, 312)), 4, now=1.0)
    e.advance(1.03)  # long's prefill done: its 3 prompt blocks are cached and referenced
    long_held = e.cached_block_hashes() - {*a_keys, *b_keys}
    assert len(long_held) == 3
    e.add_request("c", list(range(500, 508)), 2, now=1.03)
    removed = [ev.block_hashes[0] for ev in events(e) if isinstance(ev, BlockRemoved)]
    # Free blocks: 8 - 4 cached - 4 (long) = 0, so c evicts 3: a's tail, a's head, then b's tail.
    assert removed == [a_keys[1], a_keys[0], b_keys[1]]
    assert long_held <= e.cached_block_hashes()
    run_idle(e)


def test_head_of_line_waits_for_blocks() -> None:
    e = EngineModel(config(num_blocks=4))
    e.add_request("big", list(range(8)), 8, now=0.0)  # needs all 4 blocks
    e.add_request("small", [1], 1, now=0.0)
    assert (e.metrics().running, e.metrics().waiting) == (1, 1)
    done = run_idle(e)
    assert [d.req_id for d in done] == ["big", "small"]
    assert done[1].first_token_time > done[0].finish_time - 1e-9


def test_event_stream_equals_cache_contents_under_random_load() -> None:
    c = config(num_blocks=40, max_num_seqs=6)
    rng = random.Random(11)
    e = EngineModel(c)
    prefixes = [[rng.randrange(30) for _ in range(rng.randrange(4, 24))] for _ in range(6)]
    mirror: set = set()
    now = 0.0
    live: dict[str, int] = {}  # req_id -> max_tokens
    finished: list[tuple[Completion, int]] = []
    n_removed = 0
    for i in range(300):
        now += rng.expovariate(60.0)
        for d in e.advance(now):
            finished.append((d, live.pop(d.req_id)))
        if live and rng.random() < 0.05:
            victim = rng.choice(sorted(live))
            del live[victim]
            assert e.abort(victim, now)
        prompt = rng.choice(prefixes) + [rng.randrange(30) for _ in range(rng.randrange(0, 12))]
        live[f"r{i}"] = rng.randrange(1, 20)
        e.add_request(f"r{i}", prompt, live[f"r{i}"], now)
        if i == 150:
            for d in run_idle(e):
                finished.append((d, live.pop(d.req_id)))
            now = e.now
            assert e.reset_prefix_cache()
        for batch in e.drain_events():
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    assert ev.parent_block_hash is None or ev.parent_block_hash in mirror
                    assert len(ev.token_ids) == BS * len(ev.block_hashes)
                    assert ev.medium == "GPU" and ev.block_size == BS
                    assert not mirror & set(ev.block_hashes)
                    mirror.update(ev.block_hashes)
                elif isinstance(ev, BlockRemoved):
                    assert len(ev.block_hashes) == 1 and ev.block_hashes[0] in mirror
                    mirror.discard(ev.block_hashes[0])
                    n_removed += 1
                else:
                    assert isinstance(ev, AllBlocksCleared)
                    mirror.clear()
        unannounced = e.unannounced_block_hashes()
        assert unannounced <= e.cached_block_hashes() and mirror == e.cached_block_hashes() - unannounced
        assert len(mirror) <= 40
    for d in run_idle(e):
        finished.append((d, live.pop(d.req_id)))
    assert not live and n_removed > 20  # every request not aborted finished; the cache was under pressure
    fastest_step = c.tpot_base_s + c.tpot_per_seq_s
    for d, max_tokens in finished:
        assert len(d.output_token_ids) == max_tokens
        assert d.ttft >= c.ttft_overhead_s + c.prefill_s_per_token * (d.prompt_tokens - d.cached_tokens) - 1e-9
        assert d.finish_time - d.first_token_time >= (max_tokens - 1) * fastest_step - 1e-9


def test_reset_refused_while_running_then_clears() -> None:
    e = EngineModel(config())
    e.add_request("a", list(range(12)), 3, now=0.0)
    assert not e.reset_prefix_cache()
    run_idle(e)
    events(e)
    assert e.cached_block_hashes()
    assert e.reset_prefix_cache()
    assert events(e) == [AllBlocksCleared()]
    assert not e.cached_block_hashes()
    e.add_request("b", list(range(12)), 3, now=5.0)
    (b,) = run_idle(e)
    assert b.cached_tokens == 0


def test_lora_blocks_are_separate_entries() -> None:
    e = EngineModel(config(lora_names=("ad1",)))
    prompt = list(range(12))
    e.add_request("base", prompt, 1, now=0.0)
    run_idle(e)
    e.add_request("lora", prompt, 1, now=1.0, lora="ad1")
    (done,) = run_idle(e)
    assert done.cached_tokens == 0
    base_ev, lora_ev = [ev for ev in events(e) if isinstance(ev, BlockStored)]
    assert (base_ev.lora_name, base_ev.lora_id) == (None, None)
    assert (lora_ev.lora_name, lora_ev.lora_id) == ("ad1", 1)
    assert not set(base_ev.block_hashes) & set(lora_ev.block_hashes)


def test_abort_frees_blocks_and_yields_no_completion() -> None:
    e = EngineModel(config())
    e.add_request("a", list(range(12)), 50, now=0.0)
    e.add_request("b", list(range(40, 52)), 5, now=0.0)
    e.advance(0.1)
    assert e.abort("a", 0.1)
    assert not e.abort("a", 0.1)
    done = run_idle(e)
    assert [d.req_id for d in done] == ["b"]
    assert e.metrics().kv_usage == 0.0


def test_output_so_far_grows_until_completion() -> None:
    c = config()
    e = EngineModel(c)
    e.add_request("a", list(range(8)), 10, now=0.0)
    seen = []
    t = 0.0
    while e.is_live("a"):
        t += 0.005
        done = e.advance(t)
        out = e.output_so_far("a", t)
        seen.append(len(out) if out is not None else len(done[0].output_token_ids))
    assert seen == sorted(seen) and seen[0] == 0 and seen[-1] == 10
    assert len(set(seen)) > 5


def test_bytes_block_hashes() -> None:
    e = EngineModel(config(int_block_hashes=False))
    e.add_request("a", list(range(8)), 1, now=0.0)
    run_idle(e)
    (stored,) = [ev for ev in events(e) if isinstance(ev, BlockStored)]
    assert all(isinstance(h, bytes) and len(h) == 32 for h in stored.block_hashes)


@pytest.mark.parametrize("kwargs, match", [
    (dict(token_ids=[]), "at least one token"),
    (dict(token_ids=[-1]), "token ids"),
    (dict(token_ids=[1.5]), "token ids"),
    (dict(token_ids=b"abcd"), "token ids"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(lora="nope"), "LoRA"),
    (dict(token_ids=list(range(300))), "exceeds"),
    (dict(now=-1.0), "backwards"),
    (dict(req_id="dup"), "already live"),
])
def test_bad_requests_are_refused(kwargs: dict, match: str) -> None:
    e = EngineModel(config())
    e.add_request("dup", [1, 2], 5, now=0.0)
    args = dict(req_id="x", token_ids=[1, 2, 3], max_tokens=4, now=0.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        e.add_request(**args)
    assert [d.req_id for d in run_idle(e)] == ["dup"]


def test_bad_config_is_refused() -> None:
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=0)
    with pytest.raises(ValueError, match="prefill_s_per_token"):
        EngineConfig(prefill_s_per_token=-1)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "add", "add", "abort", "reset"]), st.integers(0, 5),
                          st.integers(1, 40), st.integers(1, 12), st.floats(0, 0.05)), max_size=40))
def test_any_operation_sequence_keeps_events_and_capacity_consistent(ops: list) -> None:
    e = EngineModel(config(num_blocks=16, max_num_seqs=3))
    mirror: set = set()
    now = 0.0
    for n, (op, prefix, length, max_tokens, dt) in enumerate(ops):
        now += dt
        e.advance(now)
        if op == "add":
            tokens = [prefix] * 5 + list(range(length))
            if len(tokens) + max_tokens <= 16 * BS:
                e.add_request(f"r{n}", tokens, max_tokens, now)
        elif op == "abort" and n:
            e.abort(f"r{n - 1}", now)
        else:
            e.reset_prefix_cache(now)
        for batch in e.drain_events():
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    assert not mirror & set(ev.block_hashes)
                    mirror.update(ev.block_hashes)
                elif isinstance(ev, BlockRemoved):
                    mirror.remove(ev.block_hashes[0])
                else:
                    mirror.clear()
        m = e.metrics()
        unannounced = e.unannounced_block_hashes()
        assert unannounced <= e.cached_block_hashes() and mirror == e.cached_block_hashes() - unannounced
        assert 0.0 <= m.kv_usage <= 1.0 and m.running <= 3 and m.cached_blocks <= 16
    run_idle(e)
    m = e.metrics()
    assert (m.running, m.waiting, m.kv_usage) == (0, 0, 0.0)
