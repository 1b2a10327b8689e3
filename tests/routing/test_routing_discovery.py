"""Static discovery: YAML file (reloaded on change, bad content kept out), one-line list, registry diffs."""
from __future__ import annotations

import asyncio
import os
import textwrap

import pytest

from routing.discovery.static import StaticSource, parse_pods_line, parse_pods_yaml
from routing.errors import DiscoveryError
from routing.metrics import RoutingMetrics
from routing.pods import KVEventsEndpoint, Pod
from routing.registry import PodRegistry

YAML = """
- name: vllm-0
  address: 10.0.0.1
  port: 8000
  model: meta-llama/Llama-3-8B
  kv_events: {pub_port: 6000, dp_size: 2}
  lora: [sql-adapter]
- name: vllm-1
  address: "::1"
  port: 8001
  model: meta-llama/Llama-3-8B
  kv_events: true
- name: vllm-2
  address: localhost
  port: 8002
  model: other
"""


def test_parse_yaml():
    pods = parse_pods_yaml(YAML, "f.yaml")
    assert pods[0] == Pod("vllm-0", "10.0.0.1", 8000, "meta-llama/Llama-3-8B", ("sql-adapter",),
                          KVEventsEndpoint(6000, 5558, 2))
    assert pods[1].kv_events == KVEventsEndpoint() and pods[1].endpoint == "[::1]:8001"
    assert pods[2].kv_events is None and pods[2].lora == ()
    assert parse_pods_yaml("pods: []", "f") == [] and parse_pods_yaml("", "f") == []


@pytest.mark.parametrize("text, message", [
    ("- {name: a, address: x, port: 80}", "missing 'model'"),
    ("- {name: a, address: x, port: 0, model: m}", "port"),
    ("- {name: a, address: x, port: '80', model: m}", "port"),
    ("- {name: a, address: x, port: 80, model: m, colour: red}", "unknown keys"),
    ("- {name: a, address: x, port: 80, model: m, kv_events: {dp_size: 0}}", "dp_size"),
    ("- {name: a, address: x, port: 80, model: m, kv_events: {pubport: 1}}", "unknown keys"),
    ("- {name: a, address: x, port: 80, model: m}\n- {name: a, address: y, port: 80, model: m}", "appears twice"),
    ("name: a", "expected a YAML list"),
    ("- [unclosed", "not valid YAML"),
    ("- 42", "expected a mapping"),
])
def test_parse_yaml_errors_name_the_source(text, message):
    with pytest.raises(DiscoveryError, match=message) as e:
        parse_pods_yaml(text, "pods.yaml")
    assert "pods.yaml" in str(e.value)


def test_parse_line():
    pods = parse_pods_line("a=10.0.0.1:8000/org/model-x, b=[::1]:8001/m?kv&dp=2&lora=x+y,c=host:9/m?kv=6000&replay=none")
    assert pods[0] == Pod("a", "10.0.0.1", 8000, "org/model-x")
    assert (pods[1].address, pods[1].port, pods[1].model) == ("::1", 8001, "m")
    assert pods[1].kv_events == KVEventsEndpoint(5557, 5558, 2) and pods[1].lora == ("x", "y")
    assert pods[2].kv_events == KVEventsEndpoint(6000, None, 1)


@pytest.mark.parametrize("line", ["a", "a=host/m", "a=host:80", "a=host:80/", "a=::1:80/m", "a=[::1/m",
                                  "a=h:99999/m", "a=h:1/m?speed=3", "a=h:1/m,a=h:2/m", "a=h:1/m?dp=x"])
def test_parse_line_errors(line):
    with pytest.raises(DiscoveryError, match="KVGATE_PODS"):
        parse_pods_line(line)


def test_registry_diffs_and_listeners():
    reg = PodRegistry()
    seen = []
    reg.add_listener(lambda added, removed: seen.append(([p.name for p in added], [p.name for p in removed])))
    reg.add_listener(lambda added, removed: 1 / 0)  # a broken listener does not stop the others
    a, b = Pod("a", "10.0.0.1", 80, "m"), Pod("b", "10.0.0.2", 80, "m", lora=("l",))
    reg.replace([a, b])
    reg.replace([a, Pod("b", "10.0.0.2", 80, "m", lora=("l",), ready=False)])  # readiness only: silent
    assert reg.ready_pods("m") == [a] and reg.ready_pods("l") == []
    reg.replace([Pod("a", "10.0.0.9", 80, "m")])  # moved + b gone
    assert seen == [(["a", "b"], []), (["a"], ["a", "b"])]
    assert reg.models() == {"m"}



def test_registry_candidates_follow_every_replace():
    """candidates() is kept between requests; every replace (a readiness flip too, which notifies no
    listener) gives the new answer."""
    a, b = Pod("a", "10.0.0.1", 80, "m"), Pod("b", "10.0.0.2", 80, "m", lora=("l",))
    reg = PodRegistry([a, b])
    assert reg.candidates("m") == ((a, b), (a, b)) and reg.candidates("l") == ((b,), (b,))
    assert reg.candidates("nope") == ((), ())
    b_down = Pod("b", "10.0.0.2", 80, "m", lora=("l",), ready=False)
    reg.replace([a, b_down])
    assert reg.candidates("m") == ((a, b_down), (a,)) and reg.candidates("l") == ((b_down,), ())
    reg.replace([b])
    assert reg.candidates("m") == ((b,), (b,))

async def test_static_file_reload(tmp_path):
    path = tmp_path / "pods.yaml"
    path.write_text(YAML)
    metrics = RoutingMetrics()
    src = StaticSource(str(path), "extra=127.0.0.1:9000/other", poll_interval_s=3600, metrics=metrics)
    reg = PodRegistry()
    changes = []
    reg.add_listener(lambda added, removed: changes.append((sorted(p.name for p in added),
                                                             sorted(p.name for p in removed))))
    await src.start(reg)
    try:
        assert sorted(p.name for p in reg.pods()) == ["extra", "vllm-0", "vllm-1", "vllm-2"]
        assert src.check_now() is False  # unchanged file: nothing re-read

        path.write_text(textwrap.dedent(YAML).replace("port: 8002", "port: 8102"))
        os.utime(path, ns=(1, 1))
        assert src.check_now() is True
        assert reg.get("vllm-2").port == 8102
        assert changes[-1] == (["vllm-2"], ["vllm-2"])

        path.write_text("- {name: broken")  # bad content: logged, counted, last good list kept
        os.utime(path, ns=(2, 2))
        assert src.check_now() is False
        assert reg.get("vllm-2").port == 8102 and src.reload_errors == 1
        assert "pods.yaml" in src.last_error
        assert metrics.registry.get_sample_value("kvgate_discovery_errors_total", {"source": "static"}) == 1

        path.unlink()  # a vanished file too
        assert src.check_now() is False and src.reload_errors == 2 and len(reg.pods()) == 4
    finally:
        await src.stop()


async def test_static_file_polling_picks_up_a_change(tmp_path):
    path = tmp_path / "pods.yaml"
    path.write_text("- {name: a, address: 127.0.0.1, port: 8000, model: m}\n")
    src = StaticSource(str(path), poll_interval_s=0.02)
    reg = PodRegistry()
    await src.start(reg)
    changed = asyncio.Event()
    reg.add_listener(lambda added, removed: changed.set())
    try:
        path.write_text("- {name: b, address: 127.0.0.1, port: 8001, model: m}\n")
        os.utime(path, ns=(5, 5))
        await asyncio.wait_for(changed.wait(), 10)
        assert [p.name for p in reg.pods()] == ["b"]
    finally:
        await src.stop()


async def test_static_start_raises_on_bad_file(tmp_path):
    path = tmp_path / "pods.yaml"
    path.write_text("- {name: a}")
    with pytest.raises(DiscoveryError, match=str(path)):
        await StaticSource(str(path)).start(PodRegistry())
    with pytest.raises(DiscoveryError, match="KVGATE_PODS_FILE or KVGATE_PODS"):
        StaticSource("", "")
    with pytest.raises(DiscoveryError, match="cannot read"):
        await StaticSource(str(tmp_path / "missing.yaml")).start(PodRegistry())
