"""The simulated engine in both roles of vLLM's NixlConnector (pull mode): the prefill leg's answer, the decode
leg's pull (stored and published as the engine's own blocks), malformed kv_transfer_params as vLLM treats them."""
from __future__ import annotations

from typing import AsyncIterator

import httpx
import pytest

from helpers import free_ports
from sim.engine import EngineConfig, EngineModel
from sim.server import SimOptions, SimServer

ENGINE = EngineConfig(block_size=16, num_blocks=256, ttft_overhead_s=0.001, prefill_s_per_token=0.00002,
                      tpot_base_s=0.002, tpot_per_seq_s=0.0001)
PROMPT = " ".join(f"word{i} and more text" for i in range(40))
P_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}


@pytest.fixture
async def sims() -> AsyncIterator[tuple[SimServer, SimServer]]:
    a, b, c, d = free_ports(4)
    p = SimServer(SimOptions(name="sim-p", port=0, engine=ENGINE, kv_events_port=a, replay_port=b))
    dec = SimServer(SimOptions(name="sim-d", port=0, engine=ENGINE, kv_events_port=c, replay_port=d))
    await p.start()
    await dec.start()
    yield p, dec
    await p.stop()
    await dec.stop()


async def test_prefill_answer_then_decode_pulls_and_stores(sims):
    p, d = sims
    async with httpx.AsyncClient(timeout=10) as c:
        r = await c.post(p.url + "/v1/completions", headers={"X-Request-Id": "req-1"},
                         json={"model": "sim-model", "prompt": PROMPT, "max_tokens": 1, "stream": False,
                               "kv_transfer_params": P_PARAMS})
        assert r.status_code == 200 and r.headers["x-sim-kv-transfer"] == "prefill"
        kv = r.json()["kv_transfer_params"]
        n_prompt = r.json()["usage"]["prompt_tokens"]
        assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
        assert kv["remote_engine_id"] == "sim-p-rank0" and kv["remote_request_id"].startswith("cmpl-req-1-")
        assert (kv["remote_host"], kv["remote_port"], kv["tp_size"], kv["transfer_mode"]) == ("127.0.0.1", 5600, 1,
                                                                                                "pull")
        assert kv["remote_num_tokens"] == n_prompt and len(kv["remote_block_ids"]) == 1
        assert len(kv["remote_block_ids"][0]) == -(-n_prompt // 16)
        held_before = len(d.ranks[0].engine.cached_block_hashes())
        r = await c.post(d.url + "/v1/completions", headers={"X-Request-Id": "req-1"},
                         json={"model": "sim-model", "prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": kv})
        assert r.status_code == 200 and r.headers["x-sim-kv-transfer"] == "decode"
        assert "kv_transfer_params" not in r.json()
        # the pulled blocks are the decode engine's own now (stored, so published as BlockStored), not a prefix hit
        assert len(d.ranks[0].engine.cached_block_hashes()) >= held_before + n_prompt // 16
        m = d.ranks[0].engine.metrics()
        assert m.prefix_cache_hits == 0 and m.prefix_cache_queries == n_prompt
        # a streamed prefill leg carries the parameters on its last chunk
        r = await c.post(p.url + "/v1/completions", json={"model": "sim-model", "prompt": PROMPT, "max_tokens": 1,
                                                        "stream": True, "kv_transfer_params": P_PARAMS})
        last = [line for line in r.text.splitlines() if line.startswith("data: {")][-1]
        assert '"do_remote_prefill":true' in last
    assert (p.kv_transfers, d.kv_transfers) == ({"prefill": 2, "decode": 0, "invalid": 0},
                                                {"prefill": 0, "decode": 1, "invalid": 0})


@pytest.mark.parametrize("params", [
    {"do_remote_prefill": True, "remote_block_ids": [[1, 2]], "remote_engine_id": "e", "remote_host": "h",
     "remote_port": 1},  # no remote_request_id
    {"do_remote_prefill": True, "remote_block_ids": [], "remote_engine_id": "e", "remote_request_id": "r",
     "remote_host": "h", "remote_port": 1},  # no blocks
])
async def test_decode_leg_that_cannot_pull_prefills_itself_as_vllm(sims, params):
    _, d = sims
    async with httpx.AsyncClient(timeout=10) as c:
        r = await c.post(d.url + "/v1/completions", json={"model": "sim-model", "prompt": PROMPT, "max_tokens": 2,
                                                        "kv_transfer_params": params})
    assert r.status_code == 200 and r.headers["x-sim-kv-transfer"] == "invalid"
    assert d.kv_transfers["invalid"] == 1


@pytest.mark.parametrize("value", ["yes", [1], 3])
async def test_kv_transfer_params_not_an_object_is_a_400(sims, value):
    _, d = sims
    async with httpx.AsyncClient(timeout=10) as c:
        for path, body in (("/v1/completions", {"prompt": PROMPT}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            r = await c.post(d.url + path, json={"model": "sim-model", **body, "kv_transfer_params": value})
            assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"


def test_engine_remote_tokens_skip_the_prefill_compute():
    cfg = EngineConfig(block_size=16, num_blocks=64, ttft_overhead_s=0.0, prefill_s_per_token=0.001)
    tokens = list(range(1000, 1320))
    whole, pulled = EngineModel(cfg), EngineModel(cfg)
    whole.add_request("a", tokens, 2, 0.0)
    pulled.add_request("a", tokens, 2, 0.0, remote_tokens=len(tokens))
    assert whole.next_event_time() == pytest.approx(0.320)  # 320 tokens computed
    assert pulled.next_event_time() == pytest.approx(0.001)  # only the last prompt token
    with pytest.raises(ValueError, match="remote_tokens"):
        pulled.add_request("b", tokens, 2, 0.0, remote_tokens=-1)
