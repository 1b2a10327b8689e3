"""Prefill/decode disaggregation: which pair of engines serves a request, and whether to split it at all.

A P/D fleet has prefill engines (Pod.role "prefill"), decode engines ("decode") and engines that serve whole
requests ("both", which may also take either leg). For a request routed with the `pd` strategy, `PDPlanner.plan`:

1. picks the decode engine among the decoding pods with the `pd-decode` strategy: its running requests (over
   every gateway) and free KV cache, and what it already holds of the prompt (decode engines publish KV events
   too: a conversation's next turn finds its history there). The running counts move with each pick, so a burst
   does not pile onto one new, empty engine whose scraped KV usage still reads 0;
2. decides: when that engine lacks fewer than `threshold_tokens` of the prompt (a short prompt, or one it mostly
   holds), splitting buys nothing (the transfer would cost about what the prefill saves): the request is served
   on the decode engine alone (like llm-d's prefix-based decider). A request with no token ids (the tokenizer
   failed) is split: that is what the fleet is for;
3. otherwise picks the prefill engine among the prefill pods with the request's strategy's scores (`pd`'s: the TTFT
   cost model on the index's prefix hits and each engine's prefill backlog, with load; a P/D-aware `kv-sync` or
   `slo`, KVGATE_PD_STRATEGIES, its own); its ranked fallbacks are the next prefill engines to retry on.

Both picks are counted as running on their engines (the prefill one until its leg answers: `release_prefill`).
The router only plans; plugin.pd runs the handoff. Imports routing's own pieces only.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Sequence

from routing.errors import NoEligibleEndpointError, NoReadyPodError
from routing.pods import Pod
from routing.registry import PodRegistry
from routing.router import Decision, Router
from routing.scheduling.scoring import RouteRequest

log = logging.getLogger(__name__)

STRATEGY = "pd"  # the request's strategy: plan a pair; its scorer weights choose the prefill engine
DECODE_STRATEGY = "pd-decode"  # the decode engine's choice
# Why a request was served as it was (the kvgate_pd_requests_total `mode` label and the x-kvgate-pd header).
DISAGGREGATED = "disaggregated"
AGGREGATED = "aggregated"  # the decider: too little of the prompt to compute for a split to pay
NO_PREFILL_POD = "no_prefill_pod"  # no ready prefill engine: served whole on the decode engine
FALLBACK = "fallback"  # the prefill leg failed twice (or once, with no other engine): served whole


@dataclass(frozen=True, slots=True)
class PDConfig:
    threshold_tokens: int = 256  # KVGATE_PD_THRESHOLD_TOKENS: split only when the decode engine lacks this many
    prefill_timeout_s: float = 30.0  # KVGATE_PD_PREFILL_TIMEOUT_S: one prefill leg's bound (connect to answer)

    def __post_init__(self) -> None:
        if type(self.threshold_tokens) is not int or self.threshold_tokens < 0:
            raise ValueError(f"KVGATE_PD_THRESHOLD_TOKENS must be an integer >= 0, got {self.threshold_tokens!r}")
        if not 0 < self.prefill_timeout_s < float("inf"):
            raise ValueError(f"KVGATE_PD_PREFILL_TIMEOUT_S must be a number of seconds > 0, got "
                             f"{self.prefill_timeout_s!r}")


@dataclass(slots=True)
class PDPlan:
    """One request's pair: `decode` serves it (through Envoy, counted until its stream ends); `prefill`, when not
    None, runs its prefill leg first. `mode`: why (DISAGGREGATED or AGGREGATED / NO_PREFILL_POD)."""

    decode: Decision
    prefill: Decision | None
    mode: str
    uncached_tokens: int | None  # prompt tokens the decode engine lacks (None: the prompt was not tokenized)


class PDPlanner:
    """Plans the pair with the Router's own picks, each within the endpoints of the role that may run it."""

    def __init__(self, router: Router, registry: PodRegistry, config: PDConfig = PDConfig()) -> None:
        self.router, self.registry, self.config = router, registry, config
        self.decode_strategy = DECODE_STRATEGY

    def _endpoints(self, model: str, subset: frozenset[str] | None, role_ok) -> frozenset[str]:
        pods: Sequence[Pod] = self.registry.candidates(model)[1]
        out = frozenset(p.endpoint for p in pods if role_ok(p))
        return out if subset is None else out & subset

    async def plan(self, request: RouteRequest, subset: frozenset[str] | None = None, *,
                   sheddable: bool = False) -> PDPlan:
        decoders = self._endpoints(request.model, subset, lambda p: p.decodes)
        if not decoders:
            # nothing may decode: the usual errors (404 unknown model, 503 nothing ready) from a plain pick
            if not self.registry.candidates(request.model)[1]:
                await self.router.pick(replace(request, strategy=self.decode_strategy), subset=subset)
            raise (NoEligibleEndpointError(request.model, subset) if subset is not None
                   else NoReadyPodError(request.model))
        decode = await self.router.pick(replace(request, strategy=self.decode_strategy), subset=decoders,
                                        sheddable=sheddable)
        strategy = request.strategy or STRATEGY  # pd, or a P/D-aware kv-sync or slo: its scores pick the prefill
        decode = replace(decode, strategy=strategy)  # the request's strategy, in its metrics and x-kvgate-strategy
        uncached = None
        if request.token_ids is not None:
            n = len(request.token_ids)
            bs = n // decode.total_blocks if decode.total_blocks else 0
            uncached = n - decode.matched_blocks * bs
            if uncached < self.config.threshold_tokens:
                return PDPlan(decode, None, AGGREGATED, uncached)
        prefillers = self._endpoints(request.model, subset, lambda p: p.role == "prefill")
        if not prefillers:
            return PDPlan(decode, None, NO_PREFILL_POD, uncached)
        try:
            prefill = await self.router.pick(replace(request, strategy=strategy), subset=prefillers)
        except Exception:  # a prefill engine is an optimisation: the decode engine can serve it whole
            log.exception("request %s: no prefill engine could be picked; serving it whole", request.request_id)
            return PDPlan(decode, None, NO_PREFILL_POD, uncached)
        return PDPlan(decode, prefill, DISAGGREGATED, uncached)

    def retry_target(self, prefill: Decision) -> Pod | None:
        """The next-ranked prefill engine after `prefill`'s (its count moved there), None if there is none."""
        for endpoint in prefill.fallbacks:
            pod = self.router.served(prefill, endpoint)
            if pod is not None:
                return pod
        return None

    async def release_prefill(self, prefill: Decision) -> None:
        """The prefill leg answered, failed or was cancelled: its engine no longer runs it."""
        await self.router.release(prefill)
