"""TLS and mTLS for the ext_proc gRPC port, with certificate reload without a restart.

gRPC asks ``CertificateReloader.fetch`` for the certificate at every new TLS handshake
(``grpc.dynamic_ssl_server_credentials``); the reloader looks at the files' modification
times at most every ``reload_seconds`` and hands gRPC a new configuration only when they
changed and load cleanly. A half-written or broken rotation is logged and the certificate
already in use is kept, so a bad deploy of the files never takes the port down. Connections
already open keep the certificate they were established with.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from collections.abc import Callable

import grpc

from .config import TLSConfig

log = logging.getLogger(__name__)


class TLSFilesError(ValueError):
    """A certificate, key or CA file that cannot be used; the message names it."""


def _read(path: str, what: str) -> bytes:
    try:
        data = open(path, "rb").read()  # noqa: SIM115 (tiny file, read once)
    except OSError as exc:
        raise TLSFilesError(f"tls.{what} {path!r}: {exc.strerror or exc}") from None
    if b"-----BEGIN" not in data:
        raise TLSFilesError(f"tls.{what} {path!r}: not a PEM file")
    return data


def _check_pair(cert_file: str, key_file: str) -> None:
    """The key must belong to the certificate (catches a rotation caught half-way)."""

    def no_password() -> bytes:
        raise TLSFilesError(f"tls.key_file {key_file!r}: encrypted keys are not supported")

    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_file, key_file, no_password)
    except ssl.SSLError as exc:
        raise TLSFilesError(
            f"tls.cert_file/key_file {cert_file!r}, {key_file!r}: {exc.reason or exc}"
        ) from None
    except OSError as exc:
        raise TLSFilesError(f"tls files: {exc}") from None


class CertificateReloader:
    """Loads the configured PEM files and reloads them when they change."""

    def __init__(self, config: TLSConfig, clock: Callable[[], float] = time.monotonic) -> None:
        if not config.enabled:
            raise TLSFilesError("tls.cert_file is not set")
        self.config = config
        self.clock = clock
        self._lock = threading.Lock()
        self._checked_at = clock()
        self._stamp = self._file_stamp()
        self.reloads = 0
        self.current = self._load()

    @property
    def require_client_auth(self) -> bool:
        return self.config.client_ca_file is not None

    def _paths(self) -> list[str]:
        c = self.config
        return [p for p in (c.cert_file, c.key_file, c.client_ca_file) if p is not None]

    def _file_stamp(self) -> tuple[tuple[int, int, int], ...]:
        stamp = []
        for path in self._paths():
            try:
                st = os.stat(path)
                stamp.append((st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                stamp.append((-1, -1, -1))
        return tuple(stamp)

    def _load(self) -> grpc.ServerCertificateConfiguration:
        c = self.config
        assert c.cert_file is not None and c.key_file is not None
        cert = _read(c.cert_file, "cert_file")
        key = _read(c.key_file, "key_file")
        ca = _read(c.client_ca_file, "client_ca_file") if c.client_ca_file else None
        _check_pair(c.cert_file, c.key_file)
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's per-handshake callback: a new configuration, or None to keep the current."""
        try:
            now = self.clock()
            with self._lock:
                if now - self._checked_at < self.config.reload_seconds:
                    return None
                self._checked_at = now
                stamp = self._file_stamp()
                if stamp == self._stamp:
                    return None
                try:
                    fresh = self._load()
                except TLSFilesError as exc:
                    log.error("TLS files changed but cannot be loaded (%s); keeping the old", exc)
                    return None
                self._stamp = stamp
                self.current = fresh
                self.reloads += 1
            log.info("TLS certificate reloaded from %s", self.config.cert_file)
            return fresh
        except Exception:  # an exception here would fail the handshake
            log.exception("TLS reload check failed; keeping the current certificate")
            return None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self.current,
            self.fetch,
            require_client_authentication=self.require_client_auth,
        )


def server_credentials(config: TLSConfig) -> tuple[grpc.ServerCredentials, CertificateReloader]:
    """Credentials for ``server.add_secure_port``; raises TLSFilesError for bad files."""
    reloader = CertificateReloader(config)
    return reloader.credentials(), reloader
