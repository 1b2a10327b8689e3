"""`kvgate bench bakeoff`: its plan, its flushes, its summary and targets, and one short run of the real thing
(three simulated engines; kvgate as shipped behind a real Envoy with redis-server; SGLang's model gateway)."""
from __future__ import annotations

import asyncio
import importlib.util
import shutil
from collections import Counter

import httpx
import pytest

from bench import bakeoff


def test_a_plan_is_the_same_for_a_seed_and_sends_exactly_the_requests_asked():
    w = bakeoff.WORKLOAD
    plan = bakeoff.make_plan(7, 100)
    assert plan == bakeoff.make_plan(7, 100) and plan != bakeoff.make_plan(8, 100)
    assert plan.requests == sum(len(c.questions) for c in plan.conversations) == 100
    assert all(1 <= len(c.questions) <= w.turns[1] for c in plan.conversations)
    assert all(w.turns[0] <= len(c.questions) for c in plan.conversations[:-1])  # the last may be cut short
    assert all(w.think_s[0] <= t <= w.think_s[1] for c in plan.conversations for t in c.thinks)
    assert len(plan.systems) == w.tenants and all(len(s.split()) >= w.system_words for s in plan.systems)
    tenants = Counter(c.tenant for c in bakeoff.make_plan(1, 4000).conversations)
    assert tenants[0] > tenants[1] > tenants[w.tenants - 1]  # Zipf-popular


def test_evicting_engines_hold_about_half_the_plans_distinct_prompt_tokens():
    plans = [bakeoff.make_plan(s, 168) for s in (1, 2)]
    tokens = max(p.distinct_prompt_tokens(bakeoff.WORKLOAD) for p in plans)
    blocks = bakeoff.engine_blocks("evicting", plans, bakeoff.WORKLOAD, 3)
    assert abs(blocks * 3 * bakeoff.BLOCK_SIZE - tokens / 2) <= 3 * bakeoff.BLOCK_SIZE
    assert bakeoff.engine_blocks("steady", plans, bakeoff.WORKLOAD, 3) * bakeoff.BLOCK_SIZE * 3 > 2 * tokens


def test_flushes_take_the_engines_in_turn_or_drawn_the_same_for_every_router():
    assert bakeoff.flush_order("steady", 1, 3, 100) is None
    assert bakeoff.flush_order("flush-rotate", 1, 3, 100) == [0, 1, 2]
    drawn = bakeoff.flush_order("flush-random", 1, 3, 100)
    assert drawn == bakeoff.flush_order("flush-random", 1, 3, 100) != bakeoff.flush_order("flush-random", 2, 3, 100)
    assert len(drawn) == 6 and set(drawn) <= {0, 1, 2}


def test_a_reset_refused_while_requests_run_is_asked_again_and_one_failed_is_counted_apart():
    async def go():
        result = bakeoff.RunResult()
        busy = iter([409, 409, 200])  # refused while requests run, then taken
        transport = httpx.MockTransport(lambda req: httpx.Response(
            next(busy) if "busy" in str(req.url) else 200 if "good" in str(req.url) else 503))
        async with httpx.AsyncClient(transport=transport) as client:
            flusher = bakeoff.Flusher(["http://good", "http://bad", "http://busy"], [0, 1, 2], result)
            for _ in range(3 * bakeoff.FLUSH_EVERY):
                flusher.sending(client)
            await flusher.settle()
        async with httpx.AsyncClient(transport=httpx.MockTransport(_refuse)) as client:
            flusher = bakeoff.Flusher(["http://down"], [0], result)
            for _ in range(bakeoff.FLUSH_EVERY):
                flusher.sending(client)
            await flusher.settle()
        return result
    result = asyncio.run(go())
    assert (result.flushes, result.flush_errors) == (2, 2)


def _refuse(request):
    raise httpx.ConnectError("refused", request=request)


def _run(ttft_ms, engines, hits, queries, cpu_s=0.1):
    return bakeoff.RunResult(ttft_s=[t / 1e3 for t in ttft_ms], tpot_s=[t / 1e4 for t in ttft_ms],
                             tenants={0: Counter(engines)}, hits=hits, queries=queries, cpu_s=cpu_s)


def test_the_summary_pools_the_runs_and_the_targets_compare_kv_sync_with_sglang():
    ours = bakeoff.summarize_router([_run([10, 20, 30], {"sim0": 3}, 70, 100), _run([40], {"sim1": 1}, 10, 100)])
    assert ours["requests"] == 4 and ours["hit_rate"] == 0.4 and ours["hit_rate_runs"] == [0.7, 0.1]
    assert (ours["ttft_mean_ms"], ours["ttft_p50_ms"], ours["ttft_p90_ms"]) == (25.0, 30.0, 40.0)
    assert (ours["tpot_p50_ms"], ours["tpot_p90_ms"]) == (3.0, 4.0)
    assert ours["engines"] == {"sim0": 3, "sim1": 1} and ours["router_cpu_ms_per_request"] == 50.0
    theirs = bakeoff.summarize_router([_run([5, 25, 28, 45], {"sim0": 4}, 403, 1000, cpu_s=None)])
    assert theirs["router_cpu_ms_per_request"] is None
    t = bakeoff.targets({"steady": {"kv-sync": ours, "sglang": theirs}})
    assert t == {"steady: kv-sync ttft_mean_ms <= sglang's": True, "steady: kv-sync ttft_p50_ms <= sglang's": False,
                 "steady: kv-sync ttft_p90_ms <= sglang's": True,
                 "steady: kv-sync hit_rate >= sglang's - 0.5 point": True}  # 40.0% against 40.3%
    assert not bakeoff.targets({"steady": {"kv-sync": ours, "sglang": {**theirs, "hit_rate": 0.406}}})[
        "steady: kv-sync hit_rate >= sglang's - 0.5 point"]
    for summary in (ours, theirs):
        summary["system_missed_floor"] = 1
    text = bakeoff.table({"scenarios": {"steady": {"kv-sync": ours, "sglang": theirs}}, "requests_per_run": 4,
                          "reps": 1, "seconds": 1.0, "targets": t, "workload": {"conversations_at_once": 8}})
    assert "steady        kv-sync   40.0    25.0    30.0    40.0  3.00       0    50.00    0    0  1.00  3 / 1" in text
    assert "target steady: kv-sync ttft_p50_ms <= sglang's: MISSED" in text


@pytest.mark.skipif(not shutil.which("redis-server"), reason="redis-server (Debian) is installed by ./dev setup")
def test_a_short_bakeoff_runs_every_request_through_kvgate_and_sglang_with_the_flushes():
    result = bakeoff.run(["flush-rotate"], ["kv-sync", "sglang"], requests=40, reps=1, log=lambda m: None)
    s = result["scenarios"]["flush-rotate"]
    for router in ("kv-sync", "sglang"):
        r = s[router]
        assert r["requests"] == 40 and r["errors"] == 0, r["error_samples"]
        assert r["flushes"] == 2 and r["flush_errors"] == 0
        assert sum(r["engines"].values()) == 40 and set(r["engines"]) <= {"sim0", "sim1", "sim2"}
        assert 0.3 < r["hit_rate"] < 1.0  # later turns hit their history; the first of each tenant cannot
        assert 0 < r["ttft_p50_ms"] <= r["ttft_p90_ms"] and r["router_cpu_ms_per_request"] > 0
        assert 2.0 <= r["tpot_p50_ms"] <= r["tpot_p90_ms"]  # the engines take 2 ms a token, more with a batch
        # every tenant's first request misses; turns after a flush of their engine may lose their history too
        assert r["system_missed_floor"] <= r["system_missed"] < 40 and 0 <= r["history_lost"] < 40
        assert 1 / 3 <= r["tenant_home_share"] <= 1
    assert set(result["targets"]) == {f"flush-rotate: kv-sync {m}" for m in (
        "ttft_mean_ms <= sglang's", "ttft_p50_ms <= sglang's", "ttft_p90_ms <= sglang's",
        "hit_rate >= sglang's - 0.5 point")}


def _listening(pid: int) -> set[tuple[str, int]]:
    """The (address, port) pairs process `pid` listens on over TCP (IPv4 and IPv6), from /proc."""
    import os
    import socket
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                    continue
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)
                # /proc prints each 32-bit word in host order (little-endian here)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                out.add((socket.inet_ntop(family, raw), int(port, 16)))
    return out


@pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None, reason="sglang-router (the bench extra)")
def test_sglangs_router_listens_on_loopback_only_and_two_run_side_by_side():
    """Its metrics server too (its default: 0.0.0.0:29000): two routers on one machine (the two Pythons' suites side
    by side in CI) each start, and nothing of theirs listens beyond loopback."""
    from bench.path import MODEL, SIM_ARGS, start_sglang
    from devkit.stack import Stack
    with Stack() as stack:
        pods = stack.engines(1, model=MODEL, extra=SIM_ARGS)
        urls = [f"http://127.0.0.1:{p['port']}" for p in pods]
        started = [start_sglang(stack, urls, f"sglang{i}") for i in range(2)]
        for s in started:
            assert s is not None
            proc, port = s
            addresses = _listening(proc.popen.pid)
            assert ("127.0.0.1", port) in addresses and len(addresses) >= 2, addresses  # the router and its metrics
            assert {a for a, _ in addresses} == {"127.0.0.1"}, addresses
