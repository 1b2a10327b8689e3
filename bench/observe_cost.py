"""What watching responses costs kvgate's ext_proc server, per request and per response chunk.

    python -m bench.observe_cost [--requests 400] [--chunks 0,1,32]

A kvgate ext_proc server (plugin.extproc with the real Router, least-request, no tokenizer) runs in a
child process on loopback; this process plays Envoy over real gRPC: request headers, body and
response headers for every request and, when the response is watched, its body in `chunks` SSE
chunks (one token each, usage in the last), as Envoy does once kvgate's answer to the response
headers turns STREAMED on for an event stream. The child's CPU time (from /proc) per request is reported with
observation on and off (off: Envoy sends no body, as with KVGATE_OBSERVE_RESPONSES=false).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

_SERVER = r'''
import asyncio, sys
import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from prometheus_client import CollectorRegistry
from plugin.extproc import ExternalProcessor
from plugin.pipeline import Gateway
from plugin.metrics import GatewayMetrics
from plugin.observe import Observer
from routing.pods import Pod
from routing.registry import PodRegistry
from routing.router import Router

async def main(observe):
    reg = PodRegistry([Pod(f"p{i}", f"10.0.0.{i + 1}", 8000, "m") for i in range(4)])
    router = Router(reg, default_strategy="least-request", seed=1)
    registry = CollectorRegistry()
    gw = Gateway(router=router, registry=reg, tokenizer=None, metrics=GatewayMetrics(registry),
                 default_strategy="least-request", max_body_bytes=1 << 20, tokenizer_timeout_s=1.0,
                 observer=Observer(registry) if observe else None)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(gw), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()

asyncio.run(main(sys.argv[1] == "on"))
'''


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


async def _drive(port: int, requests: int, chunks: int, observe: bool) -> None:
    import grpc
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    def headers(pairs):
        return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])

    req_headers = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=headers(
        [(":method", "POST"), (":path", "/v1/chat/completions")])))
    body = pb.ProcessingRequest(request_body=pb.HttpBody(body=json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}).encode(), end_of_stream=True))
    resp_headers = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=headers(
        [(":status", "200"), ("content-type", "text/event-stream")])))
    token = b'data: {"object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
    last = (b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":%d}}\n\ndata: [DONE]\n\n' % chunks)
    parts = [pb.ProcessingRequest(response_body=pb.HttpBody(body=token)) for _ in range(max(chunks - 1, 0))]
    if chunks:
        parts.append(pb.ProcessingRequest(response_body=pb.HttpBody(body=token + last, end_of_stream=True)))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)

        async def one() -> None:
            call = stub.Process()
            for m in (req_headers, body, resp_headers, *(parts if observe else ())):
                await call.write(m)
                await call.read()
            await call.done_writing()
            await call.read()

        for _ in range(requests // 8):
            await asyncio.gather(*(one() for _ in range(8)))


def measure(requests: int, chunks: int, observe: bool) -> float:
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, "on" if observe else "off"], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None
    try:
        port = int(proc.stdout.readline())
        asyncio.run(_drive(port, 40, chunks, observe))  # warm up
        before = _cpu_s(proc.pid)
        asyncio.run(_drive(port, requests, chunks, observe))
        return (_cpu_s(proc.pid) - before) / requests * 1e6
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--chunks", default="1,32")
    args = p.parse_args()
    off = measure(args.requests, 0, False)
    out = {"server_cpu_us_per_request_observe_off": round(off, 1)}
    for n in (int(c) for c in args.chunks.split(",")):
        on = measure(args.requests, n, True)
        out[f"server_cpu_us_per_request_observe_on_{n}_chunks"] = round(on, 1)
        if n:
            out[f"server_cpu_us_per_chunk_{n}_chunks"] = round((on - off) / n, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    time.sleep(0)
    sys.exit(main())
