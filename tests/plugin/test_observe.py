"""Response observation (plugin.observe) and request tracking (routing.learning.tracking), as units: bytes in,
what the trackers and Prometheus see out."""
from __future__ import annotations

import json

import pytest
from prometheus_client import CollectorRegistry

from plugin.observe import Observer
from routing.learning.tracking import TraceWindows, Tracker, TrackerRegistry, trace_bucket
from helpers import Clock



class Recorder:
    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def add_request_count(self, ctx, request_id, model):
        self.calls.append((self.name, "add", request_id))
        return 7

    def done_request_count(self, ctx, request_id, model, term):
        self.calls.append((self.name, "done", request_id, term))

    def done_request_trace(self, ctx, request_id, model, i, o, term):
        self.calls.append((self.name, "trace", request_id, i, o, term))


def sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def chat_chunk(text, first=False):
    delta = {"role": "assistant", "content": ""} if first else {"content": text}
    return sse({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]})


def value(reg, name, **labels):
    return reg.get_sample_value(name, labels) or 0.0


def run_stream(obs, clock, tokens=5, usage=True, step=0.02):
    w = obs.start("r1", "m", "p0", tokens=list(range(40)))
    w.on_headers(200, "text/event-stream")
    clock.t += 0.3
    w.on_chunk(chat_chunk("", first=True) + chat_chunk("a"))
    for _ in range(tokens - 1):
        clock.t += step
        w.on_chunk(chat_chunk("b"))
    if usage:
        w.on_chunk(sse({"choices": [], "usage": {"prompt_tokens": 42, "completion_tokens": tokens,
                                                 "total_tokens": 42 + tokens}}) + b"data: [DONE]\n\n")
    else:
        w.on_chunk(b"data: [DONE]\n\n")
    w.close()
    return w


@pytest.mark.parametrize("usage", [True, False])
def test_stream_gives_ttft_tpot_and_tokens_from_usage_or_counted(usage):
    reg, clock, calls = CollectorRegistry(), Clock(100.0), []
    obs = Observer(reg, TrackerRegistry((Recorder("a", calls),)), clock=clock)
    o = run_stream(obs, clock, tokens=5, usage=usage)
    assert o.ttft == pytest.approx(0.3)
    assert o.tpot == pytest.approx(0.02)
    assert o.completion_tokens == 5
    assert o.prompt_tokens == (42 if usage else 40)  # usage's, else the tokenized prompt's
    assert value(reg, "kvgate_request_completion_tokens_total", model="m", pod="p0") == 5
    assert value(reg, "kvgate_request_ttft_seconds_count", model="m", pod="p0") == 1
    assert value(reg, "kvgate_request_tpot_seconds_sum", model="m", pod="p0") == pytest.approx(0.02)
    assert calls == [("a", "add", "r1"), ("a", "trace", "r1", o.prompt_tokens, 5, 7)]


def test_json_response_gives_tokens_but_no_ttft():
    reg, clock = CollectorRegistry(), Clock(100.0)
    obs = Observer(reg, clock=clock)
    w = obs.start("r", "m", "p1")
    w.on_headers(200, "application/json")
    body = json.dumps({"choices": [{"text": "x" * 3000}], "usage": {"prompt_tokens": 9, "completion_tokens": 3}})
    raw = body.encode()
    for i in range(0, len(raw), 700):  # usage split over the last chunks
        w.on_chunk(raw[i:i + 700])
    w.close()
    assert (w.prompt_tokens, w.completion_tokens, w.ttft, w.tpot) == (9, 3, None, None)
    assert value(reg, "kvgate_request_prompt_tokens_total", model="m", pod="p1") == 9
    assert value(reg, "kvgate_request_ttft_seconds_count", model="m", pod="p1") == 0


def _response_headers_msg(status, content_type):
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    headers = [base_pb2.HeaderValue(key=":status", raw_value=str(status).encode())]
    if content_type:
        headers.append(base_pb2.HeaderValue(key="content-type", raw_value=content_type.encode()))
    return pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=headers)))


def test_the_answer_to_response_headers_asks_for_a_json_body_whole_and_an_event_stream_by_chunk():
    """A JSON body comes back to kvgate in one message (BUFFERED_PARTIAL: STREAMED costs a message per
    chunk plus one for the end of the stream); a token stream chunk by chunk (STREAMED, for TTFT and
    TPOT); a failed response not at all. Every override restates the request's modes."""
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.config.core.v3 import base_pb2

    from plugin import observe
    Mode = pm.ProcessingMode
    cont = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
    obs = Observer(CollectorRegistry(), clock=Clock(100.0))
    modes = {}
    for ctype in ("application/json", "text/event-stream; charset=utf-8", ""):
        out = observe.response_headers(obs.start("r", "m", "p"), _response_headers_msg(200, ctype), cont, False)
        assert out.HasField("mode_override") and out.HasField("response_headers")
        m = out.mode_override
        assert (m.request_header_mode, m.request_body_mode, m.response_header_mode) == (
            Mode.SEND, Mode.BUFFERED, Mode.SEND)
        modes[ctype] = m.response_body_mode
    assert modes == {"application/json": Mode.BUFFERED_PARTIAL, "text/event-stream; charset=utf-8": Mode.STREAMED,
                     "": Mode.BUFFERED_PARTIAL}
    # a failed response: no body asked for; a fallback's header mutation is kept beside the override
    assert not observe.response_headers(obs.start("r", "m", "p"), _response_headers_msg(503, "application/json"),
                                        cont, False).HasField("mode_override")
    rewrite = pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=pb.CommonResponse(
        header_mutation=pb.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key="x-kvgate-pod", raw_value=b"p2"))]))))
    out = observe.response_headers(obs.start("r", "m", "p"), _response_headers_msg(200, "application/json"),
                                   rewrite, False)
    assert out.mode_override.response_body_mode == Mode.BUFFERED_PARTIAL
    assert out.response_headers.response.header_mutation.set_headers[0].header.raw_value == b"p2"
    # Envoy already sends the body (FULL_DUPLEX_STREAMED configured): nothing to turn on
    assert not observe.response_headers(obs.start("r", "m", "p"), _response_headers_msg(200, "application/json"),
                                        cont, True).HasField("mode_override")


def test_failed_or_cut_response_is_done_without_usage_once():
    calls = []
    obs = Observer(CollectorRegistry(), TrackerRegistry((Recorder("a", calls),)), clock=Clock(100.0))
    w = obs.start("r", "m", "p")
    w.on_headers(503, "application/json")
    w.close()
    w.close()
    cut = obs.start("r2", "m", "p")  # cancelled before any response
    cut.close()
    assert calls == [("a", "add", "r"), ("a", "done", "r", 7), ("a", "add", "r2"), ("a", "done", "r2", 7)]


def test_served_by_a_fallback_is_counted_on_that_pod():
    reg, clock = CollectorRegistry(), Clock(100.0)
    obs = Observer(reg, clock=clock)
    w = obs.start("r", "m", "p0")
    w.served_by("p2")
    w.on_headers(200, "text/event-stream")
    w.on_chunk(sse({"choices": [{"index": 0, "text": "a"}]}))
    w.close()
    assert value(reg, "kvgate_request_completion_tokens_total", model="m", pod="p2") == 1
    assert value(reg, "kvgate_request_completion_tokens_total", model="m", pod="p0") == 0


def test_registry_calls_trackers_in_order_idempotent_start_and_survives_a_failing_one():
    calls = []

    class Broken(Recorder):
        def add_request_count(self, ctx, request_id, model):
            raise RuntimeError("boom")

    reg = TrackerRegistry((Recorder("a", calls),))
    reg.register(Broken("x", calls))
    reg.register(Recorder("b", calls))
    assert reg.add_request_count(None, "r", "m") == 7
    assert reg.add_request_count(None, "r", "m") == 7  # again: counted once
    reg.done_request_trace(None, "r", "m", 10, 20, 7)
    reg.done_request_count(None, "r", "m", 7)  # already done: nothing
    reg.done_request_count(None, "never-started", "m", 0)  # cancelled before routing: nothing
    assert calls == [("a", "add", "r"), ("b", "add", "r"), ("a", "trace", "r", 10, 20, 7),
                     ("x", "trace", "r", 10, 20, 7), ("b", "trace", "r", 10, 20, 7)]
    assert reg.in_flight == 0


def test_registry_calls_what_a_tracker_overrides_of_tracker_on_its_class_or_instance():
    """A Tracker subclass acts on what it overrides (on its class, or on the instance before it is
    registered); the rest are Tracker's no-ops (term 0)."""
    calls = []

    class Traces(Tracker):
        def done_request_trace(self, ctx, request_id, model, i, o, term):
            calls.append(("trace", request_id, i, o, term))

    counted = Traces()
    counted.done_request_count = lambda ctx, request_id, model, term: calls.append(("done", request_id, term))
    reg = TrackerRegistry((Traces(), counted, Tracker()))
    reg.register(Recorder("a", calls))
    assert reg.add_request_count(None, "r", "m") == 7  # the first non-zero term: the Recorder's
    reg.done_request_trace(None, "r", "m", 3, 4, 7)
    assert reg.add_request_count(None, "s", "m") == 7
    reg.done_request_count(None, "s", "m", 7)
    assert calls == [("a", "add", "r"), ("trace", "r", 3, 4, 7), ("trace", "r", 3, 4, 7), ("a", "trace", "r", 3, 4, 7),
                     ("a", "add", "s"), ("done", "s", 7), ("a", "done", "s", 7)]


def test_trace_window_is_aibrix_format_and_rotates_with_terms():
    clock = Clock(100.0)
    clock.t = 1_700_000_017.3
    w = TraceWindows(10.0, clock=clock, queueing=lambda m: 2)
    t1 = w.add_request_count(None, "a", "m")
    t2 = w.add_request_count(None, "b", "m")
    w.done_request_trace(None, "a", "m", 1000, 100, t1)
    assert trace_bucket(1000) == 100 and trace_bucket(100) == 66 and trace_bucket(0) == 0  # log2 x 10, rounded
    t, traces = w.rotate()
    assert t == 1_700_000_010
    assert traces["m"] == {"100:66": 1, "meta_v": 4, "meta_interval_sec": 10, "meta_precision": 10,
                           "meta_total_reqs": 2, "meta_pending_reqs": 1, "meta_queueing_reqs": 2}
    # b finishes in the next window: its trace is counted there (its term an older one)
    w.done_request_trace(None, "b", "m", 16, 16, t2)
    _, traces = w.rotate()
    assert traces["m"]["40:40"] == 1 and traces["m"]["meta_total_reqs"] == 0 and traces["m"]["meta_pending_reqs"] == 0


@pytest.mark.integration
async def test_trace_writer_puts_aibrix_keys_in_redis_with_expiry(redis_server):
    from redis.asyncio import Redis
    from routing.learning.tracking import TraceWriter
    client = Redis.from_url(redis_server.url)
    try:
        clock = Clock(100.0)
        clock.t = 1_700_000_123.0
        windows = TraceWindows(10.0, clock=clock)
        term = windows.add_request_count(None, "a", "llama-3")
        windows.done_request_trace(None, "a", "llama-3", 512, 64, term)
        assert await TraceWriter(windows, client).write_once() == 1
        raw = await client.get("aibrix:llama-3_request_trace_1700000120")
        trace = json.loads(raw)
        assert trace["90:60"] == 1 and trace["meta_v"] == 4 and trace["meta_total_reqs"] == 1
        assert 0 < await client.ttl("aibrix:llama-3_request_trace_1700000120") <= 600
    finally:
        await client.aclose()


def test_first_token_hook_fires_at_the_first_chunk_and_again_at_the_end_for_cut_requests():
    seen = []
    obs = Observer(CollectorRegistry(), clock=Clock(100.0), on_first_token=seen.append)
    w = obs.start("r1", "m", "p")
    w.on_headers(200, "text/event-stream")
    w.on_chunk(chat_chunk("", first=True))
    w.on_chunk(chat_chunk("a"))
    assert seen == ["r1"]
    cut = obs.start("r2", "m", "p")
    cut.close()
    assert seen[-1] == "r2"


def test_observe_cost_bench_drives_a_real_server_and_reports_cpu_per_request():
    from bench import observe_cost
    assert observe_cost.measure(40, 2, True) > 0  # the child server's CPU over 40 requests of 2 chunks


def test_an_unwatched_request_is_done_without_usage_and_a_stray_chunk_only_fires_the_first_token_hook():
    """Not sampled: its end tells the trackers done (without usage, whatever a response said) and counts
    it unsampled; should Envoy send a chunk all the same, only the first-token hook sees it (once)."""
    reg, calls, seen = CollectorRegistry(), [], []
    obs = Observer(reg, TrackerRegistry((Recorder("a", calls),)), clock=Clock(100.0), on_first_token=seen.append)
    w = obs.start("r", "m", "p0", tokens=list(range(40)), watched=False)
    assert w.on_headers(200, "text/event-stream")  # the answer to response headers is the watched one's
    w.on_chunk(b"")
    assert seen == []
    w.on_chunk(chat_chunk("", first=True) + chat_chunk("a"))
    w.on_chunk(sse({"choices": [], "usage": {"prompt_tokens": 42, "completion_tokens": 2, "total_tokens": 44}}))
    assert seen == ["r"]
    w.close()
    w.close()
    assert seen == ["r", "r"]  # the end tells it again (idempotent there), as for a watched request
    assert calls == [("a", "add", "r"), ("a", "done", "r", 7)]
    assert not w.watched and not w.usage and w.ttft is None
    assert value(reg, "kvgate_requests_observed_total", source="unsampled") == 1
    assert value(reg, "kvgate_request_completion_tokens_total", model="m", pod="p0") == 0
    assert value(reg, "kvgate_request_prompt_tokens_total", model="m", pod="p0") == 0
