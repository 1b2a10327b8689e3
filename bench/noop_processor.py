"""A no-op ext_proc server for `kvgate bench gateway`: the cheapest Python processor that
still routes (it names one fixed upstream), so the benchmark isolates kvgate's own cost.

    python -m bench.noop_processor PORT UPSTREAM_IP:PORT [--bodies [SHARE]] [--server kvgate|grpcio]

With `--bodies` it watches responses as kvgate does: a share of the requests (SHARE, by default
kvgate's own KVGATE_OBSERVE_SAMPLE default, taken evenly by kvgate's Sampler) has its successful
response's body asked for with the same mode override (STREAMED for an event stream, BUFFERED_PARTIAL
for anything else), each body message answered with an empty one; the others are told in their
headers answer to send nothing of the response (the same override as kvgate's). Envoy then sends it
the messages it sends kvgate, and the difference in CPU is what kvgate does with them.

`--server`: the gRPC server it runs on, kvgate's own (plugin.grpcserver, the default, as kvgate serves) or
grpcio's asyncio server.
"""
from __future__ import annotations

import argparse
import asyncio
import signal
import sys

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2

from plugin import grpcserver
from plugin.config import Settings
from plugin.pipeline import Sampler
from plugin.observe import UNWATCHED, body_on

STREAMED = processing_mode_pb2.ProcessingMode.STREAMED


class NoopProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, upstream: str, bodies: bool = False, share: float = Settings.observe_sample) -> None:
        header = base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key="x-gateway-destination-endpoint", raw_value=upstream.encode()),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
        routed = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=[header]))
        self._headers = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
        self._headers_unwatched = pb.ProcessingResponse(request_headers=pb.HeadersResponse(), mode_override=UNWATCHED)
        self._sampler = Sampler(share)
        self._headers_routed = pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=routed))
        # override_host reads the endpoint from envoy.lb metadata
        lb = struct_pb2.Struct()
        lb.update({"envoy.lb": {"x-gateway-destination-endpoint": upstream}})
        self._headers_routed.dynamic_metadata.CopyFrom(lb)
        self._body = pb.ProcessingResponse(request_body=pb.BodyResponse(response=routed), dynamic_metadata=lb)
        self._response_headers = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
        self._response_request_chunk = pb.ProcessingResponse(request_body=pb.BodyResponse())
        self._response_body = pb.ProcessingResponse(response_body=pb.BodyResponse())
        self._bodies = bodies

    def _on_response_headers(self, msg: pb.ProcessingRequest) -> pb.ProcessingResponse:
        if not self._bodies:
            return self._response_headers
        status, streamed = b"", False
        for h in msg.response_headers.headers.headers:
            if h.key == ":status":
                status = h.raw_value
            elif h.key == "content-type":
                streamed = h.raw_value.startswith(b"text/event-stream")
        return body_on(streamed) if status == b"200" else self._response_headers

    async def Process(self, request_iterator, context):  # noqa: N802
        streamed, chunks = False, 0  # a STREAMED request body: the headers' answer waits for its end
        async for msg in request_iterator:
            which = msg.WhichOneof("request")
            if which == "request_headers":
                streamed = msg.protocol_config.request_body_mode == STREAMED
                if streamed and not msg.request_headers.end_of_stream:
                    continue
                if msg.request_headers.end_of_stream:
                    yield self._headers_routed
                elif self._bodies and not self._sampler.take():
                    yield self._headers_unwatched  # as kvgate answers a request it does not watch
                else:
                    yield self._headers
            elif which == "request_body" and streamed:
                chunks += 1
                if msg.request_body.end_of_stream:  # the pick, then one answer per chunk, in order
                    yield self._headers_routed
                    for _ in range(chunks):
                        yield self._response_request_chunk
            elif which == "request_body":
                yield self._body
            elif which == "response_headers":
                yield self._on_response_headers(msg)
            elif which == "response_body":
                yield self._response_body


def native_answers(upstream: str) -> dict[str, str]:
    """The no-op's answers as bench/native_noop.js sends them, per kind of message Envoy sends (hex of the
    serialized ProcessingResponse): a request's headers answered as an unwatched request's (nothing of its
    response sent), its body with the pick."""
    p = NoopProcessor(upstream)
    return {name: msg.SerializeToString().hex() for name, msg in (
        ("request_headers", p._headers_unwatched), ("request_body", p._body),
        ("response_headers", p._response_headers), ("response_body", p._response_body))}


async def _main(port: int, upstream: str, bodies: bool, share: float, server_kind: str = "kvgate") -> None:
    processor = NoopProcessor(upstream, bodies, share)
    server: grpc.aio.Server | grpcserver.Server
    if server_kind == "grpcio":
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_ExternalProcessorServicer_to_server(processor, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
    else:
        server = grpcserver.Server()
        server.add(grpcserver.EXT_PROC_SERVICE, grpcserver.ext_proc_methods(processor))
        await server.listen("127.0.0.1", port)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0)


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.noop_processor")
    p.add_argument("port", type=int)
    p.add_argument("upstream")
    p.add_argument("--bodies", nargs="?", type=float, const=Settings.observe_sample, default=None,
                   help="watch responses as kvgate does, this share of them (default KVGATE_OBSERVE_SAMPLE's)")
    p.add_argument("--server", choices=("kvgate", "grpcio"), default="kvgate")
    return p.parse_args(argv)


if __name__ == "__main__":
    a = _args(sys.argv[1:])
    asyncio.run(_main(a.port, a.upstream, a.bodies is not None,
                      Settings.observe_sample if a.bodies is None else a.bodies, a.server))
