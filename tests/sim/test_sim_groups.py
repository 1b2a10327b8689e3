"""The simulated engine's KV cache groups, sparse retention, salts, media and LoRA extra keys, against
vLLM 0.33's rules (/work/notes/vllm-facts-25.md), and sim.cache_rules against a brute-force model."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.blockkeys import MediaItem
from kvcache.events import BlockRemoved, BlockStored
from sim.cache_rules import FULL, MAMBA, SLIDING, GroupSpec, longest_hit, scheduler_block_size, window_blocks
from sim.engine import Completion, EngineConfig, EngineModel

GPT_OSS = (GroupSpec(SLIDING, 16, 128), GroupSpec(FULL, 16))


def engine(**kw) -> EngineModel:
    base = dict(block_size=16, num_blocks=2048, max_num_seqs=8, ttft_overhead_s=0.010, prefill_s_per_token=0.0001,
                tpot_base_s=0.010, tpot_per_seq_s=0.001, groups=GPT_OSS)
    base.update(kw)
    return EngineModel(EngineConfig(**base))


def run_idle(e: EngineModel) -> list[Completion]:
    done = []
    while (t := e.next_event_time()) is not None:
        done += e.advance(t)
    return done


def stores(e: EngineModel) -> list[BlockStored]:
    return [ev for b in e.drain_events() for ev in b.events if isinstance(ev, BlockStored)]


def prompt(n: int, base: int = 1000) -> list[int]:
    return [base + i for i in range(n)]


# ---- vLLM's worked example: window 128, block 16, sparse retention ------------------------------------


def test_gpt_oss_like_worked_example() -> None:
    e = engine()
    a = prompt(840)
    e.add_request("a", a, 1, now=0.0)
    (done,) = run_idle(e)
    assert done.cached_tokens == 0
    g0, g1 = stores(e)
    # Sliding window: only the 8 blocks before the replay boundary (839 -> 832), token ids over all 52.
    assert (g0.group_idx, g0.kv_cache_spec_kind, g0.kv_cache_spec_sliding_window) == (0, SLIDING, 128)
    assert len(g0.block_hashes) == 8 and len(g0.token_ids) == 832 and g0.parent_block_hash is None
    assert (g1.group_idx, g1.kv_cache_spec_kind, g1.kv_cache_spec_sliding_window) == (1, FULL, None)
    assert len(g1.block_hashes) == 52 and tuple(g1.token_ids) == tuple(a[:832])
    assert g0.block_hashes == g1.block_hashes[44:]  # one hash chain for every group
    assert g1.extra_keys == (None,) * 52
    chain = g1.block_hashes

    b = a[:800] + prompt(40, base=5000)  # shares 50 blocks: group 0 holds 44..49 but needs 42..49
    e.add_request("b", b, 1, now=1.0)
    (done,) = run_idle(e)
    assert done.cached_tokens == 0
    g0, g1 = stores(e)
    assert len(g0.block_hashes) == 4 and len(g0.token_ids) == 832  # 42, 43 (junction), 50, 51 (replay)
    assert g0.block_hashes[:2] == chain[42:44]
    assert len(g1.block_hashes) == 2  # blocks 0..49 are shared with a's, only 50 and 51 are new
    m = e.metrics()
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (1680, 0)

    e.add_request("c", a[:800] + prompt(40, base=9000), 1, now=2.0)  # a third request sharing the prefix hits
    (done,) = run_idle(e)
    assert done.cached_tokens == 800
    assert e.metrics().prefix_cache_hits == 800


def test_decode_blocks_of_a_sparse_group_publish_no_hash_and_the_next_turn_hits_the_replay_boundary() -> None:
    e = engine()
    a = prompt(840)
    e.add_request("a", a, 20, now=0.0)
    (done,) = run_idle(e)
    decode = stores(e)[2:]
    g0 = [s for s in decode if s.group_idx == 0]
    g1 = [s for s in decode if s.group_idx == 1]
    assert [len(s.block_hashes) for s in g0] == [0] and len(g0[0].token_ids) == 16  # block 52: no hash
    assert [len(s.block_hashes) for s in g1] == [1]
    assert g0[0].parent_block_hash == g1[0].parent_block_hash  # the request's block 51
    turn2 = a + list(done.output_token_ids) + prompt(140, base=7000)  # 1000 tokens
    e.add_request("a2", turn2, 1, now=5.0)
    (done2,) = run_idle(e)
    assert done2.cached_tokens == 832  # group 1 holds 848, group 0 lacks block 52
    g0, g1 = stores(e)
    # Block 52 (the junction at 848) and 54..61 (replay 999 -> 992); block 53 skipped mid-range.
    assert len(g0.block_hashes) == 9 and len(g0.token_ids) == 160
    # Group 1 already holds block 52 (a's decode block, shared): its event starts at 53, parent 52.
    assert len(g1.block_hashes) == 9 and g1.parent_block_hash == g0.block_hashes[0]
    assert g0.block_hashes[1:] == g1.block_hashes[1:]


def test_exact_events_with_block_offsets_shape() -> None:
    e = engine(event_block_offsets=True)
    a = prompt(840)
    e.add_request("a", a, 1, now=0.0)
    run_idle(e)
    g0, g1 = stores(e)
    assert len(g0.token_ids) == len(g0.block_hashes) * 16 == 128
    assert tuple(g0.token_ids) == tuple(a[704:832]) and g0.parent_block_hash == g1.block_hashes[43]


def test_dense_retention_caches_every_block_like_one_group() -> None:
    dense = engine(retention_interval=None)
    plain = EngineModel(EngineConfig(block_size=16, num_blocks=2048, max_num_seqs=8, ttft_overhead_s=0.010,
                                     prefill_s_per_token=0.0001, tpot_base_s=0.010, tpot_per_seq_s=0.001))
    rng = random.Random(7)
    system = prompt(600)
    for i in range(12):
        p = system + [rng.randrange(2000, 3000) for _ in range(rng.randrange(5, 200))]
        for e in (dense, plain):
            e.add_request(f"r{i}", p, 8, now=float(i))
    done_dense, done_plain = run_idle(dense), run_idle(plain)
    assert [c.cached_tokens for c in done_dense] == [c.cached_tokens for c in done_plain]
    assert any(c.cached_tokens for c in done_plain)
    by_group = dense.cached_blocks_by_group()
    assert by_group[1] == plain.cached_block_hashes()
    assert by_group[0] <= by_group[1]  # windows left behind stay cached until evicted


def test_sliding_window_blocks_keep_their_hash_until_evicted_then_removed_with_their_group() -> None:
    e = engine(num_blocks=140, retention_interval=None)
    e.add_request("a", prompt(840), 1, now=0.0)
    run_idle(e)
    stores(e)
    e.add_request("b", prompt(840, base=50000), 1, now=1.0)  # needs more blocks than are free
    run_idle(e)
    removed = [ev for b in e.drain_events() for ev in b.events if isinstance(ev, BlockRemoved)]
    assert removed and {ev.group_idx for ev in removed} <= {0, 1}
    assert all(len(ev.block_hashes) == 1 for ev in removed)


def test_mamba_group_caches_only_the_state_at_the_replay_boundary() -> None:
    e = engine(groups=(GroupSpec(FULL, 16), GroupSpec(MAMBA, 64)))
    a = prompt(840)
    e.add_request("a", a, 1, now=0.0)
    run_idle(e)
    full, mamba = stores(e)
    assert mamba.kv_cache_spec_kind == MAMBA and mamba.block_size == 64
    assert len(mamba.block_hashes) == 1 and len(mamba.token_ids) == 832  # 832 = 13 blocks of 64
    assert mamba.block_hashes[0] == full.block_hashes[51]  # the chain hash at its last hash unit
    e.add_request("b", a[:832] + prompt(50, base=4000), 1, now=1.0)
    (done,) = run_idle(e)
    assert done.cached_tokens == 832
    e.add_request("c", a[:700] + prompt(50, base=6000), 1, now=2.0)
    (done,) = run_idle(e)
    assert done.cached_tokens == 0  # no mamba state held at or below 688 tokens


# ---- extra keys ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("groups", [(), GPT_OSS])
def test_salts_never_share(groups) -> None:
    e = engine(groups=groups)
    p = prompt(200)
    for i, salt in enumerate([None, "u1", "u2", "u1"]):
        e.add_request(f"r{i}", p, 1, now=float(i), cache_salt=salt)
    done = run_idle(e)
    assert [c.cached_tokens for c in done] == [0, 0, 0, 192]
    first = [s for s in stores(e) if s.parent_block_hash is None and s.group_idx in (None, 1)]
    assert [s.extra_keys[0] if s.extra_keys else None for s in first] == [None, ("u1",), ("u2",)]
    assert first[1].extra_keys[1] is None


def test_media_with_the_same_tokens_and_another_identifier_never_share() -> None:
    e = engine(groups=())
    p = prompt(100)
    img = dict(offset=20, length=40)
    e.add_request("a", p, 1, now=0.0, mm_items=(MediaItem("img-a", **img),))
    e.add_request("b", p, 1, now=1.0, mm_items=(MediaItem("img-b", **img),))
    e.add_request("c", p, 1, now=2.0, mm_items=(MediaItem("img-a", **img),))
    done = run_idle(e)
    assert [c.cached_tokens for c in done] == [0, 16, 96]  # b shares block 0 only: the image starts in block 1
    a_ev = stores(e)[0]
    # Per block: (identifier, offset from the block's start), negative on continuation blocks.
    assert a_ev.extra_keys[:5] == (None, (("img-a", 4),), (("img-a", -12),), (("img-a", -28),), None)


def test_lora_name_leads_the_extra_keys_with_groups() -> None:
    e = engine(lora_names=("ad1",))
    e.add_request("a", prompt(100), 1, now=0.0, lora="ad1", cache_salt="s")
    run_idle(e)
    full = [s for s in stores(e) if s.group_idx == 1][0]
    assert full.lora_name == "ad1"
    assert full.extra_keys[0] == ("ad1", "s") and full.extra_keys[1] == ("ad1",)


def test_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of block_size"):
        EngineConfig(block_size=16, groups=(GroupSpec(FULL, 24),))
    with pytest.raises(ValueError, match="retention_interval"):
        EngineConfig(groups=(GroupSpec(FULL, 16),), retention_interval=32)
    with pytest.raises(ValueError, match="multiple of the scheduler"):
        EngineConfig(groups=GPT_OSS, retention_interval=24)
    with pytest.raises(ValueError, match="sliding_window"):
        GroupSpec(SLIDING, 16)
    with pytest.raises(ValueError, match="kind"):
        GroupSpec("linear", 16)
    e = engine()
    with pytest.raises(ValueError, match="cache_salt"):
        e.add_request("x", prompt(10), 1, now=0.0, cache_salt="")
    with pytest.raises(ValueError, match="placeholders"):
        e.add_request("x", prompt(10), 1, now=0.0, mm_items=(MediaItem("i", 5, 10),))


# ---- the hit rule against brute force -------------------------------------------------------------------


def brute_force_hit(groups, held, max_tokens, align) -> int:
    """The largest aligned length <= max_tokens that every group can serve, tried one by one."""
    for h in range(max(0, max_tokens) // align * align, -1, -align):
        ok = True
        for g, spec in zip(groups, held):
            bs = g.block_size
            if h % bs:
                ok = False
            elif g.kind == FULL:
                ok = all(i in spec for i in range(h // bs))
            elif g.kind == MAMBA:
                ok = h == 0 or h // bs - 1 in spec
            else:
                need = max(1, window_blocks(g))
                ok = all(i in spec for i in range(max(0, h // bs - need), h // bs))
            if not ok:
                break
        if ok:
            return h
    return 0


group_st = st.one_of(
    st.builds(lambda m: GroupSpec(FULL, 4 * m), st.sampled_from([1, 2, 4])),
    st.builds(lambda m, w: GroupSpec(SLIDING, 4 * m, w), st.sampled_from([1, 2]), st.integers(1, 40)),
    st.builds(lambda m: GroupSpec(MAMBA, 4 * m), st.sampled_from([1, 2, 4])),
)


@settings(max_examples=400, deadline=None)
@given(groups=st.lists(group_st, min_size=1, max_size=4), data=st.data())
def test_longest_hit_is_the_largest_length_every_group_serves(groups, data) -> None:
    n_tokens = data.draw(st.integers(1, 200))
    held = [set(data.draw(st.lists(st.integers(0, n_tokens // g.block_size), max_size=60))) for g in groups]
    align = scheduler_block_size(groups)
    hit, longest = longest_hit(groups, [s.__contains__ for s in held], n_tokens - 1, align)
    assert hit == brute_force_hit(groups, held, n_tokens - 1, align)
    assert longest >= hit
