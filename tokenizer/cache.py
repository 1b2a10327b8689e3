"""A cache in front of any Tokenizer that never returns tokens the engine would not.

Two levels, one byte-bounded LRU:
- whole requests: (model, the input's fields: text, messages as (key, value) pairs or JSON
  text, tools and options as JSON text) -> ids. Exact because tokenization is a deterministic
  function of the model's tokenizer and the input.
- pieces: for models with a local copy of the engine's tokenizer files, the input
  is rendered locally (chat template) and cut at added tokens such as the ChatML
  turn markers (see tokenizer.segments for why the tokenizer never merges across
  them, and the conditions checked before a model is segmented). Then
      tokens(input) = prefix + concat(tokens(piece) or id(added token)) + suffix
  holds exactly, so each plain piece is looked up on its own and only the pieces
  never seen before are tokenized by the backend, all in one call (joined by an
  added token, and split back at its id; a mismatch in the count of that id falls
  back to one call per piece). A shared system prompt, and every earlier turn of a
  multi-turn chat, are then tokenized once.
The pieces' tokens come from the same backend (the engine's /tokenize, or the local
tokenizer), tokenized with add_special_tokens=False as the identity requires. The
local files must be the engine's own (same tokenizer.json and chat template); the
first few requests of each model are checked against a whole-request call, and a
difference turns the piece level off for that model (counted, logged).
"""
from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from tokenizer.segments import Piece, Segmenter, SpecialAffixes, join_pieces
from tokenizer.types import ChatInput, PromptInput, TokenizeInput, Tokenizer, TokenizerError, TokenizesNow

log = logging.getLogger(__name__)

_ENTRY_OVERHEAD = 120  # dict slot, OrderedDict links, key tuple, array header


ONCE_KEPT = 4096  # requests assembled from pieces remembered as seen once (a second sighting keeps one whole)


@dataclass(frozen=True, slots=True)
class CacheOptions:
    max_bytes: int = 64 * 1024 * 1024
    max_entry_bytes: int = 4 * 1024 * 1024  # a larger single entry is not kept
    # The first requests of each model assembled from pieces are also tokenized whole and compared;
    # a difference (local files that are not the engine's) turns the piece level off for that model.
    verify_requests: int = 3


class ByteLRU:
    """Token id arrays by key, least recently used dropped first, bounded in approximate bytes."""

    def __init__(self, max_bytes: int, max_entry_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.max_entry_bytes = max_entry_bytes
        self.bytes = 0
        self._data: OrderedDict[Hashable, tuple[array, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: Hashable) -> array | None:
        hit = self._data.get(key)
        if hit is None:
            return None
        self._data.move_to_end(key)
        return hit[0]

    def put(self, key: Hashable, ids: Sequence[int], key_bytes: int) -> array | None:
        """Keeps a copy of `ids` (an array of 32-bit ids is copied as bytes) and returns it; None when
        not kept (too large, or an id that does not fit 32 bits)."""
        try:
            values = array("I", ids)  # token ids fit in 32 bits: half the memory of Python's default
        except (OverflowError, TypeError):
            return None
        cost = key_bytes + values.itemsize * len(values) + _ENTRY_OVERHEAD
        if cost > self.max_entry_bytes or cost > self.max_bytes:
            return None
        old = self._data.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        self._data[key] = (values, cost)
        self.bytes += cost
        while self.bytes > self.max_bytes:
            _, (_, dropped) = self._data.popitem(last=False)
            self.bytes -= dropped
        return values

    def clear(self) -> None:
        self._data.clear()
        self.bytes = 0


class CacheMetrics:
    """The cache's Prometheus metrics. Plain numbers, changed without a lock on the event loop's thread
    (a prometheus_client child takes a lock per update, and a cache hit made four), turned into samples
    when scraped: the same series, names and types as prometheus_client's Counter and Gauge would give
    (counters with `_total` and `_created`, every label child present from the start)."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.request_hit = self.request_miss = self.piece_hit = self.piece_miss = 0
        self.tokens_cache = self.tokens_backend = 0
        self.mismatches = 0
        self.bytes = self.entries = 0  # as last set (the cache's size after its last insertion or clear)
        self._created = time.time()
        if registry is not None:
            registry.register(self)

    @property
    def hit_ratio(self) -> float:
        """Fraction of returned tokens served from the cache."""
        total = self.tokens_cache + self.tokens_backend
        return self.tokens_cache / total if total else 0.0

    def describe(self) -> Iterator[Metric]:
        return iter(self._families(samples=False))

    def collect(self) -> Iterator[Metric]:
        return iter(self._families(samples=True))

    def _families(self, samples: bool) -> list[Metric]:
        created = self._created
        lookups = CounterMetricFamily("kvgate_tokenizer_cache_lookups", "Tokenizer cache lookups",
                                      labels=("level", "result"))
        tokens = CounterMetricFamily("kvgate_tokenizer_cache_tokens", "Tokens returned, by where they came from",
                                     labels=("source",))
        mismatches = CounterMetricFamily("kvgate_tokenizer_cache_piece_mismatches",
                                         "Models whose pieces did not add up to the engine's tokens")
        gauges = [GaugeMetricFamily(name, doc, value=float(value) if samples else None) for name, doc, value in (
            ("kvgate_tokenizer_cache_hit_ratio", "Fraction of returned tokens served from the cache", self.hit_ratio),
            ("kvgate_tokenizer_cache_bytes", "Approximate bytes held by the cache", self.bytes),
            ("kvgate_tokenizer_cache_entries", "Entries held by the cache", self.entries))]
        if samples:
            for labels, value in ((("request", "hit"), self.request_hit), (("request", "miss"), self.request_miss),
                                  (("piece", "hit"), self.piece_hit), (("piece", "miss"), self.piece_miss)):
                lookups.add_metric(labels, float(value), created=created)
            tokens.add_metric(("cache",), float(self.tokens_cache), created=created)
            tokens.add_metric(("backend",), float(self.tokens_backend), created=created)
            mismatches.add_metric((), float(self.mismatches), created=created)
        hit_ratio, size, entries = gauges
        return [lookups, tokens, hit_ratio, size, mismatches, entries]  # the order they were registered in before


class _FetcherGone(TokenizerError):
    """A piece's fetch ended because the request fetching it was cancelled: a request waiting on it fetches the
    piece itself."""


class CachedTokenizer:
    """Tokenizer protocol: `inner`'s tokens, served from a cache of whole requests and of pieces.

    `segmenters` (per model, else `default_segmenter`) enable the piece level; each must be
    built from that model's own tokenizer files. Models without one get the request level only.
    With `trust`, the piece level (which renders chats locally) serves an input only when
    trust(model, input) holds (tokenizer.verified: its shape was verified against the engine), and
    `observe(model, input, ids, base_url)` is told of every answer assembled from pieces (to sample it);
    then `inner.tokenize` must take `sample=False`, passed for the pieces themselves.
    An `inner` with a `tokenize_now` (its answer when it needs no wait, else None; LocalBackend and
    VerifiedTokenizer have one) lets this cache's `tokenize_now` answer misses too, not only hits.
    """

    def __init__(
        self,
        inner: Tokenizer,
        *,
        segmenters: Mapping[str, Segmenter] | None = None,
        default_segmenter: Segmenter | None = None,
        options: CacheOptions = CacheOptions(),
        registry: CollectorRegistry | None = None,
        trust: Callable[[str, TokenizeInput], bool] | None = None,
        observe: Callable[[str, TokenizeInput, Sequence[int], str | None], None] | None = None,
    ) -> None:
        self._inner = inner
        self._trust = trust
        self._observe = observe
        # With `observe`, the answers assembled from pieces are what gets sampled, not the piece batches.
        self._piece_kwargs = {"sample": False} if observe is not None else {}
        self._segmenters = dict(segmenters or {})
        self._default_segmenter = default_segmenter
        self._lru = ByteLRU(options.max_bytes, options.max_entry_bytes)
        self._once: OrderedDict[int, None] = OrderedDict()  # hashes of requests assembled once, not kept (yet)
        # The inner tokenizer's answer without a wait (its `tokenize_now`, None when it would wait), if it has one.
        self._inner_now: Callable[..., Sequence[int] | None] | None = (
            inner.tokenize_now if isinstance(inner, TokenizesNow) else None)
        # The key `cached` or `tokenize_now` built for the item it last missed, and the plan (segmenter,
        # pieces) `tokenize_now` made of it: `tokenize` of that same object (the request path's next call)
        # takes them instead of making them again. (item, key, plan or None) or None.
        self._missed: tuple[TokenizeInput, tuple, tuple | None] | None = None
        self._inflight: dict[tuple[str, str], asyncio.Future[list[int]]] = {}
        self._verify_requests = options.verify_requests
        self._verified: dict[str, int] = {}
        self._mismatched: set[str] = set()
        self._metrics = CacheMetrics(registry)

    @property
    def tokens_cached(self) -> int:
        """Tokens returned from the cache since start (a counter)."""
        return self._metrics.tokens_cache

    @property
    def tokens_total(self) -> int:
        """Tokens returned since start (a counter)."""
        return self._metrics.tokens_cache + self._metrics.tokens_backend

    @property
    def hit_ratio(self) -> float:
        return self._metrics.hit_ratio

    def set_segmenter(self, model: str, segmenter: Segmenter) -> None:
        """Enable the piece level for `model` (its tokenizer files arrived after start)."""
        self._segmenters[model] = segmenter

    def clear(self) -> None:
        """Forget everything, e.g. when a model's tokenizer changed."""
        self._lru.clear()
        self._update_size()

    async def tokenize(self, model: str, item: TokenizeInput, *, base_url: str | None = None) -> list[int]:
        ids = await self.tokenize_ids(model, item, base_url=base_url)
        return ids if type(ids) is list else cast("array[int] | memoryview", ids).tolist()

    async def tokenize_ids(self, model: str, item: TokenizeInput, *, base_url: str | None = None) -> Sequence[int]:
        """`tokenize` for callers that only read the ids (the request path): a cached request's as a
        read-only view of the cache's array (as `cached` gives them), one assembled from pieces as an
        array of 32-bit ids; a list otherwise. The list `tokenize` makes of an array costs a Python int
        per id (~21 us for a 1,700-token prompt, as much as the rest of assembling it)."""
        if isinstance(item, PromptInput) and item.token_ids is not None:
            return list(item.token_ids)
        key, plan = self._take_missed(model, item)
        hit = self._hit(key)
        if hit is not None:
            return memoryview(hit).toreadonly()
        self._metrics.request_miss += 1
        segmenter, planned = self._plan(model, item) if plan is None else plan
        ids: Sequence[int]
        if planned is None:
            ids = await self._inner.tokenize(model, item, base_url=base_url)
            self._count(0, len(ids))
        else:
            pieces, affixes = planned
            ids = await self._from_pieces(model, segmenter, pieces, base_url, affixes)
            if self._verified.get(model, 0) < self._verify_requests:
                ids = await self._verify(model, item, base_url, ids)  # what is kept: the engine's answer
            elif self._observe is not None:
                self._observe(model, item, ids, base_url)
            return self._keep(key, ids, assembled=True)
        return self._keep(key, ids)

    def tokenize_now(self, model: str, item: TokenizeInput, *, base_url: str | None = None) -> Sequence[int] | None:
        """`tokenize_ids`' answer when it needs no wait: a cached request, or a miss the inner tokenizer's
        own `tokenize_now` answers now (the whole request, or the pieces not cached; not while the model's
        first requests are verified). None when it would wait, with nothing done or counted: `tokenize_ids`
        of the same item then does all of it. Raises TokenizerError as `tokenize_ids` would."""
        if isinstance(item, PromptInput) and item.token_ids is not None:
            return list(item.token_ids)
        key, _ = self._take_missed(model, item)
        hit = self._hit(key)
        if hit is not None:
            return memoryview(hit).toreadonly()
        self._missed = (item, key, None)  # taken by `tokenize_ids` of this item, if it is not answered here
        now = self._inner_now
        if now is None:
            return None
        try:
            plan = segmenter, planned = self._plan(model, item)
            self._missed = (item, key, plan)  # not made again by `tokenize_ids` (a chat's rendering)
            if planned is None:
                ids = now(model, item, base_url=base_url)
                if ids is None:
                    return None
                self._count(0, len(ids))
            else:
                if self._verified.get(model, 0) < self._verify_requests:
                    return None
                pieces, affixes = planned
                assert segmenter is not None  # _plan plans pieces only with a segmenter
                ids = self._from_pieces_now(model, segmenter, pieces, base_url, affixes, now)
                if ids is None:
                    return None
                if self._observe is not None:
                    self._observe(model, item, ids, base_url)
        except BaseException:  # counted as `tokenize_ids` counts a miss that raises
            self._missed = None
            self._metrics.request_miss += 1
            raise
        self._missed = None
        self._metrics.request_miss += 1
        return self._keep(key, ids, assembled=planned is not None)

    def cached(self, model: str, item: TokenizeInput) -> memoryview | None:
        """`item`'s ids if the whole request is cached (counted as a hit, like `tokenize`), without a
        copy: a read-only view of the cache's own array, for callers that only read the ids (the
        request path). None when not cached (nothing counted: `tokenize` will count the miss)."""
        if isinstance(item, PromptInput) and item.token_ids is not None:
            return None
        try:
            key = ("req", model, _request_key(item))
        except TokenizerError:  # `tokenize` will raise it
            return None
        hit = self._hit(key)
        if hit is None:
            self._missed = (item, key, None)
            return None
        return memoryview(hit).toreadonly()

    def _take_missed(self, model: str, item: TokenizeInput) -> tuple[tuple, tuple | None]:
        """(the whole request's key, its plan or None): as `cached` or `tokenize_now` left them for this same
        item (its next call on the request path), else a new key and no plan."""
        missed, self._missed = self._missed, None
        if missed is not None and missed[0] is item and missed[1][1] == model:
            return missed[1], missed[2]
        return ("req", model, _request_key(item)), None

    def _plan(self, model: str, item: TokenizeInput) -> tuple[Segmenter | None, tuple[list[Piece], SpecialAffixes] | None]:
        """The model's segmenter and `item`'s pieces, (None, None) when the piece level does not serve it."""
        segmenter = None if model in self._mismatched else self._segmenters.get(model, self._default_segmenter)
        if segmenter is not None and self._trust is not None and not self._trust(model, item):
            segmenter = None
        try:
            return segmenter, segmenter.pieces(item) if segmenter is not None else None
        except ValueError as e:
            raise TokenizerError(f"cannot tokenize for model {model!r}: {e}") from e

    def _seen_before(self, key: tuple) -> bool:
        """Whether a request assembled from pieces is worth keeping whole: it was asked for once already (among
        the last ONCE_KEPT first sightings). Most requests are asked for once (a chat's every turn is a new
        request), and assembling one from cached pieces costs little; keeping each copied its ids into the
        cache (5% of kvgate's CPU per request in process on bench path's chats) and pushed older entries,
        the pieces among them, out of it."""
        h = hash(key)
        once = self._once
        if h in once:
            del once[h]
            return True
        once[h] = None
        if len(once) > ONCE_KEPT:
            once.popitem(last=False)
        return False

    def _keep(self, key: tuple, ids: Sequence[int], assembled: bool = False) -> Sequence[int]:
        if not assembled or self._seen_before(key):
            self._lru.put(key, ids, _key_bytes(key))
        self._update_size()
        return ids

    def _hit(self, key: tuple) -> array | None:
        hit = self._lru.get(key)
        if hit is not None:
            m = self._metrics  # _count(n, n), inline: every warm request comes here
            m.request_hit += 1
            m.tokens_cache += len(hit)
        return hit

    async def _verify(self, model: str, item: TokenizeInput, base_url: str | None,
                      assembled: Sequence[int]) -> list[int]:
        whole = await self._inner.tokenize(model, item, base_url=base_url)
        if whole == (assembled.tolist() if type(assembled) is array else assembled):
            self._verified[model] = self._verified.get(model, 0) + 1
        elif model not in self._mismatched:
            self._mismatched.add(model)
            self._metrics.mismatches += 1
            log.error("tokenizer cache: pieces of model %r do not add up to the engine's tokens (are the local "
                      "tokenizer files the engine's?); caching whole requests only for this model", model)
        return whole

    async def _from_pieces(
        self, model: str, segmenter: Segmenter, pieces: list[Piece], base_url: str | None, affixes: SpecialAffixes
    ) -> Sequence[int]:
        """The request's ids from its pieces' (see join_pieces for the form), fetching those not cached."""
        tokens, missing = self._cached_pieces(model, pieces)
        self._count_pieces(tokens, missing)
        fetched = await self._fetch_once(model, segmenter, missing, base_url) if missing else {}
        return self._join(pieces, tokens, fetched, affixes)

    def _from_pieces_now(self, model: str, segmenter: Segmenter, pieces: list[Piece], base_url: str | None,
                         affixes: SpecialAffixes, now: Callable[..., Sequence[int] | None]) -> Sequence[int] | None:
        """`_from_pieces` when the pieces not cached are tokenized by `now` (the inner tokenizer's answer
        without a wait); None, with nothing counted or kept, when one of them would wait (or is being
        fetched for another request)."""
        tokens, missing = self._cached_pieces(model, pieces)
        fetched: dict[str, Sequence[int]] = {}
        if missing:
            if any((model, t) in self._inflight for t in missing):
                return None
            try:
                got = self._fetch_now(model, segmenter, missing, base_url, now)
            except BaseException:
                self._count_pieces(tokens, missing)  # as `_from_pieces` counts them before its fetch fails
                raise
            if got is None:
                return None
            for text, ids in got.items():
                kept = self._lru.put(("seg", model, text), ids, sys.getsizeof(text))
                fetched[text] = ids if kept is None else kept  # the cache's array: joined into requests as bytes
        self._count_pieces(tokens, missing)
        return self._join(pieces, tokens, fetched, affixes)

    def _cached_pieces(self, model: str, pieces: list[Piece]) -> tuple[dict[str, Sequence[int]], list[str]]:
        """(each plain piece -> its cached ids, or () when not cached; the pieces not cached, in order)."""
        tokens: dict[str, Sequence[int]] = {}
        missing: list[str] = []
        get = self._lru.get
        for p in pieces:
            if isinstance(p, int) or p in tokens:
                continue
            hit = get(("seg", model, p))
            if hit is None:
                tokens[p] = ()
                missing.append(p)
            else:
                tokens[p] = hit
        return tokens, missing

    def _count_pieces(self, tokens: dict[str, Sequence[int]], missing: list[str]) -> None:
        if missing:
            self._metrics.piece_miss += len(missing)
        if len(tokens) > len(missing):
            self._metrics.piece_hit += len(tokens) - len(missing)

    def _join(self, pieces: list[Piece], tokens: dict[str, Sequence[int]], fetched: Mapping[str, Sequence[int]],
              affixes: SpecialAffixes) -> Sequence[int]:
        tokens.update(fetched)
        out = join_pieces(pieces, tokens, affixes)
        new = sum(len(fetched[p]) for p in pieces if isinstance(p, str) and p in fetched)
        self._count(len(out) - new, len(out))
        return out

    async def _fetch_once(self, model: str, segmenter: Segmenter, texts: list[str],
                          base_url: str | None) -> dict[str, Sequence[int]]:
        """Pieces already being fetched for another request are awaited, not fetched again."""
        waits = {t: f for t in texts if (f := self._inflight.get((model, t))) is not None}
        own = [t for t in texts if t not in waits]
        loop = asyncio.get_running_loop()
        futures = {t: loop.create_future() for t in own}
        self._inflight.update(((model, t), f) for t, f in futures.items())
        try:
            fetched = await self._fetch(model, segmenter, own, base_url) if own else {}
            for text, ids in fetched.items():
                kept = self._lru.put(("seg", model, text), ids, sys.getsizeof(text))
                if kept is not None:  # the cache's array: joined into requests as bytes
                    fetched[text] = ids = kept
                futures[text].set_result(ids)
        except BaseException as e:
            if isinstance(e, asyncio.CancelledError):
                failure: TokenizerError = _FetcherGone("the request fetching this piece was cancelled")
            else:
                failure = e if isinstance(e, TokenizerError) else TokenizerError(f"piece fetch failed: {e!r}")
            for f in futures.values():
                if not f.done():
                    f.set_exception(failure)
                    f.exception()  # retrieved: no "never retrieved" warning when nobody waits
            raise
        finally:
            for t in own:
                self._inflight.pop((model, t), None)
        again = []
        for text, fut in waits.items():
            try:
                fetched[text] = await asyncio.shield(fut)
            except _FetcherGone:  # its deadline or its client, not the backend: this request has its own time
                again.append(text)
        if again:
            fetched.update(await self._fetch_once(model, segmenter, again, base_url))
        return fetched

    async def _fetch(self, model: str, segmenter: Segmenter, texts: list[str],
                     base_url: str | None) -> dict[str, Sequence[int]]:
        sep = segmenter.separator
        if sep is not None and len(texts) > 1:
            joined = await self._inner.tokenize(model, _joined(texts, sep[0]), base_url=base_url, **self._piece_kwargs)
            parts = _split_at(joined, sep[1])
            if len(parts) == len(texts):
                return dict(zip(texts, parts))
        out: dict[str, Sequence[int]] = {}
        for text in texts:  # sequential: one slow backend should not get a burst from one request
            out[text] = await self._inner.tokenize(model, PromptInput(text=text, add_special_tokens=False),
                                                   base_url=base_url, **self._piece_kwargs)
        return out

    def _fetch_now(self, model: str, segmenter: Segmenter, texts: list[str], base_url: str | None,
                   now: Callable[..., Sequence[int] | None]) -> dict[str, Sequence[int]] | None:
        """`_fetch` by `now`; None when it would wait. When the joined text is answered now, so is each
        piece of it: a shorter input (and ASCII if the joined one is) stays on the calling thread."""
        sep = segmenter.separator
        if sep is not None and len(texts) > 1:
            joined = now(model, _joined(texts, sep[0]), base_url=base_url, **self._piece_kwargs)
            if joined is None:
                return None
            parts = _split_at(joined, sep[1])
            if len(parts) == len(texts):
                return dict(zip(texts, parts))
        out = {}
        for text in texts:
            ids = now(model, PromptInput(text=text, add_special_tokens=False), base_url=base_url, **self._piece_kwargs)
            if ids is None:
                return None
            out[text] = ids
        return out

    def _count(self, cached: int, total: int) -> None:
        m = self._metrics
        m.tokens_cache += cached
        m.tokens_backend += total - cached

    def _update_size(self) -> None:
        self._metrics.bytes = self._lru.bytes
        self._metrics.entries = len(self._lru)

    async def aclose(self) -> None:
        await self._inner.aclose()


def _joined(texts: list[str], separator: str) -> PromptInput:
    """Pieces tokenized in one call: joined by an added token, whose id splits the answer back."""
    return PromptInput(text=separator.join(texts), add_special_tokens=False)


def _split_at(ids: Sequence[int], sep: int) -> list[list[int]]:
    ids = ids if isinstance(ids, list) else list(ids)
    parts: list[list[int]] = []
    start = 0
    index = ids.index
    while True:
        try:
            end = index(sep, start)
        except ValueError:
            parts.append(ids[start:])
            return parts
        parts.append(ids[start:end])
        start = end + 1


def _request_key(item: TokenizeInput) -> tuple:
    """A hashable copy of everything the engine's tokenization depends on, equal only for equal
    inputs as a template sees them: key order kept, and 1, 1.0, true, "1", 0.0 and -0.0 apart.
    A message whose values are all strings is keyed by its (key, value) pairs, its strings not copied
    (a chat's text is mostly such messages); any other message, the tools and the template kwargs by
    their JSON text, which holds exactly that information for JSON's values (the engine reads the
    request as JSON) and is made in C, where freezing them value by value took Python's time per value.
    Raises TokenizerError for input nested deeper than even repr can walk."""
    if not isinstance(item, ChatInput):
        return ("prompt", item.text, item.add_special_tokens)
    tools, kwargs = item.tools, item.chat_template_kwargs
    try:
        messages = []
        for m in item.messages:
            if type(m) is dict:
                pairs = tuple(m.items())
                for _, v in pairs:
                    if type(v) is not str:
                        messages.append(_json_key(m))
                        break
                else:
                    messages.append(pairs)  # a tuple of pairs: never a JSON text (str) or a _frozen form
            else:
                messages.append(_json_key(m))
        return ("chat", tuple(messages), None if tools is None else _json_key(tools), item.chat_template,
                None if kwargs is None else _json_key(kwargs), item.add_generation_prompt, item.continue_final_message)
    except _TooDeep:  # nested tuples that deep would make every key comparison recurse as deep
        pass
    try:
        return ("chat-repr", repr((item.messages, item.tools, item.chat_template, item.chat_template_kwargs,
                                   item.add_generation_prompt, item.continue_final_message)))
    except RecursionError:
        raise TokenizerError("the request is nested too deeply to tokenize") from None


# JSON text as json.dumps makes it (floats by repr: -0.0 and every digit kept; NaN and Infinity as such;
# lists and tuples alike, as JSON arrays; key order kept), without escaping non-ASCII text.
_json_text = json.JSONEncoder(ensure_ascii=False, check_circular=False).encode


def _json_key(value: object) -> object:
    """`value`'s JSON text; for a value the encoder refuses (an object JSON has no form for) or that is
    too deep for it, its _frozen form instead (a tuple: never equal to a text). A ChatInput holds the
    JSON values of a request body, and what the engine is sent of it is this same text (json.dumps; see
    tokenizer.remote): inputs with equal texts are one request to the engine."""
    try:
        return _json_text(value)
    except (TypeError, ValueError, RecursionError):
        return _frozen(value)


_MAX_DEPTH = 32  # a value JSON cannot encode that nests deeper than this is keyed by the request's repr


class _TooDeep(Exception):
    pass


def _frozen(value: Any, depth: int = 0) -> object:
    """JSON-shaped data as nested tuples: strings as they are, objects and arrays tagged with their type,
    numbers, booleans and null with their type (floats by repr, which keeps -0.0 and every digit).
    Raises _TooDeep past _MAX_DEPTH levels."""
    t = type(value)
    if t is str:
        return value
    if t is dict or t is list or t is tuple:
        if depth >= _MAX_DEPTH:
            raise _TooDeep
        if t is dict:
            return (dict, tuple([(k, _frozen(v, depth + 1)) for k, v in value.items()]))
        return (list, tuple([_frozen(v, depth + 1) for v in value]))
    if t is float:
        return (float, repr(value))
    return (t, value)


def _key_bytes(key: object) -> int:
    """Approximate bytes a request key holds (its strings and tuples), for the cache's bound.
    Walked without recursion: a key is as deep as the request's JSON."""
    total, todo = 0, [key]
    while todo:
        k = todo.pop()
        if type(k) is tuple:
            total += sys.getsizeof(k)
            todo.extend(k)
        else:
            total += sys.getsizeof(k) if type(k) is str else 16
    return total
