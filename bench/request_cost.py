"""Where kvgate's own CPU goes in one warm routed request, gRPC left out.

    python -m bench.request_cost [--requests 3000] [--runs 5] [--watched | --unwatched]

kvgate's processor (plugin.app's App: kv-sync, the local test tokenizer with its cache, responses
observed, 4 pods, the prompt's blocks in the index on pod0) is driven in this process with the four
messages Envoy sends for a JSON answer (request headers, request body, response headers, response
body), parsed from bytes as gRPC would. Reported: CPU per request (the least of `--runs` runs, the
machine's other load only ever adds) and its split by phase (cProfile's cumulative times in one run,
scaled to that least). By default KVGATE_OBSERVE_SAMPLE's default share of the responses is watched
(one in ten; the others still get their two response messages, which Envoy would not send);
`--watched` watches every one; `--unwatched` none, with only the two messages Envoy then sends
(request headers and body). What gRPC and the event loop cost per message is not here: `kvgate bench
gateway` measures the whole path through Envoy, beside a no-op processor answering the same messages.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

# phase -> (file suffix, function name) whose cumulative time is the phase's (nested ones apart)
PHASES = {
    "request_headers": ("plugin/extproc.py", "on_headers"),
    "parse_body": ("plugin/request.py", "parse_body"),
    "tokens_from_cache": ("plugin/extproc.py", "_tokens"),
    "pick": ("routing/router.py", "pick"),
    "response_headers": ("plugin/extproc.py", "on_response_headers"),
    "response_body": ("plugin/extproc.py", "on_response_body"),
    "observation_close": ("plugin/observe.py", "close"),
    "release": ("plugin/extproc.py", "_release"),
    "message_parse": ("~", "<built-in method FromString>"),
}
_NESTED = {"decide_rest": (("plugin/extproc.py", "_decide"), ("parse_body", "tokens_from_cache", "pick"))}


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

    pods = [{"name": f"pod{i}", "address": "127.0.0.1", "port": 9000 + i, "model": MODEL} for i in range(4)]
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


async def _one(processor, raw: list[bytes]) -> list[pb.ProcessingResponse]:
    async def incoming():
        for r in raw:
            yield pb.ProcessingRequest.FromString(r)
    return [r async for r in processor.Process(incoming(), None)]


def _phase_split(stats: pstats.Stats, per_request_us: float) -> dict[str, float]:
    """The phases' CPU per request, scaled so that the whole profile is `per_request_us`: the profiler's
    own cost, which it leaves out of its function times, varies from run to run. A phase counted twice
    (nested in another) shows as a sum over that whole."""
    cum: dict[tuple[str, str], float] = {}
    for (file, _line, func), (_cc, _nc, _tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        for phase, (suffix, name) in PHASES.items():
            if func == name and file.endswith(suffix):
                cum[(suffix, name)] = cum.get((suffix, name), 0.0) + ct
        suffix, name = _NESTED["decide_rest"][0]
        if func == name and file.endswith(suffix):
            cum[(suffix, name)] = cum.get((suffix, name), 0.0) + ct
    out = {phase: cum.get(key, 0.0) for phase, key in PHASES.items()}
    key, inner = _NESTED["decide_rest"]
    out["decide_rest"] = max(0.0, cum.get(key, 0.0) - sum(out[p] for p in inner))
    total = sum(tt for (_cc, _nc, tt, _ct, _c) in stats.stats.values())  # type: ignore[attr-defined]
    out["other"] = max(0.0, total - sum(out.values()))
    scale = per_request_us / total if total else 0.0
    return {k: round(v * scale, 1) for k, v in out.items()}


async def measure(requests: int, runs: int, watched: bool | None = None) -> dict:
    """`watched` None: the default sample; True: every response; False: none (two messages per request)."""
    with tempfile.TemporaryDirectory() as tmp:
        app, raw = await _build(Path(tmp), None if watched is None else float(watched))
        if watched is False:
            raw = raw[:2]
        try:
            return await _measure(app, raw, requests, runs)
        finally:
            await app.subscriptions.aclose()  # its ZMQ context: never started, but open


async def _measure(app, raw: list[bytes], requests: int, runs: int) -> dict:
    processor = app.processor
    first = await _one(processor, raw)
    routed = first[1].dynamic_metadata.fields["kvgate"].struct_value.fields["pod"].string_value
    for _ in range(200):
        await _one(processor, raw)
    per_run = []
    for _ in range(runs):
        started = time.process_time()
        for _ in range(requests):
            await _one(processor, raw)
        per_run.append((time.process_time() - started) / requests * 1e6)
    profile = cProfile.Profile(time.process_time)  # CPU, not wall: the machine's other load stays out
    profile.enable()
    for _ in range(requests):
        await _one(processor, raw)
    profile.disable()
    best = min(per_run)
    split = _phase_split(pstats.Stats(profile), best)
    return {"cpu_us_per_request": round(best, 1), "cpu_us_per_request_runs": [round(v, 1) for v in per_run],
            "phases_us": split, "messages": len(first), "routed_to": routed, "requests": requests}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--runs", type=int, default=5)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--watched", action="store_true", help="watch every response (KVGATE_OBSERVE_SAMPLE=1)")
    which.add_argument("--unwatched", action="store_true",
                       help="watch none: Envoy's two messages per request (KVGATE_OBSERVE_SAMPLE=0)")
    args = p.parse_args(argv)
    watched = True if args.watched else False if args.unwatched else None
    print(json.dumps(asyncio.run(measure(args.requests, args.runs, watched))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
