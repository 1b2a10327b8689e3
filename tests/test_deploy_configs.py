"""The shipped deployment files: Envoy config, Envoy Gateway manifests, docker-compose."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from plugin.config import VARIABLES, Settings
from plugin.stack import find_envoy, render_envoy_config
from routing.discovery import parse_pods_line

REPO = Path(__file__).resolve().parent.parent
KNOWN = {v.env for v in VARIABLES}


def test_envoy_yaml_validates_with_real_envoy(tmp_path):
    proc = subprocess.run([find_envoy(), "--mode", "validate", "-c", str(REPO / "envoy" / "envoy.yaml")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rendered = tmp_path / "r.yaml"
    rendered.write_text(yaml.safe_dump(render_envoy_config(listen_port=1, admin_port=2, extproc_port=3,
                                                           pool=[("127.0.0.1", 4)])))
    proc = subprocess.run([find_envoy(), "--mode", "validate", "-c", str(rendered)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_envoy_yaml_never_fails_open_and_skips_response_phases():
    config = yaml.safe_load((REPO / "envoy" / "envoy.yaml").read_text())
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")["typed_config"]
    assert ext["failure_mode_allow"] is False
    mode = ext["processing_mode"]
    assert mode["request_body_mode"] == "BUFFERED" and mode["response_header_mode"] == "SKIP"
    assert mode["response_body_mode"] == "NONE"
    assert {"envoy.lb", "kvgate"} <= set(ext["metadata_options"]["receiving_namespaces"]["untyped"])


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_gateway_manifests_parse_and_are_wired():
    files = sorted((REPO / "envoy" / "gateway").glob("*.yaml"))
    assert files
    kinds = {}
    for f in files:
        for doc in _docs(f):
            assert {"apiVersion", "kind", "metadata"} <= set(doc), f
            kinds.setdefault(doc["kind"], []).append(doc)
    for kind in ("Deployment", "Service", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Gateway",
                 "HTTPRoute", "EnvoyExtensionPolicy", "EnvoyPatchPolicy"):
        assert kind in kinds, kind
    rules = kinds["ClusterRole"][0]["rules"]
    assert any("pods" in r["resources"] and {"list", "watch"} <= set(r["verbs"]) for r in rules)
    container = kinds["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"] for e in container["env"]}
    assert env <= KNOWN, env - KNOWN
    ext = kinds["EnvoyExtensionPolicy"][0]["spec"]["extProc"][0]
    assert ext["failOpen"] is False and ext["processingMode"]["request"]["body"] == "Buffered"
    patch = kinds["EnvoyPatchPolicy"][0]["spec"]["jsonPatches"][0]["operation"]["value"]
    assert patch["original_dst_lb_config"]["http_header_name"] == "x-gateway-destination-endpoint"


def test_compose_file_uses_known_settings():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"envoy", "kvgate", "redis", "sim1", "sim2", "sim3", "loadgen"} <= set(services)
    env = services["kvgate"]["environment"]
    assert set(env) <= KNOWN
    Settings.from_env(env)  # every value valid
    pods = parse_pods_line(env["KVGATE_PODS"])
    assert len(pods) == 3 and all(p.kv_events is not None for p in pods)


@pytest.mark.skipif(not shutil.which("docker-compose") and not os.environ.get("CI"),
                    reason="docker-compose (Debian package) not installed; ./dev installs it as root")
def test_compose_file_validates_with_docker_compose():
    proc = subprocess.run(["docker-compose", "-f", str(REPO / "docker-compose.yml"), "config", "-q"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
