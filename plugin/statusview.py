"""The operator's view of one kvgate replica, built from its `/debug` snapshot (the one source: nothing here
reads the process), and rendered as the status page's HTML (`render_html`, served at `/`) or as text for the
terminal (`render_text`, `kvgate status`).

Every number the page shows that is in `/debug` carries its place there: `data-path` (a JSON list of keys)
and `data-v` (the value as /debug has it), so a test or a script can check the page against `/debug`.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from html import escape
from typing import Any, Iterable, Sequence

DebugPath = tuple[Any, ...]  # keys into /debug's JSON, outermost first


@dataclass(frozen=True)
class Cell:
    """One shown value: its text, and where /debug has it (None: a label or a value derived here)."""

    text: str
    path: DebugPath | None = None
    value: Any = None
    cls: str = ""
    # the Prometheus counter (name, labels) whose samples, summed, this value equals over the window
    metric: tuple[str, dict[str, str]] | None = None


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[Cell]] = field(default_factory=list)
    note: str = ""


@dataclass
class StatusView:
    replica: str
    taken: float | None
    summary: list[tuple[str, Cell]]
    tables: list[Table]
    mix_minutes: list[tuple[int, dict[str, int]]]  # (minute start, requests by strategy)
    strategies: list[str]
    window_minutes: int = 15
    # what `kvgate status` compares between replicas: label -> value
    key_numbers: dict[str, str] = field(default_factory=dict)


_MISSING = object()


def _get(d: Any, path: DebugPath, missing: Any = None) -> Any:
    for key in path:
        if isinstance(d, dict) and key in d:
            d = d[key]
        elif isinstance(d, list) and isinstance(key, int) and 0 <= key < len(d):
            d = d[key]
        else:
            return missing
    return d


def _fmt(v: Any, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if unit == "%":
            return f"{v * 100:.1f}%"
        if math.isfinite(v) and v == int(v) and abs(v) < 1e15:
            return f"{int(v)}{unit}"
        return f"{v:.3g}{unit}" if abs(v) < 1000 else f"{v:,.0f}{unit}"
    if isinstance(v, int):
        return f"{v}{unit}"
    return str(v)


def _at(debug: dict, path: DebugPath, unit: str = "", cls: str = "",
        metric: tuple[str, dict[str, str]] | None = None) -> Cell:
    """The value at `path` in /debug (and the Prometheus series equal to it, if any); shown as `-`, and
    tagged with no path, where /debug has none."""
    v = _get(debug, path, _MISSING)
    if v is _MISSING:
        return Cell("-", None, None, cls)
    return Cell(_fmt(v, unit), path, v, cls, metric)


def _label(text: Any, cls: str = "") -> Cell:
    return Cell(_fmt(text), None, None, cls)


def _ratio(num: float, den: float) -> Cell:
    return Cell("-" if den <= 0 else f"{num / den * 100:.1f}%")


def build_view(debug: dict) -> StatusView:
    """The view of one replica's /debug snapshot."""
    settings = debug.get("settings") or {}
    counts = debug.get("counts") or {}
    replica = str(counts.get("gateway_id") or settings.get("gateway_id") or "kvgate")
    summary = [
        ("default strategy", _at(debug, ("strategies", "default"))),
        ("in flight here", _at(debug, ("in_flight_here",))),
        ("running counts", _at(debug, ("counts", "backend"))),
        ("redis", _at(debug, ("counts", "redis"))),
        ("redis up", _at(debug, ("counts", "redis_up"), cls="ok" if counts.get("redis_up") else
                         ("bad" if counts.get("backend") == "redis" else ""), metric=("kvgate_counts_redis_up", {}))),
        ("other replicas", _at(debug, ("counts", "other_gateways"))),
        ("their counts' age", _at(debug, ("counts", "others_age_s"), " s")),
        ("index entries", _at(debug, ("index", "entries"), metric=("kvgate_index_entries", {}))),
        ("index bound", _at(debug, ("index", "max_entries"))),
        ("recent warnings", _at(debug, ("recent_errors", "total"), cls="bad" if _get(
            debug, ("recent_errors", "total")) else "")),
    ]
    for medium in sorted((debug.get("index") or {}).get("keys_by_medium") or {}):
        summary.append((f"blocks in {medium}", _at(debug, ("index", "keys_by_medium", medium))))
    if "sessions" in debug:  # session affinity: sessions this replica remembers, and whether Redis shares them
        summary.append(("sessions here", _at(debug, ("sessions", "remembered_here"))))
        summary.append(("sessions shared", _at(debug, ("sessions", "shared"))))
    if "admission" in debug:  # KVGATE_ADMISSION_MAX_RUNNING: requests by how admission went, and its shared counts
        admission = debug["admission"]
        summary += [
            ("waiting for admission", _at(debug, ("admission", "waiting"), metric=("kvgate_admission_waiting", {}))),
            ("admitted after a wait", _at(debug, ("admission", "after_wait"), metric=(
                "kvgate_admission_requests_total", {"outcome": "after_wait"}))),
            ("admission timeouts (429)", _at(debug, ("admission", "timed_out"), cls="bad" if admission.get(
                "timed_out") else "", metric=("kvgate_admission_requests_total", {"outcome": "timed_out"}))),
            ("admission on own counts", _at(debug, ("admission", "limiter_failing"), cls="bad" if admission.get(
                "limiter_failing") else "")),
        ]
    # the routing mix first: the page shows it beside its chart
    tables = [_mix_table(debug), _fleet(debug), _events(debug), _cache_share(debug), _tokenizer(debug),
              _profiles(debug), _errors(debug)]
    minutes, strategies = _mix_series(debug)
    taken = debug.get("time")
    window = (debug.get("routing_mix") or {}).get("window_minutes")
    routed = sum(int(n) for m in (debug.get("routing_mix") or {}).get("minutes") or []
                 for key, n in (m.get("requests") or {}).items() if "/rejected:" not in key)
    pods = debug.get("pods") or []
    key_numbers = {"redis up": _fmt(counts.get("redis_up")), "sees others": _fmt(counts.get("other_gateways")),
                   "pods ready": f"{sum(1 for p in pods if p.get('ready'))}/{len(pods)}",
                   "running": _fmt(sum(int(p.get("running") or 0) for p in pods)),
                   "in flight here": _fmt(debug.get("in_flight_here")),
                   "index entries": _fmt((debug.get("index") or {}).get("entries")),
                   "routed": str(routed), "warnings": _fmt((debug.get("recent_errors") or {}).get("total"))}
    return StatusView(replica, taken if isinstance(taken, (int, float)) else None, summary,
                      [t for t in tables if t.rows or t.note], minutes, strategies,
                      window if isinstance(window, int) and window > 0 else 15, key_numbers)


def _fleet(debug: dict) -> Table:
    pods = debug.get("pods") or []
    has_role = any("role" in p for p in pods)
    cols = ["pod", "endpoint", "model", "ranks", "ready"] + (["role"] if has_role else []) + [
        "running", "here", "engine running", "queue", "KV usage", "blocks held", "scraped"]
    t = Table("Fleet", cols, note="" if pods else "no pods known")
    for i, p in enumerate(pods):
        ready = p.get("ready")
        unreachable = bool((p.get("engine") or {}).get("unreachable"))
        row = [_at(debug, ("pods", i, "name")), _at(debug, ("pods", i, "endpoint")), _at(debug, ("pods", i, "model")),
               _at(debug, ("pods", i, "kv_events", "dp_size")),
               _at(debug, ("pods", i, "ready"), cls="ok" if ready and not unreachable else "bad")]
        if has_role:
            row.append(_at(debug, ("pods", i, "role")))
        row += [_at(debug, ("pods", i, "running")), _at(debug, ("pods", i, "running_here")),
                _at(debug, ("pods", i, "engine", "running")), _at(debug, ("pods", i, "engine", "waiting")),
                _at(debug, ("pods", i, "engine", "kv_usage"), "%"), _at(debug, ("pods", i, "blocks")),
                Cell("unreachable", ("pods", i, "engine", "unreachable"), True, "bad") if unreachable
                else _at(debug, ("pods", i, "engine", "age_s"), " s ago")]
        t.rows.append(row)
    return t


def _events(debug: dict) -> Table:
    subs = debug.get("subscriptions") or []
    t = Table("KV event subscriptions", ["pod", "rank", "connected", "last seq", "batches", "events", "missed",
                                         "backlog", "lag", "last message", "replays", "reconnects", "errors"],
              note="backlog: messages read, not yet applied; lag: how old the newest batch was (the engine's "
                   "timestamp) when kvgate began applying it" if subs else "no subscriptions")
    for i, s in enumerate(subs):
        t.rows.append([_at(debug, ("subscriptions", i, "pod")), _at(debug, ("subscriptions", i, "rank")),
                       _at(debug, ("subscriptions", i, "connected"), cls="ok" if s.get("connected") else "bad",
                           metric=("kvgate_kvevents_connection_status",
                                   {"pod": str(s.get("pod")), "rank": str(s.get("rank"))})),
                       _at(debug, ("subscriptions", i, "last_seq")), _at(debug, ("subscriptions", i, "batches")),
                       _at(debug, ("subscriptions", i, "events")),
                       _at(debug, ("subscriptions", i, "missed_batches"), cls="bad" if s.get("missed_batches") else ""),
                       _at(debug, ("subscriptions", i, "backlog")),
                       _at(debug, ("subscriptions", i, "lag_s"), " s"),
                       _at(debug, ("subscriptions", i, "last_message_age_s"), " s ago"),
                       _at(debug, ("subscriptions", i, "replays")), _at(debug, ("subscriptions", i, "reconnects")),
                       _at(debug, ("subscriptions", i, "errors"), cls="bad" if s.get("errors") else "")])
    return t


def _cache_share(debug: dict) -> Table:
    mix = debug.get("routing_mix") or {}
    models = mix.get("models") or {}
    t = Table("Cache share per model", ["model", "believed", "blocks cached", "blocks routed", "engines' hit rate",
                                        "tokens hit", "tokens looked up"],
              note=f"over the last {mix.get('window_minutes', '?')} minutes. Believed: the prompt blocks this "
                   "replica believed the picked pod held; engines' hit rate: vllm:prefix_cache_hits over "
                   "vllm:prefix_cache_queries of the model's engines (all traffic to them)")
    for model in sorted(models):
        m = models[model]
        base = ("routing_mix", "models", model)
        t.rows.append([Cell(model), _ratio(m.get("believed_cached", 0), m.get("believed_total", 0)),
                       _at(debug, (*base, "believed_cached")), _at(debug, (*base, "believed_total")),
                       _ratio(m.get("engine_hits", 0), m.get("engine_queries", 0)),
                       _at(debug, (*base, "engine_hits")), _at(debug, (*base, "engine_queries"))])
    return t


def _mix_totals(debug: dict) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for m in (debug.get("routing_mix") or {}).get("minutes") or []:
        for key, n in (m.get("requests") or {}).items():
            strategy, _, reason = key.partition("/")
            by = out.setdefault(strategy, {})
            by[reason] = by.get(reason, 0) + int(n)
    return out


def _mix_table(debug: dict) -> Table:
    totals = _mix_totals(debug)
    reasons = sorted({r for by in totals.values() for r in by})
    mix = debug.get("routing_mix") or {}
    t = Table("Routing mix", ["strategy", "routed", *reasons],
              note=f"requests over the last {mix.get('window_minutes', '?')} minutes, by strategy and reason "
                   "(rejected: status and code of kvgate's answer)")
    for strategy in sorted(totals):
        by = totals[strategy]
        routed = sum(n for r, n in by.items() if not r.startswith("rejected:"))
        t.rows.append([Cell(strategy), Cell(str(routed), None, routed, "total",
                                            ("kvgate_routed_requests_total", {"strategy": strategy})),
                       *(Cell(str(by.get(r, 0))) for r in reasons)])
    return t


def _mix_series(debug: dict) -> tuple[list[tuple[int, dict[str, int]]], list[str]]:
    minutes = []
    names: set[str] = set()
    for m in (debug.get("routing_mix") or {}).get("minutes") or []:
        by: dict[str, int] = {}
        for key, n in (m.get("requests") or {}).items():
            strategy = key.partition("/")[0]
            by[strategy] = by.get(strategy, 0) + int(n)
            names.add(strategy)
        minutes.append((int(m.get("start", 0)), by))
    return minutes, sorted(names)


def _tokenizer(debug: dict) -> Table:
    tok = debug.get("tokenizer") or {}
    models = tok.get("models") or {}
    t = Table("Tokenizer", ["model", "state", "source", "local", "engine", "agree", "disagree", "verified shapes",
                            "error"],
              note=f"mode {tok.get('mode', '?')}" + ("" if models else _no_tokenizer_models(debug)))
    for model in sorted(models):
        m = models[model]
        base = ("tokenizer", "models", model)
        state = m.get("state")
        t.rows.append([Cell(model), _at(debug, (*base, "state"), cls="ok" if state == "serving" else
                                        ("bad" if state in ("disagreed", "failed", "error") else "")),
                       _at(debug, (*base, "source")), _at(debug, (*base, "served", "local")),
                       _at(debug, (*base, "served", "remote")),
                       _at(debug, (*base, "checks", "agree"),
                           metric=("kvgate_tokenizer_local_checks_total", {"model": model, "result": "agree"})),
                       _at(debug, (*base, "checks", "disagree"), cls="bad" if (m.get("checks") or {}).get("disagree")
                           else "", metric=("kvgate_tokenizer_local_disagreements_total", {"model": model})),
                       Cell(", ".join(str(v) for v in m.get("verified") or []) or "-"),
                       _at(debug, (*base, "error"))])
    return t


def _no_tokenizer_models(debug: dict) -> str:
    settings = debug.get("settings") or {}
    tok = debug.get("tokenizer") or {}
    if tok.get("mode") != "remote" and (settings.get("tokenizer_path") or settings.get("tokenizer_hub")):
        return ": no model asked for yet"
    return ": the engines tokenize (no local files)"


def _profiles(debug: dict) -> Table:
    profiles = debug.get("profiles") or {}
    t = Table("Learned engine profiles", ["pod", "prefill tok/s", "decode samples", "TTFT overhead @1",
                                          "TTFT overhead @8", "TTFT samples", "TTFT error mean", "mean |error|"],
              note="" if profiles else "nothing learned yet (responses observed feed them)")
    for pod in sorted(profiles):
        base = ("profiles", pod)
        t.rows.append([Cell(pod), _at(debug, (*base, "prefill_tokens_per_s")), _at(debug, (*base, "samples")),
                       _at(debug, (*base, "ttft_overhead_ms", "1"), " ms"),
                       _at(debug, (*base, "ttft_overhead_ms", "8"), " ms"), _at(debug, (*base, "ttft_samples")),
                       _at(debug, (*base, "ttft_error_ms", "mean"), " ms"),
                       _at(debug, (*base, "ttft_error_ms", "mean_abs"), " ms")])
    return t


def _errors(debug: dict) -> Table:
    recent = (debug.get("recent_errors") or {}).get("recent") or []
    t = Table("Recent warnings and errors", ["time", "level", "logger", "message"],
              note="" if recent else "none since start")
    for i, e in enumerate(recent[:20]):
        base = ("recent_errors", "recent", i)
        t.rows.append([Cell(_clock(e.get("time"))), _at(debug, (*base, "level"),
                                                        cls="bad" if e.get("level") in ("ERROR", "CRITICAL") else ""),
                       _at(debug, (*base, "logger")), _at(debug, (*base, "message"), cls="msg")])
    return t


def _clock(t: Any) -> str:
    if not isinstance(t, (int, float)):
        return "-"
    return time.strftime("%H:%M:%S", time.gmtime(t))


# --- HTML ------------------------------------------------------------------------------------

_PALETTE = ("#2f6fdf", "#e07b24", "#2a9d5c", "#b03fb0", "#c23b3b", "#7a7a7a", "#1aa3a3", "#8c6d1f")

_CSS = """
*{box-sizing:border-box}body{margin:0;font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;
color:#1d232b;background:#f4f6f9}header{background:#1d232b;color:#fff;padding:10px 16px;display:flex;
flex-wrap:wrap;gap:4px 16px;align-items:baseline}header h1{font-size:18px;margin:0}header span{opacity:.8}
main{padding:12px;display:grid;gap:12px;grid-template-columns:repeat(auto-fit,minmax(min(100%,520px),1fr))}
section{background:#fff;border-radius:6px;box-shadow:0 1px 2px rgba(0,0,0,.12);padding:10px 12px;min-width:0}
section.wide{grid-column:1/-1}h2{font-size:15px;margin:0 0 6px}.scroll{overflow-x:auto}
table{border-collapse:collapse;width:100%}th,td{padding:3px 8px;text-align:right;white-space:nowrap;
border-bottom:1px solid #e6e9ee}th:first-child,td:first-child{text-align:left}th{font-weight:600;color:#55606e}
td.msg{white-space:normal;text-align:left;word-break:break-word;min-width:14em}.ok{color:#1e7d45}
.bad{color:#c0392b;font-weight:600}.note{color:#66707c;font-size:12px;margin:4px 0 0}
dl{display:grid;grid-template-columns:repeat(auto-fill,minmax(150px,1fr));gap:6px 12px;margin:0}
dt{color:#66707c;font-size:12px}dd{margin:0;font-weight:600;overflow-wrap:anywhere}
#recent-warnings-and-errors th,#recent-warnings-and-errors td{text-align:left}.legend{display:flex;flex-wrap:wrap;gap:4px 12px;font-size:12px}.legend i{display:inline-block;width:10px;
height:10px;margin-right:4px;border-radius:2px}svg{width:100%;height:auto;display:block}
@media (max-width:600px){main{padding:6px;gap:8px}section{padding:8px}th,td{padding:2px 5px}}
"""


def _cell_html(c: Cell, tag: str = "td") -> str:
    attrs = f' class="{escape(c.cls)}"' if c.cls else ""
    if c.path is not None:
        attrs += f' data-path="{escape(json.dumps(list(c.path)))}"'
    if c.metric is not None:
        attrs += f' data-metric="{escape(c.metric[0])}" data-labels="{escape(json.dumps(c.metric[1]))}"'
    if c.path is not None or c.metric is not None:
        attrs += f' data-v="{escape(json.dumps(c.value, default=str))}"'
    return f"<{tag}{attrs}>{escape(c.text)}</{tag}>"


def _table_html(t: Table) -> str:
    head = "".join(f"<th>{escape(c)}</th>" for c in t.columns)
    body = "".join("<tr>" + "".join(_cell_html(c) for c in row) + "</tr>" for row in t.rows)
    note = f'<p class="note">{escape(t.note)}</p>' if t.note else ""
    table = f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>' \
        if t.rows else ""
    slug = "".join(ch if ch.isalnum() else "-" for ch in t.title.lower())
    wide = " wide" if len(t.columns) > 6 or t.title == "Recent warnings and errors" else ""
    return f'<section class="table{wide}" id="{escape(slug)}"><h2>{escape(t.title)}</h2>{table}{note}</section>'


def _mix_chart(minutes: Sequence[tuple[int, dict[str, int]]], strategies: Sequence[str], window: int) -> str:
    """Stacked bars of requests by strategy, one slot per minute of the window (the newest minute at the
    right): an inline SVG."""
    if not minutes:
        return '<p class="note">no requests routed yet</p>'
    colors = {s: _PALETTE[i % len(_PALETTE)] for i, s in enumerate(strategies)}
    width, height, pad = 600, 160, 24
    top = max(sum(by.values()) for _, by in minutes) or 1
    bar = (width - pad) / window
    newest = minutes[-1][0]
    parts = [f'<svg viewBox="0 0 {width} {height + 20}" role="img" aria-label="requests per minute by strategy">',
             f'<text x="0" y="12" font-size="11" fill="#66707c">{top}</text>',
             f'<line x1="{pad}" y1="{height}" x2="{width}" y2="{height}" stroke="#c9ced6"/>']
    for i, (start, by) in enumerate(minutes):
        slot = window - 1 - (newest - start) // 60
        if slot < 0:
            continue
        x = pad + slot * bar + 2
        y = float(height)
        for s in strategies:
            n = by.get(s, 0)
            if not n:
                continue
            h = n / top * (height - 16)
            y -= h
            parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(bar - 4, 1):.1f}" height="{h:.1f}" '
                         f'fill="{colors[s]}"><title>{escape(_clock(start))} {escape(s)}: {n}</title></rect>')
        if i == 0 or i == len(minutes) - 1:
            parts.append(f'<text x="{x:.1f}" y="{height + 14}" font-size="11" fill="#66707c">'
                         f'{escape(_clock(start)[:5])}</text>')
    parts.append("</svg>")
    legend = "".join(f'<span><i style="background:{colors[s]}"></i>{escape(s)}</span>' for s in strategies)
    return "".join(parts) + f'<div class="legend">{legend}</div>'


def render_html(view: StatusView, refresh_s: int = 5) -> str:
    """The whole page: inline CSS and SVG, no script; `refresh_s` > 0 reloads it that often."""
    refresh = f'<meta http-equiv="refresh" content="{int(refresh_s)}">' if refresh_s > 0 else ""
    summary = "".join(f"<div><dt>{escape(name)}</dt>{_cell_html(c, 'dd')}</div>" for name, c in view.summary)
    taken = f"at {_clock(view.taken)} UTC" if view.taken is not None else ""
    tables = "".join(_table_html(t) for t in view.tables)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width,initial-scale=1">{refresh}'
            '<link rel="icon" href="data:,">'
            f"<title>kvgate {escape(view.replica)}</title><style>{_CSS}</style></head><body>"
            f'<header><h1>kvgate {escape(view.replica)}</h1><span>{escape(taken)}</span>'
            f'<span><a href="debug" style="color:#9cc3ff">/debug</a> · '
            f'<a href="metrics" style="color:#9cc3ff">/metrics</a></span></header><main>'
            f'<section class="wide" id="summary"><h2>This replica</h2><dl>{summary}</dl></section>'
            f'<section id="mix-chart"><h2>Requests per minute by strategy</h2>'
            f"{_mix_chart(view.mix_minutes, view.strategies, view.window_minutes)}</section>"
            f"{tables}</main></body></html>")


# --- text ------------------------------------------------------------------------------------

def _text_table(t: Table, width_cap: int = 40) -> list[str]:
    cells = [t.columns] + [[c.text[:width_cap] for c in row] for row in t.rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(t.columns))]
    lines = [f"{t.title}:" + (f" ({t.note})" if t.note else "")]
    for r in cells if t.rows else []:
        lines.append("  " + "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))))
    return lines


def render_text(views: Iterable[tuple[str, StatusView | str]]) -> str:
    """Each replica's view (or why it could not be read) as compact text tables."""
    out: list[str] = []
    views = list(views)
    read = [(url, v) for url, v in views if not isinstance(v, str)]
    if len(views) > 1 and read:
        # the replicas side by side: running counts they share, index entries they should agree on
        columns = list(read[0][1].key_numbers)
        t = Table("Replicas", ["replica", "url", *columns],
                  [[Cell(v.replica), Cell(url), *(Cell(v.key_numbers.get(c, "-")) for c in columns)] for url, v in read])
        out += _text_table(t, width_cap=60) + [""]
    for url, view in views:
        if isinstance(view, str):
            out += [f"== {url}: unreachable: {view}", ""]
            continue
        taken = f" at {_clock(view.taken)} UTC" if view.taken is not None else ""
        out.append(f"== kvgate {view.replica} ({url}){taken}")
        out.append("  " + ", ".join(f"{name} {c.text}" for name, c in view.summary))
        mix = {s: sum(by.get(s, 0) for _, by in view.mix_minutes) for s in view.strategies}
        for t in view.tables:
            if t.title == "Recent warnings and errors":
                t = Table(t.title, t.columns, t.rows[:5], t.note)
            out += _text_table(t)
        if mix:
            out.append("  per minute: " + " | ".join(
                f"{_clock(start)[:5]} " + " ".join(f"{s}={by[s]}" for s in sorted(by)) for start, by in
                view.mix_minutes[-5:]))
        out.append("")
    return "\n".join(out)
