"""The routing benchmark's `char-tree` baseline: the character radix tree and the policy's rules."""
from __future__ import annotations

import random

import pytest

from bench.chartree import CHARS_PER_TOKEN, CharTree, CharTreePolicy, token_text


def test_token_text_is_a_fixed_width_injective_map_on_the_bench_ids():
    ids = list(range(0, 70000, 7))
    texts = [token_text([t]) for t in ids]
    assert all(len(x) == CHARS_PER_TOKEN for x in texts)
    assert len(set(texts)) == len(ids)
    assert token_text([5, 6, 7]) == token_text([5]) + token_text([6]) + token_text([7])


def test_insert_then_longest_match_counts_characters():
    tree = CharTree()
    tree.insert("hello world")
    tree.insert("hello there")
    assert tree.match("hello world, again") == len("hello world")
    assert tree.match("hello thx") == len("hello th")  # stops inside an edge
    assert tree.match("help") == len("hel")
    assert tree.match("xyz") == 0
    assert tree.match("") == 0
    assert "hello" in tree and "hello there" in tree and "hello!" not in tree
    assert tree.size == len("hello ") + len("world") + len("there")  # shared prefix stored once


def test_inserting_a_prefix_of_a_stored_text_adds_nothing():
    tree = CharTree()
    tree.insert("abcdef")
    tree.insert("abc")
    assert tree.size == 6
    assert tree.match("abcdef") == 6 and tree.match("abcx") == 3


def test_lru_eviction_removes_least_recently_inserted_leaves_down_to_the_bound():
    tree = CharTree(max_chars=12)
    tree.insert("aaaa1111")  # 8 chars
    tree.insert("bbbb")  # 12: at the bound, nothing evicted
    assert tree.size == 12 and tree.match("aaaa1111") == 8
    tree.insert("aaaa2")  # splits "aaaa1111" and adds leaf "2": 13 > 12
    # leaves: "1111" (last used by insert 1), "bbbb" (insert 2), "2" (insert 3): "1111" goes
    assert tree.size == 9
    assert tree.match("aaaa1111") == 4  # leaf "1111" (last touched at insert 1) evicted first
    assert tree.match("bbbb") == 4 and tree.match("aaaa2") == 5
    tree.insert("bbbb")  # refresh bbbb
    tree.insert("cccccc")  # 4 + 1 + 4 + 6 = 15 > 12: oldest leaf is "2", then "aaaa" becomes a leaf
    assert tree.size <= 12
    assert tree.match("bbbb") == 4 and tree.match("cccccc") == 6
    assert tree.match("aaaa2") == 0


def test_a_text_larger_than_the_bound_does_not_stay():
    tree = CharTree(max_chars=4)
    tree.insert("abcdefgh")
    assert tree.size <= 4
    with pytest.raises(ValueError):
        CharTree(max_chars=0)


def _policy(pods=("a", "b", "c"), **kw) -> CharTreePolicy:
    return CharTreePolicy(pods, random.Random(1), **kw)


def test_match_ratio_at_or_above_the_threshold_routes_to_the_longest_match():
    pol = _policy()
    pol.trees["b"].insert("x" * 30)
    pol.trees["c"].insert("x" * 20)
    assert pol.choose("x" * 30 + "y" * 70, {}) == ("b", "match")  # ratio 0.3: >= threshold
    pol.trees["a"].insert("z" * 500)  # a is now the biggest tree, b the smallest non-empty...
    assert pol.choose("x" * 29 + "y" * 71, {})[1] == "smallest"  # ratio 0.29 < 0.3


def test_below_the_threshold_the_smallest_tree_wins():
    pol = _policy()
    pol.trees["a"].insert("q" * 50)
    pol.trees["b"].insert("r" * 10)
    pol.trees["c"].insert("s" * 30)
    assert pol.choose("t" * 100, {}) == ("b", "smallest")


def test_imbalance_override_needs_both_the_absolute_and_the_relative_gap():
    pol = _policy()
    pol.trees["a"].insert("k" * 100)
    text = "k" * 100
    assert pol.choose(text, {"a": 100, "b": 35, "c": 40}) == ("b", "imbalance")  # gap 65 > 64, 100 > 1.5 x 35
    assert pol.choose(text, {"a": 100, "b": 36, "c": 40})[1] == "match"  # gap 64: not > 64
    assert pol.choose(text, {"a": 200, "b": 135, "c": 140})[1] == "match"  # 200 < 1.5 x 135


def test_pick_inserts_into_the_chosen_tree_only_and_sticks_to_it():
    pol = _policy()
    prompt = list(range(1000, 1100))
    first = pol.pick(prompt, {})
    assert [p for p, t in pol.trees.items() if t.size] == [first]
    follow_up = prompt + list(range(5000, 5020))  # the next turn re-sends the history
    assert pol.pick(follow_up, {}) == first
    other = list(range(20000, 20100))  # nothing in common: the smallest (an empty) tree
    assert pol.pick(other, {}) != first


def test_a_joining_pod_starts_with_an_empty_tree_and_gets_unmatched_text():
    pol = _policy(("a", "b"))
    pol.pick(list(range(1000, 1100)), {})
    pol.pick(list(range(3000, 3100)), {})
    pol.add_pod("c")
    assert pol.trees["c"].size == 0
    assert pol.pick(list(range(40000, 40100)), {}) == "c"
    pol.remove_pod("c")
    assert set(pol.trees) == {"a", "b"}
