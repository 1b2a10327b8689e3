"""Prefill/decode roles: from the pods file, the one-line list, and both Kubernetes label conventions; on /debug."""
from __future__ import annotations

import pytest

from routing.discovery.inferencepool import member_from_object
from routing.discovery.k8s import pod_from_object, role_from_labels
from routing.discovery.static import parse_pods_line, parse_pods_yaml
from routing.errors import DiscoveryError
from routing.pods import Pod
from routing.registry import PodRegistry
from routing.router import Router


def _k8s(labels: dict) -> dict:
    return {"metadata": {"name": "p", "namespace": "llm", "labels": {"model.aibrix.ai/name": "m", **labels}},
            "status": {"podIP": "10.0.0.1", "phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}}


def test_pods_file_roles_default_both_and_bad_role_named():
    pods = parse_pods_yaml("""
- {name: p0, address: 10.0.0.1, port: 8000, model: m, role: prefill, roleset: rs1}
- {name: d0, address: 10.0.0.2, port: 8000, model: m, role: decode, roleset: rs1}
- {name: a0, address: 10.0.0.3, port: 8000, model: m}
""", "pods.yaml")
    assert [(p.name, p.role, p.roleset, p.prefills, p.decodes) for p in pods] == [
        ("p0", "prefill", "rs1", True, False), ("d0", "decode", "rs1", False, True), ("a0", "both", "", True, True)]
    with pytest.raises(DiscoveryError, match=r"pods.yaml: pod #0.role: expected one of both, prefill, decode"):
        parse_pods_yaml("- {name: x, address: 10.0.0.1, port: 8000, model: m, role: prefil}", "pods.yaml")
    with pytest.raises(ValueError, match="role must be one of"):
        Pod("x", "10.0.0.1", 8000, "m", role="encode")


def test_pods_line_role_option():
    pods = parse_pods_line("p=10.0.0.1:8000/m?role=prefill,d=10.0.0.2:8000/m?kv&role=decode,a=10.0.0.3:8000/m")
    assert [p.role for p in pods] == ["prefill", "decode", "both"]
    with pytest.raises(DiscoveryError, match="role='x'"):
        parse_pods_line("p=10.0.0.1:8000/m?role=x")


@pytest.mark.parametrize("labels, expected", [
    ({"role-name": "prefill", "roleset-name": "rs-a"}, ("prefill", "rs-a")),  # AIBrix StormService
    ({"role-name": "decode", "roleset-name": "rs-a"}, ("decode", "rs-a")),
    ({"role-name": "routing"}, ("both", "")),  # another AIBrix role: serves whole requests
    ({"llm-d.ai/role": "prefill"}, ("prefill", "")),  # llm-d
    ({"llm-d.ai/role": "decode"}, ("decode", "")),
    ({"llm-d.ai/role": "both"}, ("both", "")),
    ({}, ("both", "")),
])
def test_kubernetes_role_labels(labels, expected):
    assert role_from_labels(labels) == expected
    pod = pod_from_object(_k8s(labels))
    assert pod is not None and (pod.role, pod.roleset) == expected
    member = member_from_object(_k8s(labels))  # the InferencePool source reads the same labels
    assert member is not None and (member.role, member.roleset) == expected


def test_debug_shows_roles():
    registry = PodRegistry([Pod("p0", "10.0.0.1", 8000, "m", role="prefill", roleset="rs"),
                            Pod("d0", "10.0.0.2", 8000, "m", role="decode", roleset="rs")])
    pods = Router(registry, default_strategy="least-request").debug_snapshot()["pods"]
    assert [(p["name"], p["role"], p["roleset"]) for p in pods] == [("d0", "decode", "rs"), ("p0", "prefill", "rs")]
