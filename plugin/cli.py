"""The `kvgate` command: one entry point, subcommands loaded lazily.

Each subcommand module exposes `add_arguments(parser)` and `main(args) -> int`.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("plugin.serve", "run the ext_proc server (configured by KVGATE_* variables)"),
    "sim": ("sim.cli", "run a simulated vLLM engine"),
    "demo": ("devkit.demo", "start the whole stack on loopback and compare strategies"),
    "events": ("plugin.events_cmd", "tail one engine's KV events"),
    "status": ("plugin.status_cmd", "the status page's view in the terminal, for one replica or a Service's all"),
}
BENCHES: dict[str, tuple[str, str]] = {
    "index": ("bench.index", "prefix index: ingest rate, match latency, bytes per entry"),
    "tokenizer": ("bench.tokenizer", "tokenizer: remote vs local, cold vs cached"),
    "routing": ("bench.routing", "routing policies on simulated engines, virtual clock"),
    "gateway": ("bench.gateway", "the full path through a real Envoy"),
    "path": ("bench.path", "time to first token through the shipped stack against straight to the engine"),
    "watch": ("bench.watch", "what watching a response costs the request and kvgate, three ways through Envoy"),
    "bakeoff": ("bench.bakeoff", "kvgate as shipped against SGLang's model gateway on the same engines, multi-turn chat"),
    "ingest": ("bench.ingest", "live KV event ingestion: kvgate serve's CPU per batch"),
    "request": ("bench.request_cost", "kvgate's own CPU per routed request, in process, by phase"),
    "soak": ("bench.soak", "mixed traffic through Envoy for a long run"),
    "all": ("bench.all", "every benchmark, written to docs/BENCHMARKS.md"),
}


def _add(sub: argparse._SubParsersAction, name: str, module: str, help_: str) -> None:
    p = sub.add_parser(name, help=help_, description=help_)
    p.set_defaults(_module=module)
    try:
        importlib.import_module(module).add_arguments(p)
    except ModuleNotFoundError as e:  # a subcommand whose module is missing is reported when run
        p.set_defaults(_missing=str(e))


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description="KV-cache-aware router for vLLM fleets behind Envoy")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Import only the module of the subcommand asked for: start-up stays fast.
    wanted = argv[0] if argv else None
    for name, (module, help_) in COMMANDS.items():
        if wanted == name:
            _add(sub, name, module, help_)
        else:
            sub.add_parser(name, help=help_)
    bench = sub.add_parser("bench", help="benchmarks (each prints a table, or JSON with --json)")
    bsub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    wanted_bench = argv[1] if wanted == "bench" and len(argv) > 1 else None
    for name, (module, help_) in BENCHES.items():
        if wanted_bench == name:
            _add(bsub, name, module, help_)
        else:
            bsub.add_parser(name, help=help_)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    if getattr(args, "_missing", None):
        print(f"kvgate: this command is not available: {args._missing}", file=sys.stderr)
        return 2
    module = importlib.import_module(args._module)
    try:
        return int(module.main(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
