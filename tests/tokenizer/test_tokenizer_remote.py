"""RemoteTokenizer (httpx) against real aiohttp servers on loopback: shapes, retries, Retry-After, timeouts, failures."""
from __future__ import annotations

import asyncio
import email.utils
import importlib.util
import time

import httpcore
import httpx
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from tokenizer import testdata
from tokenizer.local import LocalTokenizer
from tokenizer.remote import RemoteOptions, RemoteTokenizer, parse_retry_after, request_body
from tokenizer.transport import OneWriteTransport, _OneWrite, environment_mounts
from devkit.tokenizer_stub import make_app
from tokenizer.types import ChatInput, PromptInput, TokenizerError, TokenizerTimeout
from helpers import serve_app

MODEL = "test-model"
FAST = RemoteOptions(total_timeout_s=2.0, attempt_timeout_s=1.0, max_retries=3, backoff_base_s=0.001, backoff_max_s=0.005)


@pytest.fixture(scope="module")
def local() -> LocalTokenizer:
    return LocalTokenizer.from_path(testdata.path())


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner, port = await serve_app(app, shutdown_timeout=0.2)
    return runner, f"http://127.0.0.1:{port}"


def tokenize_app(handle) -> web.Application:
    """An engine stand-in whose /tokenize is `handle`."""
    app = web.Application()
    app.router.add_post("/tokenize", handle)
    return app


def scripted(responses: list, seen: list) -> web.Application:
    """Answers /tokenize with the scripted (status, headers, body) in turn, then 200 [1, 2, 3]."""

    async def handle(request: web.Request) -> web.Response:
        seen.append(await request.json())
        if responses:
            status, headers, delay = responses.pop(0)
            if delay:
                await asyncio.sleep(delay)
            return web.json_response({"error": "busy"}, status=status, headers=headers)
        return web.json_response({"count": 3, "max_model_len": 100, "tokens": [1, 2, 3], "token_strs": None})

    return tokenize_app(handle)


async def test_prompt_and_chat_match_local_tokenizer(local) -> None:
    runner, url = await serve(make_app({MODEL: local}))
    remote = RemoteTokenizer({MODEL: url}, options=FAST)
    try:
        chat = ChatInput(
            messages=({"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi <|im_end|> there"}),
            tools=({"type": "function", "function": {"name": "f"}},),
            chat_template_kwargs={"enable_thinking": False},
        )
        assert await remote.tokenize(MODEL, chat) == local.encode_chat(chat)
        prompt = PromptInput(text="hello world", add_special_tokens=False)
        assert await remote.tokenize(MODEL, prompt) == local.encode_prompt("hello world", False)
        assert await remote.tokenize(MODEL, PromptInput(token_ids=(9, 8))) == [9, 8]
    finally:
        await remote.aclose()
        await runner.cleanup()


def test_request_bodies_have_vllm_shapes() -> None:
    chat = ChatInput(messages=({"role": "user", "content": "x"},), chat_template="T", chat_template_kwargs={"k": 1},
                     tools=({"type": "function"},), add_generation_prompt=False, continue_final_message=True)
    assert request_body("m", chat) == {
        "model": "m", "messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False,
        "continue_final_message": True, "add_special_tokens": False, "tools": [{"type": "function"}],
        "chat_template": "T", "chat_template_kwargs": {"k": 1},
    }
    assert request_body("m", PromptInput(text="p")) == {"model": "m", "prompt": "p", "add_special_tokens": True}


async def test_base_url_of_a_ready_pod_is_used_when_no_endpoint_configured() -> None:
    seen: list = []
    runner, url = await serve(scripted([], seen))
    remote = RemoteTokenizer(options=FAST)
    try:
        assert await remote.tokenize("other", PromptInput(text="x"), base_url=url + "/") == [1, 2, 3]
        assert seen[0]["model"] == "other"
        with pytest.raises(TokenizerError, match="no tokenizer endpoint"):
            await remote.tokenize("other", PromptInput(text="x"))
    finally:
        await remote.aclose()
        await runner.cleanup()


async def test_retries_429_and_5xx_then_succeeds() -> None:
    seen: list = []
    runner, url = await serve(scripted([(429, {}, 0), (503, {}, 0), (500, {}, 0)], seen))
    registry = CollectorRegistry()
    remote = RemoteTokenizer({MODEL: url}, options=FAST, registry=registry)
    try:
        assert await remote.tokenize(MODEL, PromptInput(text="x")) == [1, 2, 3]
        assert len(seen) == 4
        assert registry.get_sample_value("kvgate_tokenizer_remote_attempts_total", {"outcome": "429"}) == 1
        assert registry.get_sample_value("kvgate_tokenizer_remote_attempts_total", {"outcome": "5xx"}) == 2
    finally:
        await remote.aclose()
        await runner.cleanup()


async def test_retry_after_is_honoured() -> None:
    seen: list = []
    runner, url = await serve(scripted([(429, {"Retry-After": "0.3"}, 0)], seen))
    remote = RemoteTokenizer({MODEL: url}, options=FAST)
    try:
        t0 = time.monotonic()
        assert await remote.tokenize(MODEL, PromptInput(text="x")) == [1, 2, 3]
        assert time.monotonic() - t0 >= 0.3  # waited at least what the server asked (a lower bound, not a speed claim)
    finally:
        await remote.aclose()
        await runner.cleanup()


async def test_retry_after_beyond_budget_fails_without_waiting() -> None:
    seen: list = []
    runner, url = await serve(scripted([(503, {"Retry-After": "120"}, 0)], seen))
    remote = RemoteTokenizer({MODEL: url}, options=FAST)
    try:
        with pytest.raises(TokenizerError, match="HTTP 503"):
            await asyncio.wait_for(remote.tokenize(MODEL, PromptInput(text="x")), timeout=10)
        assert len(seen) == 1
    finally:
        await remote.aclose()
        await runner.cleanup()


async def test_gives_up_after_max_retries() -> None:
    seen: list = []
    runner, url = await serve(scripted([(500, {}, 0)] * 10, seen))
    registry = CollectorRegistry()
    remote = RemoteTokenizer({MODEL: url}, options=FAST, registry=registry)
    try:
        with pytest.raises(TokenizerError, match="after 4 attempt") as failed:
            await remote.tokenize(MODEL, PromptInput(text="x"))
        assert not isinstance(failed.value, TokenizerTimeout)  # it answered, with 500s: not a timeout
        assert len(seen) == 4
        assert registry.get_sample_value("kvgate_tokenizer_remote_failures_total") == 1
    finally:
        await remote.aclose()
        await runner.cleanup()


async def test_slow_server_is_bounded_by_total_timeout() -> None:
    seen: list = []
    runner, url = await serve(scripted([(200, {}, 1.5)] * 5, seen))
    options = RemoteOptions(total_timeout_s=0.3, attempt_timeout_s=0.2, max_retries=5, backoff_base_s=0.001)
    remote = RemoteTokenizer({MODEL: url}, options=options)
    try:
        # Given up on its own budget after attempts that timed out: a timeout, as the caller's own would be.
        with pytest.raises(TokenizerTimeout, match="timed out|no time left"):
            await asyncio.wait_for(remote.tokenize(MODEL, PromptInput(text="x")), timeout=10)
    finally:
        await remote.aclose()
        await runner.cleanup()


async def test_refused_request_is_not_retried(local) -> None:
    runner, url = await serve(make_app({MODEL: local}))
    remote = RemoteTokenizer({"unknown": url}, options=FAST)
    try:
        with pytest.raises(TokenizerError, match="HTTP 404"):
            await remote.tokenize("unknown", PromptInput(text="x"))
        bad = ChatInput(messages=({"role": "user", "content": "x"},), add_generation_prompt=True, continue_final_message=True)
        remote2 = RemoteTokenizer({MODEL: url}, options=FAST)
        with pytest.raises(TokenizerError, match="HTTP 400"):
            await remote2.tokenize(MODEL, bad)
        await remote2.aclose()
    finally:
        await remote.aclose()
        await runner.cleanup()


async def test_connection_refused_and_malformed_answers_raise_tokenizer_error() -> None:
    runner, url = await serve(web.Application())
    await runner.cleanup()  # nothing listens there any more
    remote = RemoteTokenizer({MODEL: url}, options=FAST)
    with pytest.raises(TokenizerError, match="after 4 attempt"):
        await remote.tokenize(MODEL, PromptInput(text="x"))
    await remote.aclose()

    async def bad(request):
        return web.json_response({"count": 5, "tokens": [1, 2]})

    runner, url = await serve(tokenize_app(bad))
    remote = RemoteTokenizer({MODEL: url}, options=FAST)
    try:
        with pytest.raises(TokenizerError, match="count=5"):
            await remote.tokenize(MODEL, PromptInput(text="x"))
    finally:
        await remote.aclose()
        await runner.cleanup()


def test_parse_retry_after() -> None:
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(None) is None
    assert parse_retry_after("soon") is None
    now = time.time()
    assert parse_retry_after(email.utils.formatdate(now + 10, usegmt=True), now=now) == pytest.approx(10, abs=1)
    assert parse_retry_after(email.utils.formatdate(now - 10, usegmt=True), now=now) == 0.0


def test_options_reject_bad_values() -> None:
    with pytest.raises(ValueError):
        RemoteOptions(total_timeout_s=0)
    with pytest.raises(ValueError):
        RemoteOptions(max_retries=-1)


async def test_unencodable_request_is_a_tokenizer_error() -> None:
    remote = RemoteTokenizer({MODEL: "http://127.0.0.1:9"}, options=FAST)
    try:
        with pytest.raises(TokenizerError, match="JSON"):
            await remote.tokenize(MODEL, PromptInput(text="a\ud800"))
        with pytest.raises(TokenizerError, match="JSON"):
            await remote.tokenize(MODEL, ChatInput(messages=({"role": "user", "content": "x"},),
                                                   tools=({"x": float("nan")},)))
    finally:
        await remote.aclose()


async def test_slow_drip_answer_is_bounded_by_the_attempt_timeout() -> None:
    async def drip(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "application/json"})
        await resp.prepare(request)
        for chunk in (b'{"count": 1, ', b'"max_model_len": 9, ', b'"tokens": [1]}'):
            await resp.write(chunk)
            await asyncio.sleep(0.15)  # every read is quick; the whole answer is not
        await resp.write_eof()
        return resp

    runner, url = await serve(tokenize_app(drip))
    options = RemoteOptions(total_timeout_s=0.3, attempt_timeout_s=0.3, max_retries=0)
    remote = RemoteTokenizer({MODEL: url}, options=options)
    try:
        with pytest.raises(TokenizerTimeout, match="timed out"):
            await asyncio.wait_for(remote.tokenize(MODEL, PromptInput(text="x")), timeout=10)
    finally:
        await remote.aclose()
        await runner.cleanup()


def _clear_proxy_env(monkeypatch) -> None:
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY",
                 "REQUEST_METHOD"):
        monkeypatch.delenv(name, raising=False)


async def test_proxy_from_the_environment_is_used_unless_no_proxy_exempts_the_engine(monkeypatch) -> None:
    engine_seen: list = []
    engine, engine_url = await serve(scripted([], engine_seen))
    proxied: list = []

    async def via_proxy(request: web.Request) -> web.Response:
        proxied.append((str(request.url), request.headers.get("Proxy-Authorization")))
        return web.json_response({"count": 1, "tokens": [7]})

    proxy, proxy_url = await serve(tokenize_app(via_proxy))
    _clear_proxy_env(monkeypatch)
    try:
        monkeypatch.setenv("HTTP_PROXY", proxy_url.replace("http://", "http://user:secret@"))
        remote = RemoteTokenizer({MODEL: engine_url}, options=FAST)
        assert await remote.tokenize(MODEL, PromptInput(text="x")) == [7]
        await remote.aclose()
        assert engine_seen == [] and len(proxied) == 1
        assert proxied[0][0].endswith(engine_url.removeprefix("http://") + "/tokenize")
        assert proxied[0][1] == "Basic dXNlcjpzZWNyZXQ="  # user:secret, sent to the proxy only

        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        remote = RemoteTokenizer({MODEL: engine_url}, options=FAST)
        assert await remote.tokenize(MODEL, PromptInput(text="x")) == [1, 2, 3]
        await remote.aclose()
        assert len(engine_seen) == 1 and len(proxied) == 1
    finally:
        await engine.cleanup()
        await proxy.cleanup()


async def test_unusable_url_fails_without_retrying(monkeypatch) -> None:
    _clear_proxy_env(monkeypatch)
    registry = CollectorRegistry()
    remote = RemoteTokenizer({MODEL: "localhost:8000"}, options=FAST, registry=registry)
    try:
        with pytest.raises(TokenizerError, match="not usable"):
            await remote.tokenize(MODEL, PromptInput(text="x"))
        assert registry.get_sample_value("kvgate_tokenizer_remote_attempts_total", {"outcome": "refused"}) == 1
        assert registry.get_sample_value("kvgate_tokenizer_remote_attempts_total", {"outcome": "connect_error"}) is None
    finally:
        await remote.aclose()


async def test_one_connection_is_kept_alive_and_a_closed_tokenizer_refuses() -> None:
    peers: list = []

    async def handle(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername"))
        return web.json_response({"count": 1, "tokens": [4]})

    runner, url = await serve(tokenize_app(handle))
    remote = RemoteTokenizer({MODEL: url}, options=FAST)
    try:
        for _ in range(5):
            assert await remote.tokenize(MODEL, PromptInput(text="x")) == [4]
        assert len(set(peers)) == 1  # sequential calls reuse one kept-alive connection
        await remote.aclose()
        with pytest.raises(TokenizerError, match="closed"):
            await remote.tokenize(MODEL, PromptInput(text="x"))
    finally:
        await remote.aclose()
        await runner.cleanup()


async def test_credentials_in_the_endpoint_url_are_sent_as_basic_auth(monkeypatch) -> None:
    _clear_proxy_env(monkeypatch)
    seen: list = []

    async def handle(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"count": 1, "tokens": [4]})

    runner, url = await serve(tokenize_app(handle))
    remote = RemoteTokenizer({MODEL: url.replace("http://", "http://tok:pw@")}, options=FAST)
    try:
        assert await remote.tokenize(MODEL, PromptInput(text="x")) == [4]
        assert seen == ["Basic dG9rOnB3"]  # tok:pw
    finally:
        await remote.aclose()
        await runner.cleanup()


class _Recorder:
    """A network stream that records what reaches it."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.writes.append(buffer)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return b"answer"

    async def aclose(self) -> None:
        self.closed = True

    def get_extra_info(self, info: str) -> object:
        return info


async def test_headers_and_body_go_out_in_one_write() -> None:
    inner = _Recorder()
    stream = _OneWrite(inner)
    await stream.write(b"POST /tokenize HTTP/1.1\r\n\r\n")
    await stream.write(b'{"prompt": "x"}')
    await stream.write(b"")
    assert inner.writes == []  # nothing sent before the client reads the answer
    assert await stream.read(100) == b"answer"
    assert inner.writes == [b'POST /tokenize HTTP/1.1\r\n\r\n{"prompt": "x"}']
    assert await stream.read(100) == b"answer" and len(inner.writes) == 1  # nothing pending: no empty write
    await stream.write(b"never sent")
    await stream.aclose()
    assert inner.closed and len(inner.writes) == 1
    assert stream.get_extra_info("is_readable") == "is_readable"


class _Counted(httpcore.AsyncNetworkStream):
    """A real network stream that records each write before it sends it."""

    def __init__(self, stream: httpcore.AsyncNetworkStream, writes: list[bytes]) -> None:
        self._stream = stream
        self._writes = writes

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._writes.append(buffer)
        await self._stream.write(buffer, timeout)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return await self._stream.read(max_bytes, timeout)

    async def aclose(self) -> None:
        await self._stream.aclose()

    def get_extra_info(self, info: str) -> object:
        return self._stream.get_extra_info(info)


def _counting_backend(writes: list[bytes]) -> type:
    """httpcore's anyio backend, its connections recording their writes in `writes`."""

    class Counting(httpcore.AnyIOBackend):
        async def connect_tcp(self, *args, **kwargs) -> httpcore.AsyncNetworkStream:
            return _Counted(await super().connect_tcp(*args, **kwargs), writes)

    return Counting


async def test_every_pool_of_the_client_sends_requests_in_one_write(monkeypatch) -> None:
    _clear_proxy_env(monkeypatch)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    mounts = environment_mounts(httpx.Limits(), httpx.create_ssl_context())
    assert list(mounts) == ["https://"]  # the proxy for https, beside the client's direct transport
    assert all(isinstance(t, OneWriteTransport) for t in mounts.values())
    for transport in mounts.values():
        assert transport is not None
        await transport.aclose()

    # End to end, direct and through an HTTP proxy: each request reaches the socket in one write.
    writes: list[bytes] = []
    monkeypatch.setattr(httpcore, "AnyIOBackend", _counting_backend(writes))
    _clear_proxy_env(monkeypatch)
    engine_seen: list = []
    engine, engine_url = await serve(scripted([], engine_seen))

    async def via_proxy(request: web.Request) -> web.Response:
        return web.json_response({"count": 1, "tokens": [7]})

    proxy, proxy_url = await serve(tokenize_app(via_proxy))
    try:
        # direct: with a proxy for https only (so httpx's client, not tokenizer.http1, carries the http request)
        for expected, env in (([1, 2, 3], ("HTTPS_PROXY", "http://proxy.invalid:3128")), ([7], ("HTTP_PROXY", proxy_url))):
            monkeypatch.setenv(*env)
            writes.clear()
            remote = RemoteTokenizer({MODEL: engine_url}, options=FAST)
            try:
                for _ in range(2):
                    assert await remote.tokenize(MODEL, PromptInput(text="one write")) == expected
            finally:
                await remote.aclose()
            assert len(writes) == 2  # headers and body of each request together
            assert all(w.startswith(b"POST ") and w.endswith(b'"add_special_tokens": true}') for w in writes)
        assert len(engine_seen) == 2  # the proxied requests went to the proxy
    finally:
        await engine.cleanup()
        await proxy.cleanup()
    # httpcore asks sniffio for the event loop many times per request: without it, each is a failed import.
    assert importlib.util.find_spec("sniffio") is not None


async def test_without_a_proxy_an_http_endpoint_is_asked_over_tokenizer_http1_in_one_write(monkeypatch) -> None:
    """No proxy in the environment, a plain http:// endpoint: the request goes over tokenizer.http1 (httpx's pools see
    none of it), head and body in one write, its connection kept for the next; the answers as httpx's."""
    import tokenizer.http1 as http1

    _clear_proxy_env(monkeypatch)
    writes: list[bytes] = []
    monkeypatch.setattr(httpcore, "AnyIOBackend", _counting_backend(writes))
    sent: list[bytes] = []
    real = http1._exchange

    async def exchange(conn, data):
        sent.append(data)
        return await real(conn, data)

    monkeypatch.setattr(http1, "_exchange", exchange)
    seen: list = []
    engine, engine_url = await serve(scripted([], seen))
    remote = RemoteTokenizer({MODEL: engine_url}, options=FAST)
    try:
        for _ in range(3):
            assert await remote.tokenize(MODEL, PromptInput(text="one write")) == [1, 2, 3]
    finally:
        await remote.aclose()
        await engine.cleanup()
    assert writes == [] and len(sent) == 3 and len(seen) == 3
    assert all(w.startswith(b"POST /tokenize HTTP/1.1\r\n") and w.endswith(b'"add_special_tokens": true}') for w in sent)
