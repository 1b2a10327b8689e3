"""The simulated engine's side of prefill/decode disaggregation, as vLLM 0.33.0's NixlConnector (pull mode) speaks it.

A request's `kv_transfer_params` (vllm/entrypoints/openai/*/protocol.py: `dict[str, Any] | None`, anything else
a 400 from request validation, sim.protocol's too) selects the leg:
- `do_remote_decode` true: the prefill leg. The engine prefills (the router sends max_tokens 1) and answers with
  the parameters the decode engine needs (nixl/pull_scheduler.py `request_finished`): `do_remote_prefill` true,
  `do_remote_decode` false, `remote_block_ids` (one list per KV cache group), `remote_engine_id`,
  `remote_request_id`, `remote_host`, `remote_port` (the NIXL side channel), `tp_size`, `dcp_size`, `pp_size`,
  `remote_num_tokens`, `remote_blocks_expiry_time` (null on a prefill engine), `remote_registration_generation`,
  `transfer_mode` "pull".
- `do_remote_prefill` true with non-empty `remote_block_ids` and every one of `remote_engine_id`,
  `remote_request_id`, `remote_host`, `remote_port` present: the decode leg. The engine pulls the prompt's
  blocks (the sim: a transfer time per block, `SimOptions.kv_transfer_s_per_block`), stores them as its own
  (published as BlockStored once the request's prefill step ends) and computes only the rest.
- `do_remote_prefill` true without those: vLLM logs "Got invalid KVTransferParams ... will not utilize
  KVTransfer" and serves the request by prefilling it itself; so does the sim (counted as `invalid`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


# What the decode leg needs besides do_remote_prefill and remote_block_ids (nixl/pull_scheduler.py).
DECODE_REQUIRED = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


@dataclass(frozen=True, slots=True)
class Leg:
    """What a request's kv_transfer_params make of it: `kind` is "prefill", "decode", "invalid" (a decode leg
    whose parameters do not let it pull: served with a local prefill) or "" (no disaggregation)."""

    kind: str
    remote_tokens: int = 0  # decode: prompt tokens whose KV arrives from the prefill engine
    blocks: int = 0  # decode: blocks pulled


def leg(params: dict[str, Any] | None, n_prompt: int, block_size: int) -> Leg:
    if not params:
        return Leg("")
    if params.get("do_remote_decode"):
        return Leg("prefill")
    if not params.get("do_remote_prefill"):
        return Leg("")
    ids = params.get("remote_block_ids")
    if not ids or not all(k in params for k in DECODE_REQUIRED):
        return Leg("invalid")
    remote = params.get("remote_num_tokens") or n_prompt
    if type(remote) is not int or remote < 0:
        return Leg("invalid")
    remote = min(remote, n_prompt)
    return Leg("decode", remote, -(-remote // block_size))


def prefill_answer(*, engine_id: str, request_id: str, host: str, port: int, n_prompt: int,
                   block_size: int, first_block: int) -> dict[str, Any]:
    """The prefill leg's `kv_transfer_params`, as vLLM's NixlConnector returns them (block ids: the sim's own
    numbering from `first_block`, one KV cache group)."""
    n_blocks = -(-n_prompt // block_size)
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": [list(range(first_block, first_block + n_blocks))],
            "remote_engine_id": engine_id, "remote_request_id": request_id, "remote_host": host,
            "remote_port": port, "tp_size": 1, "dcp_size": 1, "pp_size": 1, "remote_num_tokens": n_prompt,
            "remote_blocks_expiry_time": None, "remote_registration_generation": 0, "transfer_mode": "pull"}
