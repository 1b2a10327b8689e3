"""W11: a prefill/decode-disaggregated fleet under a long-prompt chat mix, on a virtual clock (issue 28).

Two prefill engines and two decode engines (`sim.engine.EngineModel`, the `kvgate sim` timing model), all
publishing KV events straight into one `kvcache.index.PrefixIndex` (no delay, no loss: W11 is about the pair's
choice, not event delivery; bench.routing_sim covers that). kvgate's real `routing.pd.PDPlanner` over a real
`Router` plans each request; the run plays the handoff as plugin.pd and the engines do:
- split: the prefill engine runs the prompt with max_tokens 1; when it finishes, the decode engine receives the
  request `transfer_s_per_block` x the prompt's blocks later (the pull) with the whole prompt's KV
  (`remote_tokens`: only the last token is computed there) and decodes; the prefill engine's count is released
  when its leg ends, the decode engine's when the request does;
- whole: the decode engine runs the request alone.
The client's TTFT is the decode engine's first token less the arrival. The prefill hit rate is, over every
request, the prompt tokens the engine that computed its prompt (the prefill engine, or the decode engine for a
whole request) found cached, over all prompt tokens.

Policies: `pd` (kvgate's: the decode engine by pd-decode, the decider, the prefill engine by the pd strategy's
TTFT cost model on the index), `kv-sync-pd` (the same pair planning, the prefill engine by kv-sync's scores: a
P/D-aware kv-sync, KVGATE_PD_STRATEGIES=kv-sync), `pd-always` (the same, threshold 0: every request split), `pd-never` (every request
served whole on a decode engine; the prefill engines idle), `random-pair` (a uniformly random prefill and decode
engine, every request split: the toy proxy's round robin, in effect). Targets (issue 28): pd's prefill hit rate
>= random-pair's + 10 points with a lower TTFT p90; pd's TTFT p90 no worse than pd-always's nor pd-never's.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import heapq
import json
import math
import sys
from dataclasses import dataclass

import numpy as np

from bench.routing_workloads import BLOCK_SIZE, ChatShape, Workload, build
from kvcache.index import PrefixIndex
from routing.pd import DISAGGREGATED, PDConfig, PDPlan, PDPlanner
from routing.pods import KVEventsEndpoint, Pod
from routing.registry import PodRegistry
from routing.router import Router
from routing.scheduling.scoring import RouteRequest
from routing.scheduling.strategies import StrategyConfig
from routing.state.counts import LocalCounts
from sim.engine import EngineConfig, EngineModel

MODEL = "sim-model"
POLICIES = ("pd", "kv-sync-pd", "pd-always", "pd-never", "random-pair")
PREFILL, DECODE = ("prefill-0", "prefill-1"), ("decode-0", "decode-1")


def w11(load: float = 0.35) -> ChatShape:
    """Long prompts: 40 Zipf(1) tenants with 2,000-4,000-token system prompts, 2-4 turns of 100-300 user tokens
    and 100-token replies; four engines (2 prefill + 2 decode); `load` of the four engines' decode capacity."""
    return ChatShape(name="W11", tenants=40, zipf_s=1.0, system_tokens=(2000, 4000), user_tokens=(100, 300),
                     output_tokens=100, turns=(2, 4), turn_gap_s=(2.5, 5.0), duration_s=16.0, pods=4,
                     capacity_ratio=0.73, load=load)


@dataclass(slots=True)
class PDResult:
    policy: str
    seed: int
    requests: int
    prefill_hit_rate: float
    ttft_p50_s: float
    ttft_p90_s: float
    split_share: float  # requests served with a prefill leg


class _RandomPair:
    """Random pairing: a uniformly random prefill and decode engine, every request split."""

    def __init__(self, router: Router, registry: PodRegistry) -> None:
        self.router, self.registry = router, registry

    async def plan(self, request: RouteRequest) -> PDPlan:
        pods = self.registry.pods()
        rr = dataclasses.replace(request, strategy="random")
        decode = await self.router.pick(rr, subset=frozenset(p.endpoint for p in pods if p.role == "decode"))
        prefill = await self.router.pick(rr, subset=frozenset(p.endpoint for p in pods if p.role == "prefill"))
        return PDPlan(decode, prefill, DISAGGREGATED, None)


def run(workload: Workload, policy: str, seed: int, *, transfer_s_per_block: float = 0.0002,
        threshold_tokens: int = 256) -> PDResult:
    return asyncio.run(_run(workload, policy, seed, transfer_s_per_block, threshold_tokens))


async def _run(workload: Workload, policy: str, seed: int, transfer_s: float, threshold: int) -> PDResult:
    cfg = EngineConfig(block_size=BLOCK_SIZE, num_blocks=workload.blocks_per_pod,
                       max_num_seqs=workload.shape.max_num_seqs)
    names = (*PREFILL, *DECODE)
    engines = {n: EngineModel(cfg) for n in names}
    pods = [Pod(n, "127.0.0.1", 8000 + i, MODEL, kv_events=KVEventsEndpoint(), role="prefill" if n in PREFILL
                else "decode") for i, n in enumerate(names)]
    registry = PodRegistry(pods)
    index = PrefixIndex()
    clock = [0.0]
    router = Router(registry, default_strategy="pd", counts=LocalCounts(), index=index, seed=seed,
                    config=StrategyConfig(clock=lambda: clock[0]))
    if policy == "random-pair":
        planner: PDPlanner | _RandomPair = _RandomPair(router, registry)
    else:
        limit = {"pd": threshold, "kv-sync-pd": threshold, "pd-always": 0, "pd-never": 10**9}[policy]
        planner = PDPlanner(router, registry, PDConfig(threshold_tokens=limit))
    reqs = {r.req_id: r for r in workload.requests}
    arrivals = sorted(workload.requests, key=lambda r: r.arrival)
    pending: list[tuple[float, int, str]] = []  # (time, seq, request id): a decode leg arriving after its pull
    seq = 0
    plans: dict[str, PDPlan] = {}
    prefill_cached: dict[str, int] = {}
    ttfts: list[float] = []
    hit = total = split = 0
    next_t = dict.fromkeys(names, math.inf)

    def pump(n: str) -> None:
        t = engines[n].next_event_time()
        next_t[n] = math.inf if t is None else t
        for batch in engines[n].drain_events():
            index.apply(n, MODEL, 0, batch.events)

    i = 0
    while True:
        te = min(next_t.values())
        tp = pending[0][0] if pending else math.inf
        ta = arrivals[i].arrival if i < len(arrivals) else math.inf
        t = min(te, tp, ta)
        if t == math.inf:
            break
        clock[0] = t
        if te <= t:  # engines first, at equal times
            for n in names:
                if next_t[n] <= t:
                    for comp in engines[n].advance(t):
                        rid, _, leg = comp.req_id.partition("/")
                        plan = plans[rid]
                        if leg == "p":  # the prefill leg ended: the pull, then the decode leg
                            assert plan.prefill is not None
                            await router.release(plan.prefill)
                            prefill_cached[rid] = comp.cached_tokens
                            seq += 1
                            blocks = -(-comp.prompt_tokens // BLOCK_SIZE)
                            heapq.heappush(pending, (t + blocks * transfer_s, seq, rid))
                        else:
                            await router.release(plan.decode)
                            ttfts.append(comp.first_token_time - reqs[rid].arrival)
                            cached = prefill_cached.pop(rid, comp.cached_tokens)
                            hit, total = hit + cached, total + comp.prompt_tokens
                            del plans[rid]
                    pump(n)
        elif tp <= t:
            _, _, rid = heapq.heappop(pending)
            d = plans[rid].decode.pod.name
            r = reqs[rid]
            engines[d].add_request(rid, r.token_ids, r.max_tokens, t, remote_tokens=len(r.token_ids))
            pump(d)
        else:
            r = arrivals[i]
            i += 1
            request = RouteRequest(MODEL, list(r.token_ids), "kv-sync" if policy == "kv-sync-pd" else "pd", r.req_id)
            plan = plans[r.req_id] = await planner.plan(request)
            if plan.prefill is not None:
                split += 1
                p = plan.prefill.pod.name
                engines[p].add_request(r.req_id + "/p", r.token_ids, 1, t)
                pump(p)
            else:
                d = plan.decode.pod.name
                engines[d].add_request(r.req_id, r.token_ids, r.max_tokens, t)
                pump(d)
    arr = np.array(ttfts) if ttfts else np.zeros(1)
    return PDResult(policy, seed, len(ttfts), hit / total if total else 0.0, float(np.percentile(arr, 50)),
                    float(np.percentile(arr, 90)), split / len(arrivals) if arrivals else 0.0)


def report(results: dict[str, list[PDResult]]) -> tuple[list[str], list[tuple[str, bool, str]]]:
    """The table's lines and the targets: (name, met, detail)."""
    mean = {p: PDResult(p, -1, sum(r.requests for r in rs), float(np.mean([r.prefill_hit_rate for r in rs])),
                        float(np.mean([r.ttft_p50_s for r in rs])), float(np.mean([r.ttft_p90_s for r in rs])),
                        float(np.mean([r.split_share for r in rs]))) for p, rs in results.items()}
    lines = [f"{'policy':<12} {'prefill hit':>11} {'TTFT p50 s':>10} {'TTFT p90 s':>10} {'split':>6} {'requests':>8}"]
    for p, m in mean.items():
        lines.append(f"{p:<12} {m.prefill_hit_rate:>10.1%} {m.ttft_p50_s:>10.3f} {m.ttft_p90_s:>10.3f} "
                     f"{m.split_share:>5.0%} {m.requests:>8}")
    pd, rnd = mean["pd"], mean["random-pair"]
    targets = [
        ("pd prefill hit rate >= random-pair + 10 points", pd.prefill_hit_rate >= rnd.prefill_hit_rate + 0.10,
         f"{pd.prefill_hit_rate:.1%} vs {rnd.prefill_hit_rate:.1%}"),
        ("pd TTFT p90 < random-pair", pd.ttft_p90_s < rnd.ttft_p90_s, f"{pd.ttft_p90_s:.3f} vs {rnd.ttft_p90_s:.3f} s"),
        ("pd TTFT p90 <= pd-always", pd.ttft_p90_s <= mean["pd-always"].ttft_p90_s,
         f"{pd.ttft_p90_s:.3f} vs {mean['pd-always'].ttft_p90_s:.3f} s"),
        ("pd TTFT p90 <= pd-never", pd.ttft_p90_s <= mean["pd-never"].ttft_p90_s,
         f"{pd.ttft_p90_s:.3f} vs {mean['pd-never'].ttft_p90_s:.3f} s"),
    ]
    return lines, targets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.routing_pd", description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--load", type=float, default=0.35, help="of the four engines' decode capacity")
    parser.add_argument("--threshold-tokens", type=int, default=256, help="pd's KVGATE_PD_THRESHOLD_TOKENS")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    shape = w11(args.load)
    results: dict[str, list[PDResult]] = {p: [] for p in POLICIES}
    for seed in range(1, args.seeds + 1):
        workload = build(shape, seed)
        for p in POLICIES:
            results[p].append(run(workload, p, seed, threshold_tokens=args.threshold_tokens))
    lines, targets = report(results)
    if args.json:
        print(json.dumps({"workload": "W11", "shape": shape.as_dict(), "seeds": args.seeds,
                          "results": {p: [dataclasses.asdict(r) for r in rs] for p, rs in results.items()},
                          "targets": [{"target": n, "met": ok, "detail": d} for n, ok, d in targets]}))
    else:
        print(f"W11 ({shape.describe()}; 2 prefill + 2 decode engines), {args.seeds} seeds, means:")
        print("\n".join(lines))
        for name, ok, detail in targets:
            print(f"[{'met' if ok else 'MISSED'}] {name}: {detail}")
    return 0 if all(ok for _, ok, _ in targets) else 1


if __name__ == "__main__":
    sys.exit(main())
