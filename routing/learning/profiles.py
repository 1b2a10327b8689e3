"""Engine profiles: per pod, how fast it prefills and how long a decode step takes with n requests
running, learned from observed requests; optionally a deployment's profile written to Redis by an
external optimizer (AIBrix's `ModelGPUProfile`), which takes precedence where present.

Learned (a RequestTracker: fed by every completed request, its ctx an `Observation`; and from each
scrape of the engine's own inter-token histogram, `observe_engine`):
- prefill tokens/s: a slowly decaying maximum of uncached prompt tokens / TTFT over requests with at
  least `min_prefill_tokens` uncached. Queueing only ever makes that ratio smaller, so the maximum
  tracks the engine's own speed, not its queue; an uncached count too large makes it larger, so the
  tracker counts only the ones the index answered: the count the cost model read when it routed the
  request (`expect`; slo, the ttft scorer). Another strategy's Decision counts the whole prompt (random,
  round-robin, least-request look up nothing) or its own guess (prefix-cache); on the `./dev demo`'s
  10,000-token/s engines those mostly cached prompts gave up to 45,000 tokens/s and the learned rates
  ended at 19,000-41,000, so slo under-predicted every prefill by half and the TTFT overhead took the
  rest, large on whichever pod had served long prompts.
- decode step seconds = a + b * running: a least-squares line over (running requests at routing,
  TPOT) samples with exponential forgetting (each sample's weight decays by `decay` per sample).
- TTFT overhead seconds = c + d * running: the part of a request's TTFT that neither its queue nor its
  own prefill explain (the engine's fixed cost per request, its scheduler, its process's load, the
  network), the same kind of line over (running at routing, observed TTFT - predicted queue wait - own
  prefill time). The slo scorer tells `expect` what it predicted for each request it routed; a request
  routed without that prediction (another strategy) teaches it nothing. `ttft_error` keeps, per pod,
  the decayed mean of observed - predicted TTFT (overhead included) and of its absolute value: how far
  the model is off, for /debug and the demo.
Before any sample, the configured priors answer (overhead: `ttft_overhead_s` + `ttft_overhead_per_request_s`
per running request, 0 + 1 ms by default: a batch slows an engine's prefill a little, as vLLM's chunked prefill
shares each step with the decoding requests, so without observed responses load still counts, mildly). The
overhead line starts from that prior as `overhead_prior_weight` samples (4, at 1 and 8 running), forgotten
like samples: one response does not make a pod's overhead (the demo's first slo response from an engine
came 80-130 ms late, a cold start, the later ones ~10 ms; learned from that one, slo avoided the engine for
the rest of its slice), while a true overhead is most of the way after 5 responses and within 10% after 40.

Decayed and re-explored, so a bad early estimate heals: each sample weighs `decay` times less per later
sample (recent observations weigh more), a line is never read beyond the largest batch it was observed at
(two early samples do not make a slope to extrapolate to a batch never seen), and a pod's learned rate and
overhead drift back toward the priors while nothing re-observes them (halfway every `explore_s` on the
profiles' clock since the pod's last sample of that kind): an estimate that sends traffic away from a pod
(a slow rate, a large overhead) would otherwise never be corrected, since only traffic observes it. The
pod looks like the priors say again and gets tried. (The `./dev demo`'s slo once learned 1,744 ms of
overhead at 8 running from a bad start and never went back there.)

AIBrix's profile (JSON under `aibrix:profile_<model>_<deployment>`): `gpu` (the deployment), `indexes`
([output token counts, input token counts]), `ttft` and `tpot` ([output index][input index], seconds),
`tputs`, `e2e`, `cost`, `created`, `slos`. A request's signature is the nearest index in log2 on each
axis (halfway between two counts goes up, as AIBrix's tolerance 0.5 does). A pod uses the profile of
the deployment whose name, followed by `-`, starts the pod's name (Kubernetes names a deployment's pods
`<deployment>-<hash>-<hash>`).
"""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

from routing.learning.tracking import Tracker

log = logging.getLogger(__name__)

PROFILE_KEY = "aibrix:profile_{model}_{deployment}"


@dataclass
class GPUProfile:
    deployment: str
    outputs: list[float]  # log2 of the index's output token counts
    inputs: list[float]  # log2 of the input token counts
    ttft: list[list[float]]
    tpot: list[list[float]]

    @classmethod
    def from_json(cls, raw: bytes | str) -> "GPUProfile":
        d = json.loads(raw)
        idx = d.get("indexes") or []
        if len(idx) != 2 or not idx[0] or not idx[1]:
            raise ValueError("profile: `indexes` must be [output counts, input counts], both non-empty")
        outs = [math.log2(float(v)) for v in idx[0]]
        ins = [math.log2(float(v)) for v in idx[1]]
        ttft, tpot = d.get("ttft") or [], d.get("tpot") or []
        for name, table in (("ttft", ttft), ("tpot", tpot)):
            if len(table) != len(outs) or any(len(row) != len(ins) for row in table):
                raise ValueError(f"profile: `{name}` must be {len(outs)} x {len(ins)}")
        return cls(str(d.get("gpu", "")), outs, ins, [[float(v) for v in r] for r in ttft],
                   [[float(v) for v in r] for r in tpot])

    @staticmethod
    def _nearest(axis: list[float], tokens: float) -> int:
        v = math.log2(max(tokens, 1.0))
        best = 0
        for i, a in enumerate(axis):
            if a <= v:
                best = i
        if best + 1 < len(axis) and v >= (axis[best] + axis[best + 1]) / 2:
            best += 1
        return best

    def lookup(self, input_tokens: float, output_tokens: float) -> tuple[float, float]:
        """(TTFT s, TPOT s) for a request of this shape."""
        o, i = self._nearest(self.outputs, output_tokens), self._nearest(self.inputs, input_tokens)
        return self.ttft[o][i], self.tpot[o][i]


class _Line:
    """y = a + b x, least squares with exponential forgetting; `clamped`: read no further than the largest x
    seen (a line that is not a law of the engine: the TTFT overhead). `prior`: points (x, y) that start the
    sums as `prior_weight` samples spread over them, forgotten like samples (`prior_w`: their weight left)."""

    __slots__ = ("w", "sx", "sy", "sxx", "sxy", "decay", "xmax", "at_time", "prior_w")

    def __init__(self, decay: float, clamped: bool = False, prior: tuple[tuple[float, float], ...] = (),
                 prior_weight: float = 0.0, now: float = 0.0) -> None:
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.xmax = 0.0 if clamped else math.inf
        self.at_time = now  # when the last sample came (the profiles' clock)
        self.decay = decay
        self.prior_w = prior_weight if prior else 0.0
        k = self.prior_w / len(prior) if prior else 0.0  # each prior point's share
        for x, y in prior:
            self.w += k
            self.sx += k * x
            self.sy += k * y
            self.sxx += k * x * x
            self.sxy += k * x * y

    @property
    def samples(self) -> float:
        """The decayed weight of the observed samples (the prior's left out)."""
        return self.w - self.prior_w

    def add(self, x: float, y: float, now: float = 0.0, half_life: float = math.inf) -> None:
        d = self.decay
        if now > self.at_time and self.w > 0:  # samples not re-observed for a while weigh less, too
            d *= 0.5 ** ((now - self.at_time) / half_life)
        self.w = self.w * d + 1
        self.prior_w *= d
        self.sx = self.sx * d + x
        self.sy = self.sy * d + y
        self.sxx = self.sxx * d + x * x
        self.sxy = self.sxy * d + x * y
        if self.xmax < math.inf and x > self.xmax:  # clamped: the largest x seen so far
            self.xmax = x
        self.at_time = now

    def at(self, x: float, floor: float = 1e-6) -> float | None:
        if self.samples < 1 - 1e-9:
            return None
        if x > self.xmax:  # not observed that far: the line's value at the largest batch seen
            x = self.xmax
        mx, my = self.sx / self.w, self.sy / self.w
        var = self.sxx / self.w - mx * mx
        if var <= 1e-9:
            return max(floor, my)
        b = max(0.0, (self.sxy / self.w - mx * my) / var)
        return max(floor, my + b * (x - mx))


class EngineProfiles(Tracker):
    def __init__(self, *, prefill_tokens_per_s: float = 10_000.0, decode_base_s: float = 0.01,
                 decode_per_request_s: float = 0.0005, min_prefill_tokens: int = 256,
                 decay: float = 0.995, ttft_overhead_s: float = 0.0, ttft_overhead_per_request_s: float = 0.001,
                 explore_s: float = 60.0, overhead_prior_weight: float = 4.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not explore_s > 0:
            raise ValueError("explore_s must be positive")
        if not overhead_prior_weight >= 0:
            raise ValueError("overhead_prior_weight must not be negative")
        self.prior_rate = prefill_tokens_per_s
        self.prior_overhead = ttft_overhead_s
        self.prior_overhead_per = ttft_overhead_per_request_s
        self.prior_base, self.prior_per = decode_base_s, decode_per_request_s
        self.min_prefill_tokens = min_prefill_tokens
        self.decay = decay
        self.explore_s = explore_s
        self.overhead_prior_weight = overhead_prior_weight
        self.clock = clock
        self._rate: dict[str, float] = {}
        self._rate_at: dict[str, float] = {}  # pod -> when its rate was last sampled
        self._decode: dict[str, _Line] = {}
        self._gpu: dict[tuple[str, str], GPUProfile] = {}  # (model, deployment)
        self._scrapes: dict[str, Any] = {}  # pod -> last EngineLoad seen
        self._overhead: dict[str, _Line] = {}
        # request id -> (pod, target, predicted queue wait + own prefill s, predicted overhead s, uncached
        # prompt tokens the prediction counted or None), by `expect`
        self._expected: dict[str, tuple[str, str, float, float, float | None]] = {}
        self._error: dict[str, list[float]] = {}  # pod -> [weight, sum of errors, sum of |errors|] (decayed)

    # --- answers ---------------------------------------------------------------------------
    def _toward_prior(self, learned: float, prior: float, at: float) -> float:
        """`learned`, drifting back to `prior` by half every `explore_s` since it was last observed at `at`."""
        age = self.clock() - at
        if age <= 0.0:
            return learned
        return prior + (learned - prior) * 0.5 ** (age / self.explore_s)

    def gpu_profile(self, model: str, pod: str) -> GPUProfile | None:
        if not self._gpu:
            return None
        for (m, dep), prof in self._gpu.items():
            if m == model and pod.startswith(dep + "-"):
                return prof
        return None

    def prefill_rate(self, pod: str, model: str = "", input_tokens: float = 0.0, output_tokens: float = 1.0) -> float:
        prof = self.gpu_profile(model, pod) if model else None
        if prof is not None and input_tokens > 0:
            ttft, _ = prof.lookup(input_tokens, output_tokens)
            if ttft > 0:
                return input_tokens / ttft
        rate = self._rate.get(pod)
        if rate is None:
            return self.prior_rate
        return self._toward_prior(rate, self.prior_rate, self._rate_at[pod])

    def step_time(self, pod: str, running: float, model: str = "", input_tokens: float = 0.0,
                  output_tokens: float = 1.0) -> float:
        prof = self.gpu_profile(model, pod) if model else None
        if prof is not None and input_tokens > 0:
            _, tpot = prof.lookup(input_tokens, output_tokens)
            if tpot > 0:
                return tpot
        line = self._decode.get(pod)
        got = line.at(running) if line is not None else None
        return got if got is not None else self.prior_base + self.prior_per * running

    def ttft_overhead(self, pod: str, running: float) -> float:
        """Seconds a request's first token takes beyond its queue and its own prefill, with `running`
        requests on the pod (this one included)."""
        prior = self.prior_overhead + self.prior_overhead_per * running
        line = self._overhead.get(pod)
        got = line.at(running, floor=0.0) if line is not None else None
        if line is None or got is None:
            return prior
        return self._toward_prior(got, prior, line.at_time)

    def ttft_error(self, pod: str) -> tuple[float, float, float] | None:
        """(mean observed - predicted TTFT s, mean |that| s, decayed sample weight), None before any."""
        e = self._error.get(pod)
        if e is None or e[0] <= 0:
            return None
        return e[1] / e[0], e[2] / e[0], e[0]

    def learned(self, pod: str) -> dict[str, Any]:
        line, over = self._decode.get(pod), self._overhead.get(pod)
        err = self.ttft_error(pod)
        return {"prefill_tokens_per_s": self._rate.get(pod), "samples": 0 if line is None else round(line.w, 1),
                "ttft_overhead_ms": {n: round(self.ttft_overhead(pod, n) * 1000, 2) for n in (1, 8)},
                "ttft_samples": 0 if over is None else round(over.samples, 1),
                "ttft_error_ms": None if err is None else {"mean": round(err[0] * 1000, 2),
                                                          "mean_abs": round(err[1] * 1000, 2)}}

    def pods(self) -> list[str]:
        return sorted(set(self._rate) | set(self._decode) | set(self._overhead))

    # --- learning ----------------------------------------------------------------------------
    def expect(self, request_id: str, pod: str, work_s: float, overhead_s: float, target: str = "",
               uncached: float | None = None) -> None:
        """The slo scorer routed `request_id` to `pod` (its data-parallel rank `target`, `<pod>#<rank>`, if
        any) predicting its TTFT as `work_s` (queue wait and own prefill of its `uncached` prompt tokens, the
        index's count) + `overhead_s`; its observed TTFT (`observe` with the same id, by the pod or the rank's
        name) teaches the pod's overhead, and, through the tracker, its prefill rate."""
        if not request_id:
            return
        if len(self._expected) > 100_000:  # requests never completed (a bug elsewhere): do not grow
            self._expected.clear()
        self._expected[request_id] = (pod, target or pod, work_s, overhead_s, uncached)

    def observe(self, pod: str, *, uncached_tokens: int = 0, ttft: float | None = None, tpot: float | None = None,
                running: int = 0, request_id: str = "") -> None:
        expected = self._expected.pop(request_id, None) if request_id else None
        if expected is not None and ttft is not None and ttft > 0 and pod in expected[:2]:
            key, _, work, over, _ = expected  # served where routed (not by a fallback): learned under the pod's name
            line = self._overhead.get(key)
            if line is None:  # starting from the prior, as `overhead_prior_weight` samples at 1 and 8 running
                prior = tuple((x, self.prior_overhead + self.prior_overhead_per * x) for x in (1.0, 8.0))
                line = self._overhead[key] = _Line(self.decay, clamped=True, prior=prior,
                                                   prior_weight=self.overhead_prior_weight, now=self.clock())
            line.add(float(max(running, 1)), ttft - work, self.clock(), self.explore_s)
            err = ttft - work - over
            e = self._error.setdefault(key, [0.0, 0.0, 0.0])
            d = self.decay
            e[0], e[1], e[2] = e[0] * d + 1, e[1] * d + err, e[2] * d + abs(err)
        if ttft is not None and ttft > 0 and uncached_tokens >= self.min_prefill_tokens:
            sample = uncached_tokens / ttft
            old = self._rate.get(pod)
            # the decayed maximum, from the estimate as it stands now (drifted toward the prior if stale)
            self._rate[pod] = sample if old is None else max(sample, self.prefill_rate(pod) * self.decay)
            self._rate_at[pod] = self.clock()
        if tpot is not None and tpot > 0:
            line = self._decode.get(pod)
            if line is None:
                line = self._decode[pod] = _Line(self.decay)
            line.add(float(max(running, 1)), tpot)

    def observe_engine(self, pod: str, load: Any) -> None:
        """A fresh scrape of the pod's /metrics (routing.state.engine_metrics.EngineLoad): vLLM's own
        inter-token histogram, its mean over the scrape interval at the batch the engine reported."""
        prev = self._scrapes.get(pod)
        self._scrapes[pod] = load
        if prev is None or load.tpot is None or prev.tpot is None:
            return
        ds, dn = load.tpot[0] - prev.tpot[0], load.tpot[1] - prev.tpot[1]
        if dn <= 0 or ds <= 0:  # nothing decoded meanwhile, or the engine restarted (counters reset)
            return
        running = max(1.0, (load.running + prev.running) / 2)
        line = self._decode.get(pod)
        if line is None:
            line = self._decode[pod] = _Line(self.decay)
        line.add(running, ds / dn)

    def set_gpu_profile(self, model: str, deployment: str, profile: GPUProfile) -> None:
        self._gpu[(model, deployment)] = profile

    async def load_gpu_profiles(self, redis_client: Any) -> int:
        """Read every `aibrix:profile_*` key: (model, deployment) from the key, checked against the value's
        `gpu`. Returns how many loaded; a bad one is logged and skipped."""
        found: dict[tuple[str, str], GPUProfile] = {}
        async for raw in redis_client.scan_iter(match="aibrix:profile_*", count=1000):
            key = raw.decode() if isinstance(raw, bytes) else raw
            value = await redis_client.get(key)
            if value is None:
                continue
            try:
                prof = GPUProfile.from_json(value)
            except (ValueError, TypeError, KeyError) as e:
                log.warning("skipping GPU profile %s: %s", key, e)
                continue
            rest = key[len("aibrix:profile_"):]
            if not prof.deployment or not rest.endswith("_" + prof.deployment):
                log.warning("skipping GPU profile %s: its `gpu` %r does not end the key", key, prof.deployment)
                continue
            found[(rest[:-len(prof.deployment) - 1], prof.deployment)] = prof
        self._gpu = found
        return len(found)

    # --- RequestTracker (a start: nothing) -----------------------------------------------------
    def done_request_count(self, ctx: Any, request_id: str, model: str, term: int) -> None:
        self._expected.pop(request_id, None)  # ended without a response to learn from

    def done_request_trace(self, ctx: Any, request_id: str, model: str, input_tokens: int, output_tokens: int,
                           term: int) -> None:
        if ctx is None:
            return
        # The prefill rate learns only from an uncached count the index answered for the serving pod: the one
        # the cost model (slo, the ttft scorer) read when it routed the request. Any other request's count is
        # its Decision's: the whole prompt where the strategy looks up nothing (random, round-robin,
        # least-request), its own guess for prefix-cache; mostly cached at the engine, such prompts gave
        # tokens / TTFT up to 45,000/s on the demo's 10,000-token/s engines, and the decaying maximum kept it.
        expected = self._expected.get(request_id)
        uncached = 0.0
        if expected is not None and ctx.pod in expected[:2]:
            uncached = expected[4] if expected[4] is not None else ctx.uncached_tokens
        self.observe(ctx.pod, uncached_tokens=int(uncached), ttft=ctx.ttft, tpot=ctx.tpot,
                     running=ctx.running_at_start, request_id=request_id)
