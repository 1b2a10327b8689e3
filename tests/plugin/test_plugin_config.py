"""Configuration: one table, every variable read and used, bad values named, exit status 2."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from plugin.config import GENERATED, VARIABLES, ConfigError, Settings, markdown_table, redact_url

REPO = Path(__file__).resolve().parents[2]
BASE = {"KVGATE_PODS": "p0=127.0.0.1:8000/m"}


def test_readme_tables_are_the_generated_ones():
    readme = (REPO / "README.md").read_text()
    assert markdown_table() in readme, "README's table is stale: regenerate it with `python -m plugin.config README.md`"
    for marker, make in GENERATED.items():
        assert make() in readme, f"README's {marker} is stale: regenerate it with `python -m plugin.config README.md`"


def test_every_setting_is_used_by_the_wiring():
    # "Documented but read nowhere" is a defect: every field must be consumed outside config.py.
    sources = "\n".join(p.read_text() for p in (REPO / "plugin").glob("*.py") if p.name != "config.py")
    for var in VARIABLES:
        assert re.search(rf"\b(settings|s)\.{var.field}\b", sources), f"{var.env} is read but never used"


def test_defaults_and_overrides():
    s = Settings.from_env({**BASE, "KVGATE_GRPC_PORT": "6000", "KVGATE_TARGET_POD_HEADER": "false",
                           "KVGATE_ROUTING_STRATEGY": "least-request", "KVGATE_TOKENIZER_TIMEOUT_S": "0.5"})
    assert s.grpc_port == 6000 and s.target_pod_header is False
    assert s.routing_strategy == "least-request" and s.tokenizer_timeout_s == 0.5
    assert Settings.from_env(BASE).http_port == 8080


@pytest.mark.parametrize("env, name", [
    ({"KVGATE_GRPC_PORT": "70000"}, "KVGATE_GRPC_PORT"),
    ({"KVGATE_GRPC_PORT": "abc"}, "KVGATE_GRPC_PORT"),
    ({"KVGATE_ROUTING_STRATEGY": "fastest"}, "KVGATE_ROUTING_STRATEGY"),
    ({"KVGATE_TARGET_POD_HEADER": "maybe"}, "KVGATE_TARGET_POD_HEADER"),
    ({"KVGATE_TOKENIZER_TIMEOUT_S": "-1"}, "KVGATE_TOKENIZER_TIMEOUT_S"),
    ({"KVGATE_TOKENIZER_TIMEOUT_S": "nan"}, "KVGATE_TOKENIZER_TIMEOUT_S"),
    ({"KVGATE_REDIS_URL": "http://x"}, "KVGATE_REDIS_URL"),
    ({"KVGATE_TOKENIZER": "local"}, "KVGATE_TOKENIZER_PATH"),
    ({"KVGATE_PODZ": "x"}, "KVGATE_PODZ"),
    ({"KVGATE_ROUTING_WEIGHTS": "kv-sync:magic=1"}, "KVGATE_ROUTING_WEIGHTS"),
    ({"KVGATE_ROUTING_GUARD_SLACK": "-3"}, "KVGATE_ROUTING_GUARD_SLACK"),
    ({"KVGATE_PODS_POLL_S": "0"}, "KVGATE_PODS_POLL_S"),
    ({"KVGATE_HTTP_PORT": "50051"}, "KVGATE_HTTP_PORT"),
    ({"KVGATE_GRPC_TLS": "on"}, "KVGATE_GRPC_TLS"),
    ({"KVGATE_GRPC_TLS": "files", "KVGATE_GRPC_TLS_KEY": "k.pem"}, "KVGATE_GRPC_TLS_CERT"),
    ({"KVGATE_GRPC_TLS_CERT": "c.pem", "KVGATE_GRPC_TLS_KEY": "k.pem"}, "KVGATE_GRPC_TLS_CERT"),
    ({"KVGATE_GRPC_HEALTH_PORT": "50051"}, "KVGATE_GRPC_HEALTH_PORT"),
    ({"KVGATE_KV_EVENTS_BACKOFF_MIN_S": "5", "KVGATE_KV_EVENTS_BACKOFF_MAX_S": "1"}, "KVGATE_KV_EVENTS_BACKOFF_MAX_S"),
])
def test_bad_values_name_the_variable(env, name):
    with pytest.raises(ConfigError) as info:
        Settings.from_env({**BASE, **env})
    assert str(info.value).startswith(name)


def test_static_discovery_needs_pods():
    with pytest.raises(ConfigError, match="KVGATE_PODS_FILE or KVGATE_PODS"):
        Settings.from_env({})


def test_secrets_are_not_echoed():
    with pytest.raises(ConfigError) as info:
        Settings.from_env({**BASE, "KVGATE_REDIS_URL": "http://user:hunter2@host"})
    assert "hunter2" not in str(info.value)
    s = Settings.from_env({**BASE, "KVGATE_REDIS_URL": "rediss://default:hunter2@127.0.0.1:6380/0"})
    assert "hunter2" not in str(s.redacted())
    assert "pw" not in redact_url("redis://:pw@h:1/0")


def test_serve_exits_2_naming_the_variable():
    env = {"PATH": "/usr/bin:/bin", "KVGATE_PODS": "p0=127.0.0.1:8000/m", "KVGATE_GRPC_PORT": "99999"}
    proc = subprocess.run([sys.executable, "-m", "plugin.cli", "serve"], env=env, capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert proc.returncode == 2
    assert "KVGATE_GRPC_PORT" in proc.stderr
