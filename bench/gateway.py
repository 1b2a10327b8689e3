"""`kvgate bench gateway`: what kvgate costs on the request path, through a real Envoy.

Three gateways in one run, same upstream, same request, measured in alternating rounds:
- `kvsync`: Envoy -> `kvgate serve` with the kv-sync strategy (local tokenizer, cache
  warm, the prefix index holding the prompt's blocks from a simulated engine's events);
- `noop`: Envoy -> a no-op Python ext_proc that names a fixed upstream (bench.noop_processor);
- `envoy_only`: Envoy without ext_proc.
The upstream is an Envoy answering every request directly (no engine work), so the
numbers are the gateways' own. Load from `wrk` (Debian package): requests/s at 16
connections, and p50/p99 latency at 1 connection, from which the added latency of a
processor is its p50/p99 minus Envoy-only's. Also, at 16 connections, each processor's own
CPU time per request (user + system, from /proc on Linux): what its Python code costs, apart
from Envoy's and wrk's share of the two cores.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from plugin.stack import Stack, StackError, find_envoy, free_port, render_envoy_config
from tokenizer import testdata

MODEL = "bench-model"
_SYSTEM = " ".join(["You are a careful assistant that answers questions about caches and routing."] * 40)
BODY = {"model": MODEL, "max_tokens": 8, "messages": [
    {"role": "system", "content": _SYSTEM},
    {"role": "user", "content": "How does prefix caching reduce time to first token?"}]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--seconds", type=float, default=5.0, help="seconds per measurement (default 5)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per gateway (default 3)")
    p.add_argument("--pods", type=int, default=4, help="pods kvgate chooses among (default 4)")
    p.add_argument("--observe", choices=("on", "off"), default="on",
                   help="kvgate watches responses (KVGATE_OBSERVE_RESPONSES; default on, as shipped)")


def _upstream_config(ports: list[int], admin: int) -> dict:
    # an engine's non-streamed answer: JSON with usage (kvgate watches it, as it would vLLM's)
    body = json.dumps({"id": "bench", "object": "chat.completion", "choices": [],
                       "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13}})
    listeners = []
    for i, port in enumerate(ports):
        listeners.append({
            "name": f"up{i}", "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "filter_chains": [{"filters": [{
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3"
                             ".HttpConnectionManager",
                    "stat_prefix": f"up{i}",
                    "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [{
                        "match": {"prefix": "/"},
                        "direct_response": {"status": 200, "body": {"inline_string": body}},
                        "response_headers_to_add": [{"header": {"key": "content-type",
                                                                "value": "application/json"}}]}]}]},
                    "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]}}]}]})
    return {"admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
            "static_resources": {"listeners": listeners}}


def _envoy_only_config(listen: int, admin: int, upstream: int) -> dict:
    config = render_envoy_config(listen_port=listen, admin_port=admin, extproc_port=1,
                                 pool=[("127.0.0.1", upstream)])
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != "envoy.filters.http.ext_proc"]
    for route in hcm["route_config"]["virtual_hosts"][0]["routes"]:
        route["route"] = {"cluster": "pool", "timeout": "0s"}
    return config


def _start_envoy(stack: Stack, name: str, config: dict, port: int) -> None:
    path = stack.workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    stack.start(name, [find_envoy(), "-c", str(path), "--concurrency", "1", "--log-level", "warning",
                       "--disable-hot-restart"], ready_port=("127.0.0.1", port), ready_timeout=60)


_LUA = """wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [[{body}]]
"""


def _wrk(url: str, script: Path, connections: int, seconds: float) -> dict:
    argv = ["wrk", "-t", "1", "-c", str(connections), "-d", f"{max(1, round(seconds))}s", "--latency", "-s", str(script),
            url + "/v1/chat/completions"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 30)
    parsed = parse_wrk(proc.stdout)
    if parsed is None:
        raise StackError(f"wrk failed (status {proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}")
    return parsed


def parse_wrk(out: str) -> dict | None:
    """wrk's report (with --latency): requests/s, requests done, p50/p99 in ms, errors; None without a rate."""
    found = re.search(r"Requests/sec:\s+([\d.]+)", out)
    if not found:
        return None
    done = re.search(r"(\d+) requests in", out)
    lat = {}
    for q, value, unit in re.findall(r"^\s+(50|99)%\s+([\d.]+)(us|ms|s)\s*$", out, re.M):
        lat[q] = float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errors = re.search(r"Socket errors:.*", out)
    return {"rps": float(found.group(1)), "requests": int(done.group(1)) if done else 0,
            "p50_ms": lat.get("50"), "p99_ms": lat.get("99"),
            "non_2xx": int(non2xx.group(1)) if non2xx else 0, "socket_errors": errors.group(0) if errors else ""}


def _cpu_s(pid: int) -> float | None:
    """User + system CPU seconds a process has used (Linux /proc), None where unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def run(seconds: float, rounds: int, n_pods: int, log, observe: bool = True) -> dict:
    if not shutil.which("wrk"):
        raise StackError("wrk not found: install the Debian package wrk (./dev setup does)")
    with Stack() as stack:
        up_ports = [free_port() for _ in range(n_pods)]
        _start_envoy(stack, "upstream", _upstream_config(up_ports, free_port()), up_ports[-1])
        # A simulated engine whose KV events stand for pod 0's cache: the index then holds the prompt.
        sim_port, pub, replay = free_port(), free_port(), free_port()
        stack.sim(name="events", port=sim_port, model=MODEL, kv_events_port=pub, replay_port=replay)
        pods = [{"name": f"pod{i}", "address": "127.0.0.1", "port": p, "model": MODEL} for i, p in enumerate(up_ports)]
        pods[0]["kv_events"] = {"pub_port": pub, "replay_port": replay}
        pods_file = stack.pods_file(pods)
        grpc_port, http_port = free_port(), free_port()
        kvgate = stack.kvgate(env={"KVGATE_PODS_FILE": str(pods_file), "KVGATE_GRPC_PORT": str(grpc_port),
                          "KVGATE_HTTP_PORT": str(http_port), "KVGATE_ROUTING_STRATEGY": "kv-sync",
                          "KVGATE_TOKENIZER": "local", "KVGATE_TOKENIZER_PATH": str(testdata.path()),
                          "KVGATE_LOG_LEVEL": "warning",
                          "KVGATE_OBSERVE_RESPONSES": "true" if observe else "false"}, grpc_port=grpc_port)
        noop_port = free_port()
        noop = stack.start("noop", [sys.executable, "-m", "bench.noop_processor", str(noop_port),
                                    f"127.0.0.1:{up_ports[0]}"], ready_port=("127.0.0.1", noop_port))
        pids = {"kvsync": kvgate.popen.pid, "noop": noop.popen.pid}
        gateways = {}
        for name, ext in (("kvsync", grpc_port), ("noop", noop_port)):
            port = free_port()
            stack.envoy(listen_port=port, extproc_port=ext, pool=[("127.0.0.1", p) for p in up_ports], name=name)
            gateways[name] = f"http://127.0.0.1:{port}"
        port = free_port()
        _start_envoy(stack, "envoy_only", _envoy_only_config(port, free_port(), up_ports[0]), port)
        gateways["envoy_only"] = f"http://127.0.0.1:{port}"

        # Warm up: the engine caches the prompt and publishes it; kvgate's tokenizer cache fills.
        httpx.post(f"http://127.0.0.1:{sim_port}/v1/chat/completions", json=BODY, timeout=30).raise_for_status()
        for url in gateways.values():
            for _ in range(20):
                httpx.post(url + "/v1/chat/completions", json=BODY, timeout=30).raise_for_status()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            metrics = httpx.get(f"http://127.0.0.1:{http_port}/metrics", timeout=5).text
            r = httpx.post(gateways["kvsync"] + "/v1/chat/completions", json=BODY, timeout=30)
            if r.headers.get("x-kvgate-pod") == "pod0" and _metric(metrics, "kvgate_prefix_blocks_total",
                                                                   kind="cached") > 0:
                break
            time.sleep(0.2)
        else:
            raise StackError("kvgate never matched the prompt's blocks: the kv-sync path is not being measured")

        script = stack.workdir / "post.lua"
        script.write_text(_LUA.format(body=json.dumps(BODY)))
        samples: dict[str, dict[str, list]] = {g: {"rps": [], "p50_ms": [], "p99_ms": [], "errors": [], "cpu_us": []}
                                               for g in gateways}
        for rnd in range(rounds):
            for name, url in gateways.items():
                pid = pids.get(name)
                before = _cpu_s(pid) if pid else None
                hi = _wrk(url, script, 16, seconds)
                after = _cpu_s(pid) if pid else None
                lo = _wrk(url, script, 1, seconds)
                s = samples[name]
                if before is not None and after is not None and hi["requests"]:
                    s["cpu_us"].append((after - before) / hi["requests"] * 1e6)
                s["rps"].append(hi["rps"])
                s["p50_ms"].append(lo["p50_ms"])
                s["p99_ms"].append(lo["p99_ms"])
                s["errors"].append(hi["non_2xx"] + lo["non_2xx"])
                log(f"  round {rnd + 1}/{rounds} {name:<10} {hi['rps']:8.0f} req/s @16  "
                    f"p50 {lo['p50_ms']:.2f} ms  p99 {lo['p99_ms']:.2f} ms @1")
        metrics = httpx.get(f"http://127.0.0.1:{http_port}/metrics", timeout=5).text
        cached = _metric(metrics, "kvgate_prefix_blocks_total", kind="cached")
        total = _metric(metrics, "kvgate_prefix_blocks_total", kind="total")

    med = {g: {k: statistics.median(v) if v else None for k, v in s.items() if k != "errors"}
           | {"errors": sum(s["errors"])} for g, s in samples.items()}
    base = med["envoy_only"]
    out = {
        "kvsync_rps": round(med["kvsync"]["rps"], 1), "noop_rps": round(med["noop"]["rps"], 1),
        "envoy_only_rps": round(base["rps"], 1),
        "kvsync_over_noop_rps": round(med["kvsync"]["rps"] / med["noop"]["rps"], 3),
        # the same ratio round by round (the two measured back to back), for the spread
        "kvsync_over_noop_rps_per_round": [round(a / b, 3) for a, b in zip(samples["kvsync"]["rps"],
                                                                           samples["noop"]["rps"])],
        "kvsync_cpu_us_per_request": _round(med["kvsync"]["cpu_us"], 1),
        "noop_cpu_us_per_request": _round(med["noop"]["cpu_us"], 1),
        "kvsync_p50_ms": round(med["kvsync"]["p50_ms"], 3), "noop_p50_ms": round(med["noop"]["p50_ms"], 3),
        "envoy_only_p50_ms": round(base["p50_ms"], 3),
        "kvsync_added_p50_ms": round(med["kvsync"]["p50_ms"] - base["p50_ms"], 3),
        "kvsync_added_p99_ms": round(med["kvsync"]["p99_ms"] - base["p99_ms"], 3),
        "noop_added_p50_ms": round(med["noop"]["p50_ms"] - base["p50_ms"], 3),
        "noop_added_p99_ms": round(med["noop"]["p99_ms"] - base["p99_ms"], 3),
        "errors": {g: m["errors"] for g, m in med.items()},
        "prefix_blocks_cached_fraction": round(cached / total, 3) if total else 0.0,
        "rounds": rounds, "seconds": seconds, "pods": n_pods, "observe_responses": observe,
    }
    return out


def _round(v: float | None, digits: int) -> float | None:
    return None if v is None else round(v, digits)


def table(r: dict) -> str:
    rows = [f"{'gateway':<12} {'req/s @16':>10} {'p50 @1 ms':>10} {'added p50':>10} {'added p99':>10}",
            f"{'envoy only':<12} {r['envoy_only_rps']:>10.0f} {r['envoy_only_p50_ms']:>10.2f} {'-':>10} {'-':>10}",
            f"{'noop proc':<12} {r['noop_rps']:>10.0f} {r['noop_p50_ms']:>10.2f} {r['noop_added_p50_ms']:>10.2f} "
            f"{r['noop_added_p99_ms']:>10.2f}",
            f"{'kv-sync':<12} {r['kvsync_rps']:>10.0f} {r['kvsync_p50_ms']:>10.2f} {r['kvsync_added_p50_ms']:>10.2f} "
            f"{r['kvsync_added_p99_ms']:>10.2f}",
            f"kv-sync / noop throughput: {r['kvsync_over_noop_rps']:.2f} (target >= 0.80); "
            f"added p50 {r['kvsync_added_p50_ms']:.2f} ms (target <= 1.5); "
            f"prompt blocks found cached: {r['prefix_blocks_cached_fraction']:.0%}",
            f"per round: {', '.join(f'{x:.2f}' for x in r['kvsync_over_noop_rps_per_round'])}"]
    if r.get("kvsync_cpu_us_per_request") is not None and r.get("noop_cpu_us_per_request") is not None:
        rows.append(f"processor CPU per request @16: kv-sync {r['kvsync_cpu_us_per_request']:.0f} us, "
                    f"no-op {r['noop_cpu_us_per_request']:.0f} us")
    return "\n".join(rows)


def main(args: argparse.Namespace) -> int:
    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        result = run(args.seconds, args.rounds, args.pods, log, observe=args.observe == "on")
    except StackError as e:
        print(f"kvgate bench gateway: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result) if args.json else table(result), flush=True)
    return 0
