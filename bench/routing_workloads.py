"""The routing benchmark's workloads: prompts, arrival times, the engines' KV capacity, and the
fleet's scheduled changes (cache flushes, an engine joining).

Every workload is a pure function of its shape and the seed, so every policy sees the same
requests at the same virtual times (and the same flushes and joins). KV capacity per pod is
set from the working set (every full block of every distinct prompt, counted once) divided by
the capacity ratio and the pod count (the pods at the start).

Two generators:

- `Shape` (W1, W2): a set of distinct prompts (a group's shared context followed by one of its
  questions) and a Poisson arrival schedule whose rate steps up through a ramp. The ramp's peak
  is a fraction (`peak_load`) of the cluster's decode capacity with the engines' default timing:
  pods x max_num_seqs / (output tokens x the step time of a full batch). Near it a router that
  keeps its hits is still below saturation and one that loses them is not.
- `ChatShape` (W3, W4, W5): multi-turn chats as users reported them. Tenants are Zipf-popular
  (weight 1/rank^s); each has a system prompt of `system_tokens` (uniform in the range). A
  conversation starts at Poisson times at a constant rate, picks a tenant, and has 2-4 turns:
  turn 1's prompt is the system prompt + a user message, turn k+1's is turn k's prompt + a
  synthetic assistant reply of `output_tokens` tokens + a new user message (the client re-sends
  its history). The reply is random tokens, not what the engine generated, so a turn can hit
  only the previous turn's prompt blocks (with real replies the engine that served turn k would
  also hold the reply's blocks, which would make keeping a conversation on its engine worth
  even more).
  Each turn arrives `turn_gap_s` (uniform in the range) after the previous turn's arrival: a
  pre-generated open-loop schedule (every policy sees identical arrivals) standing in for
  "the next turn after the reply": the gap's lower bound is above a turn's latency at the
  bench's load when routing keeps its hits (TTFT + output_tokens decode steps of a full batch,
  100 x 20.8 ms ~ 2.1 s), so most turns are sent after the previous one finished; when a
  policy is slower the next turn still arrives on time, as an impatient client's would.
  Conversations start at `load` x the starting pods' decode capacity / the mean turn count per
  second for `duration_s`, so the request rate climbs to `load` x decode capacity as later
  turns add up (~8 s in), holds until the starts stop, then tails off as conversations end;
  over a hundred conversations are in flight at once. System prompts are 600-1200 tokens, the
  reported ~1,200 at 1/2 to 1 scale rather than W1's 1/10: with the `kvgate sim` timing
  (0.1 ms/token of prefill, 5 ms overhead) a missed system prompt costs 60-120 ms, so, as in
  W1 (600-token contexts), prefill dominates TTFT and a miss shows; 120 tokens (1/10) would
  cost 12 ms, lost in the overhead and in decode queueing.
  `flush_every_s` > 0 schedules one engine's prefix-cache reset every that many seconds until
  the last arrival, the engine rotating through the pods in a seeded order; `join_at_s` adds
  one engine (pod index `pods`) at that time.
  The working set (distinct prompt blocks) grows with the run's length, and KV capacity follows
  it, so `--quick` runs the chat workloads unchanged (one seed instead of three).

The chat scenarios (40 Zipf(1) tenants, 600-1200-token system prompts, 40-120-token user
messages, 100-token replies and outputs, 2-4 turns 2.5-5 s apart, starts for 16 s, 3 pods):
- W3 pressure: 85% of decode capacity; KV capacity 50% of the working set (capacity_ratio 2).
- W4 flushes: 60% of decode capacity (at 85% the misses after each flush saturate every
  policy's prefill); KV at W1's 73% ratio; one engine flushed every 2 s.
- W5 scale-out: 120% of the 3 starting pods' decode capacity, KV at 73%; a 4th pod (same KV
  capacity) joins at 10 s, once the rate has reached its plateau; then the fleet runs at 90%.
- W3-W5 at three load levels (`at_level`): these are `heavy`; `medium` is half that load (W3-medium
  42.5%, W4-medium 30% with a flush every 3 s, W5-medium 60%), `light` 3% of decode capacity over 64 s
  (~9 conversations in flight, as the measurement against SGLang's gateway had 8; W4-light flushes
  every 7 s, ~20 requests apart as there).
- W8-W10 (issue 25) are W3's conversations (`seed_name`: the same tokens and times) with what the
  shape adds: a model shape (`model_shape`, sim.shapes: W8 hybrid, sliding window 128 + full attention,
  sparse retention; KV capacity counted per group), per-user salts (`salted_share`, W9, at 60% load),
  images (`image_share`, W10 at 60% load: a run of `image_tokens` placeholder tokens, IMAGE_TOKEN, before the
  turn's user text, with a kvcache.blockkeys.MediaItem; identifier: the client's uuid or the content
  hash). Salts and images are drawn from a generator of their own, so the rest stays W3's. A request's
  `extras` is what kvgate's request carries; the working set, the compulsory-miss bound and the
  reusable prefixes key blocks with their salt and media (`request_keys`) as the engines' hashes do.
"""
from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass
from typing import Any

from kvcache.blockkeys import BlockExtras, MediaItem
from sim.engine import EngineConfig
from sim.media import image_identifier
from sim.shapes import MODEL_SHAPES

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
        return _decode_capacity_rps(self.pods, self.max_num_seqs, self.output_tokens)

    @property
    def peak_rps(self) -> float:
        return self.peak_load * self.decode_capacity_rps()

    def describe(self) -> str:
        return (f"{self.groups} groups x {self.prompts_per_group}, {self.context_tokens}+{self.question_tokens} "
                f"prompt tokens, {self.output_tokens} out, {self.pods} pods")

    def as_dict(self) -> dict:
        return {"groups": self.groups, "prompts_per_group": self.prompts_per_group,
                "context_tokens": self.context_tokens, "question_tokens": self.question_tokens,
                "output_tokens": self.output_tokens, "pods": self.pods, "capacity_ratio": self.capacity_ratio,
                "peak_load": self.peak_load, "peak_rps": round(self.peak_rps, 1), "ramp": list(self.ramp),
                "stage_s": self.stage_s, "each_prompt_once": self.each_prompt_once}


def _decode_capacity_rps(pods: int, max_num_seqs: int, output_tokens: int) -> float:
    c = EngineConfig()
    step = c.tpot_base_s + c.tpot_per_seq_s * max_num_seqs
    return pods * max_num_seqs / (output_tokens * step)


@dataclass(frozen=True, slots=True)
class ChatShape:
    """Multi-turn chats of Zipf-popular tenants (see the module docstring)."""

    name: str
    tenants: int
    zipf_s: float  # tenant of rank k (1-based) has weight 1 / k**zipf_s
    system_tokens: tuple[int, int]  # per tenant, uniform in [lo, hi]
    user_tokens: tuple[int, int]  # per turn, uniform in [lo, hi]
    output_tokens: int  # each turn's max_tokens, and the synthetic reply's length in the next turn's prompt
    turns: tuple[int, int]  # per conversation, uniform in [lo, hi]
    turn_gap_s: tuple[float, float]  # next turn's arrival after this one's, uniform in [lo, hi]
    duration_s: float  # conversations start in [0, duration_s)
    pods: int  # at the start
    capacity_ratio: float  # working set / KV capacity of the starting pods
    load: float  # request rate / decode capacity of the starting pods
    flush_every_s: float = 0.0  # > 0: one engine's prefix cache reset this often
    flush_order: str = "rotate"  # which engine: "rotate" through the pods (seeded order) or "random" (seeded draws)
    join_at_s: float | None = None  # one engine joins at this time
    max_num_seqs: int = 64
    dp_size: int = 1  # > 1: the last starting pod is a data-parallel engine of this many ranks
    # The model's KV cache groups (sim.shapes: dense, hybrid, mamba-hybrid); None: one full-attention group
    # publishing events without group fields (the shape W1-W7 ran on before groups were modelled).
    model_shape: str | None = None
    retention: str = "sparse"  # sparse groups' retention (sim.shapes.RETENTIONS), with a model_shape
    sliding_window: int = 128
    seed_name: str | None = None  # the requests are those of this workload's name (same seed): W8 = W3's
    salted_share: float = 0.0  # share of the conversations (users) sending a cache_salt of their own
    image_share: float = 0.0  # share of the turns whose user message starts with an image
    image_tokens: int = 256  # placeholder tokens per image
    tenant_images: int = 4  # images per tenant that its users send again and again (Zipf(1)-popular)
    repeat_image_share: float = 0.5  # share of images drawn from the tenant's images; the rest are new
    uuid_share: float = 0.5  # share of the clients (conversations) giving each image a uuid
    # The APIs the conversations speak, one per conversation drawn uniformly (W12): "chat" and "messages" resend
    # their history; "responses" continues by previous_response_id after its first turn (the engine that stored
    # the conversation holds it: such a turn goes there and carries no tokens for kvgate). Empty: all chat.
    api_mix: tuple[str, ...] = ()

    @property
    def kv_groups(self) -> int:
        """KV cache groups of the model (each holds its own blocks of a prompt)."""
        return len(MODEL_SHAPES[self.model_shape](16, self.sliding_window)) if self.model_shape else 1

    @property
    def engines(self) -> int:
        """Engines at the start: a data-parallel pod's ranks count one each (each has its own KV
        cache and batch, as each rank has its own GPU)."""
        return self.pods + self.dp_size - 1

    def decode_capacity_rps(self) -> float:
        return _decode_capacity_rps(self.engines, self.max_num_seqs, self.output_tokens)

    @property
    def request_rps(self) -> float:
        return self.load * self.decode_capacity_rps()

    def describe(self) -> str:
        extra = ""
        if self.flush_every_s > 0:
            extra += f"; one engine's cache flushed every {self.flush_every_s:g} s"
            if self.flush_order == "random":
                extra += " (a random engine)"
        if self.join_at_s is not None:
            extra += f"; an engine joins at {self.join_at_s:g} s"
        if self.dp_size > 1:
            extra += f"; pod-{self.pods - 1} is data-parallel with {self.dp_size} ranks"
        if self.model_shape == "hybrid":
            extra += f"; model hybrid (sliding window {self.sliding_window} + full attention, {self.retention} retention)"
        elif self.model_shape is not None:
            extra += f"; model {self.model_shape}" + (f" ({self.retention} retention)" if self.model_shape != "dense" else "")
        if self.salted_share > 0:
            extra += f"; {self.salted_share:.0%} of users send a cache_salt of their own"
        if self.api_mix:
            extra += f"; each conversation speaks one of {', '.join(self.api_mix)} (responses: by previous_response_id)"
        if self.image_share > 0:
            extra += (f"; {self.image_share:.0%} of turns start with an image ({self.image_tokens} tokens; "
                      f"{self.repeat_image_share:.0%} from {self.tenant_images} per tenant, {self.uuid_share:.0%} "
                      f"of clients send uuids)")
        return (f"chat: {self.tenants} Zipf({self.zipf_s:g}) tenants, {self.system_tokens[0]}-{self.system_tokens[1]}"
                f"-token system prompts, {self.turns[0]}-{self.turns[1]} turns (+{self.user_tokens[0]}-"
                f"{self.user_tokens[1]} user, +{self.output_tokens} reply tokens each), {self.output_tokens} out, "
                f"{self.request_rps:.0f} req/s over {self.duration_s:g} s, {self.pods} pods{extra}")

    def as_dict(self) -> dict:
        return {"tenants": self.tenants, "zipf_s": self.zipf_s, "system_tokens": list(self.system_tokens),
                "user_tokens": list(self.user_tokens), "output_tokens": self.output_tokens,
                "turns": list(self.turns), "turn_gap_s": list(self.turn_gap_s), "duration_s": self.duration_s,
                "pods": self.pods, "capacity_ratio": self.capacity_ratio, "load": self.load,
                "request_rps": round(self.request_rps, 1), "flush_every_s": self.flush_every_s,
                "flush_order": self.flush_order if self.flush_every_s > 0 else None,
                "join_at_s": self.join_at_s, "dp_size": self.dp_size, "model_shape": self.model_shape,
                "retention": self.retention if self.model_shape not in (None, "dense") else None,
                "sliding_window": self.sliding_window if self.model_shape == "hybrid" else None,
                "salted_share": self.salted_share, "image_share": self.image_share,
                "image_tokens": self.image_tokens if self.image_share else None, "api_mix": list(self.api_mix)}


@dataclass(frozen=True, slots=True)
class Request:
    req_id: str
    arrival: float
    token_ids: tuple[int, ...]
    max_tokens: int
    slo_ttft_s: float = 0.0  # > 0: the request's latency targets (W6), sent as x-slo-ttft-ms / -tpot-ms
    slo_tpot_s: float = 0.0
    cache_salt: str | None = None  # the engine gets it; kvgate's request carries it in its BlockExtras
    media: tuple[MediaItem, ...] = ()  # images: the engine's mm_items, and what its render tells kvgate
    session: str | None = None  # the conversation (W12)
    # A Responses API turn by previous_response_id: it goes to the engine that answered the conversation's
    # previous turn (the only one that stored it), and kvgate knows none of its tokens.
    continues: bool = False

    @property
    def extras(self) -> BlockExtras | None:
        """What kvgate's request carries besides the token ids (None: nothing), as the pipeline builds it:
        the salt from the body, the media items as the engine's render gives them."""
        if self.cache_salt is None and not self.media:
            return None
        return BlockExtras(cache_salt=self.cache_salt, media=self.media)


@dataclass(frozen=True, slots=True)
class SLOShape:
    """W6: short chats and long documents mixed, each request with TTFT and TPOT targets (see w6)."""

    name: str
    pods: int = 4
    duration_s: float = 60.0
    load: float = 0.8  # request rate / fleet capacity (the lower of prefill and decode capacity)
    chat_share: float = 0.8
    tenants: int = 20
    zipf_s: float = 1.0
    system_tokens: tuple[int, int] = (600, 1200)  # a chat's tenant system prompt (cacheable)
    user_tokens: tuple[int, int] = (40, 160)
    chat_output: tuple[int, int] = (16, 256)  # log-uniform
    doc_tokens: tuple[int, int] = (3000, 8000)  # a document: never seen before
    doc_output: tuple[int, int] = (128, 512)  # log-uniform
    chat_slo: tuple[float, float] = (0.3, 0.015)  # TTFT s, TPOT s
    doc_slo: tuple[float, float] = (2.0, 0.025)
    capacity_ratio: float = 0.73
    max_num_seqs: int = 64

    def _means(self) -> tuple[float, float]:
        """(prefill seconds, output tokens) per request, on average (kvgate sim timing)."""
        def logu(lo, hi):
            return (hi - lo) / math.log(hi / lo)
        cfg = EngineConfig()
        chat_prefill = sum(self.user_tokens) / 2 + 16  # the system prompt mostly cached
        prefill = (self.chat_share * chat_prefill + (1 - self.chat_share) * sum(self.doc_tokens) / 2)
        out = self.chat_share * logu(*self.chat_output) + (1 - self.chat_share) * logu(*self.doc_output)
        return cfg.ttft_overhead_s + prefill * cfg.prefill_s_per_token, out

    def capacity_rps(self) -> float:
        prefill_s, out = self._means()
        cfg = EngineConfig()
        step = cfg.tpot_base_s + cfg.tpot_per_seq_s * self.max_num_seqs
        decode = self.max_num_seqs / (out * step)
        return self.pods * min(1.0 / prefill_s, decode)

    @property
    def request_rps(self) -> float:
        return self.load * self.capacity_rps()

    @property
    def output_tokens(self) -> int:
        return int(self._means()[1])

    def describe(self) -> str:
        return (f"SLO mix: {self.chat_share:.0%} chats ({self.system_tokens[0]}-{self.system_tokens[1]}-token system "
                f"prompts of {self.tenants} Zipf tenants + {self.user_tokens[0]}-{self.user_tokens[1]} user, "
                f"{self.chat_output[0]}-{self.chat_output[1]} out, targets TTFT {self.chat_slo[0] * 1000:g} ms / "
                f"TPOT {self.chat_slo[1] * 1000:g} ms), documents ({self.doc_tokens[0]}-{self.doc_tokens[1]} new "
                f"tokens, {self.doc_output[0]}-{self.doc_output[1]} out, {self.doc_slo[0] * 1000:g} ms / "
                f"{self.doc_slo[1] * 1000:g} ms), {self.request_rps:.1f} req/s = {self.load:.0%} of fleet capacity "
                f"over {self.duration_s:g} s, {self.pods} pods")

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("pods", "duration_s", "load", "chat_share", "tenants", "system_tokens",
                                              "user_tokens", "chat_output", "doc_tokens", "doc_output", "chat_slo",
                                              "doc_slo", "capacity_ratio")} | {
            "request_rps": round(self.request_rps, 2), "capacity_rps": round(self.capacity_rps(), 2)}


@dataclass(frozen=True, slots=True)
class Workload:
    shape: Shape | ChatShape | SLOShape
    seed: int
    requests: tuple[Request, ...]
    working_set_blocks: int
    blocks_per_pod: int
    compulsory_hit_rate: float  # ceiling: every distinct block computed once in the whole cluster
    flushes: tuple[tuple[float, int], ...] = ()  # (time, pod index): that engine's prefix cache is reset
    joins: tuple[tuple[float, int], ...] = ()  # (time, pod index): that engine joins the fleet

    @property
    def pods_at_start(self) -> int:
        return self.shape.pods

    @property
    def total_pods(self) -> int:
        return self.shape.pods + len(self.joins)

    @property
    def dp_size(self) -> int:
        """Ranks of the data-parallel pod (the last starting one); 1: no such pod."""
        return getattr(self.shape, "dp_size", 1)


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
    out: list[tuple[int, ...]] = []
    for _ in range(shape.groups):
        context = _rand_tokens(rng, shape.context_tokens)
        out.extend(context + _rand_tokens(rng, shape.question_tokens) for _ in range(shape.prompts_per_group))
    return out


def prefix_keys(tokens: tuple[int, ...], block_size: int = BLOCK_SIZE, extras: BlockExtras | None = None) -> list[int]:
    """One key per full block, chained: equal keys mean equal prefixes (in this process). With `extras`, a
    block's extra keys (salt, media) enter its key as they enter the engine's hash."""
    per_block = extras.per_block(block_size, len(tokens) // block_size) if extras else {}
    keys, k = [], 0
    for i in range(len(tokens) // block_size):
        x = per_block.get(i)
        k = hash((k, tokens[i * block_size:(i + 1) * block_size]) if x is None else
                 (k, tokens[i * block_size:(i + 1) * block_size], x))
        keys.append(k)
    return keys


def request_keys(r: Request, block_size: int = BLOCK_SIZE) -> list[int]:
    """prefix_keys of a request's prompt with its extra keys."""
    return prefix_keys(r.token_ids, block_size, r.extras)


def _distinct_blocks(prompts: list[tuple[int, ...]] | list[Request]) -> int:
    seen: set[int] = set()
    for p in prompts:
        seen.update(request_keys(p) if isinstance(p, Request) else prefix_keys(p))
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


def build(shape: Shape | ChatShape | SLOShape, seed: int) -> Workload:
    if isinstance(shape, ChatShape):
        return _build_chat(shape, seed)
    if isinstance(shape, SLOShape):
        return _build_slo(shape, seed)
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
    hittable: set[int] = set()
    for r in requests:
        n = len(r.token_ids)
        keep = (n - 1) // BLOCK_SIZE
        tail += n - keep * BLOCK_SIZE
        hittable.update(request_keys(r)[:keep])
    return tail + len(hittable) * BLOCK_SIZE


IMAGE_TOKEN = 999  # the placeholder token id an image's run repeats (below _TOKEN_RANGE)
_MODEL_NAME = "sim-model"  # what content hashes of images are taken under (bench.routing_sim.MODEL)


def _image(name: str, uuid: bool) -> str:
    """The identifier vLLM gives the image: the client's uuid, else a hash of the model and the image's bytes."""
    if uuid:
        return f"uuid-{name}"
    return image_identifier(_MODEL_NAME, {"image_url": {"url": f"https://images.example/{name}.png"}})


def _chat_prompts(shape: ChatShape, rng: random.Random,
                  extra: random.Random) -> list[tuple[float, tuple[int, ...], str | None, tuple[MediaItem, ...],
                                                    str, bool]]:
    """(arrival, prompt, cache_salt, media, conversation, continues) of every turn of every conversation, in
    generation order. Salts, images and APIs are drawn from `extra`, so the tokens of the other turns, the times
    and the tenants are those of the shape without them (`rng` draws the same)."""
    systems = [_rand_tokens(rng, rng.randint(*shape.system_tokens)) for _ in range(shape.tenants)]
    weights = [1.0 / (k + 1) ** shape.zipf_s for k in range(shape.tenants)]
    image_weights = [1.0 / (k + 1) for k in range(shape.tenant_images)]
    mean_turns = (shape.turns[0] + shape.turns[1]) / 2
    conv_rate = shape.request_rps / mean_turns
    out: list[tuple[float, tuple[int, ...], str | None, tuple[MediaItem, ...], str, bool]] = []
    t = 0.0
    conv = 0
    while True:
        t += rng.expovariate(conv_rate)
        if t >= shape.duration_s:
            return out
        tenant = rng.choices(range(shape.tenants), weights)[0]
        history = systems[tenant]
        conv += 1
        salt = f"user-{conv}" if shape.salted_share and extra.random() < shape.salted_share else None
        uuids = bool(shape.image_share) and extra.random() < shape.uuid_share
        media: tuple[MediaItem, ...] = ()
        by_id = bool(shape.api_mix) and extra.choice(shape.api_mix) == "responses"
        at = t
        for turn in range(rng.randint(*shape.turns)):
            if turn:
                history += _rand_tokens(rng, shape.output_tokens)  # the previous turn's (synthetic) reply
                at += rng.uniform(*shape.turn_gap_s)
            if shape.image_share and extra.random() < shape.image_share:
                if extra.random() < shape.repeat_image_share:
                    name = f"t{tenant}-i{extra.choices(range(shape.tenant_images), image_weights)[0]}"
                else:
                    name = f"c{conv}-turn{turn}"
                media += (MediaItem(_image(name, uuids), len(history), shape.image_tokens),)
                history += (IMAGE_TOKEN,) * shape.image_tokens
            history += _rand_tokens(rng, rng.randint(*shape.user_tokens))
            out.append((at, history, salt, media, f"c{conv}", by_id and turn > 0))


def _build_chat(shape: ChatShape, seed: int) -> Workload:
    base = shape.seed_name or shape.name
    rng = random.Random(f"{base}:{seed}")
    extra = random.Random(f"{shape.name}:{seed}:extras")
    turns = sorted(_chat_prompts(shape, rng, extra), key=lambda x: x[0])  # stable: equal times keep their order
    requests = tuple(Request(f"r{i}", t, p, shape.output_tokens, cache_salt=salt, media=media,
                             session=conv if shape.api_mix else None, continues=continues)
                     for i, (t, p, salt, media, conv, continues) in enumerate(turns))
    ws = _distinct_blocks(list(requests))
    prompt_tokens = sum(len(r.token_ids) for r in requests)
    end = requests[-1].arrival if requests else 0.0
    flushes: tuple[tuple[float, int], ...] = ()
    if shape.flush_every_s > 0:
        order = list(range(shape.pods))
        rng.shuffle(order)
        n = int(end // shape.flush_every_s)
        if shape.flush_order == "random":
            draw = random.Random(f"flush:{seed}")
            order = [draw.randrange(shape.pods) for _ in range(n)]
        flushes = tuple(((k + 1) * shape.flush_every_s, order[k % len(order)]) for k in range(n))
    joins = ((shape.join_at_s, shape.pods),) if shape.join_at_s is not None else ()
    return Workload(
        shape=shape, seed=seed, requests=requests, working_set_blocks=ws,
        # per engine (rank); every KV cache group holds its own blocks of a prompt, out of the same pool
        blocks_per_pod=math.ceil(ws * shape.kv_groups / shape.capacity_ratio / shape.engines),
        compulsory_hit_rate=1.0 - _compulsory_misses(requests) / prompt_tokens if prompt_tokens else 0.0,
        flushes=flushes, joins=joins,
    )


def _chat_shape(name: str, **kw) -> ChatShape:
    base: dict[str, Any] = dict(tenants=40, zipf_s=1.0, system_tokens=(600, 1200), user_tokens=(40, 120), output_tokens=100,
                turns=(2, 4), turn_gap_s=(2.5, 5.0), duration_s=16.0, pods=3, capacity_ratio=0.73, load=0.85)
    base.update(kw)
    return ChatShape(name=name, **base)


# The chat workloads are the same with --quick (which runs one seed): their KV capacity follows the
# distinct blocks of the whole run, which grow with its length, so a shorter run would be another
# scenario, not a faster one.

def w3(quick: bool = False) -> ChatShape:
    """Pressure: the chat workload with fleet KV capacity at 50% of its working set: engines evict."""
    return _chat_shape("W3", capacity_ratio=2.0)


def w4(quick: bool = False) -> ChatShape:
    """Flushes: the chat workload with one engine's prefix cache reset every 2 s (rotating), at 60% of
    decode capacity: at 85% as in W3, the misses after each flush saturate every policy's prefill."""
    return _chat_shape("W4", flush_every_s=2.0, load=0.6)


def w5(quick: bool = False) -> ChatShape:
    """Scale-out: the chat workload at 120% of the 3 starting pods' decode capacity (over it once
    the conversations' later turns add up, ~8 s in); a 4th pod joins at 10 s, after which the
    fleet runs at 90%, as W1 and W2 at their peak. At 100% (near saturation) the oracle sent the
    new pod 3% of the requests after the join and still had the best TTFT p90: using it did not
    matter; at 120% the 3 pods alone cannot keep up."""
    return _chat_shape("W5", load=1.2, join_at_s=10.0)


# Load levels of W3-W5 (issue 26): `heavy` is the level each ran at before levels existed (W3 85%, W4 60%,
# W5 120% of the starting pods' decode capacity) and keeps the bare name; `medium` is half of it
# ("W3-medium"); `light` is 3% of decode capacity for all three ("W3-light"), ~9 conversations in flight
# as in the measurement against SGLang's gateway (8 at a time, engines far from saturation), over 64 s so
# a seed still has ~180 requests. W4's flushes keep about the same number of requests between two of them
# as in the measurement (every 20 requests) at light load (every 7 s), and every 3 s at medium.
LOAD_LEVELS = ("light", "medium", "heavy")
DEFAULT_LOAD_LEVEL = "heavy"
LEVELLED_WORKLOADS = ("W3", "W4", "W5")
_LEVEL_LOAD = {"W3": {"medium": 0.425}, "W4": {"medium": 0.3}, "W5": {"medium": 0.6}}
LIGHT_LOAD = 0.03
LIGHT_DURATION_S = 64.0
_LEVEL_FLUSH_EVERY_S = {"light": 7.0, "medium": 3.0}


def base_name(name: str) -> str:
    """The workload a scenario is a level of: "W3-light" -> "W3"."""
    return name.split("-", 1)[0]


FLUSH_ORDERS = ("rotate", "random")


def with_flush_order(shape: ChatShape, order: str) -> ChatShape:
    """`shape` with its flushes' engines in `order`, named `<name>-random` for "random"; unchanged without
    flushes. Rotating (the workloads' own order) the engine just flushed is the one flushed last again, so a
    policy that keeps a flushed engine's tenants there holds their prefixes longest, which resets that come
    when they come (a restart, a weight update) do not reward."""
    if order not in FLUSH_ORDERS:
        raise ValueError(f"flush order must be one of {', '.join(FLUSH_ORDERS)}, not {order!r}")
    if shape.flush_every_s <= 0 or order == shape.flush_order:
        return shape
    return dataclasses.replace(shape, flush_order=order, seed_name=shape.seed_name or shape.name,  # the same requests
                               name=shape.name if order == "rotate" else f"{shape.name}-{order}")


def at_level(shape: ChatShape, level: str) -> ChatShape:
    """`shape` (W3, W4 or W5) at a load level; `heavy` is the shape itself."""
    if level not in LOAD_LEVELS:
        raise ValueError(f"load level must be one of {', '.join(LOAD_LEVELS)}, not {level!r}")
    if level == DEFAULT_LOAD_LEVEL:
        return shape
    if shape.name not in LEVELLED_WORKLOADS:
        raise ValueError(f"{shape.name} has no load levels (only {', '.join(LEVELLED_WORKLOADS)})")
    kw: dict[str, Any] = {"name": f"{shape.name}-{level}",
                          "load": LIGHT_LOAD if level == "light" else _LEVEL_LOAD[shape.name][level]}
    if level == "light":
        kw["duration_s"] = LIGHT_DURATION_S
    if shape.flush_every_s > 0:
        kw["flush_every_s"] = _LEVEL_FLUSH_EVERY_S[level]
    return dataclasses.replace(shape, **kw)


def w7(quick: bool = False) -> ChatShape:
    """Data-parallel: the chat workload (85% of decode capacity, KV at the 73% ratio) on 3 pods, the
    third a data-parallel engine of 2 ranks behind one pod name: 4 engines. Routing to the pod
    alone leaves the rank to the engine's least-loaded balancer, which knows nothing of caches."""
    return _chat_shape("W7", dp_size=2)


# W8-W10: W3 (85% of decode capacity, fleet KV capacity 50% of the working set) on the model shapes kvgate
# has to be exact on (issue 25): the same conversations (seed_name "W3": the same tokens, tenants and times),
# so the three differ from W3 only in what they add.

def w8(quick: bool = False) -> ChatShape:
    """Hybrid: W3 on a gpt-oss-like model, group 0 sliding window 128 tokens, group 1 full attention, both of
    16-token blocks, vLLM's default sparse retention. KV capacity at W3's ratio counted over both groups."""
    return _chat_shape("W8", capacity_ratio=2.0, model_shape="hybrid", retention="sparse", seed_name="W3")


def w9(quick: bool = False) -> ChatShape:
    """Salted tenants: W3 where half the users (conversations) send a cache_salt of their own over their
    tenant's shared system prompt (a dense model, vLLM 0.33 events), at 60% of decode capacity (as W4): a
    salted user's first turn computes the whole system prompt again, and at 85% those prefills saturate every
    policy's prefill lanes (seed 1: TTFT p90 7 s for kv-sync, 13 s for round-robin), the queue then deciding
    the hits more than the routing."""
    return _chat_shape("W9", capacity_ratio=2.0, model_shape="dense", salted_share=0.5, load=0.6, seed_name="W3")


def w10(quick: bool = False) -> ChatShape:
    """Chat with images: W3 where 40% of the turns start their user message with an image of 256 placeholder
    tokens, half of them one of their tenant's 4 images (sent again and again), half new; half the clients
    give each image a uuid (the engine's identifier then), the others leave it to the content hash, so one
    image is two identities across clients (a dense model, vLLM 0.33 events). At 60% of decode capacity (as
    W4 and W9): the images' placeholders add prefill the decode-based load level does not count, and at 85%
    every policy's prefill lanes saturate (3 seeds: TTFT p90 over 1 s for all, the oracle's 1.33 s against a
    0.05 s floor), the queue then ranking the policies more than the routing."""
    return _chat_shape("W10", capacity_ratio=2.0, model_shape="dense", image_share=0.4, load=0.6, seed_name="W3")


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


def _build_slo(shape: SLOShape, seed: int) -> Workload:
    rng = random.Random(f"{shape.name}:{seed}")
    systems = [_rand_tokens(rng, rng.randint(*shape.system_tokens)) for _ in range(shape.tenants)]
    weights = [1.0 / (k + 1) ** shape.zipf_s for k in range(shape.tenants)]
    rate = shape.request_rps
    requests: list[Request] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= shape.duration_s:
            break
        if rng.random() < shape.chat_share:
            system = systems[rng.choices(range(shape.tenants), weights)[0]]
            prompt = system + _rand_tokens(rng, rng.randint(*shape.user_tokens))
            out, (ttft, tpot) = _log_uniform(rng, *shape.chat_output), shape.chat_slo
        else:
            prompt = _rand_tokens(rng, rng.randint(*shape.doc_tokens))
            out, (ttft, tpot) = _log_uniform(rng, *shape.doc_output), shape.doc_slo
        requests.append(Request(f"r{len(requests)}", t, prompt, out, ttft, tpot))
    reqs = tuple(requests)
    ws = _distinct_blocks([r.token_ids for r in reqs])
    prompt_tokens = sum(len(r.token_ids) for r in reqs)
    return Workload(shape=shape, seed=seed, requests=reqs, working_set_blocks=ws,
                    blocks_per_pod=math.ceil(ws / shape.capacity_ratio / shape.pods),
                    compulsory_hit_rate=1.0 - _compulsory_misses(reqs) / prompt_tokens if prompt_tokens else 0.0)


def w6(quick: bool = False) -> SLOShape:
    """SLO mix: 80% short chats (cacheable tenant system prompts, short outputs, tight targets) and 20%
    long new documents (long prefills, longer outputs, looser targets), Poisson arrivals at 80% of the
    fleet's capacity (the lower of its prefill and decode capacity with kvgate sim timing: here prefill,
    each engine prefilling one prompt at a time). A chat queued behind a document's prefill misses its
    TTFT target; a crowded decode batch misses TPOT."""
    return SLOShape("W6", duration_s=30.0 if quick else 60.0)


def w12(quick: bool = False) -> ChatShape:
    """Agents (issue 27): every conversation starts with its tenant's tool list and instructions, 2,000-8,000
    tokens resent each turn, and runs 4-12 turns; a third speak chat, a third Anthropic messages (both resend
    the history: kvgate renders it), a third the Responses API, continuing by previous_response_id after the
    first turn (routed to the engine that stored the conversation, by every policy, as any other engine would
    404; kvgate knows none of its tokens). 20 Zipf(1) tenants, 40-120-token user turns, 100-token replies,
    turns 2.5-5 s apart, at 15% of decode capacity (a missed tool list is up to 0.8 s of prefill: at W3's 85%
    every policy's prefill lanes saturate), fleet KV capacity at 67% of the working set (capacity_ratio 1.5).
    At W3's 73% every policy that keeps a conversation together reaches the compulsory-miss bound (one seed:
    kv-sync, the oracle, prefix-cache and char-tree behind one replica all 94.7%), so nothing is measured; at
    50% (ratio 2) or 30% of decode capacity the prefill lanes saturate (TTFT p90 2-38 s) and queueing ranks
    the policies more than routing."""
    return _chat_shape("W12", tenants=20, system_tokens=(2000, 8000), turns=(4, 12), load=0.15, capacity_ratio=1.5,
                       api_mix=("chat", "messages", "responses"))
