"""The index on models of several KV cache groups, and on blocks with extra keys (issue 25).

Shapes as vLLM 0.33 publishes them: gpt-oss-like (group 0 a sliding window of 128 tokens, group 1 full
attention, both of 16-token blocks; sliding-window stores sparse: the hashes of the blocks that can serve
a hit, with the token ids of every new block), full attention + mamba, salts, media, LoRA names in
extra_keys. The hits expected are worked out from vLLM's rules (kvcache/groups.py's docstring)."""
from __future__ import annotations

import pytest

from kvcache.blockkeys import BlockExtras, MediaItem
from kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvcache.index import PrefixIndex

BS = 16
W = 128  # sliding window: cdiv(127, 16) = 8 blocks before the hit point


def prompt(n: int, seed: int = 0) -> list[int]:
    return [1000 * seed + i + 1 for i in range(n)]


def hashes(tokens: list[int], salt: int = 0) -> list[int]:
    """Engine-style hashes: one chain per prefix (any injective stand-in serves)."""
    return [hash((salt, tuple(tokens[:(i + 1) * BS]))) & (2**64 - 1) for i in range(len(tokens) // BS)]


def full(tokens: list[int], group: int = 1, first: int = 0, salt: int = 0, **kw) -> BlockStored:
    h = hashes(tokens, salt)
    n = len(tokens) // BS
    return BlockStored(tuple(h[first:n]), h[first - 1] if first else None, tuple(tokens[first * BS:n * BS]), BS,
                       group_idx=group, kv_cache_spec_kind="full_attention", **kw)


def window_tail(tokens: list[int], held: range, group: int = 0) -> BlockStored:
    """A sparse sliding-window store: hashes of blocks `held` only, token ids of every block from 0."""
    h = hashes(tokens)
    n = len(tokens) // BS
    return BlockStored(tuple(h[i] for i in held), None, tuple(tokens[:n * BS]), BS, group_idx=group,
                       kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=W)


def hit_tokens(ix: PrefixIndex, tokens: list[int], pod: str = "a", extras: BlockExtras | None = None,
               lora: str | None = None) -> int:
    m = ix.match("m", lora, tokens, [pod], extras)[pod]
    return m.blocks * ix.block_size("m")


def test_gpt_oss_like_first_prompt_hits_in_full_after_its_window_tail_resolves_through_the_full_group():
    ix = PrefixIndex()
    p = prompt(840)  # 52 full blocks; the replay boundary is token 832
    # vLLM's order in one step: group 0 (sliding window) first, then group 1
    ix.apply("a", "m", 0, [window_tail(p, range(44, 52)), full(p)])
    assert hit_tokens(ix, p) == 832
    assert ix.stats()["skipped"].get("unresolved_sparse_blocks", 0) == 0
    groups = ix.stats()["kv_cache_groups"]["m"]
    assert groups["exact"] and groups["groups"][0]["rule"] == "window" and groups["groups"][1]["rule"] == "full"


def test_a_second_prompt_sharing_the_system_prompt_misses_where_the_window_was_not_kept():
    """Shares 800 tokens (50 blocks): full attention holds them, but the window group kept blocks 44-51
    of the first prompt, so no 8-block run ends at or before block 50 inside the shared part: no hit, as
    vLLM (issue 25: a second request sharing a system prompt misses entirely)."""
    ix = PrefixIndex()
    p = prompt(840)
    ix.apply("a", "m", 0, [window_tail(p, range(44, 52)), full(p)])
    q = p[:800] + prompt(40, seed=7)
    assert hit_tokens(ix, q) == 0
    # once a junction's window is kept (blocks 42-49), a third request sharing the 800 tokens hits 800
    ix.apply("a", "m", 0, [BlockStored(tuple(hashes(q)[42:50]), None, tuple(q[:50 * BS]), BS, group_idx=0,
                                       kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=W)])
    assert hit_tokens(ix, p[:800] + prompt(40, seed=9)) == 800


def test_window_blocks_removed_from_their_group_only():
    ix = PrefixIndex()
    p = prompt(840)
    ix.apply("a", "m", 0, [window_tail(p, range(44, 52)), full(p)])
    ix.apply("a", "m", 0, [BlockRemoved((hashes(p)[47],), "GPU", group_idx=0)])
    # the window run now ends at block 47 at most on the right: 48-51 is 4 blocks; 44-46 is 3: no window
    assert hit_tokens(ix, p) == 0
    ix.apply("a", "m", 0, [BlockStored((hashes(p)[47],), hashes(p)[46], tuple(p[47 * BS:48 * BS]), BS, group_idx=0,
                                       kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=W)])
    assert hit_tokens(ix, p) == 832
    ix.apply("a", "m", 0, [BlockRemoved((hashes(p)[10],), "GPU", group_idx=1)])  # full attention: from block 0
    # full attention allows 10 blocks; the window group holds nothing at or before block 10: no hit
    assert hit_tokens(ix, p) == 0


def test_a_window_block_removed_in_the_batch_that_stored_it_stays_removed():
    """An engine step that stores a window tail and then frees blocks leaving the window publishes both in
    one batch (bench routing W8: stores of blocks 4-11, removals of 5-10 in one step). The sparse store waits
    for the batch's dense one; the removal after it must still win, as the events' order says."""
    ix = PrefixIndex()
    p = prompt(840)
    ix.apply("a", "m", 0, [window_tail(p, range(44, 52)), full(p), BlockRemoved((hashes(p)[47],), "GPU", group_idx=0)])
    assert hit_tokens(ix, p) == 0  # as test_window_blocks_removed_from_their_group_only, in one batch
    assert not ix.stats()["skipped"]
    # and a removal before the store in the same batch does not undo the store
    ix2 = PrefixIndex()
    ix2.apply("a", "m", 0, [full(p)])
    ix2.apply("a", "m", 0, [BlockRemoved((hashes(p)[47],), "GPU", group_idx=0), window_tail(p, range(44, 52))])
    assert hit_tokens(ix2, p) == 832


def test_sparse_hashes_no_group_stored_densely_are_counted_never_guessed():
    ix = PrefixIndex()
    p = prompt(840)
    ix.apply("a", "m", 0, [window_tail(p, range(44, 52))])  # no full-attention store to resolve them by
    ix.apply("a", "m", 0, [])  # nor in the next call
    assert hit_tokens(ix, p) == 0
    assert ix.stats()["skipped"]["unresolved_sparse_blocks"] == 8


def test_a_decode_store_of_no_hash_is_not_an_error():
    ix = PrefixIndex()
    p = prompt(840)
    ix.apply("a", "m", 0, [window_tail(p, range(44, 52)), full(p),
                           BlockStored((), hashes(p)[51], tuple(range(16)), BS, group_idx=0,
                                       kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=W)])
    assert hit_tokens(ix, p) == 832
    assert not ix.stats()["skipped"]


def test_mamba_state_block_at_the_hit_point():
    ix = PrefixIndex()
    p = prompt(840)
    h = hashes(p)
    state = BlockStored((h[30], h[51]), None, tuple(p[:52 * BS]), BS, group_idx=1, kv_cache_spec_kind="mamba")
    ix.apply("a", "m", 0, [full(p, group=0), state])
    assert hit_tokens(ix, p) == 832
    assert hit_tokens(ix, p[:500] + prompt(300, seed=3)) == 31 * BS  # the state at block 30 serves it
    assert hit_tokens(ix, p[:400] + prompt(300, seed=3)) == 0  # no state at or before block 25


def test_an_unmodelled_kind_gets_the_full_rule_and_is_counted():
    ix = PrefixIndex()
    p = prompt(840)
    local = BlockStored(tuple(hashes(p)[:10]), None, tuple(p[:160]), BS, group_idx=1,
                        kv_cache_spec_kind="chunked_local_attention")
    ix.apply("a", "m", 0, [full(p, group=0), local])
    assert hit_tokens(ix, p) == 160  # every block from block 0 in the unmodelled group
    stats = ix.stats()
    assert stats["skipped"]["unmodelled_kv_cache_groups"] == 1 and not stats["kv_cache_groups"]["m"]["exact"]


def test_a_salted_prompt_matches_only_its_own_salt():
    ix = PrefixIndex()
    p = prompt(160)
    salted = BlockStored(tuple(hashes(p, salt=1)), None, tuple(p), BS, extra_keys=(("tenant-a",),) + (None,) * 9)
    ix.apply("a", "m", 0, [salted])
    ix.apply("b", "m", 0, [BlockStored(tuple(hashes(p)), None, tuple(p), BS)])
    got = ix.match("m", None, p, ["a", "b"], BlockExtras(cache_salt="tenant-a"))
    assert (got["a"].blocks, got["b"].blocks) == (10, 0)
    got = ix.match("m", None, p, ["a", "b"], BlockExtras(cache_salt="tenant-b"))
    assert (got["a"].blocks, got["b"].blocks) == (0, 0)
    got = ix.match("m", None, p, ["a", "b"])
    assert (got["a"].blocks, got["b"].blocks) == (0, 10)


def test_media_blocks_match_by_identifier_and_offset():
    ix = PrefixIndex()
    p = prompt(160)
    img = MediaItem("img-1", 20, 40)  # placeholders 20..59: blocks 1, 2, 3
    per = BlockExtras(media=(img,)).per_block(BS, 10)
    extra = tuple(per.get(b) for b in range(10))
    assert extra[1] == (("img-1", 4),) and extra[3] == (("img-1", -28),) and extra[0] is None
    ix.apply("a", "m", 0, [BlockStored(tuple(hashes(p, salt=2)), None, tuple(p), BS, extra_keys=extra)])
    assert ix.match("m", None, p, ["a"], BlockExtras(media=(img,)))["a"].blocks == 10
    other = BlockExtras(media=(MediaItem("img-2", 20, 40),))
    assert ix.match("m", None, p, ["a"], other)["a"].blocks == 1  # block 0 holds no placeholder
    assert ix.match("m", None, p, ["a"])["a"].blocks == 1
    assert ix.match("m", None, p, ["a"], BlockExtras(opaque=True))["a"].blocks == 0


def test_lora_name_in_extra_keys_is_the_adapters_root_not_an_extra():
    ix = PrefixIndex()
    p = prompt(64)
    ix.apply("a", "m", 0, [BlockStored(tuple(hashes(p)), None, tuple(p), BS, lora_name="sql",
                                       extra_keys=(("sql",),) * 4)])
    assert ix.match("m", "sql", p, ["a"])["a"].blocks == 4
    assert ix.match("m", None, p, ["a"])["a"].blocks == 0


def test_malformed_extra_keys_and_lookahead_are_skipped_and_counted():
    ix = PrefixIndex()
    p = prompt(64)
    ix.apply("a", "m", 0, [BlockStored(tuple(hashes(p)), None, tuple(p), BS, extra_keys=(("x",),)),  # 1 for 4
                           BlockStored(tuple(hashes(p)), None, tuple(p), BS, extra_keys=(5, None, None, None)),
                           BlockStored(tuple(hashes(p)), None, tuple(p), BS, lookahead_token_ids=(1, 2)),
                           AllBlocksCleared()])
    skipped = ix.stats()["skipped"]
    assert skipped["malformed_extra_keys"] == 2 and skipped["lookahead_blocks"] == 4
    assert ix.match("m", None, p, ["a"])["a"].blocks == 0


@pytest.mark.parametrize("generation", ["0.23", "0.25", "0.33"])
def test_hybrid_batches_from_the_wire_take_the_general_path(generation):
    from kvcache.events import EventBatch
    from kvcache.wire import encode_batch
    p = prompt(840)
    payload = encode_batch(EventBatch(1.0, (window_tail(p, range(44, 52)), full(p)), 0), generation)
    ix = PrefixIndex()
    assert ix.apply_payload("a", "m", 0, payload) is None  # declined: decoded and applied
    from kvcache.wire import decode_batch
    ix.apply("a", "m", 0, decode_batch(payload).batch.events)
    assert hit_tokens(ix, p) == 832


def test_hit_rules_agree_with_the_simulated_engines_reference_on_random_group_layouts():
    """kvcache.groups against sim.cache_rules (written apart, from vLLM's source): random groups (full
    attention, sliding windows, mamba; block sizes multiples of a unit), random held blocks."""
    import random

    from kvcache.groups import Group, longest_hit, rule_of
    from sim import cache_rules as ref

    rng = random.Random(25)
    kinds = ("full_attention", "sliding_window", "mamba")
    for case in range(3000):
        unit = rng.choice((1, 2, 4, 16))
        specs = []
        for _ in range(rng.randint(1, 3)):
            kind = rng.choice(kinds)
            bs = unit * rng.choice((1, 1, 2, 3))
            window = rng.randint(1, 10 * bs) if kind == "sliding_window" else None
            specs.append(ref.GroupSpec(kind, bs, window))
        ours = []
        for i, sp in enumerate(specs):
            rule, modelled = rule_of(i, sp.kind, sp.sliding_window)
            ours.append(Group(i, sp.kind, sp.block_size, sp.sliding_window, rule, modelled))
        align = ref.scheduler_block_size(specs)
        n_tokens = rng.randint(1, 40 * unit)
        density = rng.random()
        held_sets = [{j for j in range(n_tokens // sp.block_size + 1) if rng.random() < density} for sp in specs]
        bitmaps = []
        for sp, held in zip(specs, held_sets):
            r = sp.block_size // unit
            bitmaps.append(sum(1 << ((j + 1) * r - 1) for j in held))
        want, _ = ref.longest_hit(specs, [held.__contains__ for held in held_sets], n_tokens - 1, align)
        got = longest_hit(ours, bitmaps, n_tokens, unit, align)
        assert got == want, (case, specs, held_sets, n_tokens)


def test_the_index_collector_exports_skips_and_groups():
    from prometheus_client import CollectorRegistry

    from kvcache.metrics import IndexCollector
    ix = PrefixIndex()
    p = prompt(840)
    local = BlockStored(tuple(hashes(p)[:10]), None, tuple(p[:160]), BS, group_idx=1,
                        kv_cache_spec_kind="chunked_local_attention")
    ix.apply("a", "m", 0, [full(p, group=0), local])
    registry = CollectorRegistry()
    IndexCollector(ix.stats, registry)
    assert registry.get_sample_value("kvgate_index_skipped_total", {"reason": "unmodelled_kv_cache_groups"}) == 1
    assert registry.get_sample_value("kvgate_index_entries") == 62
    info = {"model": "m", "group": "1", "kind": "chunked_local_attention", "rule": "full", "block_size": "16",
            "modelled": "false"}
    assert registry.get_sample_value("kvgate_index_kv_cache_group_info", info) == 1

    def busy() -> dict:
        raise RuntimeError("busy")
    quiet = CollectorRegistry()
    IndexCollector(busy, quiet)
    assert quiet.get_sample_value("kvgate_index_entries") is None


def test_the_index_collector_exports_its_bound_and_evictions():
    """What an alert on a full index reads (deploy/observability: KvgateIndexAtBound): the bound, the
    entries held within it and the entries evicted to stay there."""
    from prometheus_client import CollectorRegistry

    from kvcache.metrics import IndexCollector
    ix = PrefixIndex(max_entries=40)
    registry = CollectorRegistry()
    IndexCollector(ix.stats, registry)
    assert registry.get_sample_value("kvgate_index_max_entries") == 40
    assert registry.get_sample_value("kvgate_index_evicted_entries_total") == 0
    p = prompt(840)
    ix.apply("a", "m", 0, [full(p, group=0)])  # 52 blocks: 12 beyond the bound
    assert registry.get_sample_value("kvgate_index_entries") <= 40
    assert registry.get_sample_value("kvgate_index_evicted_entries_total") >= 12


def test_a_sparse_store_waits_one_call_for_its_dense_store_then_is_counted():
    """The stream applies a large batch in chunks (kvcache.stream, apply_chunk): the full-attention store
    that places a window store's hashes may come in the next call. It is tried once more there."""
    ix = PrefixIndex()
    p, q = prompt(840), prompt(840, seed=5)
    ix.apply("a", "m", 0, [window_tail(p, range(44, 52))])
    assert ix.stats()["skipped"].get("unresolved_sparse_blocks", 0) == 0  # waiting
    ix.apply("a", "m", 0, [full(p)])
    assert hit_tokens(ix, p) == 832 and not ix.stats()["skipped"]
    ix.apply("a", "m", 0, [window_tail(q, range(44, 52))])
    ix.apply("a", "m", 0, [])  # the next call has nothing for it: counted, not guessed
    assert ix.stats()["skipped"]["unresolved_sparse_blocks"] == 8
    ix.apply("a", "m", 0, [window_tail(q, range(44, 52)), AllBlocksCleared(), full(q)])
    assert hit_tokens(ix, q) == 0  # a clear drops what waited
