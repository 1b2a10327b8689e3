"""The engine's own tokenizer: vLLM's `POST /tokenize`, through one pooled `httpx.AsyncClient`.

Requests use vLLM's TokenizeCompletionRequest / TokenizeChatRequest shapes and read
TokenizeResponse (`count`, `max_model_len`, `tokens`, `token_strs`). Chat requests with media go to
`POST /v1/chat/completions/render` instead (`render_chat`): the engine's token ids with each media item's
hash and placeholder range, which the engine's block hashes carry. 429 and 5xx
answers and connection failures are retried with exponential backoff (full
jitter), honouring Retry-After, all within one total time budget; anything else,
or running out of budget, raises TokenizerError quickly so routing can fall back.

The client keeps connections alive (HTTP/1.1 only), follows no redirects, keeps no
cookies, reads proxies from the environment once, when it is made, and sends each
request in one write (tokenizer.transport). Where no proxy is set and the endpoint is a plain
`http://` URL without credentials (an engine in the cluster, as a rule), requests go over
tokenizer.http1 instead, with the same attempts, retries and budget: a /tokenize call cost the client
~1 ms of CPU with httpx, ~0.3 ms so, the JSON included (docs/BENCHMARKS.md, request). httpcore asks `sniffio` which event loop runs ~14
times per request; without sniffio installed each is a failed import (~50 us on a
loaded 2-core machine), hence sniffio among the dependencies.
"""
from __future__ import annotations

import asyncio
import email.utils
import http.cookiejar
import json
import random
import time
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from prometheus_client import CollectorRegistry, Counter, Histogram

from tokenizer.http1 import Http1Client, HttpError
from tokenizer.transport import OneWriteTransport, environment_mounts, environment_proxies
from tokenizer.types import (ChatInput, PromptInput, Rendered, RenderedMedia, TokenizeInput, TokenizerError,
                             TokenizerTimeout)

_JSON_HEADERS = {"content-type": "application/json"}
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class RemoteOptions:
    total_timeout_s: float = 1.0  # whole tokenize call, retries included
    attempt_timeout_s: float = 0.5  # one HTTP attempt
    max_retries: int = 2
    backoff_base_s: float = 0.02
    backoff_max_s: float = 0.25
    max_connections: int = 64

    def __post_init__(self) -> None:
        if self.total_timeout_s <= 0 or self.attempt_timeout_s <= 0:
            raise ValueError("tokenizer timeouts must be positive")
        if self.max_retries < 0 or self.backoff_base_s < 0 or self.backoff_max_s < 0:
            raise ValueError("tokenizer retries and backoff must not be negative")
        if self.max_connections < 1:
            raise ValueError("tokenizer max_connections must be at least 1")


class RemoteMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.attempts = Counter(
            "kvgate_tokenizer_remote_attempts", "HTTP attempts to engines' /tokenize, by outcome", ["outcome"],
            registry=registry,
        )
        self.failures = Counter(
            "kvgate_tokenizer_remote_failures", "Tokenize calls that raised TokenizerError", registry=registry
        )
        self.seconds = Histogram(
            "kvgate_tokenizer_remote_seconds", "Successful tokenize calls, retries included", registry=registry,
            buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
        )
        self.ok = self.attempts.labels("ok")  # bound once: the per-call path


class _NoCookies(http.cookiejar.CookieJar):
    """Engines set no cookies for /tokenize: none are kept or sent."""

    def extract_cookies(self, response: Any, request: Any) -> None:
        pass

    def add_cookie_header(self, request: Any) -> None:
        pass


class _Retryable(Exception):
    def __init__(self, reason: str, retry_after: float | None = None, *, timeout: bool = False) -> None:
        super().__init__(reason)
        self.retry_after = retry_after
        self.timeout = timeout  # the attempt ran out of time (or had none left)


class RemoteTokenizer:
    """Tokenizer protocol over engines' /tokenize. The endpoint of a model is its configured
    URL if any, else the `base_url` of a ready pod passed by the caller."""

    def __init__(
        self,
        endpoints: Mapping[str, str] | None = None,
        *,
        options: RemoteOptions = RemoteOptions(),
        client: httpx.AsyncClient | None = None,
        registry: CollectorRegistry | None = None,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self._endpoints = {m: u.rstrip("/") for m, u in (endpoints or {}).items()}
        self._options = options
        self._owns_client = client is None
        self._client = client  # made on first use
        # tokenizer.http1 clients per endpoint (host, port), and per URL its client and path (None: httpx's); used
        # only for this tokenizer's own client, and only where the environment sets no proxy (read once, with it)
        self._lean: dict[tuple[str, int], Http1Client] = {}
        self._lean_ok: bool | None = None  # no proxy in the environment (read at the first call)
        self._lean_urls: dict[str, tuple[Http1Client, str] | None] = {}
        self._closed = False
        self._metrics = RemoteMetrics(registry if registry is not None else CollectorRegistry())
        self._rng = rng

    async def tokenize(self, model: str, item: TokenizeInput, *, base_url: str | None = None) -> list[int]:
        if isinstance(item, PromptInput) and item.token_ids is not None:
            return list(item.token_ids)
        base = self._base(model, base_url)
        try:
            body = json.dumps(request_body(model, item), ensure_ascii=False, allow_nan=False).encode("utf-8")
        except (TypeError, ValueError) as e:  # UnicodeEncodeError (lone surrogates) is a ValueError
            raise TokenizerError(f"the request cannot be sent as JSON: {e}") from None
        return await self._call(f"{base}/tokenize", body, model, parse_response)

    async def render_chat(self, model: str, body: bytes, *, base_url: str | None = None) -> Rendered:
        """The engine's rendering of a chat request (`POST /v1/chat/completions/render`), see `render`."""
        return await self.render(model, body, "/v1/chat/completions/render", base_url=base_url)

    async def render(self, model: str, body: bytes, path: str, *, base_url: str | None = None) -> Rendered:
        """The engine's rendering of a request at its render endpoint `path` (vLLM 0.33:
        /v1/chat/completions/render, /v1/responses/render, /v1/messages/render, each taking its API's body and
        answering one GenerateRequest): its token ids and media items with the engine's hashes and placeholder
        ranges. `body` is the client's own body (a JSON object), sent as it came, asking the engine to leave the
        processed media tensors out of its answer (`return_mm_kwargs: false`, the alias of `mm_payload: "none"`
        every 0.33 render request model reads; engines that do not know the field ignore it). Same retries and
        time budget as `tokenize`; raises TokenizerError (with the HTTP status of a refusal)."""
        base = self._base(model, base_url)
        start = body.find(b"{")
        if start < 0:
            raise TokenizerError("the request body is not a JSON object")
        rest = body[start + 1:].lstrip()
        # The client's own field, if it sent one, comes later in the object and wins (the last duplicate key).
        body = b'{"return_mm_kwargs":false' + (b"}" if rest[:1] == b"}" else b"," + rest)
        return await self._call(f"{base}{path}", body, model, parse_render_response)

    def _base(self, model: str, base_url: str | None) -> str:
        base = self._endpoints.get(model) or (base_url.rstrip("/") if base_url else None)
        if not base:
            raise TokenizerError(f"no tokenizer endpoint for model {model!r}: none configured and no ready pod given")
        return base

    async def _call(self, url: str, body: bytes, model: str, parse: Callable[[bytes, str], _T]) -> _T:
        """POST `body` to `url` and parse the answer, retrying as the options say, within the total budget."""
        started = time.monotonic()
        deadline = started + self._options.total_timeout_s
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            try:
                out = parse(await self._attempt(url, body, min(self._options.attempt_timeout_s, remaining)), url)
            except _Retryable as e:
                attempt += 1
                delay = self._delay(attempt, e.retry_after)
                if attempt > self._options.max_retries or time.monotonic() + delay >= deadline:
                    self._metrics.failures.inc()
                    raise (TokenizerTimeout if e.timeout else TokenizerError)(
                        f"tokenizer at {url} failed for model {model!r} after {attempt} attempt(s): {e}"
                    ) from None
                await asyncio.sleep(delay)
                continue
            except TokenizerError:
                self._metrics.failures.inc()
                raise
            self._metrics.seconds.observe(time.monotonic() - started)
            return out

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            if self._closed:
                raise TokenizerError("the remote tokenizer is closed")
            n = self._options.max_connections
            # Idle connections are dropped before uvicorn's (vLLM's server) 5 s keep-alive ends them, so a
            # request rarely meets a connection the engine is closing (that one is retried anyway).
            limits = httpx.Limits(max_connections=n, max_keepalive_connections=n, keepalive_expiry=4.0)
            ssl_context = httpx.create_ssl_context()  # SSL_CERT_FILE or SSL_CERT_DIR if set, as httpx reads them
            self._client = httpx.AsyncClient(
                transport=OneWriteTransport(limits, ssl_context=ssl_context),
                # HTTP(S)_PROXY, ALL_PROXY and NO_PROXY are read here, once (httpx itself reads no proxies for a
                # client given a transport). Credentials in a proxy URL go to the proxy only; in an endpoint
                # URL, as basic auth.
                mounts=environment_mounts(limits, ssl_context),
                timeout=None,  # each attempt is bounded as a whole by asyncio.timeout below
                follow_redirects=False,
                cookies=_NoCookies(),
            )
        return self._client

    def _lean_for(self, url: str) -> tuple[Http1Client, str] | None:
        """The tokenizer.http1 client and path for `url`, or None where httpx's client goes (a client given, a proxy
        in the environment, https, credentials in the URL, or a URL it cannot read)."""
        if url in self._lean_urls:
            return self._lean_urls[url]
        found = None
        if self._owns_client and len(self._lean_urls) < 256:
            if self._lean_ok is None:
                self._lean_ok = not any(p is not None for p in environment_proxies().values())
            parts = urllib.parse.urlsplit(url)
            try:
                port = parts.port or 80
            except ValueError:
                port = None
            if (self._lean_ok and parts.scheme == "http" and parts.hostname and port is not None
                    and parts.username is None and parts.password is None and not parts.fragment):
                client = self._lean.get((parts.hostname, port))
                if client is None:
                    client = self._lean[(parts.hostname, port)] = Http1Client(
                        parts.hostname, port, max_connections=self._options.max_connections, idle_s=4.0)
                found = (client, (parts.path or "/") + (f"?{parts.query}" if parts.query else ""))
            self._lean_urls[url] = found
        return found

    async def _attempt(self, url: str, body: bytes, timeout_s: float) -> bytes:
        if timeout_s <= 0:
            raise _Retryable("no time left", timeout=True)
        if self._closed:
            raise TokenizerError("the remote tokenizer is closed")
        lean = self._lean_for(url)
        if lean is not None:
            http1, path = lean
            try:
                reply = await http1.request(http1.head("POST", path, "application/json", len(body),
                                                       accept="application/json"), body, timeout_s=timeout_s)
            except TimeoutError:
                self._metrics.attempts.labels("timeout").inc()
                raise _Retryable(f"timed out after {timeout_s * 1000:.0f} ms", timeout=True) from None
            except (HttpError, OSError) as e:
                self._metrics.attempts.labels("connect_error").inc()
                raise _Retryable(f"{type(e).__name__}: {e}") from None
            retry_after = reply.headers.get(b"retry-after")
            return self._answer(url, reply.status, retry_after.decode("latin-1") if retry_after else None, reply.body)
        client = self._http()
        try:
            # One bound on the whole attempt: connecting, sending, and reading every byte of the answer.
            async with asyncio.timeout(timeout_s):
                resp = await client.post(url, content=body, headers=_JSON_HEADERS)
        except (httpx.TimeoutException, TimeoutError):
            self._metrics.attempts.labels("timeout").inc()
            raise _Retryable(f"timed out after {timeout_s * 1000:.0f} ms", timeout=True) from None
        except (httpx.UnsupportedProtocol, httpx.InvalidURL, ValueError) as e:  # no retry helps
            self._metrics.attempts.labels("refused").inc()
            raise TokenizerError(f"tokenizer URL {url!r} is not usable: {e}") from None
        except (httpx.TransportError, OSError) as e:
            self._metrics.attempts.labels("connect_error").inc()
            raise _Retryable(f"{type(e).__name__}: {e}") from None
        return self._answer(url, resp.status_code, resp.headers.get("retry-after"), resp.content)

    def _answer(self, url: str, status: int, retry_after: str | None, content: bytes) -> bytes:
        """The answer's content where it is a 200; _Retryable for 429 and 5xx, TokenizerError for the rest."""
        if status == 429 or status >= 500:
            self._metrics.attempts.labels(f"{status // 100}xx" if status != 429 else "429").inc()
            raise _Retryable(f"HTTP {status}", parse_retry_after(retry_after))
        if status != 200:
            self._metrics.attempts.labels("refused").inc()
            text = content[:200].decode("utf-8", "replace")
            raise TokenizerError(f"tokenizer at {url} refused the request: HTTP {status}: {text}", status)
        self._metrics.ok.inc()
        return content

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        backoff = self._rng() * min(self._options.backoff_max_s, self._options.backoff_base_s * 2 ** (attempt - 1))
        return max(backoff, retry_after) if retry_after is not None else backoff

    async def aclose(self) -> None:
        self._closed = True
        for lean in self._lean.values():
            lean.close()
        if self._owns_client and self._client is not None:
            await self._client.aclose()
            self._client = None


def request_body(model: str, item: TokenizeInput) -> dict[str, Any]:
    """vLLM's TokenizeCompletionRequest or TokenizeChatRequest for `item`."""
    if isinstance(item, ChatInput):
        body: dict[str, Any] = {
            "model": model,
            "messages": list(item.messages),
            "add_generation_prompt": item.add_generation_prompt,
            "continue_final_message": item.continue_final_message,
            "add_special_tokens": False,
        }
        if item.tools is not None:
            body["tools"] = list(item.tools)
        if item.chat_template is not None:
            body["chat_template"] = item.chat_template
        if item.chat_template_kwargs is not None:
            body["chat_template_kwargs"] = item.chat_template_kwargs
        return body
    if item.text is None:
        raise TokenizerError("prompt has neither text nor token ids")
    return {"model": model, "prompt": item.text, "add_special_tokens": item.add_special_tokens}


def parse_response(content: bytes, url: str = "tokenizer") -> list[int]:
    try:
        data = json.loads(content)
    except ValueError:
        raise TokenizerError(f"{url} answered with something that is not JSON") from None
    tokens = data.get("tokens") if isinstance(data, dict) else None
    if not isinstance(tokens, list) or not set(map(type, tokens)) <= {int}:  # no bools, floats or strings
        raise TokenizerError(f"{url} answered without a list of integer `tokens`")
    count = data.get("count")
    if count is not None and count != len(tokens):
        raise TokenizerError(f"{url} answered count={count!r} for {len(tokens)} tokens")
    return tokens


def parse_render_response(content: bytes, url: str = "render") -> Rendered:
    """vLLM's render answer (a GenerateRequest: `token_ids`, and `features` null or {`mm_hashes`: {modality: [hash,
    ...]}, `mm_placeholders`: {modality: [{`offset`, `length`}, ...]}, `kwargs_data`}) -> Rendered, its media in
    prompt order. A placeholder without a hash beside it (a shorter or missing hash list, a null entry) gets
    identifier None; a placeholder outside the token ids, or any other shape, is a TokenizerError."""
    try:
        data = json.loads(content)
    except ValueError:
        raise TokenizerError(f"{url} answered with something that is not JSON") from None
    tokens = data.get("token_ids") if isinstance(data, dict) else None
    if not isinstance(tokens, list) or not set(map(type, tokens)) <= {int}:
        raise TokenizerError(f"{url} answered without a list of integer `token_ids`")
    features = data.get("features")
    if features is None:
        return Rendered(tokens)
    placeholders = features.get("mm_placeholders") if isinstance(features, dict) else None
    hashes = features.get("mm_hashes") if isinstance(features, dict) else None
    if hashes is None:
        hashes = {}
    if not isinstance(placeholders, dict) or not isinstance(hashes, dict):
        raise TokenizerError(f"{url} answered `features` without `mm_placeholders` and `mm_hashes` objects")
    media = []
    for modality, ranges in placeholders.items():
        ids = hashes.get(modality)
        if not isinstance(ranges, list) or (ids is not None and not isinstance(ids, list)):
            raise TokenizerError(f"{url} answered {modality!r} placeholders or hashes that are not lists")
        for i, r in enumerate(ranges):
            offset = r.get("offset") if isinstance(r, dict) else None
            length = r.get("length") if isinstance(r, dict) else None
            if type(offset) is not int or type(length) is not int or offset < 0 or length < 0 \
                    or offset + length > len(tokens):
                raise TokenizerError(f"{url} answered a {modality!r} placeholder {r!r} outside its "
                                     f"{len(tokens)} token ids")
            h = ids[i] if ids is not None and i < len(ids) else None
            media.append(RenderedMedia(modality, h if isinstance(h, str) and h else None, offset, length))
    media.sort(key=lambda m: m.offset)
    return Rendered(tokens, tuple(media))


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Retry-After as seconds from now: delta-seconds or an HTTP date; None if absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))
