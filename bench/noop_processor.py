"""A no-op ext_proc server for `kvgate bench gateway`: the cheapest Python processor that
still routes (it names one fixed upstream), so the benchmark isolates kvgate's own cost.

    python -m bench.noop_processor PORT UPSTREAM_IP:PORT
"""
from __future__ import annotations

import asyncio
import signal
import sys

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2


class NoopProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, upstream: str) -> None:
        header = base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key="x-gateway-destination-endpoint", raw_value=upstream.encode()),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
        routed = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=[header]))
        self._headers = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
        self._headers_routed = pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=routed))
        # override_host reads the endpoint from envoy.lb metadata
        lb = struct_pb2.Struct()
        lb.update({"envoy.lb": {"x-gateway-destination-endpoint": upstream}})
        self._headers_routed.dynamic_metadata.CopyFrom(lb)
        self._body = pb.ProcessingResponse(request_body=pb.BodyResponse(response=routed), dynamic_metadata=lb)
        self._response_headers = pb.ProcessingResponse(response_headers=pb.HeadersResponse())

    async def Process(self, request_iterator, context):  # noqa: N802
        async for msg in request_iterator:
            which = msg.WhichOneof("request")
            if which == "request_headers":
                yield self._headers_routed if msg.request_headers.end_of_stream else self._headers
            elif which == "request_body":
                yield self._body
            elif which == "response_headers":
                yield self._response_headers


async def _main(port: int, upstream: str) -> None:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_ExternalProcessorServicer_to_server(NoopProcessor(upstream), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0)


if __name__ == "__main__":
    asyncio.run(_main(int(sys.argv[1]), sys.argv[2]))
