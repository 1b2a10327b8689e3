"""The demo's agent mix (devkit.workload.AgentWorkload) against one simulated engine: every API answers, a
Responses user continues by previous_response_id, chat and messages users resend their growing histories."""
from __future__ import annotations

from sim.engine import EngineConfig
from sim.server import SimOptions, SimServer
from devkit.workload import APIS, AgentShape, AgentWorkload, workload_for
from helpers import free_ports


async def test_the_agent_mix_runs_every_api_and_chains_responses():
    kv, replay = free_ports(2)
    sim = SimServer(SimOptions(model="demo-model", port=0, kv_events_port=kv, replay_port=replay,
                               engine=EngineConfig(block_size=16, num_blocks=512, ttft_overhead_s=0.001,
                                                   prefill_s_per_token=0.000005, tpot_base_s=0.0005)))
    await sim.start()
    try:
        w = AgentWorkload(AgentShape(groups=1, users_per_group=3, concurrency=3, max_tokens=3, turns=3), "demo-model")
        assert sorted(w.api_of((0, u)) for u in range(3)) == sorted(APIS)
        res = await w.run(sim.url, 30.0, max_requests=9)
        assert res.errors == 0, res.error_samples
        assert res.requests == 9
        responses_user = next(u for u in [(0, i) for i in range(3)] if w.api_of(u) == "responses")
        assert w.previous[responses_user].startswith("resp_")
        path, body = w.request(responses_user)
        assert path == "/v1/responses" and body.get("previous_response_id", "").startswith("resp_") \
            or w.turns[responses_user] == 1  # a conversation that just restarted has none
        assert len(sim.responses) >= 2
    finally:
        await sim.stop()
    assert type(workload_for("mix", 4, "m", 0)).__name__ == "MixedWorkload"
