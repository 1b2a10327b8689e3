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


def test_envoy_yaml_never_fails_open_and_uses_the_epp_data_path():
    config = yaml.safe_load((REPO / "envoy" / "envoy.yaml").read_text())
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")["typed_config"]
    assert ext["failure_mode_allow"] is False
    mode = ext["processing_mode"]
    # response headers go to kvgate (they carry the served endpoint), the token stream does not
    assert mode["request_body_mode"] == "BUFFERED" and mode["response_header_mode"] == "SEND"
    assert mode["response_body_mode"] == "NONE"
    # ...until kvgate's answer to a routed response's headers turns STREAMED on for it (plugin.observe)
    assert ext["allow_mode_override"] is True
    assert {"envoy.lb", "kvgate"} <= set(ext["metadata_options"]["receiving_namespaces"]["untyped"])
    assert {"envoy.lb", "envoy.lb.subset_hint"} <= set(ext["metadata_options"]["forwarding_namespaces"]["untyped"])
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    # the routed paths: override_host over the pool, from envoy.lb metadata only (clients cannot set it)
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    routed = [r for r in routes if r["match"].get("path") in ("/v1/completions", "/v1/chat/completions")]
    assert routed and all(r["route"]["cluster"] == "pool" for r in routed)
    assert all("connect-failure" in r["route"]["retry_policy"]["retry_on"] for r in routed)
    lb = clusters["pool"]["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert lb["name"] == "envoy.load_balancing_policies.override_host"
    sources = lb["typed_config"]["override_host_sources"]
    assert sources == [{"metadata": {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}}]
    assert lb["typed_config"]["selected_host_key"]["path"] == [{"key": "x-gateway-destination-endpoint-served"}]
    # sized for 10,000+ in-flight requests: one upstream request and one ext_proc stream each
    for name in ("pool", "kvgate"):
        limits = clusters[name]["circuit_breakers"]["thresholds"][0]
        assert min(limits["max_connections"], limits["max_pending_requests"], limits["max_requests"]) >= 10_000
    # a dead or draining kvgate replica stops getting streams
    kv = clusters["kvgate"]
    assert kv["health_checks"][0]["grpc_health_check"]["service_name"] == "envoy.service.ext_proc.v3.ExternalProcessor"
    assert "outlier_detection" in kv and ext["grpc_service"]["envoy_grpc"]["retry_policy"]["num_retries"] >= 1


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
