"""Envoy bootstrap generator: `prefix-router envoy-config`.

`render(EnvoyOptions) -> dict` is a pure function producing a complete Envoy (1.40) bootstrap;
`to_yaml` serialises it. Three modes:

* ``override-host`` (recommended): one STATIC cluster of the replicas whose load-balancing
  policy is ``envoy.load_balancing_policies.override_host``. It reads the router's decision from
  dynamic metadata ``envoy.lb`` / ``<header_name>`` (``ip:port`` or a comma list of fallbacks).
  Only hosts that are members of the cluster can be chosen; an unknown address is skipped, and
  each retry consumes the next address of the list, then round robin.
* ``original-dst``: what the Gateway API Inference Extension describes for plain Envoy. The
  router sets the header ``<header_name>: ip:port`` and ``clear_route_cache``; a route that
  matches the header sends the request to an ORIGINAL_DST cluster that connects to exactly that
  address on the first attempt (retries go to the round-robin replicas, through Envoy's
  composite cluster); without the header a second route load-balances over a STATIC cluster.
* ``round-robin``: the baseline without ext_proc (same clusters, same retries, no router).

Every mode strips client-sent routing headers with the connection manager's
``early_header_mutation_extensions`` (runs before route selection; an HTTP filter would run
after the route was chosen) and adds ``<served_header_name>: %UPSTREAM_HOST%`` to responses.

Measured behaviour of these configs with the real Envoy 1.40 is in envoy/README.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

Mode = Literal["original-dst", "override-host", "round-robin"]
BodyMode = Literal["buffered", "full_duplex_streamed"]

MODES: tuple[str, ...] = ("original-dst", "override-host", "round-robin")
BODY_MODES: tuple[str, ...] = ("buffered", "full_duplex_streamed")

ROUTER_CLUSTER = "prefix_router"
REPLICAS_CLUSTER = "replicas"
ORIGINAL_DST_CLUSTER = "replicas_original_dst"
# original-dst: attempt 1 to the header's address, retries to the round-robin replicas.
PICKED_CLUSTER = "replicas_original_dst_then_round_robin"
LB_NAMESPACE = "envoy.lb"  # dynamic-metadata namespace of the endpoint-picker protocol
MIB = 1024 * 1024

# Default 2-endpoint example used for the checked-in files in envoy/ (tests compare them).
EXAMPLE_ENDPOINTS: tuple[str, ...] = ("127.0.0.1:8001", "127.0.0.1:8002")


class EnvoyConfigError(ValueError):
    """An option that cannot produce a working Envoy config; the message names it."""


@dataclass(frozen=True)
class EnvoyOptions:
    mode: Mode = "override-host"
    endpoints: list[str] = field(default_factory=lambda: list(EXAMPLE_ENDPOINTS))
    listen: str = "127.0.0.1:8080"
    admin: str = "127.0.0.1:9901"
    # The ext_proc gRPC service: "ip:port", or a comma list of several router processes
    # (one cluster; Envoy balances streams over the ones whose gRPC health is SERVING, so a
    # draining router, NOT_SERVING, gets no new streams: rolling restarts lose nothing).
    router: str = "127.0.0.1:9002"
    body_mode: BodyMode = "buffered"
    header_name: str = "x-gateway-destination-endpoint"
    served_header_name: str = "x-gateway-destination-endpoint-served"
    # Per ext_proc message (headers, then body). The router answers in well under 10 ms even
    # for a 16 MiB body; 1 s only trips when the router is stuck or saturated, and then the
    # request fails open to round robin instead of waiting. Much shorter (Envoy's 200 ms
    # default) fails open during bursts and loses cache affinity for no gain: an LLM request
    # takes seconds anyway. Not applied in full-duplex mode (see README).
    message_timeout_ms: int = 1000
    # Largest request body Envoy buffers (BUFFERED ext_proc mode, and retries): long-context
    # prompts are megabytes. Larger bodies get 413 in BUFFERED mode.
    max_body_bytes: int = 16 * MIB
    # Route timeout in seconds for the whole response; 0 disables it (LLM streams can run for
    # minutes). stream_idle_timeout still ends streams with no bytes in either direction.
    request_timeout: float = 0.0
    stream_idle_timeout: float = 300.0
    retries: int = 2
    connect_timeout: float = 1.0
    # Active HTTP health check of the replicas (vLLM, SGLang and TGI serve /health);
    # "" disables it. Outlier detection is always on.
    health_check_path: str = "/health"
    health_check_interval: float = 5.0
    access_log: bool = False
    # OpenTelemetry collector (OTLP/gRPC, ip:port) for Envoy's own request spans; "" = off.
    otlp_tracing: str = ""
    # TLS to the router (its `tls` config section): the CA bundle that signed the router's
    # certificate; setting it turns TLS on. router_tls_sni is sent as SNI and must be a DNS
    # name in the router certificate's subjectAltName (recommended: without it any
    # certificate from that CA is accepted). router_tls_cert/key: Envoy's client certificate
    # for mTLS (the router's tls.client_ca_file). Envoy reads these files once at start.
    router_tls_ca: str = ""
    router_tls_sni: str = ""
    router_tls_cert: str = ""
    router_tls_key: str = ""


# --------------------------------------------------------------------------- validation


def parse_address(value: str, what: str) -> tuple[str, int]:
    """'ip:port' or '[v6]:port' -> (ip, port). Envoy STATIC clusters need literal IPs."""
    text = value.strip()
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
    else:
        host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise EnvoyConfigError(f"{what} {value!r} is not 'ip:port' (IPv6 as '[addr]:port')")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise EnvoyConfigError(
            f"{what} {value!r}: host must be an IP address (STATIC clusters do not resolve names)"
        ) from None
    if ip.version == 6 and not text.startswith("["):
        raise EnvoyConfigError(f"{what} {value!r}: write IPv6 addresses as '[addr]:port'")
    number = int(port)
    if not 0 < number < 65536:
        raise EnvoyConfigError(f"{what} {value!r}: port must be 1-65535")
    return str(ip), number


def router_addresses(options: EnvoyOptions) -> list[tuple[str, int]]:
    """The router processes behind the ext_proc cluster (``router`` is a comma list)."""
    addresses = [a for a in options.router.split(",") if a.strip()]
    if not addresses:
        raise EnvoyConfigError("router: at least one 'ip:port' is required")
    parsed = [parse_address(a, "router") for a in addresses]
    if len({_canonical(h, p) for h, p in parsed}) != len(parsed):
        raise EnvoyConfigError(f"router {options.router!r} lists an address twice")
    return parsed


def _canonical(host: str, port: int) -> str:
    """The address string Envoy uses for a host (`Address::asString()`)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _check_header(name: str, what: str) -> str:
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", name):
        raise EnvoyConfigError(f"{what} {name!r} must be a lowercase HTTP header name")
    if name.startswith("x-envoy-"):
        raise EnvoyConfigError(f"{what} {name!r}: x-envoy-* headers are reserved by Envoy")
    return name


def validate(options: EnvoyOptions) -> list[tuple[str, int]]:
    """Check every option; return the parsed endpoints. Raises EnvoyConfigError."""
    if options.mode not in MODES:
        raise EnvoyConfigError(f"mode {options.mode!r} is not one of {', '.join(MODES)}")
    if options.body_mode not in BODY_MODES:
        raise EnvoyConfigError(
            f"body_mode {options.body_mode!r} is not one of {', '.join(BODY_MODES)}"
        )
    if not options.endpoints:
        raise EnvoyConfigError("endpoints: at least one 'ip:port' is required")
    endpoints = [parse_address(e, "endpoint") for e in options.endpoints]
    seen: set[str] = set()
    for host, port in endpoints:
        key = _canonical(host, port)
        if key in seen:
            raise EnvoyConfigError(f"endpoint {key} is listed twice")
        seen.add(key)
    parse_address(options.listen, "listen")
    parse_address(options.admin, "admin")
    router_addresses(options)
    if bool(options.router_tls_cert) != bool(options.router_tls_key):
        raise EnvoyConfigError("router_tls_cert and router_tls_key: set both (or neither)")
    if (options.router_tls_cert or options.router_tls_sni) and not options.router_tls_ca:
        raise EnvoyConfigError(
            "router_tls_ca is required with router_tls_cert/router_tls_sni (TLS to the router)"
        )
    if options.router_tls_sni and not re.fullmatch(
        r"[A-Za-z0-9*][A-Za-z0-9.-]*", options.router_tls_sni
    ):
        raise EnvoyConfigError(f"router_tls_sni {options.router_tls_sni!r} is not a DNS name")
    _check_header(options.header_name, "header_name")
    _check_header(options.served_header_name, "served_header_name")
    if options.header_name == options.served_header_name:
        raise EnvoyConfigError("header_name and served_header_name must differ")
    if options.message_timeout_ms <= 0:
        raise EnvoyConfigError("message_timeout_ms must be > 0")
    if options.max_body_bytes < 64 * 1024:
        raise EnvoyConfigError("max_body_bytes must be at least 65536")
    if options.max_body_bytes >= 2**32:
        raise EnvoyConfigError("max_body_bytes must be below 4 GiB (Envoy uses uint32)")
    if options.retries < 0:
        raise EnvoyConfigError("retries must be >= 0")
    for name in ("request_timeout", "stream_idle_timeout"):
        if getattr(options, name) < 0:
            raise EnvoyConfigError(f"{name} must be >= 0 (0 disables it)")
    if options.connect_timeout <= 0 or options.health_check_interval <= 0:
        raise EnvoyConfigError("connect_timeout and health_check_interval must be > 0")
    if options.health_check_path and not options.health_check_path.startswith("/"):
        raise EnvoyConfigError("health_check_path must start with '/' (or be '' to disable)")
    if options.otlp_tracing:
        parse_address(options.otlp_tracing, "otlp_tracing")
    return endpoints


# --------------------------------------------------------------------------- building blocks


def _duration(seconds: float) -> str:
    text = f"{seconds:.3f}".rstrip("0").rstrip(".")
    return f"{text}s"


def _socket_address(value: str, what: str) -> dict[str, Any]:
    host, port = parse_address(value, what)
    return {"socket_address": {"address": host, "port_value": port}}


def _typed(type_name: str, body: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    return {"@type": f"type.googleapis.com/{type_name}", **(body or {}), **fields}


def _http2_protocol_options(max_concurrent_streams: int | None = None) -> dict[str, Any]:
    http2: dict[str, Any] = {}
    if max_concurrent_streams:
        http2["max_concurrent_streams"] = max_concurrent_streams
    return {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": _typed(
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            explicit_http_config={"http2_protocol_options": http2},
        )
    }


# Idle upstream connections close after this (Envoy's default is an hour). The model servers'
# HTTP servers close theirs sooner (uvicorn, under vLLM and SGLang: 5 s), and a request sent
# on a connection as the server closes it is reset: retried, and reported to the router as a
# failed attempt (server.py), which takes a live replica out until its next probe.
UPSTREAM_IDLE_TIMEOUT = 4.0


def _model_server_protocol_options() -> dict[str, Any]:
    return {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": _typed(
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            common_http_protocol_options={"idle_timeout": _duration(UPSTREAM_IDLE_TIMEOUT)},
            explicit_http_config={"http_protocol_options": {}},
        )
    }


def _circuit_breakers(limit: int, retries: int) -> dict[str, Any]:
    # Envoy's defaults (1024 requests, 3 concurrent retries) are far below what a gateway in
    # front of LLM servers holds open: every streaming request is an open request for minutes.
    return {
        "thresholds": [
            {
                "priority": "DEFAULT",
                "max_connections": limit,
                "max_pending_requests": limit,
                "max_requests": limit,
                "max_retries": retries,
            }
        ]
    }


def _outlier_detection() -> dict[str, Any]:
    # Passive and free: connect failures and resets count as gateway failures, so a dead replica
    # leaves the round-robin fallback after 3 failed attempts for 10 s (then doubles).
    # (override_host itself picks a named member regardless of health: see README.)
    return {
        "consecutive_5xx": 5,
        "consecutive_gateway_failure": 3,
        "enforcing_consecutive_gateway_failure": 100,
        "interval": "5s",
        "base_ejection_time": "10s",
        "max_ejection_time": "120s",
        "max_ejection_percent": 50,
    }


def _health_check(options: EnvoyOptions) -> list[dict[str, Any]]:
    if not options.health_check_path:
        return []
    return [
        {
            "timeout": "1s",
            "interval": _duration(options.health_check_interval),
            "interval_jitter": "0.5s",
            "unhealthy_threshold": 2,
            "healthy_threshold": 1,
            # Envoy checks idle clusters only every 60 s by default; keep the same pace.
            "no_traffic_interval": _duration(options.health_check_interval),
            "http_health_check": {"path": options.health_check_path},
        }
    ]


def _replicas_cluster(
    options: EnvoyOptions, endpoints: list[tuple[str, int]], override_host: bool
) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": REPLICAS_CLUSTER,
        "type": "STATIC",
        "connect_timeout": _duration(options.connect_timeout),
        "typed_extension_protocol_options": _model_server_protocol_options(),
        "load_assignment": {
            "cluster_name": REPLICAS_CLUSTER,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {"socket_address": {"address": h, "port_value": p}}
                            }
                        }
                        for h, p in endpoints
                    ]
                }
            ],
        },
        "circuit_breakers": _circuit_breakers(100_000, 1_000),
        "outlier_detection": _outlier_detection(),
    }
    round_robin = {
        "typed_extension_config": {
            "name": "envoy.load_balancing_policies.round_robin",
            "typed_config": _typed(
                "envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"
            ),
        }
    }
    if override_host:
        # The router's decision is read from dynamic metadata envoy.lb/<header_name>, a single
        # "ip:port" or a comma list tried in order (one per attempt, i.e. per retry); addresses
        # that are not members of this cluster are skipped, so a spoofed or stale address can
        # never open a connection elsewhere. No decision / list used up -> round robin.
        cluster["load_balancing_policy"] = {
            "policies": [
                {
                    "typed_extension_config": {
                        "name": "envoy.load_balancing_policies.override_host",
                        "typed_config": _typed(
                            "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                            override_host_sources=[
                                {
                                    "metadata": {
                                        "key": LB_NAMESPACE,
                                        "path": [{"key": options.header_name}],
                                    }
                                }
                            ],
                            fallback_policy={"policies": [round_robin]},
                        ),
                    }
                }
            ]
        }
    else:
        cluster["load_balancing_policy"] = {"policies": [round_robin]}
    health_checks = _health_check(options)
    if health_checks:
        cluster["health_checks"] = health_checks
    return cluster


def _original_dst_cluster(options: EnvoyOptions) -> dict[str, Any]:
    # SECURITY: an ORIGINAL_DST cluster connects to whatever ip:port the header names, members
    # or not. Three things keep it to the replicas: (1) the client's copy of the header is
    # stripped by early_header_mutation before routing, (2) the route that leads here only
    # matches when the header value is exactly one of the configured replicas (anything else,
    # including a comma list, takes the round-robin route), (3) the router only emits members.
    # Retries after a connect failure go to the same (dead) address: the header still names it.
    return {
        "name": ORIGINAL_DST_CLUSTER,
        "type": "ORIGINAL_DST",
        "lb_policy": "CLUSTER_PROVIDED",
        "connect_timeout": _duration(options.connect_timeout),
        "typed_extension_protocol_options": _model_server_protocol_options(),
        "original_dst_lb_config": {
            "use_http_header": True,
            "http_header_name": options.header_name,
        },
        "cleanup_interval": "60s",
        "circuit_breakers": _circuit_breakers(100_000, 1_000),
    }


def _picked_cluster(options: EnvoyOptions) -> dict[str, Any]:
    # Envoy's composite cluster picks a sub-cluster by attempt number: attempt 1 goes to the
    # ORIGINAL_DST cluster (exactly the router's pick), every retry to the round-robin
    # replicas (previous_hosts keeps it off the address that failed once it is a host of that
    # cluster, and the active health check takes a dead replica out of it). Without this, a
    # retry re-reads the header and hits the dead address again. One entry per attempt.
    return {
        "name": PICKED_CLUSTER,
        "connect_timeout": _duration(options.connect_timeout),
        "lb_policy": "CLUSTER_PROVIDED",
        "cluster_type": {
            "name": "envoy.clusters.composite",
            "typed_config": _typed(
                "envoy.extensions.clusters.composite.v3.ClusterConfig",
                clusters=[{"name": ORIGINAL_DST_CLUSTER}]
                + [{"name": REPLICAS_CLUSTER}] * options.retries,
            ),
        },
        "circuit_breakers": _circuit_breakers(100_000, 1_000),
    }


EXT_PROC_HEALTH_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# ext_proc streams one HTTP/2 connection to the router carries (one per request, open until
# it ends): more open more connections, which is what SO_REUSEPORT spreads over a router's
# `--workers`. Without a limit every stream of an Envoy thread shared one connection, and
# one worker got all of them.
ROUTER_STREAMS_PER_CONNECTION = 8
OTEL_CLUSTER = "otel_collector"
UPSTREAM_FAILURE_HEADER = "x-prefix-router-upstream-failure"


def _router_tls(options: EnvoyOptions) -> dict[str, Any]:
    """UpstreamTlsContext for the router cluster (also used by its gRPC health check)."""
    validation: dict[str, Any] = {"trusted_ca": {"filename": options.router_tls_ca}}
    if options.router_tls_sni:
        validation["match_typed_subject_alt_names"] = [
            {"san_type": "DNS", "matcher": {"exact": options.router_tls_sni}}
        ]
    common: dict[str, Any] = {"alpn_protocols": ["h2"], "validation_context": validation}
    if options.router_tls_cert:
        common["tls_certificates"] = [
            {
                "certificate_chain": {"filename": options.router_tls_cert},
                "private_key": {"filename": options.router_tls_key},
            }
        ]
    context: dict[str, Any] = {"common_tls_context": common}
    if options.router_tls_sni:
        context["sni"] = options.router_tls_sni
    return {
        "name": "envoy.transport_sockets.tls",
        "typed_config": _typed(
            "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext", context
        ),
    }


def _router_cluster(options: EnvoyOptions) -> dict[str, Any]:
    cluster = {
        "name": ROUTER_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "0.25s",
        "typed_extension_protocol_options": _http2_protocol_options(ROUTER_STREAMS_PER_CONNECTION),
        # One gRPC stream per HTTP request, open until the response ends: the default circuit
        # breaker (1024 requests) would silently fail requests open beyond 1024 in flight.
        "circuit_breakers": _circuit_breakers(100_000, 3),
        # gRPC health of the router itself: once Envoy knows the router is down it fails
        # open before opening a stream. Without it, FULL_DUPLEX_STREAMED requests race the
        # connect failure (the body may already be handed to the stream) and get a 500.
        # Unhealthy after one failed check: a threshold of 2 let twice the requests wait out
        # message_timeout on a hung router (docs/reliability.md, section 1).
        "health_checks": [
            {
                "timeout": "0.5s",
                "interval": "0.5s",
                "no_traffic_interval": "0.5s",
                "unhealthy_threshold": 1,
                "healthy_threshold": 1,
                "grpc_health_check": {"service_name": EXT_PROC_HEALTH_SERVICE},
            }
        ],
        # No panic routing to an unhealthy router: fail open at once instead.
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
        "load_assignment": {
            "cluster_name": ROUTER_CLUSTER,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {"socket_address": {"address": h, "port_value": p}}
                            }
                        }
                        for h, p in router_addresses(options)
                    ]
                }
            ],
        },
    }
    if options.router_tls_ca:
        cluster["transport_socket"] = _router_tls(options)
    return cluster


def _ext_proc_filter(options: EnvoyOptions) -> dict[str, Any]:
    full_duplex = options.body_mode == "full_duplex_streamed"
    processing_mode = {
        "request_header_mode": "SEND",
        # SEND: the router sees <served_header_name> and knows when the response started.
        "response_header_mode": "SEND",
        "request_body_mode": "FULL_DUPLEX_STREAMED" if full_duplex else "BUFFERED",
        "response_body_mode": "NONE",
        # Full duplex needs trailers so the processor always sees the end of the body.
        "request_trailer_mode": "SEND" if full_duplex else "SKIP",
        "response_trailer_mode": "SKIP",
    }
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": _typed(
            "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            {
                # No grpc_service.timeout: the stream lives as long as the HTTP request;
                # message_timeout bounds each answer instead.
                "grpc_service": {
                    "envoy_grpc": {
                        "cluster_name": ROUTER_CLUSTER,
                        # Bounds one message from the router (a full-duplex body echo).
                        "max_receive_message_length": options.max_body_bytes + MIB,
                    },
                },
                # Router down, slow or broken -> continue without a decision (round robin).
                "failure_mode_allow": True,
                "message_timeout": _duration(options.message_timeout_ms / 1000),
                "processing_mode": processing_mode,
                # With the response headers: the endpoint that answered and Envoy's response
                # flags (UF: it could not connect). The served-endpoint header and the failure
                # marker below tell the same; a gateway's Envoy config (Istio, Envoy Gateway)
                # that adds neither needs only this filter's settings (deploy/), and there a
                # replica could forge the headers: the router reads these first (server.py).
                # The attempt count tells which endpoints failed an attempt a retry saved.
                "response_attributes": [
                    "upstream.address",
                    "response.flags",
                    "upstream.request_attempt_count",
                ],
                # Pass-through requests (not an LLM call) answer the headers with
                # mode_override {request_body_mode: NONE} so Envoy skips sending the body.
                "allow_mode_override": True,
                # Accept ProcessingResponse.dynamic_metadata in the picker's namespace.
                "metadata_options": {"receiving_namespaces": {"untyped": [LB_NAMESPACE]}},
                # The router may set ordinary headers (ours is x-gateway-...) but never :authority,
                # :path, host or x-envoy-*; a forbidden mutation is ignored, not an error.
                "mutation_rules": {"disallow_system": True, "allow_envoy": False},
            },
        ),
    }


def _router_filter() -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.router",
        "typed_config": _typed("envoy.extensions.filters.http.router.v3.Router"),
    }


def _retry_policy(options: EnvoyOptions) -> dict[str, Any]:
    return {
        # Only failures where the model server did not start answering: Envoy never retries
        # after response headers went downstream, so a streamed answer is never duplicated.
        "retry_on": "connect-failure,refused-stream,reset,retriable-status-codes",
        "retriable_status_codes": [503],
        "num_retries": options.retries,
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": _typed(
                    "envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
                ),
            }
        ],
        "host_selection_retry_max_attempts": 5,
        "retry_back_off": {"base_interval": "0.025s", "max_interval": "0.25s"},
    }


def _route_action(options: EnvoyOptions, cluster: str) -> dict[str, Any]:
    return {
        "cluster": cluster,
        "timeout": _duration(options.request_timeout),
        "retry_policy": _retry_policy(options),
    }


def _member_regex(endpoints: list[tuple[str, int]]) -> str:
    return "^(" + "|".join(re.escape(_canonical(h, p)) for h, p in endpoints) + ")$"


def _routes(options: EnvoyOptions, endpoints: list[tuple[str, int]]) -> list[dict[str, Any]]:
    fallback = {
        "name": "round_robin" if options.mode != "override-host" else "replicas",
        "match": {"prefix": "/"},
        "route": _route_action(options, REPLICAS_CLUSTER),
    }
    if options.mode != "original-dst":
        return [fallback]
    picked = {
        "name": "picked_endpoint",
        "match": {
            "prefix": "/",
            "headers": [
                {
                    "name": options.header_name,
                    "string_match": {"safe_regex": {"regex": _member_regex(endpoints)}},
                }
            ],
        },
        "route": _route_action(options, PICKED_CLUSTER),
    }
    return [picked, fallback]


def _access_log() -> list[dict[str, Any]]:
    return [
        {
            "name": "envoy.access_loggers.stdout",
            "typed_config": _typed(
                "envoy.extensions.access_loggers.stream.v3.StdoutAccessLog",
                log_format={
                    "text_format_source": {
                        "inline_string": (
                            "[%START_TIME%] %REQ(:METHOD)% %REQ(:PATH)% %RESPONSE_CODE% "
                            "%RESPONSE_FLAGS% upstream=%UPSTREAM_HOST% "
                            "attempts=%UPSTREAM_REQUEST_ATTEMPT_COUNT% %DURATION%ms\n"
                        )
                    }
                },
            ),
        }
    ]


def _connection_manager(options: EnvoyOptions, endpoints: list[tuple[str, int]]) -> dict[str, Any]:
    filters = [] if options.mode == "round-robin" else [_ext_proc_filter(options)]
    filters.append(_router_filter())
    virtual_host: dict[str, Any] = {
        "name": "llm",
        "domains": ["*"],
        "routes": _routes(options, endpoints),
        # Request bodies Envoy may hold (BUFFERED ext_proc, retry buffer); 413 above it.
        # Measured on 1.40: this alone lifts the 1 MiB default for BUFFERED ext_proc and keeps
        # 8 MiB bodies retryable; raising the listener's per_connection_buffer_limit_bytes
        # works too but lets every connection buffer that much before back-pressure.
        "request_body_buffer_limit": options.max_body_bytes,
        "response_headers_to_add": [
            {
                "header": {"key": options.served_header_name, "value": "%UPSTREAM_HOST%"},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
            }
        ],
    }
    if options.mode != "round-robin":
        virtual_host["response_headers_to_remove"] = [UPSTREAM_FAILURE_HEADER]
    manager: dict[str, Any] = {
        "stat_prefix": "llm",
        "codec_type": "AUTO",
        # Runs before route selection: a client can never choose the endpoint itself.
        "early_header_mutation_extensions": [
            {
                "name": "envoy.http.early_header_mutation.header_mutation",
                "typed_config": _typed(
                    "envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
                    mutations=[
                        {"remove": options.header_name},
                        {"remove": options.served_header_name},
                    ],
                ),
            }
        ],
        "stream_idle_timeout": _duration(options.stream_idle_timeout),
        "request_timeout": "0s",
        "route_config": {"name": "llm", "virtual_hosts": [virtual_host]},
        "http_filters": filters,
    }
    if options.mode != "round-robin":
        # Envoy's own 503 for an upstream it could not reach carries the response flags, so
        # the router (response-headers phase) can tell a dead replica from a busy one and
        # stop picking it at once instead of waiting for its probes.
        # Only Envoy's own failures to reach it: not UO (its circuit breaker overflowed,
        # the endpoint is busy, not dead). A replica's response carrying the header (a proxy
        # of its own in front of it) has it removed (virtual host), before this is added.
        manager["local_reply_config"] = {
            "mappers": [
                {
                    "filter": {"response_flag_filter": {"flags": ["UF", "URX", "UH"]}},
                    "headers_to_add": [
                        {
                            "header": {"key": UPSTREAM_FAILURE_HEADER, "value": "%RESPONSE_FLAGS%"},
                            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                        }
                    ],
                }
            ]
        }
    if options.access_log:
        manager["access_log"] = _access_log()
    if options.otlp_tracing:
        # Envoy's span per request, exported over OTLP; the router's decision span shares
        # the trace through the traceparent header Envoy forwards to it.
        manager["tracing"] = {
            "random_sampling": {"value": 100},
            "provider": {
                "name": "envoy.tracers.opentelemetry",
                "typed_config": _typed(
                    "envoy.config.trace.v3.OpenTelemetryConfig",
                    grpc_service={
                        "envoy_grpc": {"cluster_name": OTEL_CLUSTER},
                        "timeout": "1s",
                    },
                    service_name="envoy",
                ),
            },
        }
    return manager


def _otel_cluster(options: EnvoyOptions) -> dict[str, Any]:
    return {
        "name": OTEL_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "1s",
        "typed_extension_protocol_options": _http2_protocol_options(),
        "load_assignment": {
            "cluster_name": OTEL_CLUSTER,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": _socket_address(options.otlp_tracing, "otlp_tracing")
                            }
                        }
                    ]
                }
            ],
        },
    }


def render(options: EnvoyOptions) -> dict[str, Any]:
    """The Envoy bootstrap for `options`, as plain data (dict/list/str/int/bool)."""
    endpoints = validate(options)
    clusters = [_replicas_cluster(options, endpoints, options.mode == "override-host")]
    if options.mode == "original-dst":
        clusters.append(_original_dst_cluster(options))
        clusters.append(_picked_cluster(options))
    if options.mode != "round-robin":
        clusters.append(_router_cluster(options))
    if options.otlp_tracing:
        clusters.append(_otel_cluster(options))
    listener = {
        "name": "llm",
        "address": _socket_address(options.listen, "listen"),
        "filter_chains": [
            {
                "filters": [
                    {
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": _typed(
                            "envoy.extensions.filters.network.http_connection_manager.v3."
                            "HttpConnectionManager",
                            **_connection_manager(options, endpoints),
                        ),
                    }
                ]
            }
        ],
    }
    return {
        "admin": {"address": _socket_address(options.admin, "admin")},
        "static_resources": {"listeners": [listener], "clusters": clusters},
        # Silences the start-up warning and bounds connections (overload manager).
        "overload_manager": {
            "resource_monitors": [
                {
                    "name": "envoy.resource_monitors.global_downstream_max_connections",
                    "typed_config": _typed(
                        "envoy.extensions.resource_monitors.downstream_connections.v3."
                        "DownstreamConnectionsConfig",
                        max_active_downstream_connections=50_000,
                    ),
                }
            ]
        },
    }


class _Dumper(yaml.SafeDumper):
    pass


def _str_presenter(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", data)


_Dumper.add_representer(str, _str_presenter)


def to_yaml(config: dict[str, Any]) -> str:
    """Stable YAML (key order kept) for a rendered config."""
    return yaml.dump(config, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)


# --------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = EnvoyOptions()
    parser.add_argument("--mode", choices=MODES, default=d.mode)
    parser.add_argument(
        "--endpoints",
        nargs="+",
        default=list(d.endpoints),
        metavar="IP:PORT",
        help="model-server replicas (space or comma separated)",
    )
    parser.add_argument("--listen", default=d.listen, help="listener ip:port")
    parser.add_argument("--admin", default=d.admin, help="admin ip:port")
    parser.add_argument(
        "--router", default=d.router, help="ext_proc service ip:port (comma list: several)"
    )
    parser.add_argument("--body-mode", dest="body_mode", choices=BODY_MODES, default=d.body_mode)
    parser.add_argument("--header-name", dest="header_name", default=d.header_name)
    parser.add_argument(
        "--served-header-name", dest="served_header_name", default=d.served_header_name
    )
    parser.add_argument(
        "--message-timeout-ms", dest="message_timeout_ms", type=int, default=d.message_timeout_ms
    )
    parser.add_argument(
        "--max-body-bytes", dest="max_body_bytes", type=int, default=d.max_body_bytes
    )
    parser.add_argument(
        "--request-timeout",
        dest="request_timeout",
        type=float,
        default=d.request_timeout,
        help="route timeout in seconds, 0 = none (default)",
    )
    parser.add_argument(
        "--stream-idle-timeout",
        dest="stream_idle_timeout",
        type=float,
        default=d.stream_idle_timeout,
    )
    parser.add_argument("--retries", type=int, default=d.retries, help="num_retries")
    parser.add_argument(
        "--connect-timeout", dest="connect_timeout", type=float, default=d.connect_timeout
    )
    parser.add_argument(
        "--health-check-path",
        dest="health_check_path",
        default=d.health_check_path,
        help="active HTTP health check path on the replicas ('' disables)",
    )
    parser.add_argument(
        "--health-check-interval",
        dest="health_check_interval",
        type=float,
        default=d.health_check_interval,
    )
    parser.add_argument("--access-log", dest="access_log", action="store_true")
    parser.add_argument(
        "--otlp-tracing",
        dest="otlp_tracing",
        default=d.otlp_tracing,
        metavar="IP:PORT",
        help="export Envoy's request spans to this OTLP/gRPC collector",
    )
    parser.add_argument(
        "--router-tls-ca",
        dest="router_tls_ca",
        default=d.router_tls_ca,
        metavar="FILE",
        help="CA (PEM) of the router's certificate: TLS to the router",
    )
    parser.add_argument(
        "--router-tls-sni",
        dest="router_tls_sni",
        default=d.router_tls_sni,
        metavar="NAME",
        help="SNI sent to the router, checked against its certificate's DNS names",
    )
    parser.add_argument(
        "--router-tls-cert",
        dest="router_tls_cert",
        default=d.router_tls_cert,
        metavar="FILE",
        help="Envoy's client certificate (PEM) for mTLS to the router",
    )
    parser.add_argument(
        "--router-tls-key",
        dest="router_tls_key",
        default=d.router_tls_key,
        metavar="FILE",
        help="key (PEM) of --router-tls-cert",
    )
    parser.add_argument("--output", "-o", default="-", help="file to write ('-' = stdout)")


def options_from_args(args: argparse.Namespace) -> EnvoyOptions:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EnvoyOptions)}
    values["endpoints"] = [e for item in args.endpoints for e in item.split(",") if e.strip()]
    return EnvoyOptions(**values)


def command_line(args: argparse.Namespace) -> str:
    """The flags that reproduce `args` (written into the generated file's header)."""
    d = EnvoyOptions()
    parts = ["prefix-router envoy-config", f"--mode {args.mode}"]
    endpoints = [e for item in args.endpoints for e in item.split(",") if e.strip()]
    parts.append("--endpoints " + " ".join(endpoints))
    for f in dataclasses.fields(EnvoyOptions):
        if f.name in ("mode", "endpoints"):
            continue
        value = getattr(args, f.name)
        if value == getattr(d, f.name):
            continue
        flag = "--" + f.name.replace("_", "-")
        parts.append(flag if value is True else f"{flag} {value}")
    return " ".join(parts)


_MODE_NOTES: dict[str, str] = {
    "override-host": """\
Recommended. The router's decision is dynamic metadata envoy.lb/<header>: "ip:port" or a
comma list tried one per attempt. Only members of cluster `replicas` can be chosen; unknown
addresses are skipped; when the list is used up (or there is no decision: router down, slow,
pass-through) the round-robin fallback policy picks, avoiding hosts already tried.""",
    "original-dst": """\
SECURITY: an ORIGINAL_DST cluster connects to any ip:port the header names. Only members are
reachable because (1) early_header_mutation strips the client's copy before routing, (2) route
`picked_endpoint` matches only a header equal to one configured replica (anything else, comma
lists included, takes round robin), (3) the router emits members only. Retries: cluster
`replicas_original_dst_then_round_robin` (Envoy's composite cluster, documented as not
hardened: trusted downstream and upstream only) sends attempt 1 to the header's address and
every retry to round robin, so a dead pick is retried on another replica.""",
    "round-robin": """\
Baseline without ext_proc: round robin over the same replicas, same retries and limits.""",
}


def header_comment(args: argparse.Namespace) -> str:
    """The comment block written above the YAML (reproducible from `args`)."""
    lines = [
        f"Generated by: {command_line(args)}",
        "Do not edit: regenerate instead (tests/test_envoy_config.py, tests/test_deploy.py check it).",
        "",
        *_MODE_NOTES[args.mode].splitlines(),
    ]
    return "".join(f"# {line}".rstrip() + "\n" for line in lines)


def run(args: argparse.Namespace) -> int:
    try:
        options = options_from_args(args)
        text = to_yaml(render(options))
    except EnvoyConfigError as error:
        print(f"prefix-router envoy-config: {error}", file=sys.stderr)
        return 2
    header = header_comment(args)
    if args.output in ("-", ""):
        sys.stdout.write(header + text)
    else:
        with open(args.output, "w", encoding="utf-8") as out:
            out.write(header + text)
    return 0
