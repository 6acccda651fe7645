"""TLS and mTLS between Envoy and the router, with certificates made in the test.

* The `tls` config section and the reloader: validation, reload on change, a broken
  rotation keeps the old certificate.
* Through the real Envoy: TLS (Envoy verifies the router against the CA and SNI name) and
  mTLS (the router requires Envoy's client certificate); a rotated router certificate is
  served to new connections without a restart and accepted by a fresh Envoy; a client
  without a valid certificate is refused (and Envoy without one fails open: served, unrouted).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc import envoyconf
from extproc.config import ConfigError, TLSConfig, load_config
from extproc.stack import LOOPBACK, Stack, free_port, validate_envoy_config
from extproc.tls import CertificateReloader, TLSFilesError

from .conftest import FAST, chat, envoy_stats, report, routed_count, wait_until

SNI = "prefix-router.test"

# -- certificates ------------------------------------------------------------------------


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject, key, issuer_name, issuer_key, *, ca=False, san=None, usage=None):
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


@dataclass
class Pki:
    dir: Path
    ca_cert: x509.Certificate
    ca_key: ec.EllipticCurvePrivateKey

    @classmethod
    def create(cls, directory: Path, name: str = "test-ca") -> Pki:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert(name, key, _name(name), key, ca=True)
        pki = cls(directory, cert, key)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "ca.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return pki

    @property
    def ca_file(self) -> str:
        return str(self.dir / "ca.pem")

    def issue(self, stem: str, server: bool) -> tuple[str, str, int]:
        """Write stem.pem / stem.key (atomically: a rotation never shows half a file)."""
        key = ec.generate_private_key(ec.SECP256R1())
        if server:
            san = [x509.DNSName(SNI), x509.IPAddress(ipaddress.ip_address(LOOPBACK))]
            usage = [ExtendedKeyUsageOID.SERVER_AUTH]
        else:
            san, usage = [x509.DNSName("envoy.test")], [ExtendedKeyUsageOID.CLIENT_AUTH]
        cert = _cert(stem, key, self.ca_cert.subject, self.ca_key, san=san, usage=usage)
        cert_path, key_path = self.dir / f"{stem}.pem", self.dir / f"{stem}.key"
        for path, data in (
            (key_path, key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )),
            (cert_path, cert.public_bytes(serialization.Encoding.PEM)),
        ):  # fmt: skip
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        return str(cert_path), str(key_path), cert.serial_number


@pytest.fixture
def pki(tmp_path) -> Pki:
    return Pki.create(tmp_path / "pki")


def served_serial(port: int, ca_file: str, client: tuple[str, str] | None = None) -> int:
    """Handshake with the router directly; the serial of the certificate it presents."""
    context = ssl.create_default_context(cafile=ca_file)
    context.set_alpn_protocols(["h2"])
    if client:
        context.load_cert_chain(*client)
    with (
        socket.create_connection((LOOPBACK, port), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname=SNI) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    return x509.load_der_x509_certificate(der).serial_number


def grpc_readiness(address: str, ca_file: str, client: tuple[str, str] | None = None):
    """gRPC health Check over TLS; returns the status or the gRPC error code."""
    key = cert = None
    if client:
        cert, key = (Path(p).read_bytes() for p in client)
    credentials = grpc.ssl_channel_credentials(Path(ca_file).read_bytes(), key, cert)
    options = [("grpc.ssl_target_name_override", SNI)]
    with grpc.secure_channel(address, credentials, options=options) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="readiness"), timeout=5
            )
            return reply.status
        except grpc.RpcError as exc:
            return exc.code()


# -- config and reloader -----------------------------------------------------------------


def test_tls_section_validation():
    assert not load_config(environ={}).tls.enabled
    for bad, message in (
        ({"tls.cert_file": "a.pem"}, "set both"),
        ({"tls.key_file": "a.key"}, "set both"),
        ({"tls.client_ca_file": "ca.pem"}, "mTLS needs"),
        ({"tls.cert_file": "a", "tls.key_file": "b", "tls.reload_seconds": 0}, "reload_seconds"),
        ({"tls.cert_file": " ", "tls.key_file": "b"}, "must be a file path"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(overrides=bad, environ={})
    env = {"PREFIX_ROUTER_TLS__CERT_FILE": "/c.pem", "PREFIX_ROUTER_TLS__KEY_FILE": "/k.pem"}
    assert load_config(environ=env).tls.enabled


def test_reloader_picks_up_a_rotation_and_keeps_the_old_on_a_broken_one(pki):
    cert, key, _ = pki.issue("server", server=True)
    now = [0.0]
    reloader = CertificateReloader(
        TLSConfig(cert_file=cert, key_file=key, reload_seconds=5), clock=lambda: now[0]
    )
    assert reloader.fetch() is None  # unchanged
    pki.issue("server", server=True)
    assert reloader.fetch() is None  # changed, but not checked again before reload_seconds
    now[0] = 6
    assert reloader.fetch() is not None and reloader.reloads == 1
    now[0] = 12
    assert reloader.fetch() is None  # nothing new
    Path(cert).write_text("-----BEGIN CERTIFICATE-----\ngarbage\n-----END CERTIFICATE-----\n")
    now[0] = 18
    assert reloader.fetch() is None and reloader.reloads == 1  # broken: the old one stays
    other_cert, _, _ = pki.issue("other", server=True)
    Path(cert).write_bytes(Path(other_cert).read_bytes())  # key no longer matches
    now[0] = 24
    assert reloader.fetch() is None and reloader.reloads == 1


def test_unusable_files_are_refused_at_start(pki, tmp_path):
    cert, key, _ = pki.issue("server", server=True)
    other_cert, _, _ = pki.issue("other", server=True)
    (tmp_path / "plain.txt").write_text("not a certificate")
    for config, message in (
        (TLSConfig(cert_file=str(tmp_path / "missing.pem"), key_file=key), "missing.pem"),
        (TLSConfig(cert_file=str(tmp_path / "plain.txt"), key_file=key), "not a PEM"),
        (TLSConfig(cert_file=other_cert, key_file=key), "cert_file/key_file"),
        (TLSConfig(cert_file=cert, key_file=key, client_ca_file=str(tmp_path / "no")), "client_ca"),
    ):
        with pytest.raises(TLSFilesError, match=message):
            CertificateReloader(config)


def test_serve_refuses_bad_tls_files_with_a_clear_message(pki, tmp_path):
    cert, _, _ = pki.issue("server", server=True)
    _, other_key, _ = pki.issue("other", server=True)
    result = subprocess.run(
        [*__import__("extproc.stack", fromlist=["python_cli"]).python_cli(
            "serve", "--listen", f"{LOOPBACK}:{free_port()}", "--endpoints", "127.0.0.1:1",
            "--set", f"tls.cert_file={cert}", "--set", f"tls.key_file={other_key}",
        )],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "invalid TLS files" in result.stderr and "key_file" in result.stderr


@pytest.mark.parametrize("mtls", [False, True])
def test_envoy_accepts_the_router_tls_config(pki, tmp_path, mtls):
    cert, key, _ = pki.issue("envoy-client", server=False)
    options = envoyconf.EnvoyOptions(
        router_tls_ca=pki.ca_file,
        router_tls_sni=SNI,
        router_tls_cert=cert if mtls else "",
        router_tls_key=key if mtls else "",
        router="127.0.0.1:9002,127.0.0.1:9004",
    )
    rendered = envoyconf.render(options)
    cluster = next(
        c for c in rendered["static_resources"]["clusters"] if c["name"] == "prefix_router"
    )
    context = cluster["transport_socket"]["typed_config"]
    assert context["sni"] == SNI
    assert bool(context["common_tls_context"].get("tls_certificates")) == mtls
    assert len(cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]) == 2
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(rendered))
    result = validate_envoy_config(path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_envoy_tls_options_are_checked():
    for bad, message in (
        ({"router_tls_cert": "c.pem"}, "set both"),
        ({"router_tls_cert": "c", "router_tls_key": "k"}, "router_tls_ca is required"),
        ({"router_tls_sni": "x.test"}, "router_tls_ca is required"),
        ({"router_tls_ca": "ca", "router_tls_sni": "bad name"}, "not a DNS name"),
        ({"router": "127.0.0.1:1,127.0.0.1:1"}, "twice"),
        ({"router": ","}, "at least one"),
    ):
        with pytest.raises(envoyconf.EnvoyConfigError, match=message):
            envoyconf.render(envoyconf.EnvoyOptions(**bad))


# -- through the real Envoy --------------------------------------------------------------


def _start_envoy(stack, members, router, name, **tls):
    port = free_port()
    options = envoyconf.EnvoyOptions(
        endpoints=members,
        listen=f"{LOOPBACK}:{port}",
        admin=f"{LOOPBACK}:{free_port()}",
        router=router,
        **tls,
    )
    _, proc = stack.start_envoy(options, name=name)
    return port, int(options.admin.rsplit(":", 1)[1]), proc


def _routed_through(stack, envoy_port, count=4, tag="tls") -> int:
    from tests.integration.conftest import request

    admin = stack.router_admin_ports["router"]
    before = routed_count(admin)
    for i in range(count):
        response = request(envoy_port, chat(hash(tag) % 1000 + i, 0), timeout=30)
        assert response.status == 200
    # The router counts a request when its stream ends, just after the response.
    wait_until(lambda: routed_count(admin) - before >= count, 5, 0.05)
    return routed_count(admin) - before


@pytest.mark.envoy
def test_tls_through_envoy_with_a_rotated_certificate(pki):
    cert, key, first_serial = pki.issue("server", server=True)
    with Stack() as stack:
        members = stack.start_replicas(2, FAST)
        router, _ = stack.start_router(
            members,
            extra_args=["--set", f"tls.cert_file={cert}", "--set", f"tls.key_file={key}",
                        "--set", "tls.reload_seconds=0.2"],
            ready=True,
        )  # fmt: skip
        router_port = int(router.rsplit(":", 1)[1])
        port, admin, envoy = _start_envoy(
            stack, members, router, "envoy-tls", router_tls_ca=pki.ca_file, router_tls_sni=SNI
        )
        assert wait_until(lambda: _healthy(admin), 10)
        assert _routed_through(stack, port, tag="before rotation") == 4
        assert served_serial(router_port, pki.ca_file) == first_serial

        _, _, second_serial = pki.issue("server", server=True)  # rotate in place
        assert wait_until(lambda: served_serial(router_port, pki.ca_file) == second_serial, 10)
        assert _routed_through(stack, port, tag="after rotation, old connection") == 4
        # A fresh Envoy handshakes with the rotated certificate and routes.
        stack.stop(envoy)
        port, admin, _ = _start_envoy(
            stack, members, router, "envoy-tls-2", router_tls_ca=pki.ca_file, router_tls_sni=SNI
        )
        assert wait_until(lambda: _healthy(admin), 10)
        assert _routed_through(stack, port, tag="after rotation, new Envoy") == 4
        # A plaintext client cannot talk to a TLS router at all.
        with grpc.insecure_channel(router) as channel, pytest.raises(grpc.RpcError) as refused:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        report(
            "tls_rotation",
            rotated_serial_served=True,
            routed_after_rotation=True,
            plaintext_refused=True,
        )


def _healthy(envoy_admin: int) -> bool:
    from .conftest import http_get

    text = http_get(f"http://{LOOPBACK}:{envoy_admin}/clusters")[1].decode()
    flags = [
        line
        for line in text.splitlines()
        if line.startswith("prefix_router::") and "::health_flags::" in line
    ]
    return bool(flags) and all(line.endswith("::healthy") for line in flags)


@pytest.mark.envoy
def test_mtls_through_envoy_and_clients_without_a_valid_certificate_are_refused(pki, tmp_path):
    server = pki.issue("server", server=True)
    client = pki.issue("envoy-client", server=False)
    rogue = Pki.create(tmp_path / "rogue", "rogue-ca").issue("rogue-client", server=False)
    with Stack() as stack:
        members = stack.start_replicas(2, FAST)
        router, _ = stack.start_router(
            members,
            extra_args=["--set", f"tls.cert_file={server[0]}", "--set", f"tls.key_file={server[1]}",
                        "--set", f"tls.client_ca_file={pki.ca_file}"],
            ready=True,
        )  # fmt: skip
        ok = grpc_readiness(router, pki.ca_file, client[:2])
        no_cert = grpc_readiness(router, pki.ca_file)
        wrong_ca = grpc_readiness(router, pki.ca_file, rogue[:2])
        assert ok == health_pb2.HealthCheckResponse.SERVING
        assert no_cert == grpc.StatusCode.UNAVAILABLE
        assert wrong_ca == grpc.StatusCode.UNAVAILABLE

        tls = {"router_tls_ca": pki.ca_file, "router_tls_sni": SNI}
        port, admin, _ = _start_envoy(
            stack, members, router, "envoy-mtls",
            router_tls_cert=client[0], router_tls_key=client[1], **tls,
        )  # fmt: skip
        assert wait_until(lambda: _healthy(admin), 10)
        assert _routed_through(stack, port, tag="mtls") == 4

        # Envoy without a client certificate: refused by the router, so it fails open
        # (answers come from a replica by round robin; nothing is routed).
        port2, admin2, _ = _start_envoy(stack, members, router, "envoy-no-cert", **tls)
        from tests.integration.conftest import request

        before = routed_count(stack.router_admin_ports["router"])
        statuses = [request(port2, chat(900 + i, 0), timeout=30).status for i in range(4)]
        assert statuses == [200] * 4
        assert routed_count(stack.router_admin_ports["router"]) == before
        assert not _healthy(admin2)
        report(
            "mtls",
            valid_client=str(ok),
            no_client_cert=no_cert.name,
            client_cert_from_other_ca=wrong_ca.name,
            envoy_without_cert_routed=0,
            envoy_without_cert_statuses=statuses,
            envoy_without_cert_failed_open=envoy_stats(admin2).get(
                "http.llm.ext_proc.failure_mode_allowed", 0
            ),
        )
