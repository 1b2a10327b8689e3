"""`kvgate bench path`'s pieces that need no stack: the response reader and the summary."""
from __future__ import annotations

import asyncio

import pytest

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


def _flat(paths: tuple[str, ...] | list[str] = path.PATHS) -> tuple[path.Samples, path.Samples]:
    """One request per path, one at a time (4 ms) and at load (10 ms): every path adding nothing."""
    seq, load = path.Samples(paths), path.Samples(paths)
    for name in paths:
        seq.add(name, 0.004, 200)
        load.add(name, 0.010, 200)
    return seq, load


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
        for name, extra in (("direct", 0.0), ("envoy_only", 0.0002), ("noop", 0.001), ("native_noop", 0.0007),
                            ("noop_nowait", 0.0008), ("kvgate", 0.0014), ("kvgate_grpcio", 0.0017), ("kvgate_two", 0.0019),
                            ("sglang", 0.0006)):
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
    # one message against two, side by side
    assert r["kvgate_seq_one_over_two_message_ms"] == pytest.approx(-0.5, abs=0.002)
    assert r["kvgate_load_one_over_two_message_ms"] == pytest.approx(-1.5, abs=0.002)
    assert "against two (kvgate_two): -0.499 ms @1, -1.500 ms @8" in path.table(r)
    # the same replicas on grpcio's server, beside kvgate's own
    assert r["kvgate_grpcio_seq_added_p50_ms"] == 1.7 and r["kvgate_grpcio_load_added_p50_ms"] == 5.1
    assert r["kvgate_seq_own_server_over_grpcio_ms"] == pytest.approx(-0.3, abs=0.002)
    assert r["kvgate_load_own_server_over_grpcio_ms"] == pytest.approx(-0.9, abs=0.002)
    assert "(kvgate_grpcio) add 1.700 ms @1; kvgate's own server against it -0.300 ms @1, -0.900 ms @8" in path.table(r)
    # a processor without Python through the same stack: the floor under the target, beside it
    assert r["native_noop_seq_added_p50_ms"] == 0.7 and r["native_noop_load_added_p50_ms"] == 2.1
    assert "a processor without Python in the no-op's place (native_noop) adds 0.700 ms @1" in path.table(r)
    # SGLang's router in Envoy's place, beside kvgate
    assert r["sglang_seq_added_p50_ms"] == 0.6 and r["sglang_load_added_p50_ms"] == 1.8
    assert r["kvgate_seq_added_over_sglang_ms"] == pytest.approx(0.8, abs=0.002)
    assert r["kvgate_load_added_over_sglang_ms"] == pytest.approx(2.4, abs=0.002)
    assert "SGLang's router (sglang, in Envoy's place) adds 0.600 ms @1, 1.800 ms @8; kvgate over it +0.800 ms @1, " \
           "+2.400 ms @8" in path.table(r)


def test_without_node_or_sglang_router_the_summary_has_no_such_path_and_says_nothing_of_it():
    paths = [p for p in path.PATHS if p not in ("native_noop", "sglang")]
    seq, load = _flat(paths)
    r = path.summarize(seq, load, requests=1, concurrency=8, engines=2)
    assert "native_noop" not in r["paths"] and "native_noop_seq_added_p50_ms" not in r
    assert "sglang" not in r["paths"] and not any(k.startswith("sglang") or "over_sglang" in k for k in r)
    assert "native_noop" not in path.table(r) and "SGLang" not in path.table(r)


def test_floor_summary_is_each_processors_median_over_envoy_answering_alone_and_the_table_says_it():
    ttft = {"envoy_answers": [0.0003, 0.0002, 0.0004], "noop": [0.0012, 0.0011, 0.0013],
            "native_noop": [0.0009, 0.0008, 0.0010], "kvgate": [0.0016, 0.0015, 0.0017]}
    f = path.summarize_floor(ttft, dict.fromkeys(path.FLOOR_PATHS, 0))
    assert (f["envoy_answers_p50_ms"], f["noop_added_p50_ms"], f["kvgate_added_p50_ms"]) == (0.3, 0.9, 1.3)
    assert f["kvgate_over_noop_ms"] == 0.4 and f["samples"] == 3 and f["native_noop_added_p50_ms"] == 0.6
    without = path.summarize_floor({k: v for k, v in ttft.items() if k != "native_noop"}, {})
    assert "native_noop_added_p50_ms" not in without  # no Node: the path is not there, not None
    seq, load = _flat()
    f["cpu_us_per_request"] = {"noop": 800, "kvgate": 1300, "native_noop": 90}
    r = path.summarize(seq, load, requests=1, concurrency=8, engines=2, floor=f)
    assert "no-op adds 0.900 ms, kvgate 1.300 ms (+0.400 over the no-op); CPU per request: no-op 800 us" in path.table(r)
    assert "without Python (native_noop: Node's HTTP/2 in C, answers made beforehand) adds 0.600 ms (CPU per " \
           "request 90 us)" in path.table(r)


def test_the_floors_envoy_answers_the_chat_route_itself_after_ext_proc_and_without_it_has_no_ext_proc(tmp_path):
    class FakeStack:
        workdir = tmp_path
        started: dict = {}

        def start(self, name, argv, **kw):
            import yaml
            self.started[name] = yaml.safe_load((tmp_path / f"{name}.yaml").read_text())

    stack = FakeStack()
    path._envoy_answering(stack, "with", 10001, [("127.0.0.1", 9)], [5001, 5002])
    path._envoy_answering(stack, "without", 10002, [("127.0.0.1", 9)], None)
    for name, has_ext in (("with", True), ("without", False)):
        config = stack.started[name]
        chat = next(r for r in path.envoy_routes(config) if r["match"].get("path") == "/v1/chat/completions")
        assert chat["direct_response"]["body"]["inline_string"] == path.FLOOR_ANSWER and "route" not in chat
        assert path._TOKEN.search(path.FLOOR_ANSWER.encode())  # the client times its first token
        hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        assert any(f["name"] == "envoy.filters.http.ext_proc" for f in hcm["http_filters"]) == has_ext
    kvgate = next(c for c in stack.started["with"]["static_resources"]["clusters"] if c["name"] == "kvgate")
    ports = [e["endpoint"]["address"]["socket_address"]["port_value"]
             for e in kvgate["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert ports == [5001, 5002]


def test_a_floor_path_without_answers_is_said_with_its_errors():
    ttft = {"envoy_answers": [0.0003], "noop": [0.0012], "kvgate": []}
    f = path.summarize_floor(ttft, {"envoy_answers": 0, "noop": 0, "kvgate": 5})
    assert f["kvgate_added_p50_ms"] is None and "kvgate_over_noop_ms" not in f
    seq, load = _flat()
    r = path.summarize(seq, load, requests=1, concurrency=8, engines=2, floor=f)
    assert "processors alone: a path without answers (failed requests per path: {'envoy_answers': 0, 'noop': 0, " \
           "'kvgate': 5})" in path.table(r)


def test_extproc_timings_are_per_phase_medians_of_the_filter_states_calls_and_the_wait_for_the_upstream():
    log = "\n".join([
        "seq 1500 rh:900:0,rb:1:300:0,bs:4962,br:178,os:0,ds:kvgate",
        "seq 1700 rh:700:0,rb:1:500:0,sh:200:0,sb:1:100:0,bs:5273,br:212,os:0,ds:kvgate",
        "seq 1600 rh:800:0,rb:2:400:0,bs:4962,br:178,os:0,ds:kvgate",
        "floor - rh:500:0,rb:1:200:0,bs:4962,br:178,os:0,ds:kvgate",
        "- - rh:1:0,rb:1:1:0",  # a request without the phase header (the warm-up): left out
    ])
    t = path.extproc_timings(log)
    assert set(t) == {"seq", "floor"}
    assert t["seq"] == {"headers_us": 800, "body_us": 400, "calls_us": 1200, "to_upstream_us": 1600, "samples": 3}
    assert t["floor"] == {"headers_us": 500, "body_us": 200, "calls_us": 700, "to_upstream_us": None, "samples": 1}


def test_the_access_log_and_the_phase_header_name_the_same_header(tmp_path):
    config = path.with_access_log({"static_resources": {"listeners": [{"filter_chains": [{"filters": [
        {"typed_config": {}}]}]}]}}, tmp_path / "a.log")
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (entry,) = hcm["access_log"]
    fmt = entry["typed_config"]["log_format"]["text_format_source"]["inline_string"]
    assert entry["typed_config"]["path"] == str(tmp_path / "a.log") and fmt.endswith("\n")
    assert fmt.startswith(f"%REQ({path.PHASE_HEADER.upper()})% ")

    async def go():
        sent = []

        class Writer:
            def write(self, data):
                sent.append(data)

            def is_closing(self):
                return False
        client = path.Client("127.0.0.1", 9)
        reader = asyncio.StreamReader()
        reader.feed_data(HEAD + _chunked(TOKEN))
        client.reader, client.writer = reader, Writer()  # type: ignore[assignment]
        await client.chat(b"{}", "paced")
        return sent[0]
    assert f"\r\n{path.PHASE_HEADER}: paced\r\n".encode() in asyncio.run(go())


def test_the_table_says_the_paced_floor_and_the_round_trips_envoy_waited_on():
    ttft = {"envoy_answers": [0.0003], "noop": [0.0012], "kvgate": [0.0016]}
    f = path.summarize_floor(ttft, dict.fromkeys(path.FLOOR_PATHS, 0))
    f["paced"] = path.summarize_floor({"envoy_answers": [0.0005], "noop": [0.0023], "kvgate": [0.0031]},
                                      dict.fromkeys(path.FLOOR_PATHS, 0))
    f["paced"]["pause_s"] = path.FLOOR_PACE_S
    seq, load = _flat()
    waited = {"kvgate": {"seq": {"headers_us": 930, "body_us": 934, "to_upstream_us": 2266}},
              "floor_noop": {"paced": {"headers_us": 1003, "body_us": 310, "to_upstream_us": None}}}
    text = path.table(path.summarize(seq, load, requests=1, concurrency=8, engines=2, floor=f, extproc_us=waited))
    assert "paced (20 ms before every request, as each path waits through the engines): no-op adds 1.800 ms, " \
           "kvgate 2.600 ms (Envoy answering alone 0.500 ms)" in text
    assert "kvgate one at a time 930 / 934 (2266)" in text and "noop paced 1003 / 310;" not in text
    assert text.split("first byte to upstream): ")[1].split("\n")[0].endswith("noop paced 1003 / 310")


@pytest.mark.integration
def test_the_native_noop_answers_each_kind_of_message_as_the_no_op_does_over_real_grpc(tmp_path):
    """bench/native_noop.js under Node, asked by a grpc.aio client as Envoy asks: each message answered in order
    with the no-op's own answer to it, trailers answered by nothing, the stream ended with status OK."""
    import json
    import shutil

    import grpc
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
    from google.protobuf import struct_pb2

    from bench.noop_processor import native_answers
    from devkit.stack import Stack, free_port

    node = shutil.which("node")
    if node is None:
        pytest.skip("no node on PATH (Debian's nodejs; ./dev setup installs npm, which brings it)")
    answers = native_answers("127.0.0.1:8000")
    (tmp_path / "answers.json").write_text(json.dumps(answers))
    attrs = {"envoy.filters.http.ext_proc": struct_pb2.Struct(fields={"request.path": struct_pb2.Value(string_value="/v1/x")})}
    headers = pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":path", raw_value=b"/v1/x")]))
    sent = [pb.ProcessingRequest(request_headers=headers, attributes=attrs),
            pb.ProcessingRequest(request_trailers=pb.HttpTrailers()),
            pb.ProcessingRequest(request_body=pb.HttpBody(body=b"{}" * 100, end_of_stream=True), attributes=attrs),
            pb.ProcessingRequest(response_headers=pb.HttpHeaders()),
            pb.ProcessingRequest(response_body=pb.HttpBody(body=b"x", end_of_stream=True))]

    async def ask(port: int):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = pb_grpc.ExternalProcessorStub(channel).Process(iter(sent))
            return [r async for r in call], await call.code()
    with Stack() as stack:
        port = free_port()
        stack.start("native_noop", [node, str(path.NATIVE_NOOP), str(port), str(tmp_path / "answers.json")],
                    ready_port=("127.0.0.1", port))
        got, code = asyncio.run(ask(port))
    assert code == grpc.StatusCode.OK
    expect = [answers[k] for k in ("request_headers", "request_body", "response_headers", "response_body")]
    assert [r.SerializeToString().hex() for r in got] == expect
    assert got[1].dynamic_metadata.fields["envoy.lb"].struct_value.fields[
        "x-gateway-destination-endpoint"].string_value == "127.0.0.1:8000"
