"""parse_engine_metrics parses only the lines it reads, with a parser of its own (read_samples): the same EngineLoad as
prometheus_client's parser of the whole page (the reference), on a page shaped as vLLM's and on random ones; a bad line
of a family it does not read fails nothing, and a read line the reference rejects fails the scrape here too."""
from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from routing.state.engine_metrics import READ, load_from_samples, parse_engine_metrics, read_samples

# vLLM 0.10's families (names from its metrics documentation), each histogram with a plausible number of buckets
HISTOGRAMS = {"vllm:time_to_first_token_seconds": 20, "vllm:time_per_output_token_seconds": 19,
              "vllm:inter_token_latency_seconds": 19, "vllm:e2e_request_latency_seconds": 21,
              "vllm:request_queue_time_seconds": 21, "vllm:request_inference_time_seconds": 21,
              "vllm:request_prefill_time_seconds": 21, "vllm:request_decode_time_seconds": 21,
              "vllm:iteration_tokens_total": 18, "vllm:request_max_num_generation_tokens": 12,
              "vllm:request_params_n": 6, "vllm:request_params_max_tokens": 12, "vllm:request_prompt_tokens": 12,
              "vllm:request_generation_tokens": 12}
COUNTERS = ("vllm:num_preemptions", "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:prefix_cache_queries",
            "vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_queries", "vllm:gpu_prefix_cache_hits")
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
          "vllm:gpu_cache_usage_perc")


def vllm_page(engines: tuple[str, ...] = ("0",), model: str = "org/Model-7B", seed: int = 1) -> str:
    """A /metrics page shaped as a vLLM 0.10 server's: its gauges, counters (with _created), 14 histograms (with
    _created), request_success by finished reason, a cache config info line, and the Python, process and HTTP
    families its server exports besides."""
    n = seed
    out = []

    def value() -> float:
        nonlocal n
        n = (n * 1103515245 + 12345) % 2**31
        return round(n / 2**20, 3)

    for g in GAUGES:
        out += [f"# HELP {g} A gauge.", f"# TYPE {g} gauge"]
        out += [f'{g}{{engine="{e}",model_name="{model}"}} {value()}' for e in engines]
    for c in COUNTERS:
        out += [f"# HELP {c}_total A counter.", f"# TYPE {c}_total counter"]
        for e in engines:
            out += [f'{c}_total{{engine="{e}",model_name="{model}"}} {value()}',
                    f'{c}_created{{engine="{e}",model_name="{model}"}} 1.7e+09']
    out += ["# HELP vllm:request_success_total Requests.", "# TYPE vllm:request_success_total counter"]
    for e in engines:
        for reason in ("stop", "length", "abort"):
            out.append(f'vllm:request_success_total{{engine="{e}",finished_reason="{reason}",model_name="{model}"}} '
                       f"{value()}")
    for h, buckets in HISTOGRAMS.items():
        out += [f"# HELP {h} A histogram.", f"# TYPE {h} histogram"]
        for e in engines:
            labels = f'engine="{e}",model_name="{model}"'
            out += [f'{h}_bucket{{{labels},le="{0.001 * 2 ** i}"}} {value()}' for i in range(buckets - 1)]
            out += [f'{h}_bucket{{{labels},le="+Inf"}} {value()}', f"{h}_count{{{labels}}} {value()}",
                    f"{h}_sum{{{labels}}} {value()}", f"{h}_created{{{labels}}} 1.7e+09"]
    out.append('vllm:cache_config_info{block_size="16",enable_prefix_caching="True",num_gpu_blocks="2340"} 1.0')
    for gen in range(3):
        out += [f'python_gc_objects_collected_total{{generation="{gen}"}} {value()}',
                f'python_gc_collections_total{{generation="{gen}"}} {value()}']
    out += [f"process_{m} {value()}" for m in ("virtual_memory_bytes", "resident_memory_bytes", "start_time_seconds",
                                               "cpu_seconds_total", "open_fds", "max_fds")]
    for handler in ("/v1/chat/completions", "/v1/completions", "/metrics", "/health", "/tokenize", "/v1/models"):
        labels = f'handler="{handler}",method="POST",status="2xx"'
        out += [f"http_requests_total{{{labels}}} {value()}", f"http_request_size_bytes_sum{{{labels}}} {value()}",
                f"http_response_size_bytes_sum{{{labels}}} {value()}"]
        out += [f'http_request_duration_seconds_bucket{{{labels},le="{b}"}} {value()}' for b in (0.1, 0.5, 1.0, "+Inf")]
    out += [f'http_request_duration_highr_seconds_bucket{{le="{0.01 * i}"}} {value()}' for i in range(1, 30)]
    return "\n".join(out) + "\n"


def whole_page(text: str, at: float = 0.0):
    """The reference: every line of the page parsed, then the same reading of the samples."""
    return load_from_samples((s for f in text_string_to_metric_families(text) for s in f.samples), at)


def test_a_vllm_shaped_page_reads_the_same_from_its_few_lines_as_from_all_of_them():
    for engines in (("0",), ("0", "1", "2", "3")):
        page = vllm_page(engines)
        assert page.count("\n") >= 400  # the size of a real page (~450 lines with one engine)
        kept = read_samples(page)
        assert {s.name for s in kept} == READ  # the page exports every one
        assert len(kept) == len(READ) * len(engines)
        load = parse_engine_metrics(page, at=5.0)
        assert load == whole_page(page, at=5.0)
        assert load.tokens is not None and load.ttft is not None and load.tpot is not None
        assert (load.ranks is not None) == (len(engines) > 1)


def test_a_bad_line_of_a_family_never_read_fails_nothing_but_one_read_still_fails_the_scrape():
    page = vllm_page() + 'http_requests_total{handler="/x" 1\n'
    assert parse_engine_metrics(page) == whole_page(vllm_page())
    try:
        parse_engine_metrics(page + "vllm:num_requests_waiting{engine=0} x\n")
    except ValueError:
        pass
    else:
        raise AssertionError("a malformed line of a family read should fail the scrape, as before")


NAMES = sorted(READ) + ["vllm:num_requests_waiting_by_reason", "vllm:prompt_tokens_created",
                        "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_created",
                        "vllm:kv_cache_usage_perc_max", "vllm:num_requests", "process_open_fds"]
label_value = st.text(alphabet=st.sampled_from('abz09 {}=,/"\\\n'), max_size=8).map(
    lambda v: v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n"))
line = st.builds(
    lambda name, engine, other, value, ts, sep: (
        f'{name}{{engine="{engine}",model_name="{other}"}}{sep}{value}' + (f" {ts}" if ts is not None else "")),
    st.sampled_from(NAMES), st.sampled_from(["0", "1", "7"]), label_value,
    st.one_of(st.integers(0, 10**6).map(str), st.floats(0, 1e6, allow_nan=False).map(repr),
              st.just("1.5e+03"), st.just("+Inf")),
    st.one_of(st.none(), st.integers(0, 2**40)), st.sampled_from([" ", "  ", "\t"]))
bare = st.builds(lambda name, value: f"{name} {value}", st.sampled_from(NAMES), st.integers(0, 100))
comment = st.sampled_from(["# HELP vllm:num_requests_waiting Waiting.", "# TYPE vllm:num_requests_running gauge",
                           "", "# a comment"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(line, bare, comment), max_size=40))
def test_any_page_reads_the_same_from_its_read_lines_as_whole(lines):
    text = "\n".join(lines) + "\n"
    try:
        expected = whole_page(text, at=1.0)
    except ValueError:  # a page the parser rejects whole (a name repeated after a TYPE, say): not compared
        return
    got = parse_engine_metrics(text, at=1.0)
    assert repr(got) == repr(expected)  # repr: +Inf sums compare equal, and nan never appears


def reference_samples(line: str):
    """The reference's samples of one line, or ValueError."""
    return [(s.name, s.labels, float(s.value)) for f in text_string_to_metric_families(line + "\n") for s in f.samples]


GOOD = ['vllm:num_requests_waiting{engine="0",model_name="a\\"b,c}"} 3',
        'vllm:kv_cache_usage_perc{model_name="x\\\\y\\nz"} 0.25 1700000000000',
        'vllm:prompt_tokens_total 12.5', 'vllm:num_requests_running{} 1', 'vllm:num_requests_running{a="1",} 2',
        'vllm:time_to_first_token_seconds_sum{engine="1"}\t+Inf', 'vllm:num_requests_waiting NaN']


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(GOOD), st.integers(0, 80), st.sampled_from(['', ' ', '"', '\\', '{', '}', ',', '=', 'x', '_', '1']))
def test_a_read_line_parses_as_the_reference_parses_it_or_fails_as_it_fails(line, at, insert):
    """Each good line as the reference reads it; the line with a character changed or added read as the reference reads
    it or refused (a ValueError: the scrape fails, counted), never read otherwise. Refused where the reference is more
    lenient than the text format (a leading comma in the labels, say): no exporter writes those."""
    at = min(at, len(line))
    for variant in (line, line[:at] + insert + line[at + 1:], line[:at] + insert + line[at:]):
        if re.split(r"[{ \t]", variant.lstrip(" \t"), maxsplit=1)[0] not in READ:
            assert read_samples(variant) == []  # a line of a name not read: never parsed here
            continue
        try:
            expected = reference_samples(variant)
        except ValueError:
            expected = None
        try:
            got = [(s.name, s.labels, s.value) for s in read_samples(variant)]
        except ValueError:
            got = None
        if variant == line:
            assert repr(got) == repr(expected), variant
        else:
            assert got is None or repr(got) == repr(expected), variant
