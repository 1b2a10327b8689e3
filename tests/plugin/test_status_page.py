"""The status page (`/`) in a real headless browser (Debian's chromium, driven over the DevTools protocol),
and `kvgate status` against the same running replicas: two `kvgate serve` sharing counts through Redis, two
simulated engines, Envoy in front of the first replica.

The page loads with no console error or exception; every number it shows from /debug (`data-path`, `data-v`)
equals /debug's at the same moment, and its routed totals equal /metrics'; it fits a phone's width. Screenshots
at laptop and phone sizes are written to $TEST_ARTIFACTS_DIR/status-page when set, else to a pytest tmp dir
(the path is printed)."""
from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest

from devkit.stack import Stack, wait_for_readiness
from plugin import cli, status_cmd
from plugin.statusview import build_view, render_text
from tests.helpers import (Clock, GatewayEnv, envoy_pool, free_port, free_ports, refused_port, start_kvgate,
                           stack_fixture, wait_until)

pytestmark = pytest.mark.integration

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
TOKENIZER = str(Path(__file__).resolve().parents[2] / "tokenizer" / "testdata")
MODEL = "demo-model"


class Env(GatewayEnv):
    def __init__(self, stack: Stack):
        super().__init__(stack)
        _, self.redis_url = stack.redis()
        # Everything starts at once (each process takes seconds to import its libraries), then is waited for:
        # kvgate reconnects to the engines' events within KVGATE_KV_EVENTS_BACKOFF_MIN_S once they listen.
        ports = free_ports(6)
        self.pods = [{"name": f"sim{i}", "address": "127.0.0.1", "port": ports[3 * i], "model": MODEL,
                      "kv_events": {"pub_port": ports[3 * i + 1], "replay_port": ports[3 * i + 2]}} for i in range(2)]
        sims = [stack.sim(name=p["name"], port=p["port"], model=MODEL, kv_events_port=p["kv_events"]["pub_port"],
                          replay_port=p["kv_events"]["replay_port"], extra=["--tpot-ms", "1", "--ttft-overhead-ms", "1"],
                          wait=False) for p in self.pods]
        self.pods_file = stack.pods_file(self.pods)
        common = {"KVGATE_REDIS_URL": self.redis_url, "KVGATE_TOKENIZER_PATH": TOKENIZER,
                  "KVGATE_OBSERVE_SAMPLE": "1", "KVGATE_ENGINE_METRICS_INTERVAL_S": "0.2",
                  "KVGATE_KV_EVENTS_BACKOFF_MIN_S": "0.1",
                  "KVGATE_ADMISSION_MAX_RUNNING": "1000"}  # never reached: the page's admission rows shown
        gates = [start_kvgate(stack, self.pods_file, {**common, "KVGATE_GATEWAY_ID": gid}, name=name, wait=False)
                 for gid, name in (("gw-a", "kvgate"), ("gw-b", "kvgate-b"))]
        self.listen = free_port()
        self.envoy = stack.envoy(listen_port=self.listen, extproc_port=gates[0].grpc_port, pool=envoy_pool(self.pods))
        for proc, pod in zip(sims, self.pods):
            stack.ready(proc, ("127.0.0.1", pod["port"]))
        for gate in gates:
            wait_for_readiness("127.0.0.1", gate.grpc_port, timeout=30, proc=gate.proc.popen, name=gate.proc.name,
                               log_path=gate.proc.log_path)
        self.kvgate, self.other = gates[0].proc, gates[1]
        self.http_port = gates[0].http_port
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.listen}", timeout=30)
        self.on_close(self.client.close)
        self.urls = [f"http://127.0.0.1:{self.http_port}", f"http://127.0.0.1:{self.other.http_port}"]
        for i in range(12):  # conversations sharing a system prompt: prefix hits and misses
            body = {"model": MODEL, "prompt": "You are a careful assistant who answers briefly. " * 6 + f"Q{i % 3}?",
                    "max_tokens": 2}
            assert self.client.post("/v1/completions", json=body).status_code == 200
        for i in range(4):  # the slo strategy's predictions, observed (streamed: a first token): engine profiles
            body = {"model": MODEL, "prompt": f"Summarise item {i} of the list.", "max_tokens": 8, "stream": True}
            assert self.client.post("/v1/completions", json=body, headers={"routing-strategy": "slo"}).status_code == 200
        assert self.client.post("/v1/completions", json={"model": "no-such-model", "prompt": "x"}).status_code == 404
        wait_until(lambda: self._settled(), interval=0.5, what="engine prefix cache counters, profiles, the other replica, idle engines in /debug",
                   detail=lambda: {k: self.debug()[k] for k in ("routing_mix", "counts", "in_flight_here", "profiles")})

    def _settled(self) -> bool:
        """The engines' counters in, the profiles learned, the other replica seen, nothing running, and the
        engines' numbers unchanged since the last poll (more than a scrape interval ago)."""
        d = self.debug()
        m = d["routing_mix"]["models"].get(MODEL, {})
        seen = json.dumps([d["routing_mix"]["models"], [p.get("engine", {}).get("running") for p in d["pods"]]])
        same, self._seen = seen == getattr(self, "_seen", None), seen
        return (same and m.get("engine_queries", 0) > 0 and d["counts"].get("other_gateways") == 1 and d["in_flight_here"] == 0
                and bool(d["profiles"]) and all((p.get("engine") or {}).get("running", 1) == 0 for p in d["pods"]))

    def debug(self, url: str | None = None) -> dict:
        return httpx.get(f"{url or self.urls[0]}/debug", timeout=5).json()

    def metrics(self) -> str:
        return httpx.get(f"{self.urls[0]}/metrics", timeout=5).text


env = stack_fixture(Env)


# --- a DevTools protocol client (aiohttp's websocket on a loop of its own) -----------------------------

class Browser:
    """One headless chromium and one page of it; `page(method, **params)` sends a DevTools command."""

    def __init__(self) -> None:
        assert CHROMIUM is not None
        self.profile = tempfile.mkdtemp(prefix="kvgate-chromium-")
        args = [CHROMIUM, "--headless=new", "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1",
                f"--user-data-dir={self.profile}", "--no-first-run", "--no-default-browser-check", "--disable-gpu",
                "--disable-extensions", "--disable-background-networking", "--hide-scrollbars", "about:blank"]
        if os.geteuid() == 0:
            args.insert(1, "--no-sandbox")  # chromium refuses to run as root with its sandbox
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        self.loop = asyncio.new_event_loop()
        self.events: list[dict] = []
        self._id = 0
        self._waiting: dict[int, asyncio.Future] = {}
        self.connected = False

    def connect(self) -> None:
        """Once chromium listens (it starts while the stack does): a page to drive."""
        if self.connected:
            return
        port_file = Path(self.profile) / "DevToolsActivePort"
        wait_until(lambda: port_file.exists() and len(port_file.read_text().split()) >= 2, timeout=30,
                   what="chromium's DevToolsActivePort")
        self.port = int(port_file.read_text().split()[0])
        self.loop.run_until_complete(self._open())
        self.connected = True

    async def _open(self) -> None:
        self.session = aiohttp.ClientSession()
        async with self.session.put(f"http://127.0.0.1:{self.port}/json/new?about:blank") as r:
            target = await r.json()
        self.ws = await self.session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0)
        self.reader = asyncio.ensure_future(self._read())
        for domain in ("Page", "Runtime", "Log"):
            await self._send(f"{domain}.enable")

    async def _read(self) -> None:
        async for msg in self.ws:
            data = json.loads(msg.data)
            if "id" in data:
                fut = self._waiting.pop(data["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result(data)
            else:
                self.events.append(data)

    async def _send(self, method: str, **params: Any) -> dict:
        self._id += 1
        fut = self._waiting[self._id] = self.loop.create_future()
        await self.ws.send_json({"id": self._id, "method": method, "params": params})
        reply = await asyncio.wait_for(fut, 30)
        assert "error" not in reply, (method, reply["error"])
        return reply.get("result", {})

    def page(self, method: str, **params: Any) -> dict:
        self.connect()
        return self.loop.run_until_complete(self._send(method, **params))

    def load(self, url: str) -> None:
        """Navigate to `url` and return once its load event fired."""
        self.connect()
        async def go() -> None:
            n = len(self.events)
            await self._send("Page.navigate", url=url)
            deadline = time.monotonic() + 30
            while not any(e.get("method") == "Page.loadEventFired" for e in self.events[n:]):
                assert time.monotonic() < deadline, "the page did not load within 30 s"
                await asyncio.sleep(0.02)
        self.loop.run_until_complete(go())

    def evaluate(self, expression: str) -> Any:
        result = self.page("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    def problems(self) -> list[dict]:
        """Console errors, uncaught exceptions and error log entries seen so far."""
        bad = []
        for e in self.events:
            m, p = e.get("method"), e.get("params", {})
            if m == "Runtime.exceptionThrown" or (m == "Runtime.consoleAPICalled" and p.get("type") in
                                                  ("error", "assert")) or \
                    (m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error"):
                bad.append(e)
        return bad

    def screenshot(self, path: Path, width: int, height: int, mobile: bool) -> None:
        self.page("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=mobile)
        full = self.evaluate("document.documentElement.scrollHeight")
        shot = self.page("Page.captureScreenshot", format="png", captureBeyondViewport=True,
                         clip={"x": 0, "y": 0, "width": width, "height": max(height, int(full)), "scale": 1})
        path.write_bytes(base64.b64decode(shot["data"]))

    def close(self) -> None:
        async def shut() -> None:
            self.reader.cancel()
            await self.ws.close()
            await self.session.close()
        try:
            if self.connected:
                self.loop.run_until_complete(shut())
        finally:
            self.loop.close()
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            shutil.rmtree(self.profile, ignore_errors=True)


@pytest.fixture(scope="module")
def browser():
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (Debian package chromium; ./dev installs it)")
    b = Browser()
    yield b
    b.close()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    given = os.environ.get("TEST_ARTIFACTS_DIR")
    path = Path(given) / "status-page" if given else tmp_path_factory.mktemp("status-page")
    path.mkdir(parents=True, exist_ok=True)
    print(f"status page screenshots in {path}")
    return path


PAGE_CELLS = """JSON.stringify([...document.querySelectorAll('[data-v]')].map(e => ({
  path: e.dataset.path ? JSON.parse(e.dataset.path) : null, metric: e.dataset.metric || null,
  labels: e.dataset.labels ? JSON.parse(e.dataset.labels) : null, v: JSON.parse(e.dataset.v), text: e.textContent})))"""

# values that move by themselves between two reads (ages, the snapshot's own time): not compared
MOVING = re.compile(r"(^|_)age_s$|^time$")
# the learned profiles decay toward their priors as time passes: compared within 5%
DRIFTING = "profiles"


def _at(d: Any, path: list) -> Any:
    for key in path:
        d = d[key]
    return d


def _metric_sum(text: str, name: str, labels: dict[str, str]) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith((name + "{", name + " ")):
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', line[len(name):line.rindex("}")])) if "{" in line else {}
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_status_page_matches_debug_and_metrics_with_no_console_errors(browser, env, artifacts):
    browser.load(f"{env.urls[0]}/?refresh=0")
    cells = json.loads(browser.evaluate(PAGE_CELLS))
    debug, metrics = env.debug(), env.metrics()
    assert not browser.problems(), browser.problems()
    checked = {"debug": 0, "metrics": 0}
    # a warning logged between the two reads (a Redis timeout on a loaded machine) shifts the recent ones
    shifted = next(c["v"] for c in cells if c["path"] == ["recent_errors", "total"]) != debug["recent_errors"]["total"]
    for c in cells:
        if shifted and c["path"] is not None and c["path"][0] == "recent_errors":
            continue
        if c["path"] is not None and not any(MOVING.search(str(k)) for k in c["path"]):
            want = _at(debug, c["path"])
            if c["path"][0] == DRIFTING and isinstance(want, float):
                want = pytest.approx(want, rel=0.05)
            assert c["v"] == want, (c, _at(debug, c["path"]))
            checked["debug"] += 1
        if c["metric"] is not None:
            assert c["v"] == _metric_sum(metrics, c["metric"], c["labels"]), c
            checked["metrics"] += 1
    assert checked["debug"] > 50 and checked["metrics"] >= 7, checked
    paths = {json.dumps(c["path"]) for c in cells if c["path"]}
    # what the page must show: the fleet, the event subscriptions, the cache share, the tokenizer, the other replica
    for want in (["pods", 1, "running"], ["pods", 0, "engine", "kv_usage"], ["subscriptions", 1, "connected"],
                 ["subscriptions", 0, "backlog"],
                 ["routing_mix", "models", MODEL, "believed_cached"], ["routing_mix", "models", MODEL, "engine_hits"],
                 ["tokenizer", "models", MODEL, "state"], ["counts", "other_gateways"], ["counts", "redis_up"]):
        assert json.dumps(want) in paths, want
    assert any(c["path"][0] == "profiles" and c["path"][-1] == "ttft_samples" for c in cells if c["path"])
    # the event lag by the batches' own timestamps: the sims publish on this machine's clock
    lags = [c["v"] for c in cells if c["path"] and c["path"][0] == "subscriptions" and c["path"][-1] == "lag_s"]
    measured = [lag for lag in lags if lag is not None]  # None: no live batch from that engine yet
    assert measured and all(0 <= lag < 5 for lag in measured), lags
    # the believed blocks over the window are every block this replica routed (the run is shorter than it)
    models = debug["routing_mix"]["models"]
    assert sum(m["believed_cached"] for m in models.values()) == _metric_sum(
        metrics, "kvgate_prefix_blocks_total", {"kind": "cached"}) > 0
    assert debug["counts"]["other_gateways"] == 1
    text = browser.evaluate("document.body.innerText")
    assert "rejected:404:model_not_found" in text and "kv-sync" in text
    assert browser.evaluate("document.querySelectorAll('#mix-chart svg rect').length") >= 1


@pytest.mark.parametrize("name,width,height,mobile", [("laptop", 1366, 900, False), ("phone", 390, 844, True)])
def test_status_page_fits_laptop_and_phone(browser, env, artifacts, name, width, height, mobile):
    browser.page("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=mobile)
    browser.load(f"{env.urls[0]}/?refresh=0")
    # no sideways scrolling of the page: wide tables scroll inside their own box
    assert browser.evaluate("document.documentElement.scrollWidth") <= width
    shot = artifacts / f"status-{name}.png"
    browser.screenshot(shot, width, height, mobile)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    assert not browser.problems(), browser.problems()


def test_status_page_reloads_itself(browser, env):
    browser.load(f"{env.urls[0]}/?refresh=1")
    n = len(browser.events)
    wait_until(lambda: browser.evaluate("1") and any(e.get("method") == "Page.loadEventFired"
                                                     for e in browser.events[n:]),
               timeout=10, what="the page's own reload (refresh=1)")
    assert not browser.problems(), browser.problems()
    browser.load(f"{env.urls[0]}/?refresh=0")  # the next test's page stays put


def test_status_page_escapes_and_refreshes(env):
    page = httpx.get(f"{env.urls[0]}/", timeout=5)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<meta http-equiv="refresh" content="5">' in page.text
    assert "http-equiv" not in httpx.get(f"{env.urls[0]}/?refresh=0", timeout=5).text
    bad = httpx.get(f"{env.urls[0]}/?refresh=<b>", timeout=5)
    assert bad.status_code == 400 and "refresh" in bad.text
    # nothing from outside: no script, stylesheet or image fetched (the icon is an empty data: URL, so the
    # browser does not ask for /favicon.ico)
    assert not re.search(r"<script|<img|src=|url\(", page.text)
    assert re.findall(r"<link[^>]*>", page.text) == ['<link rel="icon" href="data:,">']


def test_kvgate_status_one_replica_and_every_replica(env, capsys, monkeypatch):
    assert cli.main(["status", "--url", env.urls[0]]) == 0
    one = capsys.readouterr().out
    assert "kvgate gw-a" in one and "sim0" in one and "sim1" in one and "Fleet:" in one
    # the table's rows are the /debug numbers: the routed count per strategy
    routed = _metric_sum(env.metrics(), "kvgate_routed_requests_total", {"strategy": "kv-sync"})
    assert re.search(rf"^\s+kv-sync\s+{int(routed)}\b", one, re.M), one
    # a Service name resolved to its addresses (here: localhost on the replicas' port) and a URL list
    assert status_cmd.main(status_cmd.parse(["--url", env.urls[0], "--url", env.urls[1]])) == 0
    both = capsys.readouterr().out
    assert "kvgate gw-a" in both and "kvgate gw-b" in both
    # the replicas side by side first: both see the same index (the engines' events)
    entries = env.debug()["index"]["entries"]
    assert re.search(rf"^  gw-a\s+{re.escape(env.urls[0])}\s+yes\s+1\s+2/2\s+0\s+0\s+{entries}\b", both, re.M), both
    assert re.search(rf"^  gw-b\s+{re.escape(env.urls[1])}\s+yes\s+\d\s+2/2\s+0\s+0\s+{entries}\b", both, re.M), both
    # a headless Service's name: its A records, one per replica (here one, the second replica's address)
    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, port, *a, **k: real(
        "127.0.0.1" if host == "kvgate-headless.test" else host, port, *a, **k))
    assert status_cmd.main(status_cmd.parse(["--service", f"kvgate-headless.test:{env.other.http_port}"])) == 0
    out = capsys.readouterr().out
    assert "kvgate gw-b" in out and "gw-a" not in out.split("\n")[0]


def test_status_page_shows_the_replicas_recent_errors(browser, env):
    """A broken pods file is logged (and the last good list kept): the page shows that line."""
    good = env.pods_file.read_text()
    try:
        env.pods_file.write_text("- name: [unclosed\n")
        wait_until(lambda: any("pod list not reloaded" in e["message"] for e in env.debug()["recent_errors"]["recent"]),
                   what="kvgate's error about the pods file")
    finally:
        env.pods_file.write_text(good)
    browser.load(f"{env.urls[0]}/?refresh=0")
    cells = json.loads(browser.evaluate(PAGE_CELLS))
    shown = [c["v"] for c in cells if c["path"] and c["path"][:2] == ["recent_errors", "recent"]
             and c["path"][-1] == "message"]
    assert any("pod list not reloaded" in m for m in shown), shown
    assert browser.evaluate("document.querySelector('#recent-warnings-and-errors td.bad').textContent") == "ERROR"
    assert not browser.problems(), browser.problems()
    wait_until(lambda: all(p["ready"] for p in env.debug()["pods"]), what="the pods back")


def test_kvgate_status_service_names_resolve_to_every_address(monkeypatch):
    records = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.12", 9090)),
               (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.11", 9090)),
               (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::1", 9090, 0, 0)),
               (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.11", 9090))]
    seen = []
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, port, *a, **k: seen.append((host, port)) or records)
    assert status_cmd.service_urls("kvgate.ns.svc:9090") == [
        "http://10.0.0.11:9090", "http://10.0.0.12:9090", "http://[fd00::1]:9090"]
    status_cmd.service_urls("kvgate.ns.svc")
    assert seen == [("kvgate.ns.svc", 9090), ("kvgate.ns.svc", 8080)]
    for bad in ("kvgate:http", "kvgate:0", ":8080"):
        with pytest.raises(ValueError, match="NAME:PORT"):
            status_cmd.service_urls(bad)
    assert status_cmd.main(status_cmd.parse([])) == 2


def test_kvgate_status_reports_an_unreachable_replica(env, capsys):
    sock, port = refused_port()
    with sock:
        dead = f"http://127.0.0.1:{port}"
        assert status_cmd.main(status_cmd.parse(["--url", env.urls[0], "--url", dead])) == 1
    out = capsys.readouterr().out
    assert "kvgate gw-a" in out and f"{dead}: unreachable" in out


def test_render_text_and_html_escape_what_they_show():
    debug = {"pods": [{"name": "<pod&>", "model": "m/<x>", "ready": True, "endpoint": "1.2.3.4:80"}],
             "recent_errors": {"total": 1, "recent": [{"time": 0, "level": "ERROR", "logger": "kvgate",
                                                         "message": "<script>alert(1)</script>"}]}}
    from plugin.statusview import render_html
    html = render_html(build_view(debug))
    assert "<script>" not in html and "&lt;script&gt;" in html and "&lt;pod&amp;&gt;" in html
    text = render_text([("http://x", build_view(debug))])
    assert "<pod&>" in text and "<script>alert(1)</script>" in text
    # an empty or partial snapshot (an older replica's /debug) renders, saying what is missing
    empty = build_view({})
    assert "no pods known" in render_html(empty) and "Fleet: (no pods known)" in render_text([("u", empty)])


def test_routing_mix_is_bounded_per_minute_and_over_minutes():
    from plugin.status import OTHER, RoutingMix
    clock = Clock(600.0)
    mix = RoutingMix(minutes=3, max_keys=4, clock=clock)
    for i in range(10):
        mix.record(f"s{i}", "prefix-hit", "m", matched_blocks=1, total_blocks=2)
    snap = mix.snapshot()
    assert snap["minutes"] == [{"start": 600, "requests": {**{f"s{i}/prefix-hit": 1 for i in range(4)},
                                                           f"{OTHER}/{OTHER}": 6}}]
    assert snap["models"]["m"]["believed_cached"] == 10 and snap["models"]["m"]["believed_total"] == 20
    for _ in range(5):  # five more minutes: only the last three are kept
        clock.t += 60
        mix.record("kv-sync", "prefix-miss", "m", 0, 3)
    snap = mix.snapshot()
    assert [m["start"] for m in snap["minutes"]] == [780, 840, 900]
    assert snap["models"]["m"] == {"believed_cached": 0, "believed_total": 9, "engine_queries": 0.0,
                                   "engine_hits": 0.0}


def test_routing_mix_engine_counters_over_the_window_survive_a_restart():
    from plugin.status import RoutingMix
    clock = Clock(0.0)
    mix = RoutingMix(minutes=5, clock=clock)
    mix.engine("a", "m", 100, 40)
    mix.engine("a", "m", 150, 60)  # same minute: the first and the last are kept
    clock.t += 60
    mix.engine("a", "m", 300, 100)
    mix.engine("b", "m", 50, 10)
    assert mix.snapshot()["models"]["m"]["engine_queries"] == 200 and mix.snapshot()["models"]["m"]["engine_hits"] == 60
    clock.t += 60
    mix.engine("a", "m", 20, 5)  # engine a restarted: its counters began again
    m = mix.snapshot()["models"]["m"]
    assert (m["engine_queries"], m["engine_hits"]) == (20, 5)


def test_recent_errors_keeps_the_last_warnings_of_any_logger():
    import logging
    from plugin.status import RecentErrors
    handler = RecentErrors(size=3)
    log = logging.getLogger("kvgate.test-status")
    log.addHandler(handler)
    try:
        log.info("not kept")
        for i in range(5):
            log.warning("warning %d", i)
        try:
            raise OSError("disk")
        except OSError:
            log.exception("failed %s", "x")
    finally:
        log.removeHandler(handler)
    snap = handler.snapshot()
    assert snap["total"] == 6
    assert [e["message"] for e in snap["recent"]] == ["failed x (OSError: disk)", "warning 4", "warning 3"]
    assert snap["recent"][0]["level"] == "ERROR" and snap["recent"][0]["logger"] == "kvgate.test-status"


def test_engine_prefix_cache_counters_are_read_from_the_scrape():
    from routing.state.engine_metrics import parse_engine_metrics
    text = ("# TYPE vllm:prefix_cache_queries counter\n"
            'vllm:prefix_cache_queries_total{engine="0"} 100\nvllm:prefix_cache_queries_total{engine="1"} 50\n'
            "# TYPE vllm:prefix_cache_hits counter\n"
            'vllm:prefix_cache_hits_total{engine="0"} 30\nvllm:prefix_cache_hits_total{engine="1"} 20\n'
            'vllm:num_requests_waiting{engine="0"} 1\nvllm:num_requests_waiting{engine="1"} 2\n')
    assert parse_engine_metrics(text).prefix_cache == (150, 50)
    assert parse_engine_metrics("vllm:num_requests_waiting 1\n").prefix_cache is None
