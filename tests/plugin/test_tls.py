"""plugin.tls: KVGATE_GRPC_TLS=files' certificate and key read again once renewed, on kvgate's gRPC server and on
grpcio's; a pair that does not load keeps the one in use serving (logged, counted); the look at the files is
throttled."""
from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from plugin import grpcserver
from plugin.tls import ServerKeys, server_keys, self_signed


def _install(tmp: Path, cert: bytes, key: bytes) -> None:
    """As kubelet updates a mounted Secret: the new files written aside, then swapped in one step each."""
    for name, data in (("tls.crt", cert), ("tls.key", key)):
        aside = tmp / f".{name}.new"
        aside.write_bytes(data)
        os.replace(aside, tmp / name)


def _der(pem: bytes) -> bytes:
    return ssl.PEM_cert_to_DER_cert(pem.decode())


async def _served_cert(port: int) -> bytes:
    """The certificate a new TLS connection to `port` is shown (DER)."""
    client = ssl.create_default_context()
    client.check_hostname = False
    client.verify_mode = ssl.CERT_NONE
    client.set_alpn_protocols(["h2"])
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client)
    try:
        return writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
    finally:
        writer.close()


def _reloads(registry: CollectorRegistry, result: str) -> float | None:
    return registry.get_sample_value("kvgate_grpc_tls_reloads_total", {"result": result})


async def test_renewed_files_are_served_to_new_connections_and_a_pair_that_does_not_load_keeps_the_last(tmp_path, caplog):
    first, second, third = self_signed(), self_signed(), self_signed()
    _install(tmp_path, *first)
    registry = CollectorRegistry()
    keys = server_keys("files", str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"), registry=registry, check_s=0.0)
    assert keys is not None and _reloads(registry, "ok") == 0 and _reloads(registry, "failed") == 0  # exported
    server = grpcserver.Server()
    server.add(grpcserver.HEALTH_SERVICE, grpcserver.health_methods(health.aio.HealthServicer()))
    port = await server.listen("127.0.0.1", 0, keys.context)
    try:
        assert await _served_cert(port) == _der(first[0])
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(first[0])) as before:
            stub = health_pb2_grpc.HealthStub(before)
            assert (await stub.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING

            _install(tmp_path, *second)  # renewed
            assert await _served_cert(port) == _der(second[0])
            assert _reloads(registry, "ok") == 1
            # a connection made before goes on with the certificate it was made with
            assert (await stub.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING

        _install(tmp_path, third[0], second[1])  # the new certificate in before its key: not a pair
        assert await _served_cert(port) == _der(second[0])
        assert _reloads(registry, "failed") == 1 and _reloads(registry, "ok") == 1
        assert "cannot be used" in caplog.text and "still serving the certificate read before" in caplog.text
        assert await _served_cert(port) == _der(second[0])  # not tried again until the files change again
        assert _reloads(registry, "failed") == 1

        _install(tmp_path, *third)  # the key follows
        assert await _served_cert(port) == _der(third[0])
        assert _reloads(registry, "ok") == 2
    finally:
        await server.stop(0)


@contextlib.asynccontextmanager
async def _grpcio_serving(tmp_path: Path, first: tuple[bytes, bytes], registry: CollectorRegistry | None = None):
    """grpcio's server on KVGATE_GRPC_TLS=files' files (`first` installed), the files looked at every time: (keys,
    port)."""
    _install(tmp_path, *first)
    keys = server_keys("files", str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"), registry=registry, check_s=0.0)
    assert keys is not None
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", keys.grpcio_credentials())
    await server.start()
    try:
        yield keys, port
    finally:
        await server.stop(0)


async def test_grpcio_server_serves_renewed_files_too(tmp_path):
    first, second = self_signed(), self_signed()
    async with _grpcio_serving(tmp_path, first) as (_, port):
        assert await _served_cert(port) == _der(first[0])
        _install(tmp_path, *second)
        assert await _served_cert(port) == _der(second[0])
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", grpc.ssl_channel_credentials(second[0])) as channel:
            answer = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert answer.status == health_pb2.HealthCheckResponse.SERVING


async def test_grpcio_gets_a_renewal_a_scrape_found_first(tmp_path):
    """A scrape of the expiry looks at the files too: the renewal it takes must still reach grpcio's next handshake,
    which asks only whether the pair changed since it last got one."""
    first, second = self_signed(), self_signed()
    registry = CollectorRegistry()
    async with _grpcio_serving(tmp_path, first, registry) as (keys, port):
        assert await _served_cert(port) == _der(first[0])
        _install(tmp_path, *second)
        registry.get_sample_value("kvgate_grpc_tls_certificate_expiry_timestamp_seconds")  # a scrape: reloads
        assert keys.pem == second
        assert await _served_cert(port) == _der(second[0])


def test_the_files_are_looked_at_no_more_often_than_the_check_period(tmp_path):
    first, second = self_signed(), self_signed()
    _install(tmp_path, *first)
    now = [100.0]
    keys = ServerKeys(first, (str(tmp_path / "tls.crt"), str(tmp_path / "tls.key")), check_s=5.0,
                      clock=lambda: now[0])
    _install(tmp_path, *second)
    now[0] += 4.0
    assert not keys.check() and keys.pem == first
    now[0] += 1.0
    assert keys.check() and keys.pem == second
    now[0] += 5.0
    assert not keys.check()  # unchanged since


def test_a_renewal_landing_while_the_files_are_first_read_is_taken_at_the_next_look(tmp_path, monkeypatch):
    """The files are looked at before they are read at start: a renewal written while they are being read (its
    stat then differs from the one taken) is taken at the next look, not missed until the files change again."""
    import plugin.tls as tls_module
    first, second = self_signed(), self_signed()
    _install(tmp_path, *first)
    read = tls_module._read_pair

    def read_then_renewed(cert_path: str, key_path: str) -> tuple[bytes, bytes]:
        pem = read(cert_path, key_path)
        _install(tmp_path, *second)  # renewed just after the first read
        return pem

    monkeypatch.setattr(tls_module, "_read_pair", read_then_renewed)
    keys = server_keys("files", str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"), check_s=0.0)
    monkeypatch.setattr(tls_module, "_read_pair", read)
    assert keys is not None and keys.pem == first
    assert keys.check() and keys.pem == second


def test_a_certificate_and_key_that_are_not_a_pair_fail_at_start_naming_both_variables(tmp_path):
    cert, _ = self_signed()
    _, other_key = self_signed()
    _install(tmp_path, cert, other_key)
    with pytest.raises(ValueError, match="^KVGATE_GRPC_TLS_CERT=.* and KVGATE_GRPC_TLS_KEY=.*do not load"):
        server_keys("files", str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"))


def test_fixed_keys_are_never_read_again():
    keys = server_keys("self-signed")
    assert keys is not None and not keys.check()
    assert isinstance(keys.context(), ssl.SSLContext)
    assert server_keys("off") is None
    assert isinstance(keys.grpcio_credentials(), grpc.ServerCredentials)  # grpcio's static ones for a fixed pair


def test_the_served_certificates_expiry_is_exported_and_a_scrape_sees_a_renewal(tmp_path):
    """kvgate_grpc_tls_certificate_expiry_timestamp_seconds: when the certificate new connections get expires. A
    renewal is seen at a scrape too (Envoy's connections to kvgate live long: none may be made for days), so an
    alert on the expiry does not fire for a certificate already renewed on disk."""
    old, new = self_signed(days=2), self_signed(days=90)
    _install(tmp_path, *old)
    registry = CollectorRegistry()
    server_keys("files", str(tmp_path / "tls.crt"), str(tmp_path / "tls.key"), registry=registry, check_s=0.0)

    def expiry() -> float | None:
        return registry.get_sample_value("kvgate_grpc_tls_certificate_expiry_timestamp_seconds")
    assert abs(expiry() - (time.time() + 2 * 86400)) < 600
    _install(tmp_path, *new)
    assert abs(expiry() - (time.time() + 90 * 86400)) < 600
    assert _reloads(registry, "ok") == 1
    _install(tmp_path, b"-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n", new[1])
    assert abs(expiry() - (time.time() + 90 * 86400)) < 600  # the pair in use is still the renewed one
    made = CollectorRegistry()
    server_keys("self-signed", registry=made)
    assert made.get_sample_value("kvgate_grpc_tls_certificate_expiry_timestamp_seconds") > time.time() + 3000 * 86400
