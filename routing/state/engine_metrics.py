"""Engine load scraped from each pod's Prometheus `/metrics` (vLLM metric names)."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, NamedTuple

from routing.metrics import RoutingMetrics
from routing.pods import Pod
from routing.registry import PodRegistry
from tokenizer.http1 import ConnectFailed, Http1Client, HttpError

log = logging.getLogger(__name__)

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # new name, pre-0.10 name
# vLLM's own latency histograms (cumulative _sum and _count): inter-token time (older name first), TTFT
TPOT = ("vllm:time_per_output_token_seconds", "vllm:inter_token_latency_seconds")
TTFT = "vllm:time_to_first_token_seconds"
# Token counters (cumulative): their rate between two scrapes is the engine's token throughput
PROMPT_TOKENS = "vllm:prompt_tokens_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
# vLLM's prefix cache counters (prompt tokens looked up, and found cached): the engine's real hit rate
PREFIX_QUERIES, PREFIX_HITS = "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"


@dataclass(frozen=True, slots=True)
class EngineLoad:
    waiting: float
    running: float
    kv_usage: float | None  # 0..1
    at: float  # time.monotonic() of the scrape
    # per value of the `engine` label when there are several (vLLM: one per data-parallel rank)
    ranks: Mapping[str, EngineLoad] | None = None
    # vLLM's histograms, summed over the engine's series: (sum of seconds, count), None if not exported
    tpot: tuple[float, float] | None = None
    ttft: tuple[float, float] | None = None
    # Cumulative prompt and generation tokens (None if not exported), and what two scrapes make of them
    # and of the histograms (`with_rates`): tokens/s since the last scrape (prompt, generation), and the
    # mean TTFT and TPOT of the requests seen since (else the last known, else the cumulative mean).
    tokens: tuple[float, float] | None = None
    token_rate: tuple[float, float] | None = None
    ttft_mean: float | None = None
    tpot_mean: float | None = None
    # vLLM's prefix cache counters summed over the engine's series: (queries, hits) in tokens, None if not exported
    prefix_cache: tuple[float, float] | None = None


def _mean(now: tuple[float, float] | None, before: tuple[float, float] | None, last: float | None) -> float | None:
    if now is None:
        return None
    if before is not None and now[1] > before[1]:
        return (now[0] - before[0]) / (now[1] - before[1])
    if before is not None and last is not None:
        return last
    return now[0] / now[1] if now[1] > 0 else None


def with_rates(load: EngineLoad, before: EngineLoad | None) -> EngineLoad:
    """`load` with its token rate and recent latency means, from the scrape `before` it (if any)."""
    rate = None
    if before is not None and load.tokens is not None and before.tokens is not None and load.at > before.at:
        dt = load.at - before.at
        # a counter that went back: the engine restarted, its new count is what it did since
        rate = tuple((n - b if n >= b else n) / dt for n, b in zip(load.tokens, before.tokens))
    return dataclasses.replace(
        load, token_rate=rate,  # type: ignore[arg-type]
        ttft_mean=_mean(load.ttft, before.ttft if before else None, before.ttft_mean if before else None),
        tpot_mean=_mean(load.tpot, before.tpot if before else None, before.tpot_mean if before else None))


@dataclass(frozen=True, slots=True)
class Saturation:
    """When an engine counts as saturated, for shedding sheddable requests (429): its own scraped
    numbers say it is queueing (`waiting` requests at or above `queue`) or its KV cache is nearly
    full (usage at or above `kv_usage`). An engine without a fresh scrape is not saturated: shedding
    on missing knowledge would drop traffic whenever scraping breaks."""

    queue: float = 5
    kv_usage: float = 0.8

    def saturated(self, load: EngineLoad | None) -> bool:
        if load is None:
            return False
        return load.waiting >= self.queue or (load.kv_usage is not None and load.kv_usage >= self.kv_usage)


def _load(waiting: float, running: float, usage: list[float], at: float) -> EngineLoad:
    kv = min(1.0, max(0.0, sum(usage) / len(usage))) if usage else None
    return EngineLoad(waiting=waiting, running=running, kv_usage=kv, at=at)


def _sum_count(pair: list[float] | None) -> tuple[float, float] | None:
    return (pair[0], pair[1]) if pair is not None else None


# Every sample name parse_engine_metrics reads; a /metrics line of any other name is never parsed.
READ = frozenset({WAITING, RUNNING, *KV_USAGE, PROMPT_TOKENS, GENERATION_TOKENS, PREFIX_QUERIES, PREFIX_HITS,
                  *(f"{h}_{part}" for h in (*TPOT, TTFT) for part in ("sum", "count"))})
_READ_STARTS = tuple(READ)


class Sample(NamedTuple):
    """One sample of a page: its name, labels and value, as the text format writes them."""
    name: str
    labels: dict[str, str]
    value: float


_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}  # any other backslash stays as it is, as the reference keeps it


def _labels(line: str, i: int) -> tuple[dict[str, str], int]:
    """The label set opening at line[i] ('{'), and the index after its '}'; ValueError if it is not one."""
    labels: dict[str, str] = {}
    i += 1
    n = len(line)
    while True:
        while i < n and line[i] in " \t":
            i += 1
        if i < n and line[i] == "}":
            return labels, i + 1
        eq = line.find("=", i)
        if eq < 0:
            raise ValueError(f"no '=' in the labels of {line!r}")
        name = line[i:eq].strip()
        if _LABEL_NAME.fullmatch(name) is None:
            raise ValueError(f"bad label name {name!r} in {line!r}")
        i = eq + 1
        while i < n and line[i] in " \t":
            i += 1
        if i >= n or line[i] != '"':
            raise ValueError(f"unquoted label value in {line!r}")
        i += 1
        close = line.find('"', i)
        if close < 0:
            raise ValueError(f"unterminated label value in {line!r}")
        if line.find("\\", i, close) < 0:  # most values: no escape, one slice
            value = line[i:close]
            i = close + 1
        else:
            chars = []
            while True:
                if i >= n:
                    raise ValueError(f"unterminated label value in {line!r}")
                c = line[i]
                if c == '"':
                    i += 1
                    break
                if c == "\\" and i + 1 < n and line[i + 1] in _ESCAPES:
                    chars.append(_ESCAPES[line[i + 1]])
                    i += 2
                else:
                    chars.append(c)
                    i += 1
            value = "".join(chars)
        if name in labels:
            raise ValueError(f"label {name!r} repeated in {line!r}")
        labels[name] = value
        while i < n and line[i] in " \t":
            i += 1
        if i < n and line[i] == ",":
            i += 1
        elif i < n and line[i] != "}":
            raise ValueError(f"expected ',' or '}}' in {line!r}")


_NAME = r'[A-Za-z_][A-Za-z0-9_]*'  # a label's name, as the text format has it
_LABEL_NAME = re.compile(_NAME)
_LABEL = _NAME + r'="[^"\\\n]*"'  # a label without an escape in its value
# A sample's line after its name, in the shape exporters write: its labels (none escaped), value, timestamp
_SIMPLE_LINE = re.compile(r'(?:\{((?:%s(?:,%s)*,?)?)\})?[ \t]+([^ \t]+)(?:[ \t]+([^ \t]+))?[ \t]*' % (_LABEL, _LABEL))
_SIMPLE_LABEL = re.compile(r'(%s)="([^"\\\n]*)"' % _NAME)


def _value(text: str, line: str) -> float:
    if "_" in text:  # float() takes 1_000; the text format does not
        raise ValueError(f"bad value {text!r} in {line!r}")
    return float(text)  # NaN, +Inf and -Inf as the format spells them


def read_samples(text: str) -> list[Sample]:
    """The samples of a Prometheus text exposition whose name `READ` has (comments and every other family
    dropped, unparsed). Why not prometheus_client's parser: it took ~15 us a line, so a vLLM server's whole page
    (14 histograms, HTTP and process families besides: ~430 lines with one engine, of which kvgate reads 14) cost
    6.4 ms of the event loop per engine per scrape, and the lines read alone 294 us; here 194 (most of it finding
    them), and on a sim's 43-line page 177 -> 51 us (docs/BENCHMARKS.md, request). The tests hold prometheus_client's
    parser as the reference. ValueError for a read line that is not a sample (the scrape fails, counted, as with the
    reference)."""
    out = []
    lines = text.splitlines()
    if text[:1] in (" ", "\t") or "\n " in text or "\n\t" in text:  # blanks before a line's name (allowed, rare)
        lines = [line.lstrip(" \t") for line in lines]
    for line in lines:
        if not line.startswith(_READ_STARTS):  # in C: most lines end here
            continue
        end = len(line)
        for sep in ("{", " ", "\t"):
            i = line.find(sep)
            if 0 <= i < end:
                end = i
        name = line[:end]
        if name not in READ:
            continue
        simple = _SIMPLE_LINE.fullmatch(line, end)
        if simple is not None:  # most lines: labels without escapes, a value, maybe a timestamp
            pairs = _SIMPLE_LABEL.findall(simple[1]) if simple[1] else []
            labels = dict(pairs)
            if len(labels) == len(pairs):
                if simple[3] is not None:
                    _value(simple[3], line)
                out.append(Sample(name, labels, _value(simple[2], line)))
                continue
        labels = {}
        i = end
        while i < len(line) and line[i] in " \t":
            i += 1
        if i < len(line) and line[i] == "{":
            labels, i = _labels(line, i)
        rest = line[i:].lstrip()
        # the value, then what the reference reads as a timestamp (its last token, checked, not kept), split as it does
        values = [v.strip() for v in rest.split(" " if " " in rest else "\t") if v.strip()]
        if not values:
            raise ValueError(f"no value in {line!r}")
        if len(values) > 1:
            _value(values[-1], line)
        out.append(Sample(name, labels, _value(values[0], line)))
    return out


def parse_engine_metrics(text: str, at: float = 0.0) -> EngineLoad:
    """Queue lengths summed over an engine's series, KV usage averaged (DP ranks report one each,
    labelled `engine`); with several ranks, each one's own numbers in `ranks`. Only the lines of the samples
    it reads are parsed (`read_samples`)."""
    return load_from_samples(read_samples(text), at)


def load_from_samples(samples: Iterable[Any], at: float) -> EngineLoad:
    """An EngineLoad from parsed samples (prometheus_client's: name, labels, value); other names are ignored."""
    per: dict[str, list] = {}  # engine label -> [waiting, running, usage samples]
    hist: dict[str, list[float]] = {}  # TPOT / TTFT -> [sum, count]
    tokens: list[float] | None = None  # [prompt, generation], summed over the engine's series
    prefix: list[float] | None = None  # [queries, hits]
    for s in samples:
        if s.name in (PROMPT_TOKENS, GENERATION_TOKENS):
            if tokens is None:
                tokens = [0.0, 0.0]
            tokens[s.name == GENERATION_TOKENS] += s.value
            continue
        if s.name in (PREFIX_QUERIES, PREFIX_HITS):
            prefix = prefix or [0.0, 0.0]
            prefix[0 if s.name == PREFIX_QUERIES else 1] += s.value
            continue
        if s.name.endswith(("_sum", "_count")):
            base, _, part = s.name.rpartition("_")
            which = "tpot" if base in TPOT else "ttft" if base == TTFT else None
            if which is not None:
                pair = hist.setdefault(which, [0.0, 0.0])
                pair[0 if part == "sum" else 1] += s.value
            continue
        if s.name == WAITING:
            i = 0
        elif s.name == RUNNING:
            i = 1
        elif s.name in KV_USAGE:
            i = 2
        else:
            continue
        acc = per.get(s.labels.get("engine", ""))
        if acc is None:
            acc = per[s.labels.get("engine", "")] = [0.0, 0.0, []]
        if i == 2:
            acc[2].append(s.value)
        else:
            acc[i] += s.value
    whole = _load(sum(a[0] for a in per.values()), sum(a[1] for a in per.values()),
                  [u for a in per.values() for u in a[2]], at)
    tpot = _sum_count(hist.get("tpot"))
    ttft = _sum_count(hist.get("ttft"))
    counted = (tokens[0], tokens[1]) if tokens is not None else None
    cache = _sum_count(prefix)
    if len(per) < 2:
        return EngineLoad(whole.waiting, whole.running, whole.kv_usage, at, None, tpot, ttft, counted,
                          prefix_cache=cache)
    ranks = {engine: _load(w, r, u, at) for engine, (w, r, u) in per.items()}
    return EngineLoad(whole.waiting, whole.running, whole.kv_usage, at, ranks, tpot, ttft, counted, prefix_cache=cache)


class EngineMetrics:
    """Scrapes every ready pod every `interval_s`; `get(pod)` is None when unknown or stale."""

    def __init__(self, registry: PodRegistry, *, interval_s: float = 1.0, timeout_s: float = 0.5,
                 metrics: RoutingMetrics | None = None) -> None:
        self._registry = registry
        self._interval = interval_s
        self._timeout = timeout_s
        self._metrics = metrics or RoutingMetrics()
        self._clients: dict[str, tuple[Http1Client, bytes]] = {}  # pod -> its kept-alive connection, the GET's head
        self._loads: dict[str, EngineLoad] = {}
        self.on_load: Callable[[str, EngineLoad], None] | None = None  # each fresh scrape (engine profiles)
        self._down: set[str] = set()  # pods whose engine refused the last scrape's connection
        self._task: asyncio.Task | None = None
        registry.add_listener(self._on_pods)

    def _on_pods(self, added: list[Pod], removed: list[Pod]) -> None:
        for p in removed:
            self._loads.pop(p.name, None)
            self._down.discard(p.name)
            client = self._clients.pop(p.name, None)
            if client is not None:
                client[0].close()

    def unreachable(self, pod: str) -> bool:
        """True when the pod's engine could not be connected to at the last scrape (down or restarting)."""
        return pod in self._down

    def get(self, pod: str, rank: int | None = None) -> EngineLoad | None:
        """The pod's load; with `rank`, that data-parallel rank's own where the engine reports it
        (vLLM's `engine` label), else the pod's."""
        load = self._loads.get(pod)
        if load is None or time.monotonic() - load.at > 3 * self._interval:
            return None
        if rank is not None and load.ranks:
            return load.ranks.get(str(rank), load)
        return load

    def put(self, pod: str, load: EngineLoad) -> None:
        self._loads[pod] = load

    async def scrape_once(self, spread_s: float = 0.0) -> None:
        """Every ready pod's page, once; with `spread_s`, the scrapes start that long apart over all of them
        (the registry's order: each pod at the same phase every round). Why spread: a scrape was ~1 ms of the event
        loop then (httpx's request, the page's lines), and all at once they queued ahead of every request's decision
        arriving meanwhile: with 128 engines the loop lagged up to 62-76 ms once a second (p99 5.1-5.2 ms); spread,
        13-19 ms (p99 1.0-1.2; docs/BENCHMARKS.md, request). Each pod's page comes over a connection of its own,
        kept open between rounds (tokenizer.http1)."""
        pods = [p for p in self._registry.pods() if p.ready]
        gap = spread_s / len(pods) if pods else 0.0
        started: list[asyncio.Future] = []
        try:
            for i, pod in enumerate(pods):
                if i and gap > 0:
                    await asyncio.sleep(gap)
                started.append(asyncio.ensure_future(self._scrape(pod)))
            await asyncio.gather(*started)
        except asyncio.CancelledError:
            for task in started:
                task.cancel()
            raise

    async def _scrape(self, pod: Pod) -> None:
        kept = self._clients.get(pod.name)
        if kept is None or (kept[0].host, kept[0].port) != (pod.address, pod.port):
            if kept is not None:
                kept[0].close()
            client = Http1Client(pod.address, pod.port)
            kept = self._clients[pod.name] = (client, client.head("GET", "/metrics", accept="text/plain"))
        try:
            reply = await kept[0].request(kept[1], timeout_s=self._timeout)
            if reply.status != 200:
                raise HttpError(f"HTTP {reply.status}")
            text = reply.body.decode("utf-8", "replace")
        except ConnectFailed as e:
            self._down.add(pod.name)  # nothing listens there: route elsewhere until it answers again
            self._loads.pop(pod.name, None)
            self._metrics.scrape_errors.inc()
            log.debug("scrape of %s failed: %s", pod.name, e)
            return
        except Exception as e:
            self._metrics.scrape_errors.inc()
            log.debug("scrape of %s failed: %s", pod.name, e)
            return
        self._down.discard(pod.name)
        try:
            load = parse_engine_metrics(text, time.monotonic())
            load = self._loads[pod.name] = with_rates(load, self._loads.get(pod.name))
            if self.on_load is not None:
                self.on_load(pod.name, load)
        except Exception as e:
            self._metrics.scrape_errors.inc()
            log.debug("scrape of %s failed: %s", pod.name, e)

    async def _loop(self) -> None:
        spread = 0.0  # the first round at once: at start nothing is routed yet, and a dead pod is known within it
        while True:
            began = time.monotonic()
            try:
                await self.scrape_once(spread_s=spread)
            except Exception:
                log.exception("engine metrics scrape round failed")
            spread = self._interval
            # the next round `interval` after this one began (a pod's scrape every interval), at once if it ran over
            await asyncio.sleep(max(0.0, began + self._interval - time.monotonic()))

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="kvgate-engine-metrics")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for client, _ in self._clients.values():
            client.close()
        self._clients.clear()

    def snapshot(self) -> dict:
        now = time.monotonic()
        out: dict = {name: {"waiting": load.waiting, "running": load.running, "kv_usage": load.kv_usage,
                            "age_s": round(now - load.at, 3)} for name, load in self._loads.items()}
        for name, load in self._loads.items():
            if load.prefix_cache is not None:  # cumulative, in prompt tokens, as the engine counts them
                out[name]["prefix_cache_queries"], out[name]["prefix_cache_hits"] = load.prefix_cache
        for name in self._down:
            out[name] = {"unreachable": True}
        return out
