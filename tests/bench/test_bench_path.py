"""`kvgate bench path`'s pieces that need no stack: the response reader and the summary."""
from __future__ import annotations

import asyncio

from bench import path


def _read(raw: bytes) -> tuple[int, float | None, bool]:
    async def go():
        reader = asyncio.StreamReader()
        reader.feed_data(raw)
        reader.feed_eof()
        return await path.read_response(reader)
    return asyncio.run(go())


def _chunked(*chunks: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"


ROLE = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
TOKEN = b'data: {"choices":[{"delta":{"content":" hi"}}]}\n\n'
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def test_the_first_token_is_the_first_chunk_carrying_content_not_the_role_chunk():
    status, first, keep = _read(HEAD + _chunked(ROLE, TOKEN, b"data: [DONE]\n\n"))
    assert status == 200 and first is not None and keep


def test_a_stream_without_a_token_has_no_first_token_and_a_token_split_over_two_chunks_is_found():
    assert _read(HEAD + _chunked(ROLE, b"data: [DONE]\n\n"))[1] is None
    assert _read(HEAD + _chunked(ROLE + TOKEN[:30], TOKEN[30:]))[1] is not None


def test_an_error_with_a_length_and_connection_close_is_read_whole():
    raw = b'HTTP/1.1 503 Service Unavailable\r\ncontent-length: 7\r\nconnection: close\r\n\r\n{"e":1}'
    assert _read(raw) == (503, None, False)


def test_summary_added_time_is_each_paths_median_over_directs_and_the_target_reads_it():
    seq, load = path.Samples(), path.Samples()
    for i in range(40):
        for name, extra in (("direct", 0.0), ("envoy_only", 0.0002), ("noop", 0.001), ("noop_nowait", 0.0008),
                            ("kvgate", 0.0014)):
            seq.add(name, 0.004 + extra + i * 1e-6, 200)
            load.add(name, 0.010 + 3 * extra, 200)
    load.add("kvgate", 1.0, 503)
    quiet = path.Samples()
    for name, t in (("direct", 0.004), ("kvgate", 0.0065), ("kvgate", 0.0055), ("direct", 0.005)):
        quiet.add(name, t, 200)
    r = path.summarize(seq, load, quiet, requests=40, concurrency=8, engines=2)
    assert r["idle"]["kvgate_added_p50_ms"] == 1.5 and r["idle"]["samples"] == 2
    assert r["kvgate_seq_added_p50_ms"] == 1.4 and r["noop_seq_added_p50_ms"] == 1.0
    assert r["kvgate_load_added_p50_ms"] == 4.2 and r["paths"]["kvgate"]["errors"] == 1
    assert r["paths"]["kvgate"]["seq_added_p50_ms_by_quarter"] == [1.4] * 4
    assert r["targets"]["kvgate_seq_added_p50_le_1.5ms"]
    assert "kvgate adds 1.400 ms" in path.table(r)
