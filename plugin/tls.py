"""TLS on kvgate's ext_proc gRPC port (KVGATE_GRPC_TLS): a configured certificate, or a self-signed one
made at start-up, as the Inference Extension's reference endpoint picker does.

Gateways that reach an InferencePool's endpoint picker over TLS (Envoy AI Gateway) do not verify its
certificate: TLS there encrypts the stream, it does not authenticate kvgate. Kubernetes' gRPC probes
speak plaintext only, so with TLS on the health services are also served on KVGATE_GRPC_HEALTH_PORT.
"""
from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc

SELF_SIGNED_DAYS = 3650  # the process restarts long before; the peer does not check it anyway


def self_signed(hosts: tuple[str, ...] = ("localhost", "127.0.0.1")) -> tuple[bytes, bytes]:
    """A fresh P-256 key and a self-signed server certificate for `hosts` (names or IPs), both PEM."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvgate")])
    alt: list[x509.GeneralName] = []
    for host in hosts:
        try:
            alt.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt.append(x509.DNSName(host))
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=SELF_SIGNED_DAYS))
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def _read_pem(variable: str, path: str, marker: bytes) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{variable}={path!r}: cannot read it ({e.strerror or e})") from None
    if marker not in data:
        raise ValueError(f"{variable}={path!r}: not a PEM file holding a {marker.decode().strip('-')}")
    return data


def server_keys(mode: str, cert_path: str = "", key_path: str = "") -> tuple[bytes, bytes] | None:
    """The gRPC port's certificate and key (PEM) for KVGATE_GRPC_TLS `mode`: None for `off` (plaintext);
    ValueError naming the variable when a configured file cannot be used."""
    if mode == "off":
        return None
    if mode == "self-signed":
        return self_signed()
    if mode == "files":
        return (_read_pem("KVGATE_GRPC_TLS_CERT", cert_path, b"-----BEGIN CERTIFICATE-----"),
                _read_pem("KVGATE_GRPC_TLS_KEY", key_path, b"PRIVATE KEY-----"))
    raise ValueError(f"KVGATE_GRPC_TLS={mode!r}: expected off, self-signed or files")


def grpcio_credentials(keys: tuple[bytes, bytes]) -> grpc.ServerCredentials:
    """server_keys' (certificate, key) as grpcio's server credentials."""
    cert, key = keys
    return grpc.ssl_server_credentials([(key, cert)])


def server_credentials(mode: str, cert_path: str = "", key_path: str = "") -> grpc.ServerCredentials | None:
    """As server_keys, as grpcio's server credentials."""
    keys = server_keys(mode, cert_path, key_path)
    return None if keys is None else grpcio_credentials(keys)
