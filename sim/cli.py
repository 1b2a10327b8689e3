"""`kvgate sim`: run one simulated vLLM engine until SIGINT/SIGTERM.

Prints one JSON line when serving: {"name", "url", "model", "loras", "dp_size",
"block_size", "num_blocks", "kv_events": {"generation", "pub_ports", "replay_ports"} | null,
"groups": [{"kind", "block_size", "sliding_window"}, ...], "retention_interval",
"image": {"placeholder_token_id", "tokens_per_image"}}.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys

import zmq

from kvcache.wire import GENERATIONS
from sim import shapes
from sim.engine import EngineConfig
from sim.server import SimOptions, SimServer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    a = parser.add_argument
    a("--host", default="127.0.0.1", help="address for HTTP and the KV event sockets (default 127.0.0.1)")
    a("--port", type=int, default=8000, help="HTTP port (0: any free port; default 8000)")
    a("--model", default="sim-model", help="served model name (default sim-model)")
    a("--name", default=None, help="engine name in responses (system_fingerprint, x-sim-name); default sim-PORT")
    a("--lora", action="append", default=[], metavar="NAME", help="serve a LoRA adapter of this name (repeatable)")
    a("--tokenizer", default=None, help="tokenizer directory (default: the project's test tokenizer)")
    a("--block-size", type=int, default=d.block_size, help=f"tokens per KV block (default {d.block_size})")
    a("--num-blocks", type=int, default=d.num_blocks, help=f"KV cache capacity in blocks (default {d.num_blocks})")
    a("--model-shape", choices=tuple(shapes.MODEL_SHAPES), default="dense",
      help="KV cache groups: dense (one full-attention group), hybrid (gpt-oss-like: group 0 sliding window, "
      "group 1 full attention), mamba-hybrid (group 0 full attention, group 1 mamba with "
      f"{shapes.MAMBA_BLOCK_FACTOR}x larger blocks) (default dense)")
    a("--retention", choices=tuple(shapes.RETENTIONS), default="sparse",
      help="which sliding-window and mamba blocks keep a hash: sparse (vLLM's default since 0.29, "
      "prefix_cache_retention_interval 0) or dense (every block) (default sparse)")
    a("--sliding-window", type=int, default=shapes.DEFAULT_SLIDING_WINDOW,
      help=f"sliding window in tokens of the hybrid shape (default {shapes.DEFAULT_SLIDING_WINDOW})")
    a("--image-tokens", type=int, default=64, help="placeholder tokens per image in chat prompts (default 64)")
    a("--max-num-seqs", type=int, default=d.max_num_seqs, help=f"most running requests (default {d.max_num_seqs})")
    a("--ttft-overhead-ms", type=float, default=d.ttft_overhead_s * 1e3,
      help=f"fixed time to first token (default {d.ttft_overhead_s * 1e3:g})")
    a("--prefill-ms-per-token", type=float, default=d.prefill_s_per_token * 1e3,
      help=f"prefill time per uncached prompt token (default {d.prefill_s_per_token * 1e3:g})")
    a("--tpot-ms", type=float, default=d.tpot_base_s * 1e3,
      help=f"decode step time with an empty batch (default {d.tpot_base_s * 1e3:g})")
    a("--tpot-ms-per-seq", type=float, default=d.tpot_per_seq_s * 1e3,
      help=f"added decode step time per running request (default {d.tpot_per_seq_s * 1e3:g})")
    a("--kv-transfer-ms-per-block", type=float, default=0.2,
      help="prefill/decode disaggregation: a decode leg's pull time per KV block (default 0.2)")
    a("--max-tokens-default", type=int, default=16, help="output tokens when a request sets none (default 16)")
    a("--dp-size", type=int, default=1, help="data-parallel ranks; rank r publishes on ports + r; a request's "
      "X-data-parallel-rank header picks its rank, as in vLLM (default 1)")
    a("--kv-events-port", type=int, default=5557, help="KV events PUB port of rank 0 (default 5557)")
    a("--replay-port", type=int, default=5558, help="KV events replay ROUTER port of rank 0 (default 5558; 0: none)")
    a("--no-kv-events", action="store_true", help="publish no KV events")
    a("--kv-events-generation", choices=GENERATIONS, default="0.33",
      help="vLLM release whose wire format to publish (default 0.33)")
    a("--kv-events-bytes-hashes", action="store_true",
      help="publish 32-byte block hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) instead of uint64")
    a("--log-level", default="WARNING", choices=("DEBUG", "INFO", "WARNING", "ERROR"), type=str.upper,
      help="logging level (default WARNING)")


def options_from_args(args: argparse.Namespace) -> SimOptions:
    engine = EngineConfig(
        block_size=args.block_size, num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
        ttft_overhead_s=args.ttft_overhead_ms / 1e3, prefill_s_per_token=args.prefill_ms_per_token / 1e3,
        tpot_base_s=args.tpot_ms / 1e3, tpot_per_seq_s=args.tpot_ms_per_seq / 1e3,
        lora_names=tuple(args.lora), int_block_hashes=not args.kv_events_bytes_hashes,
    )
    return SimOptions(
        model=args.model, name=args.name, host=args.host, port=args.port, engine=engine,
        dp_size=args.dp_size, kv_events=not args.no_kv_events, kv_events_port=args.kv_events_port,
        replay_port=args.replay_port or None, kv_events_generation=args.kv_events_generation,
        max_tokens_default=args.max_tokens_default, tokenizer_path=args.tokenizer,
        model_shape=args.model_shape, retention=args.retention, sliding_window=args.sliding_window,
        image_tokens=args.image_tokens, kv_transfer_s_per_block=args.kv_transfer_ms_per_block / 1e3,
    )


async def _serve(options: SimOptions) -> None:
    server = SimServer(options)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
        print(json.dumps(server.ready_info()), flush=True)
        await stop.wait()
    finally:
        await server.stop()


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        options = options_from_args(args)
    except ValueError as e:
        print(f"kvgate sim: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(options))
    except (OSError, zmq.ZMQError) as e:  # port in use, bad address
        print(f"kvgate sim: cannot serve: {e}", file=sys.stderr)
        return 1
    return 0
