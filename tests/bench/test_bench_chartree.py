"""The routing benchmark's `char-tree` baseline: SGLang's gateway `cache_aware` rules (its tree,
threshold, smallest-tree fallback, load override and periodic eviction), on small fixed cases."""
from __future__ import annotations

import random

from bench.chartree import CharTreePolicy, TenantTree, request_text


def test_request_text_is_the_ids_in_decimal_joined_by_spaces():
    assert request_text([12, 3456, 7]) == "12 3456 7"
    assert request_text([]) == ""
    assert request_text([5, 6, 7]).startswith(request_text([5, 6]))  # equal token prefixes, equal text prefixes


def test_insert_records_each_worker_once_per_node_and_counts_its_characters():
    tree = TenantTree()
    tree.insert("apple", "a", 1.0)
    tree.insert("apricot", "a", 2.0)
    tree.insert("banana", "a", 3.0)
    tree.insert("amplify", "b", 4.0)
    tree.insert("application", "b", 5.0)
    assert tree.tenant_chars == tree.sizes() == {"a": len("ap" + "ple" + "ricot" + "banana"),
                                                  "b": len("a" + "p" + "mplify" + "plication")}
    tree.insert("apple", "a", 6.0)  # nothing new for a
    assert tree.tenant_chars["a"] == 16
    tree.insert("apple", "b", 7.0)  # only the "e" is new for b: it has "appl" through "application"
    assert tree.tenant_chars == tree.sizes() and tree.tenant_chars["b"] == 17 + 1


def test_prefix_match_is_over_every_worker_and_names_one_holding_the_whole_match():
    tree = TenantTree()
    tree.insert("hello world", "a", 1.0)
    tree.insert("hello there", "b", 2.0)
    assert tree.prefix_match("hello world, again", 3.0) == (len("hello world"), "a")
    assert tree.prefix_match("hello thx", 3.0) == (len("hello th"), "b")  # stops inside an edge
    n, who = tree.prefix_match("hello!", 3.0)
    assert n == len("hello ") - 1 and who in ("a", "b")
    assert tree.prefix_match("xyz", 3.0)[0] == 0


def test_equal_holders_are_ordered_per_node_deterministically():
    picks = set()
    for _ in range(3):
        tree = TenantTree(seed=5)
        for w in ("a", "b", "c"):
            tree.insert("shared prefix", w, 1.0)
        picks.add(tree.prefix_match("shared prefix and more", 2.0)[1])
    assert len(picks) == 1  # the same worker every time for the same seed and history


def _policy(pods=("a", "b", "c"), **kw) -> CharTreePolicy:
    return CharTreePolicy(pods, "test", **kw)


def test_a_match_rate_above_the_threshold_routes_to_the_longest_match_at_it_not():
    pol = _policy()
    pol.tree.insert("x" * 31, "b", 0.0)
    pol.tree.insert("z" * 5, "c", 0.0)  # c is not the smallest any more: a is (empty)
    assert pol.choose("x" * 31 + "y" * 69, {}) == ("b", "match")  # 0.31 > 0.3
    assert pol.choose("x" * 30 + "y" * 70, {}) == ("a", "smallest")  # 0.30: not > 0.3 (SGLang's strict >)
    assert pol.choose("", {}) == ("a", "smallest")


def test_below_the_threshold_the_worker_with_the_fewest_characters_wins():
    pol = _policy()
    pol.tree.insert("q" * 50, "a", 0.0)
    pol.tree.insert("r" * 10, "b", 0.0)
    pol.tree.insert("s" * 30, "c", 0.0)
    assert pol.choose("t" * 100, {}) == ("b", "smallest")


def test_the_load_override_needs_both_the_absolute_and_the_relative_gap():
    pol = _policy()
    pol.tree.insert("k" * 100, "a", 0.0)
    text = "k" * 100
    assert pol.choose(text, {"a": 100, "b": 35, "c": 40}) == ("b", "imbalance")  # 65 > 64 and 100 > 1.5 x 35
    assert pol.choose(text, {"a": 100, "b": 36, "c": 40}) == ("a", "match")  # gap 64: not > 64
    assert pol.choose(text, {"a": 200, "b": 135, "c": 140}) == ("a", "match")  # 200 < 1.5 x 135
    assert pol.choose(text, {"a": 100, "b": 30, "c": 30}) == ("b", "imbalance")  # ties: the first in worker order


def test_the_overridden_request_is_still_recorded_under_the_least_loaded_worker():
    pol = _policy()
    prompt = list(range(1000, 1100))
    first = pol.pick(prompt, {})
    loads = {p: 0 for p in pol.workers}
    loads[first] = 200
    other = pol.pick(prompt, loads)
    assert other != first and pol.tree.tenant_chars[other] == len(request_text(prompt))


def test_pick_records_the_text_and_sticks_to_it_then_fresh_text_goes_to_an_empty_worker():
    pol = _policy()
    prompt = list(range(1000, 1100))
    first = pol.pick(prompt, {})
    assert [p for p, n in pol.tree.tenant_chars.items() if n] == [first]
    follow_up = prompt + list(range(5000, 5020))  # the next turn re-sends the history
    assert pol.pick(follow_up, {}) == first
    assert pol.pick(list(range(20000, 20100)), {}) != first


def test_eviction_runs_every_interval_and_trims_each_worker_to_the_size_by_lru_leaves():
    pol = _policy(("a", "b"), eviction_interval_s=10.0, max_tree_size=12)
    pol.tree.insert("aaaa1111", "a", 1.0)
    pol.tree.insert("aaaa2222", "a", 2.0)  # a: "aaaa" + "1111" + "2222" = 12, at the size
    pol.tree.insert("aaaa3333", "a", 3.0)  # 16 > 12
    pol.tree.insert("b" * 20, "b", 4.0)  # b: 20 > 12, one leaf
    pol.choose("zzzz", {}, now=9.9)
    assert pol.tree.tenant_chars == {"a": 16, "b": 20}  # not due yet
    pol.choose("zzzz", {}, now=10.0)
    assert pol.tree.tenant_chars == pol.tree.sizes() == {"a": 12, "b": 0}
    assert pol.tree.match("aaaa1111") == 4  # the least recently used leaf went
    assert pol.tree.match("aaaa2222") == 8 and pol.tree.match("aaaa3333") == 8
    assert pol.tree.match("bbbb") == 0  # its only leaf, then no one on that node: removed
    pol.tree.insert("aaaa4444", "a", 11.0)
    pol.choose("zzzz", {}, now=19.9)
    assert pol.tree.tenant_chars["a"] == 16  # the next pass is at 20
    pol.choose("zzzz", {}, now=45.0)  # passes missed in between: one pass does what they would
    assert pol.tree.tenant_chars["a"] == 12 and pol.tree.match("aaaa2222") == 4


def test_eviction_takes_a_worker_off_a_shared_node_and_keeps_the_node_for_the_other():
    tree = TenantTree()
    tree.insert("shared", "a", 1.0)
    tree.insert("shared", "b", 2.0)
    tree.insert("mine", "b", 3.0)
    tree.evict(6)  # a is at the size; b (10) loses its least recently used leaf, the shared node
    assert tree.tenant_chars == tree.sizes() == {"a": 6, "b": 4}
    assert tree.prefix_match("shared", 4.0) == (6, "a")


def test_a_joining_worker_starts_empty_and_gets_unmatched_text_and_one_leaving_is_forgotten():
    pol = _policy(("a", "b"))
    pol.pick(list(range(1000, 1100)), {})
    pol.pick(list(range(3000, 3100)), {})
    pol.add_pod("c", 1.0)
    assert pol.tree.tenant_chars["c"] == 0
    assert pol.pick(list(range(40000, 40100)), {}, 2.0) == "c"
    pol.remove_pod("c")
    assert pol.workers == ["a", "b"] and "c" not in pol.tree.sizes() and "c" not in pol.tree.tenant_chars


def test_the_tree_counts_stay_equal_to_the_nodes_over_a_random_history():
    rng = random.Random(3)
    pol = _policy(eviction_interval_s=1.0, max_tree_size=3000)
    heads = [[rng.randrange(1000, 60000) for _ in range(60)] for _ in range(5)]
    for i in range(300):
        pol.pick(rng.choice(heads) + [rng.randrange(1000, 60000) for _ in range(rng.randrange(1, 40))], {}, i * 0.05)
        assert pol.tree.tenant_chars == pol.tree.sizes()
    pol.tree.evict(3000)
    assert max(pol.tree.tenant_chars.values()) <= 3000 and pol.tree.tenant_chars == pol.tree.sizes()
