"""devkit.stack's ports for loopback stacks: drawn below the ephemeral range, never drawn twice at once on
the machine (pytest-xdist's workers and CI's two suites draw side by side), and test Envoys bind theirs
alone (with SO_REUSEPORT a second Envoy given a port in use shared it silently)."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from devkit import stack
from devkit.stack import free_port, free_port_run, render_envoy_config

REPO = Path(__file__).resolve().parents[2]

_DRAW = """
import json, sys
from devkit.stack import free_port
print(json.dumps([free_port() for _ in range(int(sys.argv[1]))]), flush=True)
"""


def test_ports_are_drawn_below_the_ephemeral_range_bindable_and_not_twice():
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == 200
    assert all(stack._PORTS[0] <= p < stack._PORTS[1] for p in ports)
    for p in ports[:20]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
    base = free_port_run(4)
    assert not set(range(base, base + 4)) & set(ports)


def test_another_process_never_draws_a_port_this_one_holds_a_claim_on():
    mine = {free_port() for _ in range(1000)}  # a twelfth of the range
    theirs = subprocess.run([sys.executable, "-c", _DRAW, "1000"], capture_output=True, text=True, check=True,
                            cwd=REPO, timeout=60)
    drawn = set(json.loads(theirs.stdout))
    assert len(drawn) == 1000 and not drawn & mine


def test_test_envoys_bind_without_reuse_port_and_the_shipped_rendering_keeps_it():
    config = render_envoy_config(listen_port=1, admin_port=2, extproc_port=3, pool=[("127.0.0.1", 4)])
    assert config["static_resources"]["listeners"][0]["enable_reuse_port"] is False
    shipped = render_envoy_config(listen_port=1, admin_port=2, extproc_port=3, pool=[], reuse_port=True)
    assert "enable_reuse_port" not in shipped["static_resources"]["listeners"][0]
