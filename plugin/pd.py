"""The prefill/decode handoff inside the ext_proc answer (the `pd` strategy; routing.pd plans the pair).

For a request the planner splits, kvgate runs the prefill leg itself, as vLLM's disaggregation proxy does
(tests/v1/kv_connector/nixl_integration/toy_proxy_server.py, AIBrix's `pd` router): it POSTs the request to the
prefill engine (same path, same `X-Request-Id`, the client's `Authorization`) with `stream: false`, `max_tokens: 1` (and
`max_completion_tokens: 1` for a chat or wherever the client set it), without `min_tokens`,
`min_completion_tokens` and `stream_options`, and with `kv_transfer_params: {do_remote_decode: true,
do_remote_prefill: false, remote_engine_id: null, remote_block_ids: null, remote_host: null, remote_port: null}`;
the answer's `kv_transfer_params` (do_remote_prefill true, the engine, request and block ids, host and port of
the blocks to pull) go into the client's own body, which the ext_proc answer sends on (a body mutation, with its
new content-length) to the decode engine through Envoy, as any routed request.

Failures never fail the request: a prefill engine that refuses (an HTTP error), times out
(KVGATE_PD_PREFILL_TIMEOUT_S) or cannot be reached, or answers without usable parameters, is retried once on the
next-ranked prefill engine; then the decode engine serves the request whole (it prefills itself), counted. A
client that leaves mid-prefill cancels the ext_proc stream, hence the prefill call (its connection closed, so
the engine aborts it); the prefill engine's count is released whatever happens.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from plugin.metrics import GatewayMetrics
from plugin.throttle import LogThrottle
from routing.learning.profiles import EngineProfiles
from routing.pd import AGGREGATED, DISAGGREGATED, FALLBACK, STRATEGY, PDPlan, PDPlanner
from routing.pods import Pod
from routing.router import Decision
from routing.state.admission import Admission
from tokenizer.http1 import Http1Client, HttpError
from routing.scheduling.scoring import RouteRequest

log = logging.getLogger("kvgate.pd")

PD_RESPONSE_KEY = "pd"  # in the kvgate dynamic metadata: Envoy copies it into the client's x-kvgate-pd
# The prefill leg's kv_transfer_params (vLLM's NixlConnector: "send the KV of this prefill to a remote decoder").
PREFILL_PARAMS: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
_DROPPED = ("min_tokens", "min_completion_tokens", "stream_options")  # not for the prefill leg
# The request kinds split (plugin.request.KINDS): the OpenAI paths vLLM's disaggregation proxy serves. The others
# (Responses, Messages) are routed by the strategy's scores, whole.
PD_KINDS = frozenset(("chat", "completion"))


def prefill_body(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    """The prefill leg's request body made from the client's (which is left as it is)."""
    out = {k: v for k, v in body.items() if k not in _DROPPED}
    out["stream"] = False
    out["max_tokens"] = 1
    if chat or "max_completion_tokens" in body:
        out["max_completion_tokens"] = 1
    out["kv_transfer_params"] = dict(PREFILL_PARAMS)
    return out


def usable_params(answer: Any) -> dict[str, Any] | None:
    """The prefill answer's kv_transfer_params when a decode engine can pull with them, else None."""
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if not isinstance(params, dict) or not params.get("do_remote_prefill") or not params.get("remote_block_ids"):
        return None
    if any(params.get(k) is None for k in ("remote_engine_id", "remote_host", "remote_port")):
        return None
    return params


def without_client_params(body: bytes) -> bytes | None:
    """The client's body without the `kv_transfer_params` it sent (None: it sent none). A client's own parameters
    would have the decode engine pull blocks from a host and port of the client's choosing."""
    if b"kv_transfer_params" not in body:  # nearly every request: no parse
        return None
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or "kv_transfer_params" not in obj:
        return None
    del obj["kv_transfer_params"]
    return json.dumps(obj, separators=(",", ":")).encode()


class PrefillFailed(Exception):
    def __init__(self, outcome: str, detail: str) -> None:
        super().__init__(detail)
        self.outcome = outcome


class PDHandoff:
    """The `pd` strategy's two pipeline parts: `plan` (in place of the pick) and `prefill` (a step after the pick
    and admission). Each prefill engine's legs go over its kept-alive connections (tokenizer.http1). With a running limit
    (`admission`) a prefill leg takes a place on its engine for its duration, without waiting: a full engine is
    passed over like a failed one. With `profiles`, an answered leg teaches its engine's prefill rate and overhead
    (the `pd` strategy's cost model), as an observed response does for a whole request."""

    def __init__(self, planner: PDPlanner, metrics: GatewayMetrics, *, admission: Admission | None = None,
                 profiles: EngineProfiles | None = None, strategies: frozenset[str] = frozenset()) -> None:
        self.planner = planner
        # Besides pd, the strategies that split requests in a fleet with prefill engines (KVGATE_PD_STRATEGIES):
        # their own scores choose the prefill engine (kv-sync's prefix and load, slo's targets).
        self.strategies = frozenset(strategies) | {STRATEGY}
        self.metrics = metrics
        self.admission = admission
        self.profiles = profiles
        self.timeout_s = planner.config.prefill_timeout_s
        # per prefill engine (address, port), its kept-alive connections (tokenizer.http1: httpx took ~1 ms of CPU per
        # leg, on the request's path; engines are plain http:// and no proxy was ever read for them)
        self._clients: dict[tuple[str, int], Http1Client] = {}
        self._log = LogThrottle(10.0)
        self._modes = {m: metrics.pd_requests.labels(m) for m in (DISAGGREGATED, AGGREGATED, FALLBACK)}

    async def aclose(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()

    def may_split(self, strategy: str) -> bool:
        return strategy in self.strategies

    def splits(self, strategy: str, model: str) -> bool:
        """Whether a request of `strategy` for `model` is planned as a pair: always for pd; for the other
        P/D-aware strategies, when some ready engine of the model is a prefill engine (else they route as ever)."""
        if strategy == STRATEGY:
            return True
        if strategy not in self.strategies:
            return False
        return any(p.role == "prefill" for p in self.planner.registry.candidates(model)[1])

    def _http(self, pod: Pod) -> Http1Client:
        client = self._clients.get((pod.address, pod.port))
        if client is None:
            if len(self._clients) >= 4096:  # engines come and go: the oldest ones' clients go too
                for old in list(self._clients)[:1024]:
                    self._clients.pop(old).close()
            client = self._clients[(pod.address, pod.port)] = Http1Client(pod.address, pod.port, max_connections=1024)
        return client

    async def plan(self, request: RouteRequest, subset: frozenset[str] | None, sheddable: bool) -> PDPlan:
        plan = await self.planner.plan(request, subset, sheddable=sheddable)
        if plan.prefill is None:
            self.metrics.pd_requests.labels(plan.mode).inc()
        return plan

    async def prefill(self, plan: PDPlan, path: str, body: bytes, request_id: str, chat: bool,
                      n_tokens: int | None = None, *, authorization: str = "") -> tuple[str, bytes | None]:
        """Run the plan's prefill leg: (the mode the request is served in, the decode engine's body, None to send the
        client's as it is). Never raises but CancelledError; the prefill engine's count is released on every path."""
        first = plan.prefill
        assert first is not None
        try:
            client_body = json.loads(body)
        except ValueError:  # parsed by the parse step already; cannot happen
            self._modes[FALLBACK].inc()
            await self.planner.release_prefill(first)
            return FALLBACK, None
        own = client_body.pop("kv_transfer_params", None) if isinstance(client_body, dict) else None
        leg = json.dumps(prefill_body(client_body, chat), separators=(",", ":")).encode()
        pod: Pod | None = first.pod
        try:
            for attempt in (1, 2):
                assert pod is not None
                try:
                    params = await self._admitted_call(pod, path, leg, request_id, first, n_tokens, authorization)
                except PrefillFailed as e:
                    self.metrics.pd_prefill.labels(e.outcome).inc()
                    self._log.log(log, logging.WARNING, e.outcome, "request %s: prefill leg on %s failed (%s: %s)%s",
                                  request_id, pod.name, e.outcome, e,
                                  "; retrying on the next prefill engine" if attempt == 1 else "")
                    pod = self.planner.retry_target(first) if attempt == 1 else None
                    if pod is None:
                        break
                    continue
                except Exception:  # a defect of ours: the request is served whole all the same
                    self.metrics.pd_prefill.labels("error").inc()
                    log.exception("request %s: prefill leg on %s failed", request_id, pod.name)
                    break
                self.metrics.pd_prefill.labels("ok").inc()
                client_body["kv_transfer_params"] = params
                self._modes[DISAGGREGATED].inc()
                return DISAGGREGATED, json.dumps(client_body, separators=(",", ":")).encode()
        except asyncio.CancelledError:
            self.metrics.pd_prefill.labels("cancelled").inc()
            raise
        finally:
            await self.planner.release_prefill(first)
        self._modes[FALLBACK].inc()
        return FALLBACK, (json.dumps(client_body, separators=(",", ":")).encode() if own is not None else None)

    async def _admitted_call(self, pod: Pod, path: str, leg: bytes, request_id: str, first: Decision,
                             n_tokens: int | None, authorization: str = "") -> dict[str, Any]:
        admission = self.admission
        if admission is not None and not await admission.limiter.try_acquire(pod.name, admission.max_running):
            raise PrefillFailed("full", f"{pod.name} runs its limit of {admission.max_running} requests")
        started = time.perf_counter()
        try:
            params = await self._call(pod, path, leg, request_id, authorization)
        finally:
            if admission is not None:
                await admission.release(pod.name)
        if self.profiles is not None and n_tokens is not None:
            bs = n_tokens // first.total_blocks if first.total_blocks else 0
            cached = first.matched_blocks * bs if pod is first.pod else 0  # a retry's engine: as the index had it
            self.profiles.observe(pod.name, uncached_tokens=n_tokens - cached, ttft=time.perf_counter() - started,
                                  running=first.running, request_id=request_id)
        return params

    async def _call(self, pod: Pod, path: str, leg: bytes, request_id: str, authorization: str = "") -> dict[str, Any]:
        extra = [("X-Request-Id", request_id)] + ([("Authorization", authorization)] if authorization else [])
        client = self._http(pod)
        try:
            head = client.head("POST", path, "application/json", len(leg), accept="application/json", extra=extra)
        except ValueError as e:  # a header no HTTP/1.1 line can carry: the request is served whole
            raise PrefillFailed("invalid", str(e)) from None
        started = time.perf_counter()
        self.metrics.pd_in_flight.inc()
        try:
            reply = await client.request(head, leg, timeout_s=self.timeout_s)
        except TimeoutError:
            raise PrefillFailed("timeout", f"no answer within {self.timeout_s:g} s") from None
        except (HttpError, OSError) as e:
            raise PrefillFailed("unreachable", f"{type(e).__name__}: {e}") from None
        finally:
            self.metrics.pd_in_flight.dec()
        if reply.status >= 400:
            raise PrefillFailed("refused", f"HTTP {reply.status}: {reply.body[:200].decode('utf-8', 'replace')}")
        try:
            params = usable_params(json.loads(reply.body))
        except ValueError:
            params = None
        if params is None:
            raise PrefillFailed("invalid", "the answer has no usable kv_transfer_params")
        self.metrics.pd_prefill_seconds.observe(time.perf_counter() - started)
        return params

