"""deploy/observability against a real stack: every alert rule evaluated (promtool) on scrapes of a run where
its condition holds and of one where it does not, and every metric name the Grafana dashboard uses found in
what kvgate and the engines really export.

One stack on loopback: Redis, three simulated engines (sim2 publishes no KV events), two kvgate replicas
sharing Redis, each behind its own Envoy so the test chooses which replica routes what. Replica A tokenizes
with `auto` (checked against the engines), B with `local` (never checked) and a small index bound; both are
given tokenizer files whose chat template is one character off the engines'. Phase 1 ("quiet") sends only
completions of a few repeated prompts: the template is not used, B's index stays under its bound, every
engine kvgate knows publishes, Redis is up; no rule may fire. Phase 2 ("faults") adds sim2 to the pods file,
kills Redis and sends chat (A finds the disagreement, B silently routes on wrong tokens so believed and real
hit rates drift apart) and long distinct prompts (B's index fills and evicts, so the replicas disagree), and
sends an HTTP/1.1 request to A's gRPC port at every step (as a health check pointed there would);
every rule must fire. A third replica, C (a job of its own, routing nothing), serves its gRPC port over TLS from
files: a certificate good for 30 days in phase 1, replaced in phase 2 by one good for 2 (a renewal gone wrong).
Each phase is a series of scrapes of every target; promtool's `test rules` takes them as input series, one
scrape per step, the step chosen per rule so that a phase spans its window and `for`.
A real Prometheus scrapes the same targets throughout, with the rules loaded: every dashboard query is asked of
it at the end (each must return series, but the few whose events this run never has) and every rule must have
evaluated without an error."""
from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from random import Random

import httpx
import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from devkit import prometheusrule
from devkit.stack import Stack, wait_for_readiness
from helpers import Kvgate, envoy_pool, free_port, free_ports, refused_port, start_kvgate, wait_until
from plugin.tls import self_signed
from tokenizer import testdata

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
OBS = REPO / "deploy" / "observability"
RULES = OBS / "prometheus" / "kvgate-rules.yaml"
PROMETHEUS_RULE = OBS / "prometheus" / "kvgate-prometheusrule.yaml"
DASHBOARD = OBS / "grafana" / "kvgate.json"
MODEL = "obs-model"
SCRAPES = 12  # per phase
B_INDEX_BOUND = 150
FAST_SIM = ["--ttft-overhead-ms", "1", "--tpot-ms", "1", "--tpot-ms-per-seq", "0"]
WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "market", "engine", "orange", "silver"]
# where each rule must fire in phase 2 (labels of its alerts; {} any)
FIRING = {
    "KvgateEngineSilent": {"pod": "sim2"},
    "KvgateHitRateDrift": {},
    "KvgateTokenizerDisagreement": {"instance": "kvgate-a", "model": MODEL},
    "KvgateRedisDown": {},
    "KvgateIndexAtBound": {"instance": "kvgate-b"},
    "KvgateReplicasDisagree": {},
    "KvgateWatchWordsLost": {},
    "KvgateGrpcProtocolErrors": {"instance": "kvgate-a", "reason": "preface"},
    "KvgateGrpcCertificateExpiring": {"instance": "kvgate-c"},
}
# alerts that must not fire in phase 2 either (label matchers): the conditions hold elsewhere only
NOT_FIRING = {"KvgateEngineSilent": 'pod!="sim2"', "KvgateIndexAtBound": 'instance="kvgate-a"',
              "KvgateGrpcProtocolErrors": 'instance="kvgate-b"'}


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed (Debian package prometheus; ./dev setup installs it)")
    return path


# --- PromQL metric names ------------------------------------------------------------------------

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NAME = re.compile(r"(?<![\w.:$])[a-zA-Z_:][\w:]*")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left", "group_right",
             "inf", "nan", "Inf", "NaN"}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: what is left once strings, label matchers, ranges,
    grouping clauses, Grafana variables, numbers and durations, function names and keywords are gone."""
    e = _STRINGS.sub('""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = _GROUPING.sub(" ", e)
    e = re.sub(r"\$\{[^}]*\}|\$\w+", " ", e)
    names = set()
    for m in _NAME.finditer(e):
        if m.group() in _KEYWORDS or re.match(r"\s*\(", e[m.end():]):
            continue
        names.add(m.group())
    return names


def test_the_metric_name_extractor_finds_selectors_only() -> None:
    expr = ('histogram_quantile(0.99, sum by (le, pod) (rate(kvgate_request_ttft_seconds_bucket{job=~"$job", '
            'pod!="a{b}"}[$__rate_interval] offset 5m))) / on (pod) group_left (model) vllm:num_requests_running '
            '> bool 1e3 unless max without (x) (up) and sum(rate(foo_total[5m:1m])) * 2')
    assert metric_names(expr) == {"kvgate_request_ttft_seconds_bucket", "vllm:num_requests_running", "up", "foo_total"}


# --- scrapes -------------------------------------------------------------------------------------

@dataclass
class Target:
    job: str
    instance: str
    url: str


@dataclass
class Run:
    """Scrapes of every target, in order, each tagged with its phase; and a real Prometheus's URL (None without
    one installed) that scraped the same targets throughout, with the rules loaded."""

    targets: list[Target]
    scrapes: list[tuple[str, dict[str, str]]] = field(default_factory=list)  # (phase, instance -> text)
    times: list[float] = field(default_factory=list)  # each scrape's wall-clock time (Unix seconds)
    prometheus: str | None = None

    def scrape(self, phase: str, pool: ThreadPoolExecutor) -> None:
        self.times.append(time.time())
        texts = pool.map(lambda t: httpx.get(t.url, timeout=5).text, self.targets)
        self.scrapes.append((phase, dict(zip((t.instance for t in self.targets), texts))))

    def series(self, names: set[str], step: int) -> dict[str, list[float | None]]:
        """Input series for promtool of the metrics named: `name{labels}` (with job and instance) -> one
        value per scrape, scrape i read at promtool's i * `step` s. A Unix time (a `_timestamp_seconds`
        series) is moved to that clock, as far as the scrape's wall-clock time is from it: against promtool's
        time(), which starts at 0, it stays as far in the future as it was when scraped."""
        out: dict[str, list[float | None]] = {}
        jobs = {t.instance: t.job for t in self.targets}
        for i, (_, texts) in enumerate(self.scrapes):
            shift = i * step - self.times[i]
            for instance, text in texts.items():
                for family in text_string_to_metric_families(text):
                    for s in family.samples:
                        if s.name not in names or not math.isfinite(s.value):
                            continue
                        labels = {**s.labels, "job": jobs[instance], "instance": instance}
                        key = s.name + "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items())) + "}"
                        value = s.value + shift if s.name.endswith("_timestamp_seconds") else s.value
                        out.setdefault(key, [None] * len(self.scrapes))[i] = value
        return out

    def exported_names(self, job: str) -> set[str]:
        """Every series name the targets of `job` expose, with the suffixes of their families' types
        (a family with no sample yet counts too: its TYPE line names it)."""
        names: set[str] = set()
        for _, texts in self.scrapes:
            for t in self.targets:
                if t.job != job:
                    continue
                for family in text_string_to_metric_families(texts[t.instance]):
                    names.update(family.name + s for s in SUFFIXES.get(family.type, ("",)))
                    names.update(s.name for s in family.samples)
        return names


def _gauge(text: str, name: str) -> float:
    """The value of the unlabelled sample `name` in a /metrics text (0 without one)."""
    return next((s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name), 0.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _values(values: list[float | None]) -> str:
    return " ".join("_" if v is None else repr(float(v)) for v in values)


# --- the stack and the two phases ----------------------------------------------------------------

def _hot_prompt(i: int) -> str:
    r = Random(i)
    return f"Document {i}: " + " ".join(r.choice(WORDS) for _ in range(80))


def _distinct_prompt(r: Random) -> str:
    return " ".join(f"w{r.randrange(10**7)}" for _ in range(100))


def _chat(i: int, turn: int) -> dict:
    return {"model": MODEL, "max_tokens": 4, "messages": [
        {"role": "system", "content": _hot_prompt(100 + i % 6)},
        {"role": "user", "content": f"Question {turn % 3} about it?"}]}


def _post(client: httpx.Client, path: str, body: dict, headers: dict[str, str] | None = None) -> None:
    r = client.post(path, json=body, headers=headers)
    assert r.status_code == 200, (path, r.status_code, r.text[:300])


def _write_certificate(tls: dict[str, str], days: int) -> None:
    """A self-signed pair for 127.0.0.1 good for `days`, in place of KVGATE_GRPC_TLS_CERT's and _KEY's files (each
    renamed over the last, as a Secret's update lands)."""
    for pem, name in zip(self_signed(("127.0.0.1",), days=days), ("KVGATE_GRPC_TLS_CERT", "KVGATE_GRPC_TLS_KEY")):
        path = Path(tls[name])
        path.with_suffix(".new").write_bytes(pem)
        path.with_suffix(".new").replace(path)


def _expiry(gate: Kvgate) -> float:
    """The gate's kvgate_grpc_tls_certificate_expiry_timestamp_seconds; 0 while its metrics do not answer."""
    try:
        return _gauge(gate.metrics(), "kvgate_grpc_tls_certificate_expiry_timestamp_seconds")
    except httpx.HTTPError:
        return 0.0


def _prometheus(stack: Stack, targets: list[Target]) -> str | None:
    """A Prometheus scraping `targets` by job every 200 ms (the run lasts seconds), kvgate's rules loaded and
    evaluated as often: its URL, None where it is not installed (Debian's package prometheus; ./dev setup installs
    it)."""
    binary = shutil.which("prometheus")
    if binary is None:
        return None
    jobs: dict[str, list[str]] = {}
    for t in targets:
        jobs.setdefault(t.job, []).append(httpx.URL(t.url).netloc.decode())
    config = stack.workdir / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "200ms", "scrape_timeout": "200ms", "evaluation_interval": "200ms"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": hosts}]} for job, hosts in jobs.items()]}))
    port = free_port()
    stack.start("prometheus", [binary, f"--config.file={config}", f"--storage.tsdb.path={stack.workdir / 'tsdb'}",
                               f"--web.listen-address=127.0.0.1:{port}"], ready_port=("127.0.0.1", port))
    return f"http://127.0.0.1:{port}"


def _http1_at(port: int) -> None:
    """An HTTP/1.1 request to a plaintext gRPC port, read until the server closes the connection (it
    answers with SETTINGS and GOAWAY: not an HTTP/2 preface)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        with contextlib.suppress(ConnectionResetError):  # a close with the request unread resets
            while sock.recv(4096):
                pass


@pytest.fixture(scope="module")
def run():
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed (Debian package redis-server; ./dev setup installs it)")
    with Stack() as stack, contextlib.ExitStack() as sockets:
        redis, redis_url = stack.redis()
        # everything starts at once; each waits for its port at the end (the imports take seconds)
        engines, pods = [], []
        for i in range(3):
            port, pub, replay = free_ports(3)
            engines.append((stack.sim(name=f"sim{i}", port=port, model=MODEL, kv_events_port=None if i == 2 else pub,
                                      replay_port=replay, extra=FAST_SIM, wait=False), port))
            pods.append({"name": f"sim{i}", "address": "127.0.0.1", "port": port, "model": MODEL,
                         "kv_events": {"pub_port": pub, "replay_port": replay}})
        # sim2 publishes nothing: the ports its pod entry names refuse connections (it joins in phase 2)
        for kind in ("pub_port", "replay_port"):
            sock, pods[2]["kv_events"][kind] = refused_port()
            sockets.callback(sock.close)
        silent = pods.pop()
        # the engines' files with the chat template one character off (a space after the role)
        wrong = stack.workdir / "wrong-template"
        wrong.mkdir()
        shutil.copy(testdata.path() / "tokenizer.json", wrong)
        config = json.loads((testdata.path() / "tokenizer_config.json").read_text())
        template = config["chat_template"].replace("message['role'] + '\\n'", "message['role'] + ' \\n'")
        assert template != config["chat_template"]
        (wrong / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
        pods_file = stack.pods_file(pods)
        common = {"KVGATE_REDIS_URL": redis_url, "KVGATE_TOKENIZER_PATH": str(wrong), "KVGATE_PODS_POLL_S": "0.2",
                  "KVGATE_ENGINE_METRICS_INTERVAL_S": "0.2",
                  "KVGATE_ADMISSION_MAX_RUNNING": "64",  # never reached here: its metrics served
                  "KVGATE_WATCH_WAIT_S": "0.3"}  # words lost with Redis (phase 2) expire within a scrape or two
        a = start_kvgate(stack, pods_file, {**common, "KVGATE_GATEWAY_ID": "a"}, name="kvgate-a", wait=False)
        b = start_kvgate(stack, pods_file, {**common, "KVGATE_GATEWAY_ID": "b", "KVGATE_TOKENIZER": "local",
                                            "KVGATE_INDEX_MAX_ENTRIES": str(B_INDEX_BOUND)}, name="kvgate-b", wait=False)
        # C: TLS from files, a certificate good for 30 days (phase 2 puts one good for 2 in its place); no pods
        tls = {"KVGATE_GRPC_TLS": "files", "KVGATE_GRPC_TLS_CERT": str(stack.workdir / "c-cert.pem"),
               "KVGATE_GRPC_TLS_KEY": str(stack.workdir / "c-key.pem")}
        _write_certificate(tls, days=30)
        no_pods = stack.workdir / "no-pods.yaml"
        no_pods.write_text("[]\n")
        c = start_kvgate(stack, no_pods, {"KVGATE_GATEWAY_ID": "c", **tls}, name="kvgate-c", wait=False)
        pool = envoy_pool([*pods, silent])
        urls = {}
        for name, gate, other in (("a", a, b), ("b", b, a)):
            # every response watched, its watch stream read by the other replica: its words go through Redis
            listen = free_port()
            stack.envoy(listen_port=listen, extproc_port=gate.grpc_port, pool=pool, name=f"envoy-{name}",
                        watch_percent=100, watch_extproc_ports=[other.grpc_port])
            urls[name] = f"http://127.0.0.1:{listen}"
        for proc, port in engines:
            stack.ready(proc, ("127.0.0.1", port))
        for gate in (a, b):
            wait_for_readiness("127.0.0.1", gate.grpc_port, timeout=30, proc=gate.proc.popen, name=gate.proc.name,
                               log_path=gate.proc.log_path)
        wait_until(lambda: _expiry(c) > time.time() + 29 * 86400, timeout=30)
        targets = [Target("kvgate", "kvgate-a", a.metrics_url), Target("kvgate", "kvgate-b", b.metrics_url),
                   Target("kvgate-tls", "kvgate-c", c.metrics_url),
                   *(Target("vllm", p["name"], f"http://127.0.0.1:{p['port']}/metrics") for p in [*pods, silent])]
        result = Run(targets, prometheus=_prometheus(stack, targets))
        with httpx.Client(base_url=urls["a"], timeout=30) as via_a, httpx.Client(base_url=urls["b"], timeout=30) as via_b, \
                ThreadPoolExecutor(5) as pool_x:
            def send(batch: list[tuple[httpx.Client, str, dict]]) -> None:
                for f in [pool_x.submit(_post, *item) for item in batch]:
                    f.result()

            # warm-up, a steady healthy fleet: each prompt of phase 1 once, until both replicas hold its blocks
            # (a prompt sent again before its events arrived is a hit kvgate did not believe in), then twice more,
            # so that every counter holds more than a step's increase at the first scrape (rate() extrapolates
            # a young counter's first steps towards its zero point: ratios of two counters of different ages,
            # cached over total, come out skewed by tens of points until their history is longer than a step)
            send([(via_a if k % 2 else via_b, "/v1/completions",
                   {"model": MODEL, "prompt": _hot_prompt(k), "max_tokens": 4}) for k in range(8)])
            wait_until(lambda: len({_gauge(g.metrics(), "kvgate_index_entries") for g in (a, b)}) == 1
                       and _gauge(a.metrics(), "kvgate_index_entries") >= 8 * 15, timeout=10)
            send([(via_a if k % 2 else via_b, "/v1/completions",
                   {"model": MODEL, "prompt": _hot_prompt(k % 8), "max_tokens": 4}) for k in range(17)])
            # phase 1: completions of the eight prompts again, half through each replica, and one streamed by the
            # slo strategy (its cost model learns from the response: the dashboard's SLO and prediction panels)
            for i in range(SCRAPES):
                send([*((via_a if k % 2 else via_b, "/v1/completions",
                         {"model": MODEL, "prompt": _hot_prompt((i * 2 + k) % 8), "max_tokens": 4}) for k in range(2)),
                      (via_a, "/v1/completions", {"model": MODEL, "prompt": _hot_prompt(i % 8), "max_tokens": 4,
                                                  "stream": True}, {"routing-strategy": "slo"})])
                result.scrape("quiet", pool_x)
            # the faults
            pods_file.write_text(yaml.safe_dump([*pods, silent], sort_keys=False))
            redis.kill()
            _write_certificate(tls, days=2)
            wait_until(lambda: _expiry(c) < time.time() + 3 * 86400, timeout=15)  # looked at within 5 s
            for gate in (a, b):
                wait_until(lambda g=gate: any(p["name"] == "sim2" for p in g.debug()["pods"]), timeout=10)
            r = Random(7)
            for i in range(SCRAPES):
                send([*((via_b, "/v1/chat/completions", _chat(i * 5 + k, i + k)) for k in range(5)),
                      (via_a, "/v1/chat/completions", _chat(i, i)),
                      (via_a, "/v1/completions", {"model": MODEL, "prompt": _distinct_prompt(r), "max_tokens": 4})])
                _http1_at(a.grpc_port)
                result.scrape("faults", pool_x)
        yield result


# --- the rules -----------------------------------------------------------------------------------

def _seconds(duration: str) -> int:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    return sum(int(n) * units[u] for n, u in re.findall(r"(\d+)([smhd])", duration))


def _step(rule: dict) -> int:
    """Seconds per scrape for `rule`: phase 2 (less 3 steps' margin) spans its longest range and its `for`;
    under 5 minutes, so that instant selectors stay within Prometheus's 5-minute lookback."""
    ranges = [_seconds(d) for d in re.findall(r"\[(\d+[smhd])\]", rule["expr"])]
    span = max(ranges, default=0) + _seconds(rule.get("for", "0s"))
    step = max(60, math.ceil(span / (SCRAPES - 3) / 30) * 30)
    assert step <= 270, f"{rule['alert']}: {span} s of range and `for` need more than {SCRAPES} scrapes a phase"
    return step


def _rule_test(rule: dict, run: Run) -> dict:
    """A promtool test: the alert never firing during phase 1 and not even pending in its second half (the
    first scrapes' rates, from two or three samples of counters just created, are what `for` absorbs), and
    firing (with FIRING's labels) at some evaluation during phase 2, never where NOT_FIRING says."""
    step = _step(rule)
    name = rule["alert"]
    quiet = sum(1 for p, _ in run.scrapes if p == "quiet")
    end1, end2 = (quiet - 1) * step, (len(run.scrapes) - 1) * step
    matchers = "".join(f',{k}="{v}"' for k, v in FIRING[name].items())
    return {
        "interval": f"{step}s",
        "input_series": [{"series": k, "values": _values(v)}
                         for k, v in run.series(metric_names(rule["expr"]), step).items()],
        "promql_expr_test": [
            {"expr": f'max(max_over_time(ALERTS{{alertname="{name}",alertstate="firing"}}[{end1 + 1}s]))',
             "eval_time": f"{end1}s", "exp_samples": []},
            {"expr": f'max(max_over_time(ALERTS{{alertname="{name}"}}[{end1 // 2}s]))', "eval_time": f"{end1}s",
             "exp_samples": []},
            {"expr": f'max(max_over_time(ALERTS{{alertname="{name}",alertstate="firing"{matchers}}}[{end2 - end1 - 1}s]))',
             "eval_time": f"{end2}s", "exp_samples": [{"labels": "{}", "value": 1}]},
            *([{"expr": f'max(max_over_time(ALERTS{{alertname="{name}",{NOT_FIRING[name]}}}[{end2 + 1}s]))',
                "eval_time": f"{end2}s", "exp_samples": []}] if name in NOT_FIRING else []),
        ],
    }


def _rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_the_rules_files_pass_promtool_and_the_prometheusrule_carries_the_same_groups() -> None:
    out = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    cr = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert (cr["apiVersion"], cr["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert cr["spec"] == yaml.safe_load(RULES.read_text())
    assert PROMETHEUS_RULE.read_text() == prometheusrule.render(RULES.read_text()), \
        "kvgate-prometheusrule.yaml is stale: python -m devkit.prometheusrule"
    assert sorted(r["alert"] for r in _rules()) == sorted(FIRING)


@pytest.mark.parametrize("rule", _rules(), ids=lambda r: r["alert"])
def test_each_alert_fires_where_its_condition_was_induced_and_not_before(run: Run, rule: dict, tmp_path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "one", "rules": [rule]}]}, sort_keys=False))
    test = tmp_path / "test.yaml"
    test.write_text(yaml.safe_dump({"rule_files": [str(rules)], "evaluation_interval": "1m",
                                    "tests": [_rule_test(rule, run)]}, sort_keys=False, width=1 << 20))
    out = subprocess.run([promtool(), "test", "rules", str(test)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:] + _where_true(rule, run, tmp_path)


def _where_true(rule: dict, run: Run, tmp_path: Path) -> str:
    """For a failure's message: the rule's expression at every scrape, where it is not empty."""
    test = _rule_test(rule, run)
    step = int(test["interval"][:-1])
    test["promql_expr_test"] = [{"expr": rule["expr"], "eval_time": f"{i * step}s", "exp_samples": []}
                                for i in range(len(run.scrapes))]
    path = tmp_path / "where.yaml"
    path.write_text(yaml.safe_dump({"tests": [test]}, sort_keys=False, width=1 << 20))
    out = subprocess.run([promtool(), "test", "rules", str(path)], capture_output=True, text=True, timeout=60)
    quiet = sum(1 for p, _ in run.scrapes if p == "quiet")
    found = re.findall(r"time: (\S+),\s+exp: nil\s+got: (.*)", out.stdout)
    return f"\n{rule['alert']}, step {step} s, phase 2 from {quiet * step} s; true at:\n" + \
        "\n".join(f"{t} {got}" for t, got in found)[-4000:]


def test_every_metric_the_rules_use_is_exported(run: Run) -> None:
    exported = run.exported_names("kvgate") | run.exported_names("kvgate-tls") | run.exported_names("vllm")
    for rule in _rules():
        assert metric_names(rule["expr"]) <= exported, (rule["alert"], metric_names(rule["expr"]) - exported)


# --- the dashboard -------------------------------------------------------------------------------

PROMETHEUS_OWN = {"up"}  # series Prometheus makes itself
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count", ""),
            "gauge": ("",), "info": ("_info",), "unknown": ("",)}


def registry_names() -> set[str]:
    """The series names of every metrics object kvgate's packages define, on a registry of their own:
    what a kvgate exports in some configuration or other."""
    from kvcache.index import PrefixIndex
    from kvcache.metrics import IndexCollector, KVEventMetrics
    from plugin.metrics import GatewayMetrics
    from plugin.observe import ObserveMetrics
    from routing.learning.profiles import EngineProfiles
    from routing.metrics import AdmissionCollector, CostModelCollector, RoutingMetrics
    from routing.state.admission import Admission, LocalLimiter
    from tokenizer.cache import CacheMetrics
    from tokenizer.remote import RemoteMetrics
    from tokenizer.verified import VerifyMetrics
    registry = CollectorRegistry()
    for metrics in (GatewayMetrics, ObserveMetrics, RoutingMetrics, KVEventMetrics, RemoteMetrics, VerifyMetrics,
                    CacheMetrics):
        metrics(registry)
    IndexCollector(PrefixIndex(16).stats, registry)
    AdmissionCollector(Admission(LocalLimiter(), max_running=1).stats, 1, registry)
    CostModelCollector(EngineProfiles(), lambda: (), registry)
    return {f.name + suffix for f in registry.collect() for suffix in SUFFIXES[f.type]}


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable (label_values(SELECTOR, label))."""
    out = []

    def walk(panels: list[dict]) -> None:
        for p in panels:
            out.extend((f"panel {p['title']!r} {t['refId']}", t["expr"]) for t in p.get("targets", []))
            walk(p.get("panels", []))
    walk(dashboard["panels"])
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = re.fullmatch(r"label_values\((.+),\s*\w+\)", query.strip())
            assert m, f"variable {v['name']}: {query}"
            out.append((f"variable {v['name']}", m.group(1)))
    return out


def unknown_metrics(dashboard: dict, exported: set[str]) -> dict[str, list[str]]:
    """Metric name -> where the dashboard uses it, for every name not in `exported`."""
    unknown: dict[str, list[str]] = {}
    for where, expr in dashboard_queries(dashboard):
        for name in sorted(metric_names(expr) - exported - PROMETHEUS_OWN):
            unknown.setdefault(name, []).append(where)
    return unknown


def _grafana_free(expr: str) -> str:
    """The expression with Grafana's variables replaced by what Prometheus would get."""
    expr = expr.replace("$__rate_interval", "5m").replace("$__interval", "1m").replace("$__range", "1h")
    return re.sub(r"\$\{?\w+\}?", ".*", expr)


def test_the_dashboard_is_importable_with_its_datasource_a_variable(tmp_path) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids, titles = [], []

    def walk(panels: list[dict]) -> None:
        for p in panels:
            ids.append(p["id"])
            assert set(p["gridPos"]) == {"h", "w", "x", "y"}, p["title"]
            if p["type"] != "row":
                titles.append(p["title"])
                assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
                assert p["targets"] and all(t["datasource"] == p["datasource"] for t in p["targets"]), p["title"]
            walk(p.get("panels", []))
    walk(dashboard["panels"])
    assert len(ids) == len(set(ids)) and len(titles) == len(set(titles))
    cells: dict[tuple[int, int], str] = {}  # no two panels on one cell of Grafana's 24-column grid
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, (p["title"], cells.get((x, y)))
                cells[(x, y)] = p["title"]
    # every expression parses: promtool checks them as recording rules
    queries = dashboard_queries(dashboard)
    rules = tmp_path / "dashboard.yaml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:q{i}", "expr": _grafana_free(expr)} for i, (_, expr) in enumerate(queries)]}]}))
    out = subprocess.run([promtool(), "check", "rules", str(rules)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    # what the issue asks it to show
    text = json.dumps(dashboard)
    for shown in ("kvgate_routed_requests_total", "vllm:prefix_cache_hits_total", "kvgate_request_ttft_seconds_bucket",
                  "kvgate_request_tpot_seconds_bucket", "kvgate_kvevents_missed_batches_total",
                  "kvgate_tokenize_seconds_bucket", "kvgate_tokenizer_fallbacks_total", "kvgate_request_errors_total",
                  "kvgate_counts_redis_up", "kvgate_index_max_entries", "kvgate_admission_wait_seconds_total",
                  "kvgate_grpc_protocol_errors_total", "kvgate_cost_model_prefill_tokens_per_second",
                  "kvgate_cost_model_ttft_overhead_seconds", "kvgate_cost_model_ttft_error_seconds"):
        assert shown in text, shown


# Panels with nothing to show in this run, and why (any other query must return series). A labelled counter has
# no series until its first event, and these events do not happen here.
EMPTY_HERE = {
    "panel 'Load guard and scorer errors' A": "no pod is set aside by the load guard",
    "panel 'Load guard and scorer errors' B": "no scorer fails",
    "panel 'Event gaps' A": "no event batch is missed",
    "panel 'Event gaps' B": "no replay fails",
    "panel 'Event gaps' C": "no engine state is dropped",
    "panel 'Event gaps' D": "no batch comes twice",
    "panel 'Events and reconnections' C": "no event fails to decode",
    "panel 'Events and reconnections' D": "no event is skipped",
    "panel 'Tokenizer paths and fallbacks' B": "the tokenizer never fails over to load-only routing",
    "panel 'Errors by status and code' A": "no request fails",
    "panel 'Discovery' B": "the pods file is never refused",
    "panel 'Index skips' A": "the index skips nothing",
}


def test_every_dashboard_query_returns_series_from_a_real_prometheus_and_every_rule_evaluates(run: Run) -> None:
    """Each panel's and variable's query (Grafana's variables as Prometheus gets them: every job) asked of a real
    Prometheus that scraped the stack throughout: none fails, and each returns series but those EMPTY_HERE names
    (a label or metric misspelt, a selector no series matches, a vector match that fails on real labels all show
    here, where promtool's syntax check passes them). And Prometheus evaluated every rule without an error."""
    if run.prometheus is None:
        pytest.skip("prometheus not installed (Debian package prometheus; ./dev setup installs it)")
    failed, empty = {}, set()
    for where, expr in dashboard_queries(json.loads(DASHBOARD.read_text())):
        answer = httpx.get(run.prometheus + "/api/v1/query", params={"query": _grafana_free(expr)}, timeout=10).json()
        if answer["status"] != "success":
            failed[where] = answer.get("error")
        elif not answer["data"]["result"]:
            empty.add(where)
    assert failed == {}
    assert empty == set(EMPTY_HERE), {"empty, not expected": empty - set(EMPTY_HERE),
                                      "expected empty, has series": set(EMPTY_HERE) - empty}
    groups = httpx.get(run.prometheus + "/api/v1/rules", timeout=10).json()["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert sorted(r["name"] for r in rules) == sorted(FIRING)
    assert all(r["health"] == "ok" for r in rules), [(r["name"], r.get("lastError")) for r in rules]


def test_every_metric_the_dashboard_uses_is_one_kvgate_or_the_engines_export(run: Run) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    served = run.exported_names("kvgate")
    assert registry_names() <= served, f"defined but not served by the test's kvgates: {registry_names() - served}"
    # the TLS replica's: kvgate exports the certificate's expiry only with KVGATE_GRPC_TLS on
    exported = served | registry_names() | run.exported_names("kvgate-tls") | run.exported_names("vllm")
    assert unknown_metrics(dashboard, exported) == {}
    # a metric renamed on either side fails it
    renamed = json.loads(DASHBOARD.read_text().replace("kvgate_index_max_entries", "kvgate_index_entries_max"))
    assert list(unknown_metrics(renamed, exported)) == ["kvgate_index_entries_max"]
    assert unknown_metrics(dashboard, exported - {"vllm:prefix_cache_queries_total"}).keys() == \
        {"vllm:prefix_cache_queries_total"}
