"""kv-sync against the real event-fed PrefixIndex (kvcache.index)."""
from __future__ import annotations

import asyncio
import collections


from kvcache.events import BlockRemoved, BlockStored
from kvcache.index import PrefixIndex
from routing.pods import Pod
from routing.registry import PodRegistry
from routing.router import Router
from routing.scoring import RouteRequest
from routing.strategies import StrategyConfig

BS = 16
PROMPT = list(range(1000, 1000 + 8 * BS))  # 8 full blocks


def stored(tokens, n_blocks, medium="GPU", first_hash=1, lora_name=None):
    hashes = tuple(range(first_hash, first_hash + n_blocks))
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tuple(tokens[: n_blocks * BS]),
                       block_size=BS, medium=medium, lora_name=lora_name)


def setup(*pods):
    index = PrefixIndex(max_entries=10_000)
    reg = PodRegistry(pods or [Pod(n, f"10.0.0.{i}", 8000, "m") for i, n in enumerate("abc")])
    return index, Router(reg, default_strategy="kv-sync", index=index, seed=0)


async def test_kv_sync_follows_the_index():
    index, r = setup()
    index.apply("a", "m", 0, [stored(PROMPT, 2)])
    index.apply("b", "m", 0, [stored(PROMPT, 6, first_hash=100)])
    d = await r.pick(RouteRequest("m", PROMPT + [7, 7, 7]))
    assert (d.pod.name, d.matched_blocks, d.total_blocks) == ("b", 6, 8)
    await r.release(d)
    # b evicts its blocks: a's 2 leading blocks win now
    index.apply("b", "m", 0, [BlockRemoved(tuple(range(100, 106)), medium="GPU")])
    d = await r.pick(RouteRequest("m", PROMPT))
    assert (d.pod.name, d.matched_blocks) == ("a", 2)


async def test_gpu_outranks_cpu_for_the_same_prefix():
    index, r = setup()
    index.apply("a", "m", 0, [stored(PROMPT, 8, medium="CPU")])
    index.apply("b", "m", 0, [stored(PROMPT, 8, medium="GPU", first_hash=50)])
    assert (await r.pick(RouteRequest("m", PROMPT))).pod.name == "b"
    # CPU with a longer prefix beats GPU with a shorter one: 8 x 0.8 > 5 x 1.0
    index.apply("b", "m", 0, [BlockRemoved(tuple(range(55, 58)), medium="GPU")])
    assert (await r.pick(RouteRequest("m", PROMPT))).pod.name == "a"


async def test_adapter_prefixes_are_kept_apart_from_the_base_model():
    pods = [Pod("a", "10.0.0.1", 8000, "m", lora=("sql",)), Pod("b", "10.0.0.2", 8000, "m", lora=("sql",))]
    index, r = setup(*pods)
    index.apply("a", "m", 0, [stored(PROMPT, 8)])  # base model blocks
    index.apply("b", "m", 0, [stored(PROMPT, 8, first_hash=200, lora_name="sql")])
    assert (await r.pick(RouteRequest("sql", PROMPT))).pod.name == "b"
    assert (await r.pick(RouteRequest("m", PROMPT))).pod.name == "a"


async def test_burst_on_one_cached_prefix_is_spread_by_the_guard():
    pods = [Pod(n, f"10.0.0.{i}", 8000, "m") for i, n in enumerate("abcd")]
    index, r = setup(*pods)
    index.apply("a", "m", 0, [stored(PROMPT, 8)])
    decisions = await asyncio.gather(*(r.pick(RouteRequest("m", PROMPT, request_id=str(i))) for i in range(100)))
    per_pod = collections.Counter(d.pod.name for d in decisions)
    assert per_pod.most_common(1)[0][0] == "a"  # affinity kept...
    least = min(per_pod[p] for p in "abcd")
    assert per_pod["a"] - least <= max(StrategyConfig().guard_abs_slack, 0.5 * least) and least > 0  # ...within the guard's slack
    snap = r.debug_snapshot()
    assert snap["index"]["entries"] == 8
    assert sum(p["running"] for p in snap["pods"]) == 100
