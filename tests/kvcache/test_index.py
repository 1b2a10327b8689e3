"""PrefixIndex semantics, one at a time."""
from __future__ import annotations

import pytest

from kvcache.blockkeys import block_keys, root_key
from kvcache.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvcache.index import PrefixIndex, PrefixMatch

BS = 4
TOKENS = tuple(range(100, 100 + 6 * BS))  # 6 full blocks


def stored(hashes, tokens=TOKENS, parent=None, medium=None, lora_name=None, lora_id=None, bs=BS):
    hashes = tuple(hashes)
    return BlockStored(hashes, parent, tuple(tokens[: len(hashes) * bs]), bs, lora_id, medium, lora_name)


def chain(first, n, tokens=TOKENS, medium=None, lora_name=None, start=0):
    """Blocks start..start+n-1 of `tokens`, engine hashes first.., parent = first-1 unless start 0."""
    hashes = tuple(range(first + start, first + start + n))
    parent = None if start == 0 else first + start - 1
    return BlockStored(hashes, parent, tuple(tokens[start * BS:(start + n) * BS]), BS, None, medium, lora_name)


def blocks(ix, pods=("a", "b", "c"), tokens=TOKENS, lora=None, model="m"):
    return {p: r.blocks for p, r in ix.match(model, lora, list(tokens), pods).items()}


def test_block_keys_are_chained_scoped_and_deterministic():
    keys = block_keys("m", None, TOKENS + (1, 2), BS)
    assert len(keys) == 6  # the partial last block has no key
    assert keys[:3] == block_keys("m", None, TOKENS[: 3 * BS], BS)
    assert len(set(keys)) == 6
    assert block_keys("m", "lora", TOKENS, BS) != keys
    assert block_keys("other", None, TOKENS, BS)[0] != keys[0]
    swapped = TOKENS[BS:2 * BS] + TOKENS[:BS]
    assert block_keys("m", None, swapped, BS)[1] != keys[1]
    assert 0 <= root_key("m", None) < 2**60 and root_key("m", None) != root_key("m", "")
    # the same value in a fresh interpreter: nothing depends on PYTHONHASHSEED
    import subprocess
    import sys
    code = ("from kvcache.blockkeys import block_keys;"
            f"print(block_keys('m', 'x', {list(TOKENS)!r}, {BS}))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    assert outs == {f"{block_keys('m', 'x', TOKENS, BS)}\n"}


def test_match_uses_kvgate_keys_not_engine_hashes():
    ix = PrefixIndex()
    ix.apply("a", "m", 0, [chain(1, 6)])
    ix.apply("b", "m", 0, [stored([b"\x01" * 32, b"\x02" * 32, b"\x03" * 32])])  # other algorithm, bytes
    assert blocks(ix) == {"a": 6, "b": 3, "c": 0}


def test_block_size_is_learned_and_partial_blocks_ignored():
    ix = PrefixIndex()
    assert ix.block_size("m") is None
    assert ix.match("m", None, list(TOKENS), ["a"]) == {"a": PrefixMatch(0, {}, 0)}
    ix.apply("a", "m", 0, [chain(1, 3)])
    assert ix.block_size("m") == BS
    r = ix.match("m", None, list(TOKENS[: 3 * BS + 3]), ["a"])["a"]
    assert (r.blocks, r.total_blocks) == (3, 3)
    assert ix.match("m", None, list(TOKENS[: BS - 1]), ["a"])["a"] == PrefixMatch(0, {}, 0)


def test_block_size_change_is_followed_and_counted():
    ix = PrefixIndex()
    ix.apply("a", "m", 0, [chain(1, 2)])
    ix.apply("a", "m", 0, [stored([50], bs=8)])
    assert ix.block_size("m") == 8
    assert ix.stats()["skipped"]["block_size_changes"] == 1
    assert ix.match("m", None, list(TOKENS), ["a"])["a"].blocks == 1


def test_unknown_parent_is_kept_out_of_chains_and_counted():
    ix = PrefixIndex()
    ix.apply("a", "m", 0, [chain(1, 1)])
    # block 2 stored with a parent nobody published: it must not become a chain start
    ix.apply("a", "m", 0, [BlockStored((3,), 999, TOKENS[BS:2 * BS], BS)])
    ix.apply("a", "m", 0, [BlockStored((4,), 3, TOKENS[2 * BS:3 * BS], BS)])  # its child: unknown too
    assert ix.stats()["skipped"]["unknown_parent_blocks"] == 2
    assert blocks(ix, ["a"]) == {"a": 1}
    # tokens of block 2 as a fresh prompt do not match either
    assert blocks(ix, ["a"], tokens=TOKENS[BS:]) == {"a": 0}
    # and its removal is an unknown hash, counted, harmless
    ix.apply("a", "m", 0, [BlockRemoved((3,))])
    assert ix.stats()["skipped"]["unknown_removed_blocks"] == 1
    assert ix.stats()["entries"] == 1


def test_a_known_parent_continues_the_chain():
    ix = PrefixIndex()
    ix.apply("a", "m", 0, [chain(1, 2), chain(1, 3, start=2)])
    assert blocks(ix, ["a"]) == {"a": 5}


def test_lora_and_model_scope_keys():
    ix = PrefixIndex()
    ix.apply("a", "m", 0, [chain(1, 6)])
    ix.apply("b", "m", 0, [chain(100, 6, lora_name="sql")])
    ix.apply("c", "m", 0, [stored(range(200, 206), lora_id=3)])  # vLLM < 0.14: an adapter without a name
    assert blocks(ix) == {"a": 6, "b": 0, "c": 0}
    assert blocks(ix, lora="sql") == {"a": 0, "b": 6, "c": 0}
    assert blocks(ix, lora="other") == {"a": 0, "b": 0, "c": 0}
    assert blocks(ix, model="m2") == {"a": 0, "b": 0, "c": 0}


def test_removal_drops_only_that_pods_entry_for_that_medium():
    ix = PrefixIndex()
    ix.apply("a", "m", 0, [chain(1, 6)])
    ix.apply("b", "m", 0, [chain(1, 6)])  # same engine hashes on both pods (vLLM >= 0.29)
    ix.apply("b", "m", 0, [chain(1, 6, medium="CPU")])
    ix.apply("b", "m", 0, [BlockRemoved((3,), "GPU")])
    assert blocks(ix) == {"a": 6, "b": 6, "c": 0}
    assert ix.match("m", None, list(TOKENS), ["b"])["b"].by_medium == {"GPU": 2, "CPU": 6}
    ix.apply("b", "m", 0, [BlockRemoved((2,), "CPU")])
    # every block is still held in some medium; the leading runs per medium shrink
    assert ix.match("m", None, list(TOKENS), ["b"])["b"] == PrefixMatch(6, {"GPU": 2, "CPU": 1}, 6)
    ix.apply("a", "m", 0, [BlockRemoved((5,))])  # medium None is GPU
    assert blocks(ix) == {"a": 4, "b": 6, "c": 0}
    assert ix.stats()["entries"] == 5 + 5 + 5


def test_repeated_stores_are_harmless():
    ix = PrefixIndex()
    for _ in range(3):
        ix.apply("a", "m", 0, [chain(1, 6), chain(1, 2, medium="GPU")])
    assert ix.stats()["entries"] == 6
    ix.apply("a", "m", 0, [BlockRemoved((4,))])
    assert blocks(ix, ["a"]) == {"a": 3}


def test_clear_drop_and_remove_pod():
    ix = PrefixIndex()
    for pod in "ab":
        for rank in (0, 1):
            ix.apply(pod, "m", rank, [chain(1, 2 + rank)])
    assert blocks(ix) == {"a": 3, "b": 3, "c": 0}
    ix.apply("a", "m", 1, [AllBlocksCleared()])
    assert blocks(ix) == {"a": 2, "b": 3, "c": 0}
    ix.drop("b", 0)
    assert blocks(ix) == {"a": 2, "b": 3, "c": 0}
    ix.drop("b", 1)
    assert blocks(ix) == {"a": 2, "b": 0, "c": 0}
    ix.apply("b", "m", 1, [chain(1, 4)])  # a restarted rank starts empty and fills again
    assert blocks(ix) == {"a": 2, "b": 4, "c": 0}
    ix.remove_pod("b")
    ix.remove_pod("ghost")
    ix.drop("ghost", 0)
    assert blocks(ix) == {"a": 2, "b": 0, "c": 0}
    assert ix.stats()["entries"] == 2 and ix.stats()["pods"] == 1


def test_data_parallel_pod_reports_its_best_rank():
    ix = PrefixIndex()
    ix.apply("a", "m", 0, [chain(1, 2)])
    ix.apply("a", "m", 1, [chain(1, 5, medium="CPU")])
    ix.apply("a", "m", 2, [chain(1, 4)])
    assert ix.match("m", None, list(TOKENS), ["a"])["a"] == PrefixMatch(5, {"CPU": 5}, 6)


@pytest.mark.parametrize("media", [("GPU",), ("GPU", "CPU")])  # the native one-medium walk and the general one
def test_match_ranks_answers_per_rank_of_a_data_parallel_pod(media):
    ix = PrefixIndex()
    ix.apply("a", "m", 1, [chain(1, 3)])
    ix.apply("b", "m", 0, [chain(1, 6, medium=media[-1])])
    ix.apply("b", "m", 1, [chain(1, 2)])
    ix.apply("c", "m", 0, [chain(1, 1)])
    targets = [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("c", 0), ("d", 0)]
    got = ix.match_ranks("m", None, list(TOKENS), targets)
    miss = PrefixMatch(0, {}, 6)
    assert got == {("a", 0): miss, ("a", 1): PrefixMatch(3, {"GPU": 3}, 6),
                   ("b", 0): PrefixMatch(6, {media[-1]: 6}, 6), ("b", 1): PrefixMatch(2, {"GPU": 2}, 6),
                   ("c", 0): PrefixMatch(1, {"GPU": 1}, 6), ("d", 0): miss}
    # only the candidates count: (b, 0) left out, b's rank 1 answers alone
    assert ix.match_ranks("m", None, list(TOKENS), [("b", 1)]) == {("b", 1): PrefixMatch(2, {"GPU": 2}, 6)}
    # match() still answers per pod with its best rank
    assert ix.match("m", None, list(TOKENS), ["a", "b"]) == {"a": PrefixMatch(3, {"GPU": 3}, 6),
                                                            "b": PrefixMatch(6, {media[-1]: 6}, 6)}
    assert ix.match_ranks("other-model", None, list(TOKENS), targets) == dict.fromkeys(targets, PrefixMatch(0, {}, 0))


def test_by_medium_counts_leading_blocks_per_medium():
    ix = PrefixIndex()
    ix.apply("a", "m", 0, [chain(1, 3), chain(1, 3, start=3, medium="CPU")])
    assert ix.match("m", None, list(TOKENS), ["a", "b"]) == {
        "a": PrefixMatch(6, {"GPU": 3}, 6), "b": PrefixMatch(0, {}, 6)}


def test_lru_bound_evicts_least_recently_stored_or_matched():
    ix = PrefixIndex(max_entries=64)
    prompts = []
    for i in range(8):  # 8 prompts x 6 blocks = 48 entries
        toks = tuple(range(1000 * i, 1000 * i + 6 * BS))
        prompts.append(toks)
        ix.apply("a", "m", 0, [chain(100 * i, 6, tokens=toks)])
    assert ix.stats()["entries"] == 48
    ix.match("m", None, list(prompts[0]), ["a"])  # prompt 0 is now recent, prompt 1 the oldest
    for i in range(8, 12):
        toks = tuple(range(1000 * i, 1000 * i + 6 * BS))
        ix.apply("a", "m", 0, [chain(100 * i, 6, tokens=toks)])
        assert ix.stats()["entries"] <= 64
    held = [blocks(ix, ["a"], tokens=p)["a"] for p in prompts]
    assert held[0] == 6 and held[1] == 0 and held[7] == 6
    assert ix.stats()["evicted_entries"] == 72 - ix.stats()["entries"]
    with pytest.raises(ValueError):
        PrefixIndex(max_entries=0)


def test_bad_events_are_skipped_and_counted_without_losing_the_rest():
    ix = PrefixIndex()
    bad_len = BlockStored((1, 2), None, TOKENS[:BS], BS)  # 2 hashes, 1 block of tokens
    unhashable = BlockStored((7,), None, ([1], 2, 3, 4), BS)
    bad_group = BlockStored((8,), None, TOKENS[:BS], BS, group_idx=-1)
    ix.apply("a", "m", 0, [bad_len, unhashable, "junk", chain(1, 6), bad_group])
    assert blocks(ix, ["a"]) == {"a": 6}
    skipped = ix.stats()["skipped"]
    assert skipped["malformed_block_stored"] == 2 and skipped["unknown_event"] == 1
    assert skipped["malformed_event"] == 1
    assert ix.stats()["entries"] == 6


def test_stats_are_json_able():
    import json
    ix = PrefixIndex(max_entries=100)
    ix.apply("a", "m", 0, [chain(1, 6)])
    s = json.loads(json.dumps(ix.stats()))
    assert s["entries"] == 6 and s["block_sizes"] == {"m": BS} and s["max_entries"] == 100


@pytest.mark.parametrize("generation", ["0.23", "0.25", "0.33"])
def test_events_decoded_from_the_wire_feed_the_index(generation):
    from kvcache.events import EventBatch
    from kvcache.wire import decode_batch, encode_batch
    big = (1 << 64) - 5  # uint64 hashes as vLLM publishes them
    events = (stored([big, big - 1, big - 2], medium="GPU"), BlockStored((big - 3,), big - 2, TOKENS[3 * BS:4 * BS], BS),
              BlockRemoved((big - 1,), "GPU"))
    decoded = decode_batch(encode_batch(EventBatch(1.0, events, 0), generation)).batch.events
    ix = PrefixIndex()
    ix.apply("a", "m", 0, decoded[:2])
    assert blocks(ix, ["a"]) == {"a": 4}
    ix.apply("a", "m", 0, decoded[2:])
    assert blocks(ix, ["a"]) == {"a": 1}
    assert ix.stats()["entries"] == 3


def test_stats_count_distinct_blocks_per_pod_over_ranks_and_media():
    ix = PrefixIndex()
    ix.apply("a", "m", 0, [chain(10, 4)])  # blocks 0-3 on GPU
    ix.apply("a", "m", 1, [chain(10, 6, medium="CPU")])  # blocks 0-5 on CPU: 6 distinct in all
    ix.apply("b", "m", 0, [chain(10, 2), chain(10, 3, medium="CPU")])
    assert ix.stats()["blocks_per_pod"] == {"a": 6, "b": 3}
    ix.apply("a", "m", 1, [BlockRemoved((15,), "CPU")])
    ix.remove_pod("b")
    assert ix.stats()["blocks_per_pod"] == {"a": 5}
    ix.apply("a", "m", 0, [AllBlocksCleared()])
    assert ix.stats()["blocks_per_pod"] == {"a": 5}  # rank 1 still holds them on CPU

    one_medium = PrefixIndex()  # one rank per pod, one medium: counted per holder bit
    one_medium.apply("a", "m", 0, [chain(10, 6)])
    one_medium.apply("b", "m", 0, [chain(10, 2)])
    one_medium.apply("c", "m", 0, [chain(10, 6, tokens=tuple(range(500, 600)))])
    one_medium.apply("d", "m", 0, [chain(10, 1), AllBlocksCleared()])
    assert one_medium.stats()["blocks_per_pod"] == {"a": 6, "b": 2, "c": 6, "d": 0}


def test_engine_hashes_stay_bounded_over_store_and_clear_cycles():
    ix = PrefixIndex()
    per_cycle, tokens = 500, tuple(range(500 * BS))
    seen = []
    for cycle in range(40):  # 20000 engine hashes stored in all, each cycle's under new hashes
        hashes = tuple(range(cycle * 10_000, cycle * 10_000 + per_cycle))
        ix.apply("a", "m", 0, [BlockStored(hashes, None, tokens, BS)])
        ix.apply("b", "m", 0, [BlockStored(hashes[:10], None, tokens[:10 * BS], BS)])
        if cycle % 3 == 0:
            ix.apply("a", "m", 0, [AllBlocksCleared()])
        elif cycle % 3 == 1:
            ix.drop("a", 0)
        else:
            ix.remove_pod("a")
        stats = ix.stats()
        assert stats["keys_by_medium"]["GPU"] == 10  # b's blocks
        seen.append(stats["engine_hashes"])
    assert max(seen) <= 4096 + per_cycle + 2 * 10  # the sweep bound: twice the live keys + 4096
    assert seen[-1] < seen[-2] or seen[-1] <= 4096 + 2 * 10
    assert ix.match("m", None, list(tokens), ["a", "b"])["b"].blocks == 10


def test_medium_tables_of_any_name_do_not_accumulate():
    """An engine that sends a new medium name per block leaves no empty tables behind."""
    ix = PrefixIndex()
    for i in range(300):
        ix.apply("a", "m", 0, [stored([i], TOKENS[:BS], medium=f"medium-{i}")])
        ix.apply("a", "m", 0, [BlockRemoved((i,), f"medium-{i}")])
    ix.apply("a", "m", 0, [stored([1000], TOKENS[:BS], medium="GPU")])
    assert len(ix.stats()["keys_by_medium"]) <= 64  # emptied tables go at the periodic sweep
    for _ in range(64):
        ix.apply("a", "m", 0, [])
    assert ix.stats()["keys_by_medium"] == {"GPU": 1}
    assert ix.match("m", None, TOKENS, ["a"])["a"].blocks == 1


def test_pod_cache_counts_what_each_pod_holds_as_stats_do_its_evictions_and_resets():
    ix = PrefixIndex()
    ix.apply("a", "m", 0, [chain(10, 4)])
    ix.apply("a", "m", 1, [chain(10, 6, medium="CPU")])
    ix.apply("b", "m", 0, [chain(10, 2)])
    assert ix.pod_cache(["a", "b", "never"]) == {"a": (6, 0, 0), "b": (2, 0, 0)}
    ix.apply("b", "m", 0, [AllBlocksCleared()])  # a reset is no eviction
    ix.apply("a", "m", 1, [BlockRemoved((15,), "CPU")])
    assert ix.pod_cache(["a", "b"]) == {"a": (5, 1, 0), "b": (0, 0, 1)}
    assert {p: n for p, (n, _, _) in ix.pod_cache(["a", "b"]).items()} == ix.stats()["blocks_per_pod"]
    ix.drop("b", 0)  # a stream no longer trusted: what the index knew of it is gone, as with a reset
    ix.remove_pod("a")
    assert ix.pod_cache(["a", "b"]) == {"b": (0, 0, 2)}
