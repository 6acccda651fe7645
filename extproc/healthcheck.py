"""`prefix-router healthcheck` (or `python -m extproc.healthcheck`): one gRPC health probe.

For container HEALTHCHECKs and scripts where no grpc probe is built in. Asks the router's
standard gRPC health service (grpc.health.v1) and exits 0 when the answer is SERVING, 1
otherwise (NOT_SERVING, unknown service, refused, timed out). The address defaults to the
configured ``server.listen`` (same file/env as `serve`), with a wildcard host replaced by
loopback. Services: "" (overall), "liveness", "readiness",
"envoy.service.ext_proc.v3.ExternalProcessor"; "readiness" is NOT_SERVING while the router
has no ready endpoint.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .config import ConfigError, format_host_port, load_config, parse_host_port


def probe_address(listen: str) -> str:
    host, port = parse_host_port(listen, allow_port_zero=True)
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1" if host == "0.0.0.0" else "::1"
    return format_host_port(host, port)


def check(address: str, service: str = "", timeout: float = 2.0) -> tuple[bool, str]:
    """(serving?, human-readable status)."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            return False, f"{address}: {getattr(code, 'name', 'error')}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address}: {status}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config file (its server.listen is probed)")
    parser.add_argument("--address", help="ip:port to probe (default: server.listen)")
    parser.add_argument(
        "--service",
        default="liveness",
        help="health service name: '', liveness (default), readiness, or the ext_proc service",
    )
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds (default 2)")
    parser.add_argument("--quiet", "-q", action="store_true")


def run(args: argparse.Namespace) -> int:
    try:
        address = args.address or probe_address(load_config(args.config).server.listen)
        address = probe_address(address)
    except (ConfigError, ValueError) as exc:
        print(f"prefix-router healthcheck: {exc}", file=sys.stderr)
        return 2
    ok, status = check(address, args.service, args.timeout)
    if not args.quiet:
        print(status, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prefix-router healthcheck", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
