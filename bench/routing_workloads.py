"""The routing benchmark's workloads: prompts, arrival times and the engines' KV capacity.

A workload is a set of distinct prompts (a group's shared context followed by one of its
questions) and a Poisson arrival schedule whose rate steps up through a ramp. Both are a
pure function of the shape and the seed, so every policy sees the same requests at the
same virtual times. KV capacity per pod is set from the working set (every full block of
every distinct prompt, counted once) divided by the capacity ratio and the pod count.
The ramp's peak is a fraction (`peak_load`) of the cluster's decode capacity with the
engines' default timing: pods x max_num_seqs / (output tokens x the step time of a full
batch). Near it a router that keeps its hits is still below saturation and one that loses
them is not.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from sim.engine import EngineConfig

BLOCK_SIZE = 16
_TOKEN_RANGE = (1000, 60000)  # token ids drawn uniformly: groups never share a block by chance


@dataclass(frozen=True, slots=True)
class Shape:
    name: str
    groups: int
    prompts_per_group: int
    context_tokens: int  # shared by the group
    question_tokens: int  # one per prompt
    output_tokens: int
    pods: int
    capacity_ratio: float  # working set / cluster KV capacity
    peak_load: float  # the ramp's peak rate / decode capacity (see decode_capacity_rps)
    ramp: tuple[float, ...]  # rate of each stage as a fraction of peak_rps
    stage_s: float  # virtual seconds per stage
    each_prompt_once: bool = False  # True: every prompt sent once, shuffled (rate still ramps)
    max_num_seqs: int = 64

    def decode_capacity_rps(self) -> float:
        """Requests/s the pods finish with full batches (engine default timing, no prefill)."""
        c = EngineConfig()
        step = c.tpot_base_s + c.tpot_per_seq_s * self.max_num_seqs
        return self.pods * self.max_num_seqs / (self.output_tokens * step)

    @property
    def peak_rps(self) -> float:
        return self.peak_load * self.decode_capacity_rps()


@dataclass(frozen=True, slots=True)
class Request:
    req_id: str
    arrival: float
    token_ids: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True, slots=True)
class Workload:
    shape: Shape
    seed: int
    requests: tuple[Request, ...]
    working_set_blocks: int
    blocks_per_pod: int
    compulsory_hit_rate: float  # ceiling: every distinct block computed once in the whole cluster


def w1(quick: bool = False) -> Shape:
    """llm-d's shape at 1/10 lengths: 150 groups x 5 users, 600 + 120 prompt tokens, 100 out;
    ramp 5% -> 100% of 90% of decode capacity in 8 stages of 6 s (quick: 2.5 s)."""
    return Shape(name="W1", groups=150, prompts_per_group=5, context_tokens=600,
                 question_tokens=120, output_tokens=100, pods=8, capacity_ratio=0.73, peak_load=0.9,
                 ramp=(0.05, 0.15, 0.3, 0.45, 0.6, 0.75, 0.9, 1.0), stage_s=2.5 if quick else 6.0)


def w2(quick: bool = False) -> Shape:
    """SGLang's generated-shared-prefix shape: 64 groups x 16 prompts, 2048 + 128 prompt tokens,
    256 out; each prompt once, in 4 equal steps up to 90% of decode capacity (quick: 32 groups)."""
    return Shape(name="W2", groups=32 if quick else 64, prompts_per_group=16, context_tokens=2048,
                 question_tokens=128, output_tokens=256, pods=8, capacity_ratio=0.73, peak_load=0.9,
                 ramp=(0.25, 0.5, 0.75, 1.0), stage_s=0.0, each_prompt_once=True)


def _rand_tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    lo, hi = _TOKEN_RANGE
    return tuple(rng.randrange(lo, hi) for _ in range(n))


def _prompts(shape: Shape, rng: random.Random) -> list[tuple[int, ...]]:
    out = []
    for _ in range(shape.groups):
        context = _rand_tokens(rng, shape.context_tokens)
        out.extend(context + _rand_tokens(rng, shape.question_tokens) for _ in range(shape.prompts_per_group))
    return out


def prefix_keys(tokens: tuple[int, ...], block_size: int = BLOCK_SIZE) -> list[int]:
    """One key per full block, chained: equal keys mean equal prefixes (in this process)."""
    keys, k = [], 0
    for i in range(len(tokens) // block_size):
        k = hash((k, tokens[i * block_size:(i + 1) * block_size]))
        keys.append(k)
    return keys


def _distinct_blocks(prompts: list[tuple[int, ...]]) -> int:
    seen: set[int] = set()
    for p in prompts:
        seen.update(prefix_keys(p))
    return len(seen)


def _arrivals(shape: Shape, rng: random.Random, count: int | None) -> list[float]:
    """Poisson arrivals stepping through the ramp; with `count`, stages share it equally."""
    times: list[float] = []
    t = 0.0
    for i, frac in enumerate(shape.ramp):
        rate = shape.peak_rps * frac
        if count is None:
            end = (i + 1) * shape.stage_s
            while True:
                t += rng.expovariate(rate)
                if t >= end:
                    t = end
                    break
                times.append(t)
        else:
            n = count // len(shape.ramp) + (i < count % len(shape.ramp))
            for _ in range(n):
                t += rng.expovariate(rate)
                times.append(t)
    return times


def build(shape: Shape, seed: int) -> Workload:
    rng = random.Random(f"{shape.name}:{seed}")
    prompts = _prompts(shape, rng)
    if shape.each_prompt_once:
        order = prompts[:]
        rng.shuffle(order)
        times = _arrivals(shape, rng, len(order))
    else:
        times = _arrivals(shape, rng, None)
        order = [prompts[rng.randrange(len(prompts))] for _ in times]
    requests = tuple(Request(f"r{i}", t, p, shape.output_tokens) for i, (t, p) in enumerate(zip(times, order)))
    ws = _distinct_blocks(prompts)
    prompt_tokens = sum(len(r.token_ids) for r in requests)
    return Workload(
        shape=shape, seed=seed, requests=requests, working_set_blocks=ws,
        blocks_per_pod=math.ceil(ws / shape.capacity_ratio / shape.pods),
        compulsory_hit_rate=1.0 - _compulsory_misses(requests) / prompt_tokens if prompt_tokens else 0.0,
    )


def _compulsory_misses(requests: tuple[Request, ...]) -> int:
    """Prompt tokens no router can serve from cache: each request's tokens past its last hittable
    block (the last prompt token is always computed, as in vLLM), plus every distinct hittable
    block once, the first time any pod sees it."""
    tail = 0
    hittable: list[tuple[int, ...]] = []
    for r in requests:
        n = len(r.token_ids)
        keep = (n - 1) // BLOCK_SIZE * BLOCK_SIZE
        tail += n - keep
        hittable.append(r.token_ids[:keep])
    return tail + _distinct_blocks(list(set(hittable))) * BLOCK_SIZE
