"""Local tokenization, trusted only as far as the engine's own `/tokenize` agrees with it.

The remote tokenizer (the engine's `/tokenize`) stays the source of truth. For a model whose tokenizer
files can be had (a fixed directory, or fetched from the Hugging Face hub by model name in the
background), requests are tokenized locally, off the engine round trip, under three rules:

1. Earned per input shape (a prompt with or without special tokens; a chat, with or without tools, a
   continued final message, no generation prompt, its own template or template kwargs): until
   `verify_requests` requests of that shape came out identical both ways, requests of that shape are
   served by the remote tokenizer, and the local result is compared in the background. A verified chat
   shape also verifies text without special tokens (its last step), which the cache's pieces use.
2. Sampled: a share (`sample_rate`) of locally served requests is also sent to the remote tokenizer in
   the background, at most `max_checks` at a time (more are skipped, counted), and compared.
3. Any difference sends the model back to the remote tokenizer at once and for good (until restart):
   counted in kvgate_tokenizer_local_disagreements_total{model}, logged with the input (truncated) and
   where the tokens part, and `on_disagreement` is called (the cache in front forgets what it holds).

Input the local renderer refuses (media parts, shapes it does not know) goes to the remote tokenizer.
A failed remote call during a check proves nothing (counted as remote_error). Without local files a
model is served by the remote tokenizer, as before.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from tokenizer.local import LocalTokenizer
from tokenizer.remote import request_body
from tokenizer.types import PromptInput, TokenizeInput, Tokenizer, TokenizerError

log = logging.getLogger(__name__)

CHECK_RESULTS = ("agree", "disagree", "local_refused", "remote_error", "skipped")


@dataclass(frozen=True, slots=True)
class VerifyOptions:
    verify_requests: int = 5  # agreements of a shape before the local path serves it
    sample_rate: float = 0.05  # share of locally served requests checked against the engine afterwards
    max_checks: int = 4  # background checks in flight at once
    offload_chars: int = 2048  # inputs this large are tokenized in a worker thread (LocalTokenizer.inline)
    log_chars: int = 400  # how much of a differing input is logged
    max_models: int = 256  # models tracked (a model beyond them is tokenized remotely, untracked)

    def __post_init__(self) -> None:
        if self.verify_requests < 1:
            raise ValueError("verify_requests must be at least 1")
        if not 0.0 <= self.sample_rate <= 1.0:
            raise ValueError("sample_rate must be from 0 to 1")
        if self.max_checks < 1:
            raise ValueError("max_checks must be at least 1")
        if self.max_models < 1:
            raise ValueError("max_models must be at least 1")


class VerifyMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("kvgate_tokenizer_path_requests",
                                "Tokenizations behind the cache (whole requests, or the cache's batches of new "
                                "pieces), by the path that served them", ["model", "path"], registry=registry)
        self.checks = Counter("kvgate_tokenizer_local_checks", "Local tokens compared with the engine's, by result",
                              ["model", "result"], registry=registry)
        self.disagreements = Counter("kvgate_tokenizer_local_disagreements",
                                     "Local tokens that differed from the engine's (the model then goes remote)",
                                     ["model"], registry=registry)


@dataclass
class _Model:
    name: str
    local: LocalTokenizer | None = None
    source: str = ""
    loading: bool = False
    error: str | None = None
    retry_at: float = 0.0  # after a failed load, when to try again
    disabled: bool = False
    agreements: dict[str, int] = field(default_factory=dict)
    verified: set[str] = field(default_factory=set)
    served: dict[str, int] = field(default_factory=lambda: {"local": 0, "remote": 0})
    checks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CHECK_RESULTS, 0))
    disagreement: dict[str, Any] | None = None
    count_local: Any = None  # bound metric children: the per-request path
    count_remote: Any = None

    @property
    def state(self) -> str:
        if self.disabled:
            return "disabled"
        if self.local is None:
            return "loading" if self.loading else "unavailable"
        return "serving" if self.verified else "verifying"


def shape_of(item: TokenizeInput) -> str:
    """The class of inputs a verification stands for (requests of one shape take the same template paths)."""
    if isinstance(item, PromptInput):
        return "prompt" if item.add_special_tokens else "prompt-raw"
    parts = ["chat"]
    if item.tools:
        parts.append("tools")
    if item.continue_final_message:
        parts.append("continue")
    elif not item.add_generation_prompt:
        parts.append("no-gen")
    if item.chat_template is not None:
        parts.append("template")
    if item.chat_template_kwargs:
        parts.append("kwargs")
    return "+".join(parts)


class VerifiedTokenizer:
    """Tokenizer protocol: local tokens where verified against `remote`, else `remote`'s.

    `local`: one LocalTokenizer for every model (KVGATE_TOKENIZER_PATH); `load`: a blocking function
    giving a model's LocalTokenizer (e.g. from the hub), run once per model in a worker thread.
    `known(model)`: whether some engine serves the model; others (names a client made up) are sent to
    `remote` untracked, so they neither grow the state and metric series nor trigger hub fetches.
    A failed load is tried again `retry_s` later (on a request of that model); `on_loaded(model, local)` is
    told of each loaded tokenizer (the cache builds the model's piece segmenter from it).
    """

    def __init__(
        self,
        remote: Tokenizer,
        *,
        local: LocalTokenizer | None = None,
        load: Callable[[str], LocalTokenizer] | None = None,
        options: VerifyOptions = VerifyOptions(),
        registry: CollectorRegistry | None = None,
        rng: Callable[[], float] = random.random,
        on_disagreement: Callable[[str], None] | None = None,
        known: Callable[[str], bool] | None = None,
        on_loaded: Callable[[str, LocalTokenizer], None] | None = None,
        retry_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._known = known
        self.on_loaded = on_loaded
        self._retry_s = retry_s
        self._clock = clock
        self._remote = remote
        self._local = local
        self._load = load
        self._options = options
        self._metrics = VerifyMetrics(registry if registry is not None else CollectorRegistry())
        self._rng = rng
        self.on_disagreement = on_disagreement
        self._models: dict[str, _Model] = {}
        self._tasks: set[asyncio.Task] = set()
        self._checks = 0

    # --- the request path --------------------------------------------------------------------
    async def tokenize(self, model: str, item: TokenizeInput, *, base_url: str | None = None,
                       sample: bool = True) -> list[int]:
        """`sample=False`: not part of the background sample (the cache's pieces: their assembled answer is)."""
        if isinstance(item, PromptInput) and item.token_ids is not None:
            return list(item.token_ids)
        m = self._models.get(model)
        if m is None:
            if len(self._models) >= self._options.max_models or (self._known is not None and not self._known(model)):
                return await self._remote.tokenize(model, item, base_url=base_url)
            m = self._add(model)
        local = m.local
        if local is None or m.disabled:
            if local is None and m.error is not None and not m.loading and self._clock() >= m.retry_at:
                m.loading = True
                self._spawn(self._load_model(m))
            ids = await self._remote.tokenize(model, item, base_url=base_url)
            m.served["remote"] += 1
            m.count_remote.inc()
            return ids
        shape = shape_of(item)
        if shape in m.verified:
            try:
                ids = await self._encode(local, item)
            except ValueError as e:  # media, shapes the local renderer refuses: the engine decides
                log.debug("tokenizer: model %r: local path refused a request (%s); asking the engine", model, e)
            else:
                self._served_locally(m, shape, item, ids, sample, base_url)
                return ids
        ids = await self._remote.tokenize(model, item, base_url=base_url)
        m.served["remote"] += 1
        m.count_remote.inc()
        if shape not in m.verified:
            self._check_later(m, shape, item, None, ids, base_url)
        return ids

    def tokenize_now(self, model: str, item: TokenizeInput, *, base_url: str | None = None,
                     sample: bool = True) -> list[int] | None:
        """`tokenize`'s answer when it is local and encoded on the calling thread (a verified shape, an input
        below `offload_chars`); None, with nothing counted, when `tokenize` would wait or ask the engine."""
        if isinstance(item, PromptInput) and item.token_ids is not None:
            return list(item.token_ids)
        m = self._models.get(model)
        if m is None or m.local is None or m.disabled:
            return None
        shape = shape_of(item)
        if shape not in m.verified or not m.local.inline(item, self._options.offload_chars):
            return None
        try:
            ids = m.local.encode(item)
        except ValueError:  # `tokenize` asks the engine, and logs why
            return None
        self._served_locally(m, shape, item, ids, sample, base_url)
        return ids

    def _served_locally(self, m: _Model, shape: str, item: TokenizeInput, ids: list[int], sample: bool,
                        base_url: str | None) -> None:
        m.served["local"] += 1
        m.count_local.inc()
        if sample and self._options.sample_rate and self._rng() < self._options.sample_rate:
            self._check_later(m, shape, item, ids, None, base_url)

    def trusts(self, model: str, item: TokenizeInput) -> bool:
        """Whether local tokens of `item` may serve now (its shape is verified for `model`)."""
        m = self._models.get(model)
        return m is not None and m.local is not None and not m.disabled and shape_of(item) in m.verified

    def observe(self, model: str, item: TokenizeInput, ids: Sequence[int], base_url: str | None) -> None:
        """`ids` were served for `item` from local work done elsewhere (the cache's pieces, which were counted
        as they were tokenized here): sampled against the engine like the requests served here."""
        m = self._models.get(model)
        if m is None or m.disabled:
            return
        if self._options.sample_rate and self._rng() < self._options.sample_rate:
            self._check_later(m, shape_of(item), item, list(ids), None, base_url)

    async def _encode(self, local: LocalTokenizer, item: TokenizeInput) -> list[int]:
        if local.inline(item, self._options.offload_chars):
            return local.encode(item)
        return await asyncio.to_thread(local.encode, item)

    # --- models ----------------------------------------------------------------------------
    def _add(self, model: str) -> _Model:
        m = _Model(model)
        m.count_local = self._metrics.requests.labels(model, "local")
        m.count_remote = self._metrics.requests.labels(model, "remote")
        self._metrics.disagreements.labels(model)  # the series exists from the start, at 0
        self._models[model] = m
        if self._local is not None:
            m.local, m.source = self._local, self._local.source
        elif self._load is not None:
            m.loading = True
            self._spawn(self._load_model(m))
        return m

    async def _load_model(self, m: _Model) -> None:
        assert self._load is not None
        started = time.monotonic()
        try:
            local = await asyncio.to_thread(self._load, m.name)
        except Exception as e:  # hub unreachable, no such repository, unusable files
            m.error = f"{type(e).__name__}: {e}"
            m.retry_at = self._clock() + self._retry_s
            log.warning("tokenizer: no local tokenizer for model %r (%s); the engine tokenizes it (trying again in "
                        "%.0f s)", m.name, m.error, self._retry_s)
        else:
            m.local, m.source, m.error = local, local.source, None
            if self.on_loaded is not None:
                self.on_loaded(m.name, local)
            log.info("tokenizer: local tokenizer for model %r loaded from %s in %.1f s; verifying it against the "
                     "engine", m.name, local.source, time.monotonic() - started)
        finally:
            m.loading = False

    # --- checks ----------------------------------------------------------------------------
    def _check_later(self, m: _Model, shape: str, item: TokenizeInput, local_ids: list[int] | None,
                     remote_ids: list[int] | None, base_url: str | None) -> None:
        if self._checks >= self._options.max_checks:
            self._record(m, "skipped")
            return
        self._checks += 1
        self._spawn(self._check(m, shape, item, local_ids, remote_ids, base_url))

    async def _check(self, m: _Model, shape: str, item: TokenizeInput, local_ids: list[int] | None,
                     remote_ids: list[int] | None, base_url: str | None) -> None:
        try:
            if remote_ids is None:
                try:
                    remote_ids = await self._remote.tokenize(m.name, item, base_url=base_url)
                except TokenizerError as e:
                    log.debug("tokenizer: check of model %r: the engine failed (%s)", m.name, e)
                    self._record(m, "remote_error")
                    return
            if local_ids is None:
                assert m.local is not None
                try:
                    local_ids = await self._encode(m.local, item)
                except ValueError:
                    self._record(m, "local_refused")
                    return
            if m.disabled:
                return
            if local_ids == remote_ids:
                self._record(m, "agree")
                if shape not in m.verified:
                    m.agreements[shape] = m.agreements.get(shape, 0) + 1
                    if m.agreements[shape] >= self._options.verify_requests:
                        m.verified.add(shape)
                        if shape.startswith("chat"):
                            # A chat's tokens are its rendered text encoded without special tokens: agreeing on
                            # them verified that encoding too (the cache's pieces use it; they are sampled).
                            m.verified.add("prompt-raw")
                        log.info("tokenizer: model %r: local tokens agreed with the engine's on %d %s requests; "
                                 "tokenizing these locally from now on", m.name, m.agreements[shape], shape)
            else:
                self._disagree(m, shape, item, local_ids, remote_ids)
        finally:
            self._checks -= 1

    def _record(self, m: _Model, result: str) -> None:
        m.checks[result] += 1
        self._metrics.checks.labels(m.name, result).inc()

    def _disagree(self, m: _Model, shape: str, item: TokenizeInput, local_ids: list[int],
                  remote_ids: list[int]) -> None:
        self._record(m, "disagree")
        m.disabled = True
        m.verified.clear()
        self._metrics.disagreements.labels(m.name).inc()
        at = next((i for i, (a, b) in enumerate(zip(local_ids, remote_ids)) if a != b),
                  min(len(local_ids), len(remote_ids)))
        shown = _excerpt(m.name, item, self._options.log_chars)
        m.disagreement = {"shape": shape, "at": at, "local_len": len(local_ids), "engine_len": len(remote_ids),
                          "local": local_ids[at:at + 8], "engine": remote_ids[at:at + 8], "input": shown}
        log.error("tokenizer: model %r: local tokens differ from the engine's on a %s request (first at token %d; "
                  "local %d tokens %s..., engine %d tokens %s...): the engine tokenizes this model from now on. "
                  "Input: %s", m.name, shape, at, len(local_ids), local_ids[at:at + 8], len(remote_ids),
                  remote_ids[at:at + 8], shown)
        if self.on_disagreement is not None:
            self.on_disagreement(m.name)

    # --- plumbing --------------------------------------------------------------------------
    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def settle(self) -> None:
        """Wait for the background work started so far (loads and checks); for tests and benchmarks."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def status(self) -> dict[str, Any]:
        """Per model: state, where the files came from, verified shapes, counts; for /debug."""
        return {name: {"state": m.state, "source": m.source, "error": m.error,
                       "verified": sorted(m.verified), "agreements": dict(m.agreements), "served": dict(m.served),
                       "checks": dict(m.checks), "disagreement": m.disagreement}
                for name, m in self._models.items()}

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        await self._remote.aclose()


def _excerpt(model: str, item: TokenizeInput, limit: int) -> str:
    try:
        text = json.dumps(request_body(model, item), ensure_ascii=False, default=str)
    except (TokenizerError, TypeError, ValueError):
        text = repr(item)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"
