"""TLS on kvgate's ext_proc gRPC port (KVGATE_GRPC_TLS): a configured certificate, or a self-signed one
made at start-up, as the Inference Extension's reference endpoint picker does.

Gateways that reach an InferencePool's endpoint picker over TLS (Envoy AI Gateway) do not verify its
certificate: TLS there encrypts the stream, it does not authenticate kvgate. Kubernetes' gRPC probes
speak plaintext only, so with TLS on the health services are also served on KVGATE_GRPC_HEALTH_PORT.

Configured files (`files`) are read again once they change, so a renewed certificate (cert-manager
rewriting the Secret that kubelet mounts) is served without a restart: looked at when a peer connects,
at most every RELOAD_CHECK_S; a connection keeps the certificate it was made with. A pair that does not
load (a certificate copied in before its key) leaves the one in use serving: logged, counted in
kvgate_grpc_tls_reloads_total{result="failed"}, and tried again once the files change again.

kvgate_grpc_tls_certificate_expiry_timestamp_seconds is when the certificate in use expires (its notAfter): an
alert on it catches a renewal that never came. Each scrape looks at the files too, as a new connection does:
Envoy keeps its connections to kvgate for days, and a certificate renewed on disk must not look expired.
"""
from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import ssl
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge

log = logging.getLogger(__name__)

RELOAD_CHECK_S = 5.0  # how often, at most, the configured files are looked at (at a new connection)

SELF_SIGNED_DAYS = 3650  # the process restarts long before; the peer does not check it anyway


def self_signed(hosts: tuple[str, ...] = ("localhost", "127.0.0.1"),
                days: int = SELF_SIGNED_DAYS) -> tuple[bytes, bytes]:
    """A fresh P-256 key and a self-signed server certificate for `hosts` (names or IPs), valid `days`, both
    PEM."""
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
            .not_valid_after(now + datetime.timedelta(days=days))
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


def _read_pair(cert_path: str, key_path: str) -> tuple[bytes, bytes]:
    return (_read_pem("KVGATE_GRPC_TLS_CERT", cert_path, b"-----BEGIN CERTIFICATE-----"),
            _read_pem("KVGATE_GRPC_TLS_KEY", key_path, b"PRIVATE KEY-----"))


def _not_after(cert: bytes) -> float:
    """When the first certificate of PEM `cert` (the server's own, before its chain) expires, Unix seconds; NaN
    for one the `cryptography` package does not read (OpenSSL took it: it serves)."""
    from cryptography import x509
    try:
        return x509.load_pem_x509_certificate(cert).not_valid_after_utc.timestamp()
    except ValueError as e:
        log.warning("gRPC TLS: the certificate's expiry cannot be read (%s); "
                    "kvgate_grpc_tls_certificate_expiry_timestamp_seconds is NaN", e)
        return float("nan")


def _context(pem: tuple[bytes, bytes]) -> ssl.SSLContext:
    from plugin.grpcserver import tls_context
    return tls_context(*pem)


class ServerKeys:
    """The gRPC port's certificate and key: fixed, or (`paths`) KVGATE_GRPC_TLS=files' files, read again once
    either changed (their inode, size or mtime), looked at no more often than `check_s`. `pem` is the pair in
    use (`pem` None: read from `paths`); `context()` the TLS context for a new connection (kvgate's server),
    `grpcio_credentials()` grpcio's."""

    def __init__(self, pem: tuple[bytes, bytes] | None, paths: tuple[str, str] | None = None, *,
                 check_s: float = RELOAD_CHECK_S, clock: Callable[[], float] = time.monotonic,
                 registry: CollectorRegistry | None = None) -> None:
        self._paths = paths
        # looked at before the files are read (`pem` None: read here), so that a change landing while they are
        # read is taken at the next look, not missed until the files change again
        self._seen = self._stat()
        if pem is None:
            assert paths is not None
            pem = _read_pair(*paths)
        self.pem = pem
        self.loads = 1  # pairs taken so far: a reader that asks on its own (grpcio) compares it with its last
        self._context = _context(pem)  # a pair that does not load fails here, at start-up
        self._expiry = _not_after(pem[0])
        self._check_s = check_s
        self._clock = clock
        self._checked = clock()
        self._lock = threading.Lock()  # grpcio asks from its own threads, the metrics server from its own
        registry = registry if registry is not None else CollectorRegistry()
        self.reloads = Counter("kvgate_grpc_tls_reloads", "Reloads of KVGATE_GRPC_TLS=files' certificate and key "
                               "after the files changed, by result: ok, or failed (the pair in use kept serving)",
                               ["result"], registry=registry)
        for result in ("ok", "failed"):
            self.reloads.labels(result)  # both series from the start
        Gauge("kvgate_grpc_tls_certificate_expiry_timestamp_seconds", "When the gRPC port's certificate in use "
              "expires (its notAfter, Unix seconds); KVGATE_GRPC_TLS=files' files are looked at again at each "
              "scrape", registry=registry).set_function(self._expires)

    def _stat(self) -> tuple | None:
        if self._paths is None:
            return None
        try:
            return tuple((st.st_ino, st.st_size, st.st_mtime_ns) for st in map(os.stat, self._paths))
        except OSError as e:
            return ("unreadable", str(e))

    def check(self) -> bool:
        """Whether a new pair was taken: the files changed since they were last read, and load."""
        if self._paths is None:
            return False
        with self._lock:
            now = self._clock()
            if now - self._checked < self._check_s:
                return False
            self._checked = now
            seen = self._stat()
            if seen == self._seen:
                return False
            self._seen = seen  # a pair that fails is tried again once the files change again, not at every look
            try:
                pem = _read_pair(*self._paths)
                context = _context(pem)
            except (ValueError, ssl.SSLError, OSError) as e:
                self.reloads.labels("failed").inc()
                log.error("gRPC TLS: the certificate or key file changed (%s, %s) but cannot be used (%s); still "
                          "serving the certificate read before", *self._paths, e)
                return False
            self.pem, self._context, self._expiry = pem, context, _not_after(pem[0])
            self.loads += 1
            self.reloads.labels("ok").inc()
            log.info("gRPC TLS: certificate and key read again from %s and %s; new connections get them",
                     *self._paths)
            return True

    def context(self) -> ssl.SSLContext:
        self.check()
        return self._context

    def _expires(self) -> float:
        self.check()  # a scrape looks at the files as a connection does
        return self._expiry

    def grpcio_credentials(self) -> grpc.ServerCredentials:
        if self._paths is None:
            cert, key = self.pem
            return grpc.ssl_server_credentials([(key, cert)])

        given = self.loads  # the pair grpcio has

        def pair() -> grpc.ServerCertificateConfiguration:
            cert, key = self.pem
            return grpc.ssl_server_certificate_configuration([(key, cert)])

        def changed() -> grpc.ServerCertificateConfiguration | None:
            # grpcio asks at each handshake: a new configuration once a new pair was taken (here, or by a scrape
            # that looked first), else None (the one it has)
            nonlocal given
            self.check()
            with self._lock:
                if self.loads == given:
                    return None
                given = self.loads
                return pair()
        return grpc.dynamic_ssl_server_credentials(pair(), changed)


def server_keys(mode: str, cert_path: str = "", key_path: str = "", *, registry: CollectorRegistry | None = None,
                check_s: float = RELOAD_CHECK_S) -> ServerKeys | None:
    """The gRPC port's certificate and key for KVGATE_GRPC_TLS `mode`: None for `off` (plaintext); ValueError
    naming the variable when a configured file cannot be used."""
    if mode == "off":
        return None
    if mode == "self-signed":
        return ServerKeys(self_signed(), registry=registry)
    if mode == "files":
        try:
            return ServerKeys(None, (cert_path, key_path), registry=registry, check_s=check_s)
        except ssl.SSLError as e:
            raise ValueError(f"KVGATE_GRPC_TLS_CERT={cert_path!r} and KVGATE_GRPC_TLS_KEY={key_path!r}: they do not "
                             f"load as a certificate and its key ({e.reason or e})") from None
    raise ValueError(f"KVGATE_GRPC_TLS={mode!r}: expected off, self-signed or files")


def server_credentials(mode: str, cert_path: str = "", key_path: str = "") -> grpc.ServerCredentials | None:
    """As server_keys, as grpcio's server credentials."""
    keys = server_keys(mode, cert_path, key_path)
    return None if keys is None else keys.grpcio_credentials()
