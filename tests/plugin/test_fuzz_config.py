"""Invalid configuration stops the real `kvgate serve` at start-up: exit status 2, the variable's
name on stderr, no traceback, no secret echoed. Extends tests/plugin/test_plugin_config.py (which runs
one bad port through the process and the rest through Settings.from_env)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BASE = {"PATH": "/usr/bin:/bin", "KVGATE_PODS": "p0=127.0.0.1:8000/m", "KVGATE_GRPC_PORT": "0",
        "KVGATE_HTTP_PORT": "0"}

BAD = [
    ("KVGATE_GRPC_PORT", "-1"),
    ("KVGATE_HTTP_PORT", "8080.5"),
    ("KVGATE_DISCOVERY", "consul"),
    ("KVGATE_ROUTING_STRATEGY", "KV-SYNC"),
    ("KVGATE_TOKENIZER", "hub"),
    ("KVGATE_TOKENIZER_TIMEOUT_S", "inf"),
    ("KVGATE_TOKENIZER_TIMEOUT_S", "0"),
    ("KVGATE_TOKENIZER_CACHE_MB", "-5"),
    ("KVGATE_MAX_BODY_BYTES", "100"),
    ("KVGATE_MAX_BODY_BYTES", "1e6"),
    ("KVGATE_TARGET_POD_HEADER", "2"),
    ("KVGATE_INDEX_MAX_ENTRIES", "0"),
    ("KVGATE_KV_EVENTS_BACKOFF_MIN_S", "-0.1"),
    ("KVGATE_KV_EVENTS_REPLAY_TIMEOUT_S", "soon"),
    ("KVGATE_LOG_LEVEL", "verbose"),
    ("KVGATE_REDIS_URL", "redis:/127.0.0.1:6379"),
    ("KVGATE_GRPC_PORT", "5\u00a05"),
    ("KVGATE_ROUTING_STRATEGY", "kv-sync:1.5,random"),  # a weighted mix: integer weights only (AIBrix)
]


def _serve(env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "plugin.cli", "serve"], env=env, cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_each_bad_value_exits_2_naming_its_variable(monkeypatch, capsys):
    """`kvgate serve`'s own entry point (plugin.cli.main) per value, in this process: the same code from
    the command line to the exit status, without an interpreter start per value (the process itself:
    the test below and the ones after it). A value let through would start serving: that fails here."""
    from plugin import cli, serve

    async def serving(settings):
        raise AssertionError(f"kvgate serve started with a bad value: {settings}")

    monkeypatch.setattr(serve, "_serve", serving)
    failures = []
    for name, value in BAD:
        with monkeypatch.context() as m:
            for k in [k for k in os.environ if k.startswith("KVGATE_")]:
                m.delenv(k)
            for k, v in {**BASE, name: value}.items():
                m.setenv(k, v)
            try:
                code = cli.main(["serve"])
            except Exception as e:  # a traceback from the real process
                code = f"{type(e).__name__}: {e}"
        err = capsys.readouterr().err
        if code != 2 or name not in err:
            failures.append((name, value, code, err[-300:]))
    assert failures == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name, value", [BAD[0], BAD[-2]])
def test_a_bad_value_exits_the_process_with_2_naming_its_variable(name, value):
    proc = _serve({**BASE, name: value})
    out, err = proc.communicate(timeout=50)
    assert proc.returncode == 2 and name in err and "Traceback" not in err, err[-500:]


@pytest.mark.timeout(60)
def test_bad_redis_url_is_named_without_its_password():
    proc = _serve({**BASE, "KVGATE_REDIS_URL": "http://admin:hunter2-secret@10.0.0.1:6379"})
    out, err = proc.communicate(timeout=50)
    assert proc.returncode == 2 and "KVGATE_REDIS_URL" in err
    assert "hunter2" not in err + out


@pytest.mark.timeout(60)
def test_malformed_pods_line_exits_2_naming_the_variable():
    proc = _serve({**BASE, "KVGATE_PODS": "garbage"})
    out, err = proc.communicate(timeout=50)
    assert proc.returncode == 2 and "KVGATE_PODS" in err and "Traceback" not in err, err[-500:]


@pytest.mark.timeout(60)
def test_unreadable_pods_file_stops_start_up_naming_the_variable():
    proc = _serve({**{k: v for k, v in BASE.items() if k != "KVGATE_PODS"}, "KVGATE_PODS_FILE": "/nonexistent/pods.yaml"})
    out, err = proc.communicate(timeout=50)
    # The value is well-formed; its file is not there: a start-up failure (status 1), named.
    assert proc.returncode != 0 and "KVGATE_PODS_FILE" in err and "Traceback" not in err
