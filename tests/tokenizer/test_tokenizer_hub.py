"""Tokenizer files fetched from a hub by model name (against a loopback stand-in of the hub's resolve URLs)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hubstub import CDN_HOST, HubStub, Repo
from tokenizer import testdata
from tokenizer.hub import HubError, HubOptions, fetch
from tokenizer.local import LocalTokenizer
from tokenizer.types import ChatInput

REPO = Path(__file__).resolve().parents[2]
CHAT = ChatInput(messages=({"role": "user", "content": "hello hub"},))


@pytest.fixture
def hub():
    files = Repo.from_dir(testdata.path()).files
    template = json.loads(files["tokenizer_config.json"])["chat_template"]
    with HubStub({"org/tiny": Repo(files),
                  "org/gated": Repo(dict(files), token="hf_secret"),
                  # A newer layout: the chat template in its own file, not in tokenizer_config.json.
                  "org/split": Repo({**files, "chat_template.jinja": template.encode(),
                                     "tokenizer_config.json": json.dumps(
                                         {k: v for k, v in json.loads(files["tokenizer_config.json"]).items()
                                          if k != "chat_template"}).encode()})}) as stub:
        yield stub


def test_fetch_downloads_the_files_once_through_head_get_and_the_cdn_redirect(hub, tmp_path) -> None:
    options = HubOptions(endpoint=hub.url, cache_dir=str(tmp_path))
    directory = fetch("org/tiny", options)
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in directory.iterdir()}
    local = LocalTokenizer.from_path(directory)
    assert local.encode(CHAT) == LocalTokenizer.from_path(testdata.path()).encode(CHAT)
    # tokenizer.json (large) came from the CDN host, without the token; the optional files were asked for.
    assert len(hub.gets(CDN_HOST)) == 1 and not hub.gets(CDN_HOST)[0].authorized
    assert {s.path.rsplit("/", 1)[1] for s in hub.seen if s.method == "HEAD"} >= {
        "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"}
    gets = len(hub.gets())
    assert fetch("org/tiny", options) == directory
    assert len(hub.gets()) == gets, "cached files were downloaded again"


def test_a_template_in_chat_template_jinja_is_used(hub, tmp_path) -> None:
    directory = fetch("org/split", HubOptions(endpoint=hub.url, cache_dir=str(tmp_path)))
    assert (directory / "chat_template.jinja").exists()
    assert LocalTokenizer.from_path(directory).encode(CHAT) == LocalTokenizer.from_path(testdata.path()).encode(CHAT)


def test_a_gated_repository_needs_the_token_which_never_reaches_the_cdn(hub, tmp_path) -> None:
    with pytest.raises(HubError, match="org/gated"):
        fetch("org/gated", HubOptions(endpoint=hub.url, cache_dir=str(tmp_path / "a")))
    hub.seen.clear()
    fetch("org/gated", HubOptions(endpoint=hub.url, cache_dir=str(tmp_path / "b"), token="hf_secret"))
    assert all(s.authorized for s in hub.seen if s.host == "127.0.0.1")
    assert hub.gets(CDN_HOST) and not any(s.authorized for s in hub.seen if s.host == CDN_HOST)


def test_an_unknown_repository_is_a_hub_error(hub, tmp_path) -> None:
    with pytest.raises(HubError, match="org/absent"):
        fetch("org/absent", HubOptions(endpoint=hub.url, cache_dir=str(tmp_path)))


def test_hf_endpoint_hf_token_and_hf_home_come_from_the_environment(hub, tmp_path) -> None:
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_secret", "HF_HOME": str(tmp_path / "hf")}
    env.pop("HF_HUB_CACHE", None)
    out = subprocess.run([sys.executable, "-c", "from tokenizer.hub import fetch; print(fetch('org/gated'))"],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert Path(out.stdout.strip()).is_relative_to(tmp_path / "hf" / "hub")


@pytest.mark.integration
def test_kvgate_serve_fetches_from_the_hub_verifies_then_tokenizes_locally(hub, tmp_path) -> None:
    """The product path: `kvgate serve` with KVGATE_TOKENIZER_HUB fetches the model's files by its name from
    HF_ENDPOINT, verifies them against the sim's /tokenize, then stops asking it."""
    import httpx

    from devkit.stack import Stack
    from helpers import free_port, start_kvgate, wait_until

    model = "org/tiny"  # the hub repository of the sim's (test) tokenizer
    with Stack() as stack:
        pods = stack.engines(1, model=model)
        kvgate = start_kvgate(stack, stack.pods_file(pods), {
            "KVGATE_TOKENIZER_HUB": "true", "KVGATE_TOKENIZER_CACHE_DIR": str(tmp_path / "cache"),
            "KVGATE_TOKENIZER_VERIFY_REQUESTS": "2", "KVGATE_TOKENIZER_SAMPLE_RATE": "0",
            "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf")})
        listen = free_port()
        stack.envoy(listen_port=listen, extproc_port=kvgate.grpc_port, pool=[("127.0.0.1", pods[0]["port"])])
        debug = f"http://127.0.0.1:{kvgate.http_port}/debug"
        metrics = kvgate.metrics_url

        def chat(i: int) -> None:
            r = httpx.post(f"http://127.0.0.1:{listen}/v1/chat/completions", timeout=30, json={
                "model": model, "max_tokens": 1, "messages": [{"role": "user", "content": f"question {i}"}]})
            assert r.status_code == 200, r.text

        def state() -> dict:
            return httpx.get(debug, timeout=5).json()["tokenizer"]["models"].get(model, {})

        chat(0)
        wait_until(lambda: state().get("state") == "verifying")  # fetched from the stand-in hub, loaded
        i = 1
        while state()["state"] != "serving":  # each request is answered by the sim and compared
            assert i < 20, state()
            chat(i)
            i += 1
        waited = state()["served"]["remote"]
        for j in range(i, i + 5):
            chat(j)
        after = state()
        assert after["served"]["remote"] == waited and after["served"]["local"] >= 5, after
        assert after["source"].startswith(str(tmp_path / "cache"))
        assert 'kvgate_tokenizer_local_disagreements_total{model="org/tiny"} 0.0' in httpx.get(metrics).text
    assert {s.path.rsplit("/", 1)[1] for s in hub.gets()} >= {"tokenizer_config.json"}
