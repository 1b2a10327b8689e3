"""What a block's hash carries besides the tokens, end to end through a real Envoy and `kvgate serve`
to simulated engines: cache_salt, images in chat (by their bytes or the client's uuid), and a hybrid
model's two KV cache groups. Each check warms a prompt directly on one engine, waits until kvgate's
index holds it, then routes through Envoy and reads what kvgate believed the chosen engine held
(kvgate_prefix_blocks_total{kind="cached"}: one kvgate, requests one at a time) beside what the engine
served from its cache (usage.prompt_tokens_details.cached_tokens)."""
from __future__ import annotations

import base64
import re

import httpx
import pytest

from devkit.stack import Stack
from helpers import GatewayEnv, stack_fixture, wait_until

pytestmark = pytest.mark.integration

DENSE = "m"  # one full-attention group
HYBRID = "h"  # gpt-oss-like: group 0 a 128-token sliding window (sparse retention), group 1 full attention
BS = 16  # every engine's block size


class Env(GatewayEnv):
    def __init__(self, stack: Stack):
        super().__init__(stack)
        fast = ["--tpot-ms", "2", "--ttft-overhead-ms", "1", "--block-size", str(BS)]
        pods = stack.engines(2, model=DENSE, extra=fast)
        pods += stack.engines(2, model=HYBRID, extra=[*fast, "--model-shape", "hybrid"], prefix="hyb")
        self.ports = {p["name"]: p["port"] for p in pods}
        self.start_gateway(pods, {"KVGATE_ROUTING_STRATEGY": "kv-sync"})

    def metric(self, name: str, **labels: str) -> float:
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        m = re.search(rf"^{re.escape(name)}{{{re.escape(want)}}} ([0-9.e+]+)$", self.metrics(), re.M)
        return float(m.group(1)) if m else 0.0

    def blocks(self, pod: str) -> int:
        return next(p for p in self.debug()["pods"] if p["name"] == pod).get("blocks", 0)

    def warm(self, pod: str, path: str, body: dict) -> None:
        """`body` sent to `pod` directly (not through kvgate); returns once kvgate's index holds more of
        that pod's blocks than before."""
        before = self.blocks(pod)
        r = httpx.post(f"http://127.0.0.1:{self.ports[pod]}{path}", json={**body, "max_tokens": 1}, timeout=10)
        assert r.status_code == 200, r.text
        wait_until(lambda: self.blocks(pod) > before, what=f"{pod}'s blocks in the index", detail=self.debug)

    def route(self, path: str, body: dict) -> tuple[str, int, int]:
        """`body` through Envoy: (the pod kvgate chose, the prompt blocks it believed that pod held, the
        prompt tokens the engine served from its cache)."""
        before = self.metric("kvgate_prefix_blocks_total", kind="cached")
        r = self.client.post(path, json={**body, "max_tokens": 1})
        assert r.status_code == 200, r.text
        believed = self.metric("kvgate_prefix_blocks_total", kind="cached") - before
        return r.headers["x-kvgate-pod"], int(believed), r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    def prompt_tokens(self, pod: str, prompt: str) -> int:
        r = httpx.post(f"http://127.0.0.1:{self.ports[pod]}/tokenize", json={"model": DENSE, "prompt": prompt},
                       timeout=10)
        assert r.status_code == 200, r.text
        return r.json()["count"]

    def image_span(self, pod: str, body: dict) -> tuple[int, int]:
        """(offset, length) of the body's one image placeholder run, as the engine renders the chat."""
        r = httpx.post(f"http://127.0.0.1:{self.ports[pod]}/v1/chat/completions/render", json=body, timeout=10)
        assert r.status_code == 200, r.text
        (span,) = r.json()["features"]["mm_placeholders"]["image"]
        return span["offset"], span["length"]


env = stack_fixture(Env)


def _words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i % 7}" for i in range(n))


def test_a_salted_prompt_is_believed_cached_only_under_its_own_salt(env):
    body = {"model": DENSE, "prompt": _words("salted", 121)}
    assert env.prompt_tokens("sim1", body["prompt"]) % BS  # whole-block prompts: the last test
    env.warm("sim1", "/v1/completions", {**body, "cache_salt": "a"})
    salted = env.metric("kvgate_request_extras_total", kind="salted")
    pod, believed, served = env.route("/v1/completions", {**body, "cache_salt": "a"})
    assert pod == "sim1" and believed > 0
    assert believed * BS == served  # what kvgate believed is what the engine served from its cache
    # another salt, or none: the same tokens hash differently, so no engine holds them, by kvgate or the engine
    for other in ({"cache_salt": "b"}, {}):
        pod, believed, served = env.route("/v1/completions", {**body, **other})
        assert (believed, served) == (0, 0), (other, pod)
    assert env.metric("kvgate_request_extras_total", kind="salted") - salted == 2


def _image(seed: int, uuid: str | None = None) -> dict:
    part: dict = {"type": "image_url",
                  "image_url": {"url": "data:image/png;base64," + base64.b64encode(bytes([seed]) * 48).decode()}}
    if uuid is not None:
        part["uuid"] = uuid
    return part


def _chat(tag: str, image: dict) -> dict:
    """A system prompt of several blocks, then a user message with the image (its placeholders go in
    front of the message's text) and text of several blocks more."""
    return {"model": DENSE, "messages": [
        {"role": "system", "content": _words(tag + "sys", 80)},
        {"role": "user", "content": [image, {"type": "text", "text": _words(tag + "q", 80)}]}]}


def test_a_chat_with_an_image_is_believed_cached_past_the_image_only_for_that_image(env):
    same = _chat("pic", _image(1))
    offset, length = env.image_span("sim0", same)
    assert offset >= 4 * BS  # blocks before the image, and blocks after it
    env.warm("sim0", "/v1/chat/completions", same)
    pod, believed, served = env.route("/v1/chat/completions", same)
    assert pod == "sim0" and believed * BS >= offset + length and believed * BS == served
    # the same text with another image: the same tokens, but the blocks from the image on hash differently
    pod, believed, served = env.route("/v1/chat/completions", _chat("pic", _image(2)))
    assert believed * BS <= offset and believed * BS == served, pod


def test_an_images_uuid_is_its_identity(env):
    """As in vLLM, the client's uuid replaces the image's hash: the same bytes under another uuid are
    another image, other bytes under the same uuid the same one."""
    warmed = _chat("uuid", _image(3, uuid="cat-1"))
    offset, length = env.image_span("sim1", warmed)
    env.warm("sim1", "/v1/chat/completions", warmed)
    pod, believed, served = env.route("/v1/chat/completions", _chat("uuid", _image(4, uuid="cat-1")))
    assert pod == "sim1" and believed * BS >= offset + length and believed * BS == served
    pod, believed, served = env.route("/v1/chat/completions", _chat("uuid", _image(3, uuid="cat-2")))
    assert believed * BS <= offset and believed * BS == served, pod


def test_a_hybrid_fleet_routes_a_repeated_prompt_to_its_engine_and_shows_both_groups(env):
    body = {"model": HYBRID, "prompt": _words("hybrid", 300)}  # longer than the 128-token window
    env.warm("hyb1", "/v1/completions", body)
    pod, believed, served = env.route("/v1/completions", body)
    assert pod == "hyb1" and believed > 128 // BS and believed * BS == served
    shape = env.debug()["index"]["kv_cache_groups"][HYBRID]
    groups = {int(i): (g["kind"], g["sliding_window"], g["block_size"], g["rule"], g["modelled"])
              for i, g in shape["groups"].items()}
    assert groups == {0: ("sliding_window", 128, BS, "window", True), 1: ("full_attention", None, BS, "full", True)}
    assert shape["exact"] is True


def test_a_repeated_prompt_of_whole_blocks_is_believed_one_block_short_as_the_engine_serves_it(env):
    n = 20 * BS
    body = {"model": DENSE, "prompt": [100 + i % 200 for i in range(n)]}  # token ids: exactly 20 blocks
    env.warm("sim0", "/v1/completions", body)
    pod, believed, served = env.route("/v1/completions", body)
    assert pod == "sim0" and served == n - BS  # vLLM: the hit is capped at the prompt's length - 1
    assert believed * BS == served
