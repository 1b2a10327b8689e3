"""Router: per request, the strategy's pick among the model's ready pods, counted as running
until `release`. A data-parallel pod (dp_size > 1) is one target per rank (Pod.rank_targets):
scored, counted and picked rank by rank; the Decision names the pod and the rank."""
from __future__ import annotations

import itertools
import logging
import random
from typing import Any, Mapping, Sequence, cast

from routing.state.counts import LocalCounts, RunningCounts
from routing.state.engine_metrics import EngineMetrics, Saturation
from routing.state.prompts import ClaimSource, RunningPrompts
from routing.errors import (NoEligibleEndpointError, NoReadyPodError, SaturatedError, UnknownModelError,
                            UnknownStrategyError)
from routing.metrics import RoutingMetrics
from routing.pods import Pod
from routing.registry import PodRegistry
from routing.scheduling.scorers import PrecisePrefixScorer, PrefixSource
from routing.scheduling.scoring import Decision, PickContext, RouteRequest, Scorer, Strategy
from routing.scheduling.slo import default_capacity
from routing.scheduling.sessions import SessionStore
from routing.scheduling.strategies import StrategyConfig, build_mix, build_strategies, mix_name, parse_mix

log = logging.getLogger(__name__)


class Router:
    def __init__(self, registry: PodRegistry, *, default_strategy: str = "kv-sync",
                 counts: RunningCounts | None = None, index: PrefixSource | None = None,
                 engines: EngineMetrics | None = None, config: StrategyConfig | None = None,
                 metrics: RoutingMetrics | None = None, seed: int | None = None,
                 saturation: Saturation | None = None, max_fallbacks: int = 3, capacity=None,
                 sessions: SessionStore | None = None) -> None:
        self._registry = registry
        self._saturation = saturation or Saturation()
        self._max_fallbacks = max_fallbacks
        self._counts = counts if counts is not None else LocalCounts()
        self._index = index
        self._engines = engines
        self._metrics = metrics or RoutingMetrics()
        capacity = capacity or default_capacity()
        self.sessions = sessions if sessions is not None else SessionStore()
        self.sessions.on_outcome = lambda outcome: self._metrics.sessions.labels(outcome).inc()
        self._rng = random.Random(seed)
        # What this gateway's running requests' pods hold or are prefilling, before their KV events say so;
        # an index without clear counts (a test's stand-in) has none.
        self._prompts = (RunningPrompts(cast(ClaimSource, index))
                         if hasattr(index, "clears") and hasattr(index, "single_group") else None)
        self._strategies: dict[str, Strategy] = build_strategies(config or StrategyConfig(), self._rng,
                                                                 index=index, engines=engines, capacity=capacity,
                                                                 sessions=self.sessions, prompts=self._prompts)
        # Weighted mixes (`prefix-cache:2,least-request:1`), built on first use from the strategies' scorers
        self._mixes: dict[str, Strategy] = {}
        # each scorer once, though several strategies may weigh it
        self._scorers: list[Scorer] = list({id(sc): sc for st in self._strategies.values()
                                            for sc, _ in st.scorers}.values())
        self.default_strategy = default_strategy
        self._tickets = itertools.count(1)
        self._active: dict[int, str] = {}  # ticket -> pod name, until released
        # Per strategy, fixed once built: whether it reads tokens; metric children bound on first use.
        self._needs_tokens = {name: st.needs_tokens for name, st in self._strategies.items()}
        self._decided: dict[str, Any] = {}
        self._filtered: dict[str, Any] = {}
        # In-process counts are current by construction: their refresh never waits, so pick skips it.
        self._refresh = type(self._counts).refresh is not LocalCounts.refresh
        # The slo scorer's shared prefill queue (Capacity.prefill): read like the running counts, by the
        # strategies that weigh it, when other gateways' shares live elsewhere (Redis).
        prefill = getattr(capacity, "prefill", None)
        self._prefill = prefill if prefill is not None and type(prefill).refresh is not LocalCounts.refresh else None
        self._reads_prefill = {name: any(sc.reads_prefill for sc, w in st.scorers if w > 0)
                               for name, st in self._strategies.items()}
        self._reads_sessions = {name: any(sc.name == "session" for sc, w in st.scorers if w > 0)
                                for name, st in self._strategies.items()}
        if default_strategy not in self._strategies:  # a weighted mix, or UnknownStrategyError
            self.default_strategy = self._mix(default_strategy)
        # Data-parallel pods by name: (the pod object the targets were made from, its rank targets).
        self._targets: dict[str, tuple[Pod, tuple[Pod, ...]]] = {}
        self._dp = any(p.dp_size > 1 for p in registry.pods())  # False: pick never looks for ranks
        self._prefill_only = any(p.role == "prefill" for p in registry.pods())
        registry.add_listener(self._on_pods)

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the shared counts' heartbeat and the engine metrics scraper (if any)."""
        await self._counts.start()
        await self.sessions.start()
        if self._engines is not None:
            await self._engines.start()

    async def close(self) -> None:
        if self._engines is not None:
            await self._engines.close()
        await self.sessions.close()
        await self._counts.close()

    # -- the request path -----------------------------------------------------------------------

    def strategy_names(self) -> tuple[str, ...]:
        return tuple(self._strategies)

    MAX_MIXES = 64  # distinct weighted mixes (each a metrics label): past these, a new one is refused

    def _strategy(self, name: str | None) -> Strategy:
        key = name or self.default_strategy
        strategy = self._strategies.get(key) or self._mixes.get(key)
        if strategy is None:
            canonical = self._mix(key)  # raises UnknownStrategyError
            strategy = self._strategies.get(canonical) or self._mixes[canonical]
        return strategy

    def _mix(self, name: str) -> str:
        """A weighted mix's canonical name, built and remembered under `name` and that name (raises
        UnknownStrategyError when `name` is neither a strategy nor a valid mix of strategies built here)."""
        try:
            items = parse_mix(name)
            if items is None:
                raise UnknownStrategyError(name, self.strategy_names())
            canonical = mix_name(items)
            if canonical in self._strategies:  # `slo` or a one-strategy "mix"
                return canonical
            mix = self._mixes.get(canonical)
            if mix is None:
                if len(self._mixes) >= 2 * self.MAX_MIXES:
                    raise ValueError(f"more than {self.MAX_MIXES} distinct weighted mixes")
                mix = build_mix(items, self._strategies, self._rng)
        except ValueError as e:
            raise UnknownStrategyError(f"{name} ({e})", self.strategy_names()) from None
        self._mixes[canonical] = self._mixes[name] = mix
        self._needs_tokens[name] = self._needs_tokens[canonical] = mix.needs_tokens
        self._reads_prefill[canonical] = any(sc.reads_prefill for sc, w in mix.scorers if w > 0)
        self._reads_sessions[canonical] = any(sc.name == "session" for sc, w in mix.scorers if w > 0)
        return canonical

    def needs_tokens(self, strategy: str | None) -> bool:
        """Whether `pick` with this strategy uses token ids (raises UnknownStrategyError)."""
        found = self._needs_tokens.get(strategy or self.default_strategy)
        if found is None:
            return self._strategy(strategy).needs_tokens  # raises UnknownStrategyError
        return found

    def _candidates(self, model: str, subset: frozenset[str] | None = None) -> Sequence[Pod]:
        serving: Sequence[Pod]
        ready: Sequence[Pod]
        serving, ready = self._registry.candidates(model)
        if not serving:
            raise UnknownModelError(model)
        if subset is not None:  # the data plane's subset hint: only these endpoints may be picked
            serving = [p for p in serving if p.endpoint in subset]
            ready = [p for p in serving if p.ready]
        elif self._prefill_only:  # a prefill engine (routing.pd) serves whole requests only when named
            ready = [p for p in ready if p.role != "prefill"] or ready
        if not ready:
            if subset is not None:
                raise NoEligibleEndpointError(model, subset)
            raise NoReadyPodError(model)
        if self._engines is not None:
            # An engine that refuses connections would answer 503, whatever its cached blocks or load
            # say; if every engine looks down, try them all rather than refuse.
            unreachable = self._engines.unreachable
            reachable = [p for p in ready if not unreachable(p.name)]
            return reachable or ready
        return ready

    async def pick(self, request: RouteRequest, *, subset: frozenset[str] | None = None,
                   sheddable: bool = False) -> Decision:
        """The pod for `request`, counted as running from now until `release(decision)`.

        `subset`: the endpoints (`ip:port`) the data plane allows (NoEligibleEndpointError when none of
        them is a ready pod of the model). `sheddable`: the request may be dropped (SaturatedError)
        when every eligible pod is saturated."""
        strategy = self._strategy(request.strategy)
        pods = self._candidates(request.model, subset)  # fail fast, before any I/O
        if self._refresh or (self._prefill is not None and self._reads_prefill[strategy.name]):
            if self._refresh:
                await self._counts.refresh()
            if self._prefill is not None and self._reads_prefill[strategy.name]:
                await self._prefill.refresh()
            pods = self._candidates(request.model, subset)  # the pods may have changed while refresh waited
        if request.session and self.sessions.shared and self._reads_sessions[strategy.name]:
            await self.sessions.load(request.session)  # the session's pod as other gateways left it (bounded)
            pods = self._candidates(request.model, subset)
        if sheddable and self._all_saturated(pods):
            raise SaturatedError(request.model, len(pods))
        # From here to the count increment nothing awaits: the next pick sees this one.
        base, lora = self._resolve_model(request.model, pods)
        ctx = PickContext(request=request, base_model=base, lora=lora, running=self._counts.totals())
        if self._dp:
            targets = self._rank_targets(pods)
            if targets is not None:
                pods, ctx.ranks = targets, True
        name = strategy.name
        filtered = self._filtered.get(name)
        if filtered is None:
            filtered = self._filtered[name] = lambda n: self._metrics.guard_excluded.labels(name).inc(n)
        target, scores = strategy.choose(ctx, pods, on_error=self._scorer_failed, on_filtered=filtered)
        self._counts.add(target.name, 1)
        ticket = next(self._tickets)
        self._active[ticket] = target.name
        if self._prompts is not None:
            # what the index answered for the pick, if a scorer asked it: the target's blocks of the prompt
            held = ctx.matched.get(target.name, 0) if ctx.total_blocks else None
            self._prompts.add(ticket, target.name, target.pod_name, target.rank or 0, base, lora,
                              request.token_ids, request.extras, held)
        decided = self._decided.get(name)
        if decided is None:
            decided = self._decided[name] = self._metrics.decisions.labels(name)
        decided.inc()
        pod = target if target.rank is None else self._targets[target.parent][0]
        return Decision(pod=pod, strategy=name, matched_blocks=ctx.matched.get(target.name, 0),
                        total_blocks=ctx.total_blocks, request_id=request.request_id, ticket=ticket,
                        rank=target.rank, fallbacks=self._fallbacks(pod, target.rank, pods, scores, ctx.running),
                        running=ctx.running.get(target.name, 0) + 1)

    def _all_saturated(self, pods: Sequence[Pod]) -> bool:
        """Every pod saturated by its engine's own numbers (a data-parallel pod: every rank's)."""
        if self._engines is None:
            return False
        get, saturated = self._engines.get, self._saturation.saturated
        for p in pods:
            ranks = range(p.dp_size) if p.dp_size > 1 else (None,)
            if not all(saturated(get(p.name, r)) for r in ranks):
                return False
        return True

    def _fallbacks(self, pod: Pod, rank: int | None, targets: Sequence[Pod], scores: Mapping[str, float],
                   running: Mapping[str, int]) -> tuple[str, ...]:
        """The next-best endpoints after `pod`'s, by the same pick: highest combined score first, then
        the candidates a filter set aside, each group least running first. A rank-pinned request only
        falls back to pods that have that rank (the rank header goes with it)."""
        if self._max_fallbacks <= 0 or len(targets) < 2:
            return ()

        def key(t: Pod) -> tuple:
            score = scores.get(t.name)
            return (score is None, -(score or 0.0), running.get(t.name, 0), t.name)
        out: list[str] = []
        seen = {pod.endpoint}
        for t in sorted(targets, key=key):
            endpoint = t.endpoint
            if endpoint in seen or (rank is not None and rank >= t.dp_size):
                continue
            seen.add(endpoint)
            out.append(endpoint)
            if len(out) == self._max_fallbacks:
                break
        return tuple(out)

    def _rank_targets(self, pods: Sequence[Pod]) -> list[Pod] | None:
        """`pods` with each data-parallel pod replaced by its rank targets; None if there is none."""
        out = None
        for i, p in enumerate(pods):
            if p.dp_size > 1:
                if out is None:
                    out = list(pods[:i])
                made = self._targets.get(p.name)
                if made is None or made[0] is not p:  # the registry replaces a pod whose readiness flips
                    made = self._targets[p.name] = (p, p.rank_targets())
                out.extend(made[1])
            elif out is not None:
                out.append(p)
        return out

    def _scorer_failed(self, scorer: str) -> None:
        self._metrics.scorer_errors.labels(scorer).inc()

    def served(self, decision: Decision, endpoint: str) -> Pod | None:
        """The data plane reports the endpoint that served `decision`'s request: when it is not the picked
        pod (a fallback), its running count moves there. Returns the serving pod (None: not a known pod,
        the count stays where it was)."""
        if endpoint == decision.pod.endpoint:
            return decision.pod
        pod = next((p for p in self._registry.pods() if p.endpoint == endpoint), None)
        if pod is None:
            return None
        old = self._active.get(decision.ticket)
        if old is not None:
            rank = decision.rank if decision.rank is not None and pod.dp_size > decision.rank else None
            new = pod.name if rank is None else f"{pod.name}#{rank}"
            if new != old:
                self._counts.add(old, -1)
                self._counts.add(new, 1)
                self._active[decision.ticket] = new
                if self._prompts is not None:
                    self._prompts.moved(decision.ticket, new, pod.name, rank or 0)
        return pod

    async def release(self, decision: Decision) -> None:
        """The request's stream ended (finished, cancelled or failed); idempotent. It never waits (the
        count changes here, RunningCounts shares it in the background): the request path releases inline."""
        self.release_now(decision)

    def release_now(self, decision: Decision) -> None:
        """`release` where no await may be (a stream's cleanup)."""
        pod = self._active.pop(decision.ticket, None)
        if pod is not None:
            self._counts.add(pod, -1)
            if self._prompts is not None:
                self._prompts.remove(decision.ticket)

    @staticmethod
    def _resolve_model(model: str, pods: Sequence[Pod]) -> tuple[str, str | None]:
        """(base model, adapter or None): a name that is no pod's base model is an adapter."""
        for p in pods:
            if p.model == model:
                return model, None
        return pods[0].model, model

    def _on_pods(self, added: list[Pod], removed: list[Pod]) -> None:
        for p in removed:
            self._targets.pop(p.name, None)
        self._dp = any(p.dp_size > 1 for p in self._registry.pods())
        self._prefill_only = any(p.role == "prefill" for p in self._registry.pods())
        # a removed data-parallel pod's rank targets go too (scorers keep per-target state by name)
        removed = removed + [t for p in removed if p.dp_size > 1 for t in p.rank_targets()]
        for scorer in self._scorers:
            try:
                scorer.pods_changed(added, removed)
            except Exception:  # one scorer's bookkeeping must not keep the others from theirs
                log.exception("scorer %s failed to follow a pod change", scorer.name)

    @property
    def prompts(self) -> RunningPrompts | None:
        """What this gateway's running requests' pods hold or are prefilling (None: the index counts no clears);
        routing.state.prompt_relay shares it with the other replicas."""
        return self._prompts

    # -- debugging ------------------------------------------------------------------------------

    def running(self) -> dict[str, int]:
        """Running requests per pod (per `<pod>#<rank>` for a data-parallel pod's ranks) over every
        live gateway, as this gateway sees them now."""
        return self._counts.totals()

    def debug_snapshot(self, subscriptions: Any = None) -> dict:
        """Pods, blocks held per pod (index stats), running counts and strategies, JSON-able."""
        totals = self._counts.totals()
        local = self._counts.local()
        index_stats: dict = {}
        if self._index is not None:
            try:
                index_stats = dict(self._index.stats())
            except Exception as e:
                index_stats = {"error": f"{type(e).__name__}: {e}"}
        per_pod_blocks = _blocks_per_pod(index_stats)
        engines = self._engines.snapshot() if self._engines is not None else {}
        cache_sizes: dict[str, int] = {}  # what each pod's cache has shown its size to be (kv-sync's CacheRoom)
        for scorer in self._scorers:
            if isinstance(scorer, PrecisePrefixScorer) and scorer.room is not None:
                cache_sizes.update(scorer.room.sizes())
        pods = []
        for p in sorted(self._registry.pods(), key=lambda p: p.name):
            entry: dict[str, Any] = {
                "name": p.name, "endpoint": p.endpoint, "model": p.model, "lora": list(p.lora),
                "ready": p.ready, "role": p.role, "roleset": p.roleset, "running": totals.get(p.name, 0), "running_here": local.get(p.name, 0),
                "kv_events": None if p.kv_events is None else {
                    "pub_port": p.kv_events.pub_port, "replay_port": p.kv_events.replay_port,
                    "dp_size": p.kv_events.dp_size},
            }
            if p.dp_size > 1:  # counted per rank target
                ranks = [t.name for t in p.rank_targets()]
                entry["running_by_rank"] = [totals.get(t, 0) for t in ranks]
                entry["running"] = sum(entry["running_by_rank"])
                entry["running_here"] = sum(local.get(t, 0) for t in ranks)
            if p.name in per_pod_blocks:
                entry["blocks"] = per_pod_blocks[p.name]
            if p.name in cache_sizes:
                entry["cache_size_blocks"] = cache_sizes[p.name]
            if p.name in engines:
                entry["engine"] = engines[p.name]
            pods.append(entry)
        out: dict[str, Any] = {
            "pods": pods,
            "strategies": {"default": self.default_strategy, "available": list(self._strategies),
                           "weights": {s.name: {sc.name: w for sc, w in s.scorers} for s in self._strategies.values()}},
            "counts": self._counts.snapshot(),
            "in_flight_here": len(self._active),
            "sessions": {"remembered_here": len(self.sessions), "shared": self.sessions.shared},
            "index": index_stats,
        }
        if subscriptions is not None:
            out["subscriptions"] = subscriptions
        return out


def _blocks_per_pod(stats: Mapping[str, Any]) -> dict[str, Any]:
    for key in ("blocks_per_pod", "pods", "per_pod"):
        value = stats.get(key)
        if isinstance(value, Mapping):
            return dict(value)
    return {}
