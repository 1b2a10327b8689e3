"""`kvgate bench watch`'s pieces that need no stack: the client's timing of token chunks and the summary."""
from __future__ import annotations

import asyncio

from bench import watch

ROLE = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
TOKEN = b'data: {"choices":[{"delta":{"content":" hi"}}]}\n\n'


def _chunk(c: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(c), c)


def test_the_client_times_the_first_token_and_the_gaps_between_token_chunks_over_a_real_socket():
    """A server streaming the role chunk, then three tokens 20 ms apart: the first token after the role chunk's
    pause, the mean gap 20 ms; the connection kept for the next request."""
    async def handle(reader, writer):
        for _ in range(2):
            await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(2)  # the body, b"{}"
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            writer.write(_chunk(ROLE))
            await asyncio.sleep(0.03)
            for _ in range(3):
                writer.write(_chunk(TOKEN))
                await writer.drain()
                await asyncio.sleep(0.02)
            writer.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            await writer.drain()

    async def go():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = watch.Client("127.0.0.1", port)
        try:
            return [await watch.chat(client, b"{}") for _ in range(2)]
        finally:
            await client.close()
            server.close()
    for status, ttft, tpot in asyncio.run(go()):
        assert status == 200
        assert 0.025 <= ttft <= 0.2
        assert 0.015 <= tpot <= 0.1


def test_the_summary_says_what_each_way_of_watching_adds_over_none_and_the_table_says_it():
    seq, load = watch.Samples(), watch.Samples()
    for path, (ttft, tpot) in {"unwatched": (0.010, 0.002), "own_stream": (0.012, 0.0025),
                               "watch_stream": (0.010, 0.0021)}.items():
        for _ in range(3):
            seq.add(path, 200, ttft, tpot)
            load.add(path, 200, ttft * 3, tpot)
    load.add("own_stream", 503, None, None)
    r = watch.summarize(seq, load, {"unwatched": 3000, "own_stream": 8000, "watch_stream": 5000},
                        {"unwatched": 1000, "own_stream": 1500, "watch_stream": 1400}, requests=3, concurrency=8, checks={"watch_waits_expired": 0})
    assert r["paths"]["own_stream"]["added_over_unwatched_ms"] == {
        "seq_ttft_p50_ms": 2.0, "seq_tpot_p50_ms": 0.5, "load_ttft_p50_ms": 6.0, "load_tpot_p50_ms": 0.5}
    assert r["paths"]["watch_stream"]["added_over_unwatched_ms"]["seq_ttft_p50_ms"] == 0.0
    assert r["paths"]["own_stream"]["errors"] == 1 and r["paths"]["watch_stream"]["cpu_us_per_request"] == 5000
    text = watch.table(r)
    assert "| own_stream | 12.0 / 12.0 | 2.5 / 2.5 | 36.0 / 36.0 | 2.5 / 2.5 | 8000 / 1500 | 1 |" in text
    assert "watch_stream over unwatched (p50 ms): seq_ttft_p50_ms +0.0" in text
