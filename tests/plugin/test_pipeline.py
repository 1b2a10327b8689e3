"""The request pipeline (plugin.pipeline): named steps in order on one request's context; a new step joins
by insertion, without the transport; steps not configured are not in the list; the tokenize step answers
without a wait when the tokenizer can, and waits under the timeout only when it must."""
from __future__ import annotations

import asyncio
import dataclasses

import pytest
from prometheus_client import CollectorRegistry

from plugin.extproc import ExternalProcessor
from plugin.observe import Observer
from plugin.pipeline import Pipeline, RequestContext, Step, build
from routing.pods import Pod
from routing.state.admission import Admission, LocalLimiter
from tokenizer.types import TokenizerError, TokenizerTimeout

from test_plugin_extproc import (POD, FakeRouter, InstantTokenizer, WaitingTokenizer, body, gateway, headers,
                                 run_stream, set_headers)

OTHER = Pod("p1", "10.0.0.8", 8000, "m")


def context(body_: bytes = b'{"model": "m", "prompt": "hello"}', path: str = "/v1/completions") -> RequestContext:
    ctx = RequestContext()
    ctx.request_id, ctx.path, ctx.kind, ctx.body = "rid-1", path, "completion", body_
    return ctx


def fallbacks(gw) -> dict[str, float]:
    return {s.labels["reason"]: s.value for m in gw.metrics.tokenizer_fallbacks.collect() for s in m.samples
            if s.name.endswith("_total")}


def test_unconfigured_steps_are_left_out_of_the_list():
    assert build(gateway()).names == ("parse", "tokenize", "pick", "record")
    full = gateway(observer=Observer(CollectorRegistry()), admission=Admission(LocalLimiter(), max_running=4))
    assert build(full).names == ("parse", "tokenize", "pick", "admit", "record", "observe")


async def test_a_new_step_joins_after_pick_and_runs_in_order_on_the_context():
    router = FakeRouter()
    pipeline = build(gateway(router, InstantTokenizer()))
    seen = []

    def handoff(ctx: RequestContext) -> None:
        # runs after pick, before record: the decision is there, the token ids the pick saw too
        seen.append(("handoff", ctx.request.model, ctx.decision.pod.name, list(ctx.token_ids), ctx.strategy))

    def before_pick(ctx: RequestContext) -> None:
        seen.append(("before_pick", ctx.decision))

    pipeline.insert(Step("handoff", handoff), after="pick")
    pipeline.insert(Step("before_pick", before_pick), before="pick")
    assert pipeline.names == ("parse", "tokenize", "before_pick", "pick", "handoff", "record")
    ctx = context()
    d = await pipeline.run(ctx)
    assert d is ctx.decision and d.pod == POD
    assert seen == [("before_pick", None), ("handoff", "m", "p0", [4, 5, 6], "kv-sync")]
    assert router.picks[0].token_ids == [4, 5, 6]


async def test_a_step_that_waits_is_awaited_before_the_next_runs():
    order = []

    async def slow(ctx: RequestContext) -> None:
        await asyncio.sleep(0.01)
        order.append("slow")

    pipeline = Pipeline([Step("slow", slow), Step("after", lambda ctx: order.append("after"))])
    assert await pipeline.run(context()) is None  # no pick in this pipeline: no decision
    assert order == ["slow", "after"]


def test_insert_refuses_a_duplicate_name_and_an_unknown_anchor():
    pipeline = build(gateway())
    with pytest.raises(ValueError, match="already"):
        pipeline.insert(Step("pick", lambda ctx: None))
    with pytest.raises(ValueError, match="no step named 'prefill'"):
        pipeline.insert(Step("handoff", lambda ctx: None), after="prefill")
    with pytest.raises(ValueError, match="not both"):
        pipeline.insert(Step("handoff", lambda ctx: None), after="pick", before="record")
    pipeline.insert(Step("last", lambda ctx: None))
    assert pipeline.names[-1] == "last"


async def test_a_step_joins_the_processor_without_touching_the_transport():
    """A prefill/decode-style handoff after pick moves the request to another pod: the answer Envoy gets
    names that pod, and the request's count is released as usual when the stream ends."""
    router = FakeRouter()
    gw = gateway(router, InstantTokenizer(), pods=(POD, OTHER))
    proc = ExternalProcessor(gw)

    def handoff(ctx: RequestContext) -> None:
        ctx.decision = dataclasses.replace(ctx.decision, pod=OTHER)

    proc.pipeline.insert(Step("handoff", handoff), after="pick")
    out = await run_stream(gw, [headers("POST", "/v1/completions"), body({"model": "m", "prompt": "x"})],
                           processor=proc)
    assert set_headers(out[-1].request_body.response)["x-gateway-destination-endpoint"] == "10.0.0.8:8000"
    assert out[-1].dynamic_metadata["kvgate"]["pod"] == "p1"
    assert gw.metrics.decisions.labels("kv-sync", "p1").value == 1
    assert router.running == 0 and gw.metrics.released.labels("completed").value == 1


class NowTokenizer(InstantTokenizer):
    """A tokenizer with an answer without a wait for some prompts (None for the others), or one that raises."""

    def __init__(self, fail: bool = False):
        self.fail = fail
        self.now, self.called = [], []

    def tokenize_now(self, model, item, *, base_url=None):
        self.now.append((item.text, base_url))
        if self.fail:
            raise TokenizerError("cannot render")
        return [1, 1] if item.text == "short" else None

    async def tokenize(self, model, item, *, base_url=None):
        self.called.append(item.text)
        return [2, 2]


async def test_tokenize_answers_without_a_wait_when_it_can_else_awaits_the_call():
    router, tok = FakeRouter(), NowTokenizer()
    gw = gateway(router, tok, tokenize_now=tok.tokenize_now)
    for prompt in ("short", "long"):
        await run_stream(gw, [headers("POST", "/v1/completions"), body({"model": "m", "prompt": prompt})])
    assert tok.now == [("short", POD.base_url), ("long", POD.base_url)]  # asked with the pod it would call
    assert tok.called == ["long"]  # only the one that could not be answered now was awaited
    assert [p.token_ids for p in router.picks] == [[1, 1], [2, 2]]
    assert sum(gw.metrics.tokenize_seconds.counts) == 2


async def test_tokenize_now_failing_routes_on_load_and_counts_an_error():
    router, tok = FakeRouter(), NowTokenizer(fail=True)
    gw = gateway(router, tok, tokenize_now=tok.tokenize_now)
    out = await run_stream(gw, [headers("POST", "/v1/completions"), body({"model": "m", "prompt": "short"})])
    assert out[-1].HasField("request_body")
    assert router.picks[0].token_ids is None and not tok.called
    assert fallbacks(gw) == {"error": 1}


class GivingUpTokenizer(InstantTokenizer):
    """A tokenizer whose own budget ends first: it raises after attempts that timed out."""

    def __init__(self, error: TokenizerError):
        self.error = error

    async def tokenize(self, model, item, *, base_url=None):
        raise self.error


@pytest.mark.parametrize("error, reason", [(TokenizerTimeout("timed out after 250 ms"), "timeout"),
                                           (TokenizerError("HTTP 500"), "error")])
async def test_a_tokenizer_giving_up_on_its_own_budget_is_counted_as_a_timeout(error, reason):
    # A remote tokenizer's budget is the pipeline's, started a little later: on a stalled loop its attempt's
    # timeout can be seen first, and with no time left for another attempt it gives up before the pipeline's
    # deadline fires. That is the tokenizer being slow, and counted so.
    router = FakeRouter()
    gw = gateway(router, GivingUpTokenizer(error))
    await run_stream(gw, [headers("POST", "/v1/completions"), body({"model": "m", "prompt": "x"})])
    assert router.picks[0].token_ids is None
    assert fallbacks(gw) == {reason: 1}


async def test_a_call_that_waits_past_the_timeout_falls_back_with_the_now_path_too():
    router, tok = FakeRouter(), WaitingTokenizer()
    gw = gateway(router, tok, timeout=0.001, tokenize_now=lambda model, item, base_url=None: None)
    await run_stream(gw, [headers("POST", "/v1/completions"), body({"model": "m", "prompt": "x"})])
    assert router.picks[0].token_ids is None
    assert fallbacks(gw) == {"timeout": 1}
