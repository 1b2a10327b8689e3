"""The request pipeline: what kvgate does with a routed request, apart from the transport that brings it.

A routed request's state is one `RequestContext`, filled in by the transport (plugin.extproc: the
headers' request id, strategy, objective, SLO targets, the data plane's subset hint, the body) and then
by the steps of a `Pipeline`, an ordered list of named steps run one after the other on that context:

    parse     the body -> an InferenceRequest (plugin.request); the strategy's default filled in; the block
              extras the body tells (cache_salt, opaque prompt embeddings), counted by kind
    tokenize  the prompt's token ids, when the strategy reads them (a fallback to none on failure or timeout);
              for a chat with media parts, the engine's render: token ids and the media items' identifiers
              and placeholders (the block extras; opaque when the engine cannot say)
    pick      the Router's Decision (within the subset hint; shedding a sheddable request under saturation)
    admit     the per-pod running limit (plugin.admit), when one is configured
    prefill   the `pd` strategy's prefill leg (plugin.pd), when that strategy is served: the pick step then
              plans a decode and a prefill engine (routing.pd), this step runs the prefill and rewrites the body
    record    the decision's metrics (time, pod, prefix blocks)
    observe   the response's Watch (plugin.observe), when responses are observed

A step is a name and a function of the context that returns None when done, or an awaitable when it
must wait (the pipeline awaits it): a step that never waits costs no coroutine. A new stage (a
prefill/decode handoff after `pick`, a second cost model) joins with `Pipeline.insert`; a stage that is
not configured is not in the list, so it costs nothing per request. The transport only reads the
context's decision, admitted pod and watch afterwards.

It owns `Gateway` (what the pipeline and the transport need, built once by plugin.app) and `Sampler`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from plugin import observe
from plugin.admit import admit
from plugin.pd import PD_KINDS, PDHandoff, without_client_params
from plugin.metrics import GatewayMetrics
from kvcache.blockkeys import BlockExtras
from plugin.request import NO_PROMPT, POOLING_PATHS, InferenceRequest, media_extras, parse_body
from plugin.responses import ResponseStore
from plugin.status import RoutingMix, decision_reason
from plugin.watch import WatchRelay
from plugin.throttle import LogThrottle
from routing.errors import NoEligibleEndpointError
from routing.registry import PodRegistry
from routing.pd import PDPlan
from routing.router import Decision, Router, RouteRequest
from routing.state.admission import Admission
from tokenizer.types import PromptInput, Rendered, TokenizeInput, Tokenizer, TokenizerError, TokenizerTimeout

log = logging.getLogger("kvgate.extproc")  # the name operators know these lines by

SLO_TTFT_HEADER, SLO_TPOT_HEADER = "x-slo-ttft-ms", "x-slo-tpot-ms"  # the request's latency targets


class Sampler:
    """Takes `share` of the calls, evenly spaced (share 0.25: every fourth), deterministically.

    Requests Envoy sends in one message (envoy/envoy.yaml's one-message routes) cannot be watched from their own
    stream: `passed()` counts those left unwatched, `relayed()` those a watch stream of their own reads (the
    watched routes, plugin.watch), and the share of the calls is set so that `share` of all requests is watched
    where it can be (Envoy sending a tenth in two messages and no watched route, share 0.1: every one of those;
    a tenth on the watched routes: none of them). The counts are halved now and then, so a change of Envoy's
    split is followed."""

    __slots__ = ("share", "_credit", "_asked", "_passed", "_relayed")

    def __init__(self, share: float) -> None:
        self.share = share
        self._credit = 1.0  # the first call is taken
        self._asked = 0.0
        self._passed = 0.0
        self._relayed = 0.0

    def passed(self) -> bool:
        """Count one request Envoy sent in one message, unwatched; True for the first while every response
        should be watched (share 1): worth a warning."""
        first = not self._passed
        self._passed += 1.0
        return first and self.share >= 1.0

    def relayed(self) -> None:
        """Count one request whose response a watch stream of its own reads."""
        self._relayed += 1.0

    def take(self) -> bool:
        share = self.share
        self._asked += 1.0
        asked, passed, relayed = self._asked, self._passed, self._relayed
        if passed or relayed:
            share = max(0.0, min(1.0, (share * (asked + passed + relayed) - relayed) / asked))
        if asked + passed + relayed > 8192.0:
            self._asked, self._passed, self._relayed = asked / 2, passed / 2, relayed / 2
        if share >= 1.0:
            return True
        if share <= 0.0:
            return False
        if self._credit >= 1.0 - 1e-9:
            self._credit -= 1.0
            self._credit += share
            return True
        self._credit += share
        return False


@dataclass
class Gateway:
    """What the processor and its pipeline need, built once by plugin.app."""

    router: Router
    registry: PodRegistry
    tokenizer: Tokenizer | None
    metrics: GatewayMetrics
    default_strategy: str
    max_body_bytes: int
    tokenizer_timeout_s: float
    tokenizer_url: str | None = None
    target_pod_header: bool = True
    # False for a pod whose engine refused the last /metrics scrape; None: no such knowledge.
    reachable: Callable[[str], bool] | None = None
    # The tokenizer cache's whole-request probe (CachedTokenizer.cached): ids without a copy or an await.
    cached_tokens: Callable[[str, TokenizeInput], Sequence[int] | None] | None = None
    # The tokenizer cache's tokenize for readers of the ids (CachedTokenizer.tokenize_ids: an array, not a list
    # of Python ints); None: `tokenizer.tokenize`.
    tokenize_ids: Callable[..., Awaitable[Sequence[int]]] | None = None
    # The tokenizer's answer when it needs no wait (CachedTokenizer.tokenize_now: a cached request, or one the
    # local tokenizer encodes on the calling thread), None when it would wait; then the call above is awaited
    # under the timeout. None: every miss is awaited.
    tokenize_now: Callable[..., Sequence[int] | None] | None = None
    # Objectives (the x-gateway-inference-objective header) whose requests may be shed (429) under saturation.
    sheddable_objectives: frozenset[str] = frozenset()
    # Watches routed responses (TTFT, TPOT, tokens; the request trackers); None: responses not read.
    observer: observe.Observer | None = None
    # Which routed responses the observer watches (besides the slo strategy's and SLO-targeted ones, always).
    sampler: Sampler = field(default_factory=lambda: Sampler(1.0))
    # A per-pod running limit, checked and counted atomically after the pick; None: no limit.
    admission: Admission | None = None
    # The engine's render of a request body (RemoteTokenizer.render(model, body, path, base_url=): token ids, media
    # hashes and placeholders), for requests whose tokens only a render endpoint gives (InferenceRequest.render);
    # None: no engine to ask (media blocks are then opaque; the rest tokenized as they can be, or not at all).
    render: Callable[..., Awaitable[Rendered]] | None = None
    # Prefill/decode disaggregation for requests routed with the `pd` strategy (plugin.pd); None: no such strategy.
    pd: PDHandoff | None = None
    # Running requests per pod over every gateway (Router.running), for the paths passed through by load; None:
    # spread by request id alone.
    running: Callable[[], Mapping[str, int]] | None = None
    # Response id -> the pod that stored it (Responses API `previous_response_id`); None: not learned.
    responses: ResponseStore | None = None
    # How long a render endpoint an engine refused as missing (403/404/405/501: vLLM without
    # --enable-scale-out) is not asked again.
    render_retry_s: float = 30.0
    # The status page's per-minute routing mix (decisions by strategy and reason); None: not kept.
    mix: RoutingMix | None = None
    # Watching from a stream of its own (envoy/envoy.yaml's watched routes, plugin.watch): both its sides here;
    # None: those routes' responses are not watched.
    relay: WatchRelay | None = None


class RequestContext:
    """One routed request's state, from its headers to its decision (the pipeline's steps read and fill it)."""

    __slots__ = ("request_id", "path", "kind", "strategy", "objective", "slo", "subset", "watched", "body",
                 "started", "request", "token_ids", "extras", "decision", "admitted", "watch", "session",
                 "session_rank", "user", "authorization", "pd_plan", "pd_mode", "body_out", "relayed")

    def __init__(self) -> None:
        # From the transport (the request's headers and the data plane's metadata):
        self.request_id = ""
        self.path = ""
        self.kind = "other"  # chat, completion, models or other: the requests metric's label
        self.strategy: str | None = None  # the routing-strategy header's; `parse` fills in the default
        self.objective = ""  # x-gateway-inference-objective
        self.authorization = ""  # the client's Authorization header (the pd strategy's prefill leg carries it)
        self.session: str | None = None  # x-session-id, x-session-token or x-aibrix-session-key (session affinity)
        self.session_rank = 0  # which of those headers it came from (the first listed wins)
        self.user: str | None = None  # the `user` header (vtc-basic's per-user fairness)
        self.slo: dict[str, float] | None = None  # latency target header -> seconds
        self.subset: frozenset[str] | None = None  # the data plane's subset hint (None: any pod of the pool)
        self.watched = True  # the response will be watched (if there is an observer)
        self.relayed = False  # ... by a watch stream of its own, which tells this Watch what it read (plugin.watch)
        self.body = b""
        # From the steps (the body, request and token ids only while the pipeline runs):
        self.started = 0.0  # perf_counter() when the pipeline started (the decision's time is from there)
        self.request: InferenceRequest | None = None
        self.token_ids: Sequence[int] | None = None
        self.extras: BlockExtras | None = None  # what the blocks' hashes carry besides tokens (None: nothing)
        self.decision: Decision | None = None
        self.admitted: str | None = None  # the pod admission counted this request on
        self.watch: observe.Watch | None = None
        # The `pd` strategy's (plugin.pd): the planned pair (the prefill decision is counted until its leg ends),
        # how the request is served, and the body the decode engine gets instead of the client's (None: the client's).
        self.pd_plan: PDPlan | None = None
        self.pd_mode: str | None = None
        self.body_out: bytes | None = None


@dataclass(frozen=True, slots=True)
class Step:
    """A named stage: `run(ctx)` does its part and returns None, or an awaitable when it must wait."""

    name: str
    run: Callable[[RequestContext], Awaitable[None] | None]


class Pipeline:
    """The steps a routed request goes through, in order, each run once on the request's context."""

    __slots__ = ("_steps", "_runs")

    def __init__(self, steps: Iterable[Step]) -> None:
        self._steps: list[Step] = []
        for step in steps:
            self._add(len(self._steps), step)
        self._runs = tuple(s.run for s in self._steps)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self._steps)

    def insert(self, step: Step, *, after: str | None = None, before: str | None = None) -> None:
        """Add `step` right after (or before) the named one; at the end when neither is given."""
        if after is not None and before is not None:
            raise ValueError("insert: give `after` or `before`, not both")
        anchor = after if after is not None else before
        if anchor is None:
            at = len(self._steps)
        else:
            names = self.names
            if anchor not in names:
                raise ValueError(f"insert: no step named {anchor!r} (steps: {', '.join(names)})")
            at = names.index(anchor) + (after is not None)
        self._add(at, step)
        self._runs = tuple(s.run for s in self._steps)

    def _add(self, at: int, step: Step) -> None:
        if any(s.name == step.name for s in self._steps):
            raise ValueError(f"a step named {step.name!r} is already in the pipeline")
        self._steps.insert(at, step)

    async def run(self, ctx: RequestContext) -> Decision | None:
        """Run every step on `ctx`; its decision (None only in a pipeline without `pick`). The body, the parsed
        request and the token ids are dropped afterwards: the context lives as long as the response."""
        ctx.started = time.perf_counter()
        try:
            for run in self._runs:
                waiting = run(ctx)
                if waiting is not None:
                    await waiting
        finally:
            ctx.body, ctx.request, ctx.token_ids, ctx.extras = b"", None, None, None
        return ctx.decision


def build(gw: Gateway) -> Pipeline:
    """The request pipeline `gw` configures: admit only with a running limit, observe only with an observer."""
    steps = [Step("parse", _Parse(gw).parse), Step("tokenize", _Tokenize(gw).tokenize), Step("pick", _Pick(gw).pick)]
    if gw.admission is not None:
        steps.append(Step("admit", _Admit(gw, gw.admission).admit))
    if gw.pd is not None:
        steps.append(Step("prefill", _Prefill(gw.pd).prefill))
    steps.append(Step("record", _Record(gw).record))
    if gw.observer is not None:
        steps.append(Step("observe", _Observe(gw.observer, gw.relay).observe))
    return Pipeline(steps)


# --- the steps (their functions are named after them: `kvgate bench request` profiles them by name) ---------

class _Parse:
    __slots__ = ("max_body_bytes", "default_strategy", "salted", "media", "opaque")

    def __init__(self, gw: Gateway) -> None:
        self.max_body_bytes, self.default_strategy = gw.max_body_bytes, gw.default_strategy
        kinds = gw.metrics.request_extras
        self.salted, self.media, self.opaque = kinds.labels("salted"), kinds.labels("media"), kinds.labels("opaque")

    def parse(self, ctx: RequestContext) -> None:
        request = ctx.request = parse_body(ctx.path, ctx.body, self.max_body_bytes)
        if ctx.path in POOLING_PATHS:  # one pass over the input, nothing cached worth routing to: by load
            ctx.strategy = POOLING_STRATEGY
            return
        ctx.strategy = ctx.strategy or self.default_strategy
        extras = request.extras
        if extras is not None or request.media is not None:  # not for plain requests
            ctx.extras = extras
            if extras is not None and extras.cache_salt is not None:
                self.salted.inc()
            if extras is not None and extras.opaque:
                self.opaque.inc()
            if request.media is not None:
                self.media.inc()


POOLING_STRATEGY = "least-request"


def _timed_out(e: BaseException) -> bool:
    """Whether a tokenize or render failure was a timeout: the request's budget (TimeoutError) or the
    tokenizer's own, which can end first (TokenizerTimeout)."""
    return isinstance(e, (TimeoutError, TokenizerTimeout))


class _Tokenize:
    """Token ids only for a strategy that reads them: a cached answer, or one the tokenizer gives without a
    wait, needs no timer; a call that waits runs under the tokenizer timeout. A failure or a timeout routes
    on load alone (counted, logged at most once per 10 s). A chat with media parts goes to the engine's render
    instead (token ids, media identifiers and placeholders in one call, under the same timeout); when that
    fails, or there is no engine to render, its blocks are opaque and the tokenizer is asked as for any other."""

    __slots__ = ("gw", "fallback_log", "opaque", "render_off")

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.fallback_log = LogThrottle(10.0)  # one warning per 10 s and kind, with a count of the rest
        self.opaque = gw.metrics.request_extras.labels("opaque")
        self.render_off: dict[tuple[str, str], float] = {}  # (engine URL, render path) -> not asked until then

    def tokenize(self, ctx: RequestContext) -> Awaitable[None] | None:
        gw = self.gw
        # the pd strategy's decider reads the prompt's length whatever its weights read
        if not gw.router.needs_tokens(ctx.strategy) and not (gw.pd is not None and gw.pd.may_split(ctx.strategy or "")):
            return None
        request = ctx.request
        assert request is not None  # parsed by the step before
        item = request.item
        render = request.render
        if render is None:
            if item is NO_PROMPT:
                return None  # a continued Responses conversation: no endpoint renders it
            if isinstance(item, PromptInput) and item.token_ids is not None:
                ctx.token_ids = list(item.token_ids)
                return None
            if gw.tokenizer is None:
                return None
        elif gw.render is None and (gw.tokenizer is None or item is NO_PROMPT):
            if request.media is not None:
                self._unrendered(ctx)
            return None  # only a render gives these tokens: none to ask
        started = time.perf_counter()
        if render is None and gw.cached_tokens is not None:
            ids = gw.cached_tokens(request.model, item)
            if ids is not None:
                gw.metrics.tokenize_seconds.observe(time.perf_counter() - started)
                ctx.token_ids = ids
                return None
        base_url = gw.tokenizer_url
        if not base_url:
            pods = gw.registry.ready_pods(request.model)
            if not pods:
                return None  # pick answers 404 or 503
            base_url = pods[hash(ctx.request_id) % len(pods)].base_url
        if render is not None:
            if gw.render is not None and self._render_on(base_url, render):
                return self._render_wait(ctx, item, base_url, started)
            if request.media is not None:
                self._unrendered(ctx)
            if gw.tokenizer is None or item is NO_PROMPT:
                self._fallback("render_unavailable", None)
                return None
        if gw.tokenize_now is not None:
            try:
                ids = gw.tokenize_now(request.model, item, base_url=base_url)
            except TokenizerError as e:
                self._fallback("error", e)
                return None
            if ids is not None:
                gw.metrics.tokenize_seconds.observe(time.perf_counter() - started)
                ctx.token_ids = ids
                return None
        return self._tokenize_wait(ctx, item, base_url, started)

    async def _tokenize_wait(self, ctx: RequestContext, item: TokenizeInput, base_url: str, started: float,
                             deadline: float | None = None) -> None:
        gw = self.gw
        assert ctx.request is not None and gw.tokenizer is not None  # as tokenize found them
        if deadline is None:
            deadline = asyncio.get_running_loop().time() + gw.tokenizer_timeout_s
        try:
            async with asyncio.timeout_at(deadline):  # no extra task, unlike wait_for
                ids = await (gw.tokenize_ids or gw.tokenizer.tokenize)(ctx.request.model, item, base_url=base_url)
        except (TimeoutError, TokenizerError) as e:
            self._fallback("timeout" if _timed_out(e) else "error", e)
            return
        gw.metrics.tokenize_seconds.observe(time.perf_counter() - started)
        ctx.token_ids = ids

    def _render_on(self, base_url: str, path: str) -> bool:
        """Whether to ask this engine's render endpoint (not while it was lately refused as missing)."""
        until = self.render_off.get((base_url, path))
        if until is None:
            return True
        if time.monotonic() < until:
            return False
        del self.render_off[(base_url, path)]
        return True

    async def _render_wait(self, ctx: RequestContext, item: TokenizeInput, base_url: str, started: float) -> None:
        """The engine's render of the request: its token ids and, for a chat with media, block extras from its
        media items. When the render fails: a chat is tokenized as the tokenizer can (its media blocks opaque);
        a Responses or Messages body is routed on load alone."""
        gw = self.gw
        request = ctx.request
        assert request is not None and request.render is not None and gw.render is not None  # as tokenize found them
        deadline = asyncio.get_running_loop().time() + gw.tokenizer_timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                rendered = await gw.render(request.model, ctx.body, request.render, base_url=base_url)
        except (TimeoutError, TokenizerError) as e:
            timeout = _timed_out(e)
            if not timeout and getattr(e, "status", None) in MISSING_ENDPOINT:
                self.render_off[(base_url, request.render)] = time.monotonic() + gw.render_retry_s
            self.fallback_log.log(log, logging.WARNING, "render", "render failed (%s: %s)",
                                  "timeout" if timeout else "error", e)
            if request.media is not None:
                self._unrendered(ctx)
            if gw.tokenizer is not None and item is not NO_PROMPT:  # the token ids still weigh the request's prefill
                await self._tokenize_wait(ctx, item, base_url, started, deadline)
            else:
                self._fallback("render_timeout" if timeout else "render_error", None)
            return
        gw.metrics.tokenize_seconds.observe(time.perf_counter() - started)
        ctx.token_ids = rendered.token_ids
        if request.media is None:
            return
        salt = request.extras.cache_salt if request.extras is not None else None
        ctx.extras = extras = media_extras(salt, request.media, rendered)
        if extras is not None and extras.opaque:
            self.opaque.inc()

    def _unrendered(self, ctx: RequestContext) -> None:
        """A media chat the engine did not render: its blocks' media keys are unknown, so none is claimed."""
        extras = ctx.extras
        ctx.extras = BlockExtras(cache_salt=extras.cache_salt if extras is not None else None, opaque=True)
        self.opaque.inc()

    def _fallback(self, reason: str, e: BaseException | None) -> None:
        self.gw.metrics.tokenizer_fallbacks.labels(reason).inc()
        if e is not None:
            self.fallback_log.log(log, logging.WARNING, "tokenizer", "tokenization failed (%s: %s); routing on load "
                                  "alone", reason, e)


# A render endpoint's answers meaning it is not there (vLLM serves the render API only with --enable-scale-out and
# answers 403 without it; older engines have no such route).
MISSING_ENDPOINT = frozenset((403, 404, 405, 501))
PREVIOUS_RESPONSE = "previous-response"  # the decision's strategy label when routed to a stored conversation


class _Pick:
    __slots__ = ("router", "sheddable_objectives", "registry", "responses", "affinity", "pd")

    def __init__(self, gw: Gateway) -> None:
        self.router, self.sheddable_objectives = gw.router, gw.sheddable_objectives
        self.registry, self.responses = gw.registry, gw.responses
        self.affinity = gw.metrics.response_affinity
        self.pd = gw.pd

    async def pick(self, ctx: RequestContext) -> None:
        assert ctx.request is not None  # parsed by an earlier step
        slo = ctx.slo or {}
        objective = ctx.objective
        subset = ctx.subset
        stored = None
        previous = ctx.request.previous_response_id
        if previous is not None and self.responses is not None:
            stored = self._stored_pod(previous, await self.responses.lookup(previous), subset)
            if stored is not None:
                subset = frozenset((stored,))
        request = RouteRequest(
            model=ctx.request.model, token_ids=ctx.token_ids, strategy=ctx.strategy, request_id=ctx.request_id,
            slo_ttft_s=slo.get(SLO_TTFT_HEADER), slo_tpot_s=slo.get(SLO_TPOT_HEADER), extras=ctx.extras,
            session=ctx.session, user=ctx.user)
        sheddable = bool(objective) and objective in self.sheddable_objectives
        if stored is not None:
            try:
                d = await self.router.pick(request, subset=subset, sheddable=sheddable)
            except NoEligibleEndpointError:  # the pod is not a candidate for this model: routed as any other
                self.affinity.labels("not_eligible").inc()
            else:
                self.affinity.labels("routed").inc()
                ctx.decision = dataclasses.replace(d, strategy=PREVIOUS_RESPONSE)
                return
        # a pair for the paths vLLM's disaggregation serves (chat, completions): the decode engine is the pick
        if self.pd is not None and ctx.kind in PD_KINDS and self.pd.splits(ctx.strategy or "", request.model):
            plan = ctx.pd_plan = await self.pd.plan(request, ctx.subset, sheddable)
            ctx.decision, ctx.pd_mode = plan.decode, plan.mode
            return
        ctx.decision = await self.router.pick(request, subset=ctx.subset, sheddable=sheddable)

    def _stored_pod(self, response_id: str, name: str | None, subset: frozenset[str] | None) -> str | None:
        """The endpoint of `name`, the pod that stored `response_id`, when it is ready (and within the data plane's
        subset), counted by outcome; None: routed as any other request."""
        if name is None:
            self.affinity.labels("unknown").inc()
            return None
        pod = self.registry.get(name)
        if pod is None or not pod.ready or (subset is not None and pod.endpoint not in subset):
            self.affinity.labels("not_ready").inc()
            return None
        return pod.endpoint


class _Prefill:
    """The `pd` strategy's prefill leg (plugin.pd), after the decode engine's pick and admission."""

    __slots__ = ("pd",)

    def __init__(self, pd: PDHandoff) -> None:
        self.pd = pd

    def prefill(self, ctx: RequestContext) -> Awaitable[None] | None:
        plan = ctx.pd_plan
        if plan is None:
            return None
        if plan.prefill is None:  # served whole: never with kv_transfer_params of the client's own
            ctx.body_out = without_client_params(ctx.body)
            return None
        return self._run(ctx, plan)

    async def _run(self, ctx: RequestContext, plan: PDPlan) -> None:
        n_tokens = len(ctx.token_ids) if ctx.token_ids is not None else None
        ctx.pd_mode, ctx.body_out = await self.pd.prefill(plan, ctx.path, ctx.body, ctx.request_id, ctx.kind == "chat",
                                                          n_tokens, authorization=ctx.authorization)


class _Admit:
    __slots__ = ("gw", "admission")

    def __init__(self, gw: Gateway, admission: Admission) -> None:
        self.gw, self.admission = gw, admission

    async def admit(self, ctx: RequestContext) -> None:
        # A 429 after the wait leaves ctx.decision the pick's: the stream's end releases the count it took.
        gw = self.gw
        assert ctx.request is not None and ctx.decision is not None  # parsed and picked by earlier steps
        ctx.decision, ctx.admitted = await admit(self.admission, gw.router, gw.registry, ctx.decision,
                                                 ctx.request.model)


class _Record:
    """The decision's metrics, their label children memoized by (strategy, pod, kind)."""

    __slots__ = ("metrics", "children", "mix")

    def __init__(self, gw: Gateway) -> None:
        self.metrics = gw.metrics
        self.children: dict = {}
        self.mix = gw.mix

    def record(self, ctx: RequestContext) -> None:
        d = ctx.decision
        assert d is not None  # picked by an earlier step
        key = (d.strategy, d.pod.name, ctx.kind)
        children = self.children.get(key)
        if children is None:
            if len(self.children) > 4096:  # pods churn: keep the memo bounded
                self.children.clear()
            m = self.metrics
            children = self.children[key] = (
                m.decision_seconds.labels(d.strategy), m.decisions.labels(d.strategy, d.pod.name),
                m.requests.labels(ctx.kind, "routed"), m.prefix_blocks.labels("total"),
                m.prefix_blocks.labels("cached"))
        seconds, decided, routed, total_blocks, cached_blocks = children
        seconds.observe(time.perf_counter() - ctx.started)
        decided.inc()
        routed.inc()
        if d.total_blocks:
            total_blocks.inc(d.total_blocks)
            cached_blocks.inc(d.matched_blocks)
        if self.mix is not None:
            assert ctx.request is not None  # parsed by an earlier step
            self.mix.record(d.strategy, decision_reason(d.matched_blocks, d.total_blocks), ctx.request.model,
                            d.matched_blocks, d.total_blocks)


class _Observe:
    __slots__ = ("observer", "relay")

    def __init__(self, observer: observe.Observer, relay: WatchRelay | None) -> None:
        self.observer = observer
        self.relay = relay

    def observe(self, ctx: RequestContext) -> None:
        d = ctx.decision
        assert d is not None and ctx.request is not None  # parsed and picked by earlier steps
        slo = ctx.slo or {}
        # running: the batch the engine profiles learn the decode step time at
        ctx.watch = self.observer.start(ctx.request_id, ctx.request.model, d.pod.name, tokens=ctx.token_ids,
                                        decision=d, running=d.running, slo_ttft_s=slo.get(SLO_TTFT_HEADER),
                                        slo_tpot_s=slo.get(SLO_TPOT_HEADER), watched=ctx.watched,
                                        marker=observe.TOKEN_EVENTS.get(ctx.kind))
        if ctx.relayed and self.relay is not None and not self.relay.expect(ctx.request_id, ctx.watch, d):
            ctx.relayed = False  # its Watch closes at its stream's end, having read nothing
