"""`kvgate bench request`: kvgate's own CPU per routed request, in process, gRPC left out.

    kvgate bench request [--json] [--requests 2000] [--runs 5] [--watched | --unwatched]
    python -m bench.request_cost (the same)

kvgate's processor (plugin.app's App: kv-sync, the local test tokenizer with its cache, responses
observed, 4 pods, the warm prompt's blocks in the index on pod0) is driven in this process with the
messages Envoy sends, parsed from bytes as gRPC would: request headers and body, then, for a request
whose response is watched, the response headers and body (Envoy sends nothing of the others: the
answer to their headers says so). Two kinds of request, as in `kvgate bench gateway`: warm (the same
prompt every time: the tokenizer cache and the index hold it) and cold (every prompt new: a fresh
nonce at its start, so neither holds any of it). Reported for each: CPU per request (the least of
`--runs` runs: the machine's other load only ever adds) and its split by phase (cProfile's cumulative
times in one more run, scaled to that least). By default KVGATE_OBSERVE_SAMPLE's default share of the
responses is watched (one in ten); `--watched` watches every one, `--unwatched` none. No target of its
own: this is the part of `kvgate bench gateway`'s CPU rows that is kvgate's code, measured without
gRPC, Envoy and the other processes on the cores (there the same code costs 2.5-3x as much: caches
left cold between requests).
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import itertools
import json
import pstats
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from plugin.observe import UNWATCHED

# phase -> the (file suffix, function name) pairs whose cumulative times are the phase's (nested ones apart)
PHASES = {
    "request_headers": (("plugin/extproc.py", "on_headers"),),
    "parse_body": (("plugin/request.py", "parse_body"),),
    # the pipeline's tokenize step: its answer without a wait, and the call it awaits when it must wait
    "tokens": (("plugin/pipeline.py", "tokenize"), ("plugin/pipeline.py", "_tokenize_wait")),
    "pick": (("routing/router.py", "pick"),),
    "response_headers": (("plugin/extproc.py", "on_response_headers"),),
    "response_body": (("plugin/extproc.py", "on_response_body"),),
    "observation_close": (("plugin/observe.py", "close"),),
    "release": (("plugin/extproc.py", "_release"),),
    "message_parse": (("~", "<built-in method FromString>"),),
}
# the request pipeline's run, less the phases above nested in it: admit, record, observe and the steps' loop
_NESTED = {"decide_rest": (("plugin/pipeline.py", "run"), ("parse_body", "tokens", "pick"))}

_SKIP = UNWATCHED.response_header_mode


def _headers(pairs: list[tuple[str, str]]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])


def messages(body: bytes, served: str) -> list[bytes]:
    """Envoy's four messages for a routed JSON answer, serialized."""
    lb = struct_pb2.Struct()
    lb.update({"x-gateway-destination-endpoint-served": served})
    meta = base_pb2.Metadata()
    meta.filter_metadata["envoy.lb"].CopyFrom(lb)
    answer = json.dumps({"id": "b", "object": "chat.completion", "choices": [],
                         "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13}}).encode()
    return [m.SerializeToString() for m in (
        pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=_headers([
            (":method", "POST"), (":path", "/v1/chat/completions"), (":authority", "gw"),
            ("content-type", "application/json"), ("x-request-id", "r")]))),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
        pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=_headers([
            (":status", "200"), ("content-type", "application/json")])), metadata_context=meta),
        pb.ProcessingRequest(response_body=pb.HttpBody(body=answer, end_of_stream=True), metadata_context=meta))]


async def _build(workdir: Path, sample: float | None = None):
    from bench.gateway import BODY, MODEL
    from kvcache.events import BlockStored
    from plugin.app import App
    from plugin.config import Settings
    from plugin.request import parse_body
    from routing.pods import Pod
    from tokenizer import testdata

    pods: list[dict[str, Any]] = [{"name": f"pod{i}", "address": "127.0.0.1", "port": 9000 + i, "model": MODEL}
                                  for i in range(4)]
    (workdir / "pods.json").write_text(json.dumps(pods))
    app = App(Settings.from_env({
        "KVGATE_PODS_FILE": str(workdir / "pods.json"), "KVGATE_ROUTING_STRATEGY": "kv-sync",
        "KVGATE_TOKENIZER": "local", "KVGATE_TOKENIZER_PATH": str(testdata.path()),
        "KVGATE_OBSERVE_RESPONSES": "true",
        **({} if sample is None else {"KVGATE_OBSERVE_SAMPLE": str(sample)})}))
    app.pods.replace([Pod(p["name"], p["address"], p["port"], MODEL) for p in pods])
    body = json.dumps(BODY).encode()
    request = parse_body("/v1/chat/completions", body, 1 << 20)
    ids = list(await app.tokenizer.tokenize(MODEL, request.item, base_url="http://127.0.0.1:1"))
    size = 16
    full = len(ids) // size * size
    app.index.apply("pod0", MODEL, 0, [BlockStored(tuple(range(1, full // size + 1)), None, tuple(ids[:full]), size)])
    return app, messages(body, "127.0.0.1:9000")


def _cold_messages() -> Callable[[], list[bytes]]:
    """A new prompt's four messages at each call (the gateway bench's cold body, a fresh nonce at its start)."""
    from bench.gateway import COLD_BODY, NONCE

    head, tail = json.dumps(COLD_BODY).split(NONCE)
    run = uuid.uuid4().hex[:12]
    count = itertools.count()
    return lambda: messages(f"{head}{run}-{next(count)}{tail}".encode(), "127.0.0.1:9000")


async def _one(processor, raw: list[bytes]) -> list[pb.ProcessingResponse]:
    """One stream as Envoy drives it: the response's messages only if the answer to the headers asked for them."""
    out: list[pb.ProcessingResponse] = []

    async def incoming():
        yield pb.ProcessingRequest.FromString(raw[0])
        yield pb.ProcessingRequest.FromString(raw[1])
        if out and out[0].mode_override.response_header_mode == _SKIP:
            return
        for r in raw[2:]:
            yield pb.ProcessingRequest.FromString(r)

    async for r in processor.Process(incoming(), None):  # each answer is in `out` before the next message is read
        out.append(r)
    return out


def _phase_split(stats: pstats.Stats, per_request_us: float) -> dict[str, float]:
    """The phases' CPU per request, scaled so that the whole profile is `per_request_us`: the profiler's
    own cost, which it leaves out of its function times, varies from run to run. A phase counted twice
    (nested in another) shows as a sum over that whole."""
    cum: dict[tuple[str, str], float] = {}
    wanted = {pair for pairs in PHASES.values() for pair in pairs} | {_NESTED["decide_rest"][0]}
    for (file, _line, func), (_cc, _nc, _tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        for suffix, name in wanted:
            if func == name and file.endswith(suffix):
                cum[(suffix, name)] = cum.get((suffix, name), 0.0) + ct
    out = {phase: sum(cum.get(pair, 0.0) for pair in pairs) for phase, pairs in PHASES.items()}
    key, inner = _NESTED["decide_rest"]
    out["decide_rest"] = max(0.0, cum.get(key, 0.0) - sum(out[p] for p in inner))
    total = sum(tt for (_cc, _nc, tt, _ct, _c) in stats.stats.values())  # type: ignore[attr-defined]
    out["other"] = max(0.0, total - sum(out.values()))
    scale = per_request_us / total if total else 0.0
    return {k: round(v * scale, 1) for k, v in out.items()}


async def measure(requests: int, runs: int, watched: bool | None = None, cold: bool = False) -> dict:
    """`watched` None: the default sample; True: every response; False: none. `cold`: every prompt new."""
    with tempfile.TemporaryDirectory() as tmp:
        app, raw = await _build(Path(tmp), None if watched is None else float(watched))
        try:
            return await _measure(app, _cold_messages() if cold else (lambda: raw), requests, runs)
        finally:
            await app.subscriptions.aclose()  # its ZMQ context: never started, but open


async def _measure(app, source: Callable[[], list[bytes]], requests: int, runs: int) -> dict:
    processor = app.processor
    first = await _one(processor, source())
    routed = first[1].dynamic_metadata.fields["kvgate"].struct_value.fields["pod"].string_value
    for _ in range(200):
        await _one(processor, source())
    cache = app.tokenizer
    cached0, total0 = cache.tokens_cached, cache.tokens_total
    per_run, answers = [], 0
    for _ in range(runs):
        batch = [source() for _ in range(requests)]  # built before the clock starts
        started = time.process_time()
        for raw in batch:
            answers += len(await _one(processor, raw))
        per_run.append((time.process_time() - started) / requests * 1e6)
    batch = [source() for _ in range(requests)]
    profile = cProfile.Profile(time.process_time)  # CPU, not wall: the machine's other load stays out
    profile.enable()
    for raw in batch:
        await _one(processor, raw)
    profile.disable()
    best = min(per_run)
    split = _phase_split(pstats.Stats(profile), best)
    return {"cpu_us_per_request": round(best, 1), "cpu_us_per_request_runs": [round(v, 1) for v in per_run],
            "phases_us": split, "messages_per_request": round(answers / (runs * requests), 2),
            # the share of the prompts' tokens the tokenizer cache gave (warm: all; cold: the shared question's)
            "tokens_from_cache_share": round((cache.tokens_cached - cached0) / max(1, cache.tokens_total - total0), 3),
            "routed_to": routed, "requests": requests}


async def measure_both(requests: int, runs: int, watched: bool | None = None) -> dict:
    return {"warm": await measure(requests, runs, watched), "cold": await measure(requests, runs, watched, cold=True),
            "requests": requests, "runs": runs,
            "observe": "every response" if watched else "none" if watched is False else "default sample"}


def table(r: dict) -> str:
    warm, cold = r["warm"], r["cold"]
    lines = [f"kvgate's own CPU per routed request, in process ({r['observe']} of responses watched; "
             f"least of {r['runs']} runs of {r['requests']})",
             f"{'':<22} {'warm':>8} {'cold':>8}",
             f"{'us per request':<22} {warm['cpu_us_per_request']:>8.1f} {cold['cpu_us_per_request']:>8.1f}",
             f"{'messages per request':<22} {warm['messages_per_request']:>8.2f} {cold['messages_per_request']:>8.2f}",
             f"{'tokens from the cache':<22} {warm['tokens_from_cache_share']:>8.0%} {cold['tokens_from_cache_share']:>8.0%}",
             "by phase, us:"]
    for phase in warm["phases_us"]:
        lines.append(f"  {phase:<20} {warm['phases_us'][phase]:>8.1f} {cold['phases_us'][phase]:>8.1f}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--requests", type=int, default=2000, help="requests per timed run (default 2000)")
    p.add_argument("--runs", type=int, default=5, help="timed runs; the least is reported (default 5)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--watched", action="store_true", help="watch every response (KVGATE_OBSERVE_SAMPLE=1)")
    which.add_argument("--unwatched", action="store_true",
                       help="watch none: Envoy's two messages per request (KVGATE_OBSERVE_SAMPLE=0)")


def main(args: argparse.Namespace | list[str] | None = None) -> int:
    """`kvgate bench request` passes its parsed arguments; `python -m bench.request_cost` the command line."""
    if not isinstance(args, argparse.Namespace):
        p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
        add_arguments(p)
        args = p.parse_args(args)
    watched = True if args.watched else False if args.unwatched else None
    r = asyncio.run(measure_both(args.requests, args.runs, watched))
    print(json.dumps(r) if args.json else table(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
