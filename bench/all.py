"""`kvgate bench all`: every benchmark, one after another, written to docs/BENCHMARKS.md
with the commands, the machine and the date.

Each benchmark runs as its own `kvgate bench NAME --json` process (one at a time: the
machine has two cores), and its JSON is rendered here as tables.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# name, extra arguments, what the targets are (from the issues)
BENCHES: tuple[tuple[str, list[str], str], ...] = (
    ("index", ["--churn-entries", "4000000"],
     "ingest >= 1M blocks/s (into an index tracking 512 pod-ranks); at 64 and at 512 pods (1M entries, side by side): "
     "match p99 <= 200 us (8k tokens, every pod a candidate), <= 64 bytes/entry; the 512-pod fleet built and measured "
     "in under 2 minutes; longest single index call (apply, evict, stats, match, drop, remove_pod) under churn at "
     "4M entries <= 2 ms (the median of 3 churn passes' longest; the longest of all beside it)"),
    ("tokenizer", [], "cached remote path >= 3x cheaper than cold"),
    ("routing", [], "in every workload W1-W5 and W7-W10 (W3 eviction pressure, W4 cache flushes, W5 an engine "
                    "joining, W8-W10 model shapes and request keys) and "
                    "behind 1 and 2 gateway replicas: kv-sync's hit rate >= the best other policy's (char-tree, "
                    "prefix-cache, least-request, round-robin, random) + 3 points, or >= the oracle's - 1 point, and "
                    "kv-sync's TTFT p90 <= the best other policy's; kv-sync within 3 points of the oracle in every "
                    "workload (and within 5 on W1, W2); on W1 kv-sync TTFT p90 >= 20x better than random and >= 3x "
                    "better than prefix-cache, with 500 ms delay + 1% loss >= 2x better than prefix-cache. W7 (a "
                    "data-parallel engine): kv-sync routed to the rank no worse than kv-sync@no-rank on hit rate "
                    "and TTFT p90. W6 (SLO mix, each request with TTFT and TPOT targets, 80% of fleet capacity): "
                    "slo's SLO attainment >= kv-sync's + 10 points and >= least-request's + 25 points; output "
                    "prediction median |log2 bucket error| <= 1 once warm. W8-W10 (W3 on a gpt-oss-like hybrid "
                    "model with sparse retention, with per-user cache_salt, with images), chat targets as W3 and: "
                    "kv-sync's believed cached share within 2 points of the engines' hit rate; kv-sync recovers "
                    ">= 85% of the round-robin -> one-engine ceiling hit-rate gap. Rows without @Ngw run behind 2 "
                    "replicas, the deployment kvgate ships"),
    ("gateway", [], "issue 14: kv-sync added p50 at 1 connection <= 1.0 ms over direct, warm and cold prompts; "
                    "kvgate CPU per routed request (its share of event following included) <= 1.2x the no-op "
                    "processor's; throughput through Envoy >= 90% of the no-op processor's. Also 1 vs 2 "
                    "replicas on this node (issue 14 item 6)"),
    ("path", [], "issue 26: time to first token of streamed chats through the shipped stack (Envoy, 2 kvgate replicas, "
                 "Redis, kv-sync), one request at a time, <= 1.5 ms over straight to the engine at p50; the no-op "
                 "processor's and Envoy's own added time beside it, and 8 at once; then the processors alone (Envoy answering "
                 "the chat itself after ext_proc: no-op vs kvgate, added time and CPU per request)"),
    ("watch", [], "issue 26 item 3: watching a response need not hold it: on the watched routes (one message, the "
                  "response read from a stream of its own that Envoy never waits on) TTFT and TPOT as unwatched "
                  "responses', side by side with watching in the request's own stream; kvgate CPU per request beside"),
    ("bakeoff", [], "issue 26, on the live stack: kvgate as shipped (Envoy, 2 replicas, Redis) against SGLang's model "
                    "gateway (cache_aware, its defaults) on the same 3 simulated engines, a multi-turn chat (Zipf "
                    "tenants, ~1,200-token system prompts, 2-4 turns, 8 conversations at a time): in each scenario "
                    "(steady, evicting, one engine flushed every 20 requests at random or in turn) kv-sync's TTFT "
                    "mean, p50 and p90 <= SGLang's and its hit rate >= SGLang's - 0.5 point"),
    ("ingest", [], "live ingestion <= 30 us of CPU per one-block batch in kvgate serve (3 engines, ~1000 "
                   "batches/s in all)"),
    ("request", [], "none of its own: kvgate's own CPU per warm and cold request in process, gRPC left out (the "
                    "part of the gateway's CPU rows that is kvgate's code)"),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=str(REPO / "docs" / "BENCHMARKS.md"), help="Markdown file to write")
    p.add_argument("--quick", action="store_true", help="bench routing --quick (the others run in full)")
    p.add_argument("--only", action="append", choices=[b[0] for b in BENCHES], help="only these (repeatable)")


def _machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 1024 / 1024:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return (f"{os.cpu_count()} cores ({cpu}){mem}, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}; load average at start {load:.1f}")


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, (dict, list)):
        return "`" + json.dumps(v, separators=(",", ":")) + "`"
    return str(v)


def render(name: str, data: dict) -> str:
    """A Markdown table for one benchmark's JSON."""
    if name == "routing" and isinstance(data.get("workloads"), dict):
        out = []
        for w, wd in data["workloads"].items():
            pols = wd.get("policies", {})
            cols = ["hit_rate", "ttft_p50_s", "ttft_p90_s", "throughput_tok_s", "max_over_mean_running",
                    "repeat_miss_share", "evicted_blocks"]
            if any("joined_share" in pd for pd in pols.values()):
                cols.append("joined_share")
            if any("believed_share" in pd for pd in pols.values()):
                cols += ["believed_share", "at_pick_share"]
            about = f" ({wd['describe']})" if wd.get("describe") else ""
            out.append(f"**{w}**{about}\n\n| policy | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
            for p, pd in pols.items():
                out.append(f"| {p} | " + " | ".join(_fmt(pd.get(c)) for c in cols) + " |")
            if "ceiling_hit_rate" in wd:
                out.append(f"\nCeiling (one engine of the fleet's KV capacity): hit rate {_fmt(wd['ceiling_hit_rate'])}"
                           + (f"; kv-sync recovers {_fmt(wd['gap_recovered'])} of the round-robin -> ceiling gap"
                              if "gap_recovered" in wd else ""))
            out.append("")
        targets = data.get("targets") or {}
        if targets:
            out.append("| target | met | kv-sync | best other | oracle |\n|---|---|---|---|---|")
            for t, td in targets.items():
                other = f"{td['best_other']}: {_fmt(td['best_other_value'])}" if "best_other" in td else ""
                if "attainable" in td:
                    other = f"at most {_fmt(td['attainable'])} for any router"
                out.append(f"| {t} | {'met' if td.get('met') else '**MISSED**'} | {_fmt(td.get('value'))} | {other} "
                           f"| {_fmt(td['oracle']) if 'oracle' in td else ''} |")
            out.append("")
        rest = {k: v for k, v in data.items() if k not in ("workloads", "targets")}
        if rest:
            out.append(render("_", rest))
        return "\n".join(out)
    if name == "bakeoff" and isinstance(data.get("scenarios"), dict):
        cols = ["hit_rate", "ttft_mean_ms", "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms", "errors", "router_cpu_ms_per_request",
                "system_missed", "history_lost", "tenant_home_share", "engines"]
        out = ["| scenario | router | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
        for scenario, routers in data["scenarios"].items():
            for router, r in routers.items():
                out.append(f"| {scenario} | {router} | " + " | ".join(_fmt(r.get(c)) for c in cols) + " |")
        out += ["", "| target | met |", "|---|---|"]
        out += [f"| {t} | {'met' if ok else '**MISSED**'} |" for t, ok in (data.get("targets") or {}).items()]
        rest = {k: v for k, v in data.items() if k not in ("scenarios", "targets")}
        return "\n".join(out) + "\n\n" + render("_", rest)
    if name == "request" and isinstance(data.get("warm"), dict) and isinstance(data.get("cold"), dict):
        warm, cold = data["warm"], data["cold"]
        out = ["| measure | warm | cold |", "|---|---|---|"]
        for k in ("cpu_us_per_request", "messages_per_request", "tokens_from_cache_share", "cpu_us_per_request_runs"):
            out.append(f"| {k} | {_fmt(warm.get(k))} | {_fmt(cold.get(k))} |")
        for phase, v in (warm.get("phases_us") or {}).items():
            out.append(f"| phase: {phase} (us) | {_fmt(v)} | {_fmt((cold.get('phases_us') or {}).get(phase))} |")
        out.append(f"| observed responses | {data.get('observe')} | |")
        return "\n".join(out)
    rows = ["| measure | value |", "|---|---|"]
    for k, v in data.items():
        rows.append(f"| {k} | {_fmt(v)} |")
    return "\n".join(rows)


def main(args: argparse.Namespace) -> int:
    started = dt.datetime.now(dt.timezone.utc)
    sections = [f"# Benchmarks\n\nWritten by `kvgate bench all{' --quick' if args.quick else ''}` on "
                f"{started:%Y-%m-%d %H:%M} UTC.\n\nMachine: {_machine()}.\n\n"
                "These machines are shared and noisy: compare numbers measured side by side in one run "
                "(each benchmark measures its baselines in the same run), not across runs.\n"]
    status = 0
    for name, extra, targets in BENCHES:
        if args.only and name not in args.only:
            continue
        argv = ["bench", name, "--json", *extra]
        if name == "routing" and args.quick:
            argv.append("--quick")
        command = "kvgate " + " ".join(argv)
        print(f"kvgate bench all: running `{command}`", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "plugin.cli", *argv], capture_output=True, text=True, cwd=REPO)
        took = time.monotonic() - t0
        section = f"## {name}\n\nCommand: `{command}` ({took:.0f} s). Targets: {targets}.\n\n"
        try:
            data = json.loads(proc.stdout.strip().splitlines()[-1])
            section += render(name, data) + "\n"
        except (ValueError, IndexError):
            status = 1
            section += f"FAILED (exit status {proc.returncode}):\n\n```\n{(proc.stderr or proc.stdout)[-2000:]}\n```\n"
        sections.append(section)
        print(section, flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(sections))
    print(f"kvgate bench all: wrote {args.out}", file=sys.stderr)
    return status
