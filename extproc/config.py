"""One typed configuration for the router: YAML file, then environment, then CLI flags.

Validation happens once at start-up; every error names the field that is wrong, so an
operator can fix the file without reading code.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

ENV_PREFIX = "PREFIX_ROUTER_"
log = logging.getLogger("extproc.config")
DEFAULT_HEADER = "x-gateway-destination-endpoint"


class ConfigError(ValueError):
    """Raised with a message that names the offending field(s)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def parse_host_port(value: str, allow_port_zero: bool = False) -> tuple[str, int]:
    """Split 'ip:port' or '[v6]:port'; Envoy routes on literal IPs, so names are rejected."""
    value = value.strip()
    if value.startswith("["):
        host, sep, port = value[1:].partition("]:")
    else:
        host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{value!r} is not 'ip:port' (IPv6 as '[addr]:port')")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{value!r}: host must be an IP address, not a name") from None
    port_number = int(port)
    if not (0 if allow_port_zero else 1) <= port_number < 65536:
        raise ValueError(f"{value!r}: port out of range")
    return host, port_number


def format_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _dns_name_or_none(value: str | None) -> str | None:
    """A DNS name field's check (discovery and peers)."""
    if value is not None and (not value.strip() or any(c.isspace() for c in value)):
        raise ValueError("must be a DNS name without spaces")
    return value


class EndpointConfig(_Strict):
    """One model-server replica."""

    address: str = Field(description="ip:port of the model server (IPv6 as [addr]:port)")
    capacity_tokens: int | None = Field(
        default=None, gt=0, description="KV-cache size in tokens; sizes this endpoint's index"
    )
    weight: float = Field(default=1.0, gt=0, description="relative share of load it can take")
    models: tuple[str, ...] = Field(
        default=(),
        description='model names it serves (a request\'s "model"); empty: read from its '
        "/v1/models (models config)",
    )
    ready: bool = Field(
        default=True,
        description="false: probed and scraped but not picked, its index kept while its "
        "metrics tell restarts (Kubernetes discovery sets it for not-ready pods)",
    )

    @field_validator("models")
    @classmethod
    def _models_named(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(not name.strip() for name in value):
            raise ValueError("a model name is empty")
        return value

    @field_validator("address")
    @classmethod
    def _address_is_ip_port(cls, value: str) -> str:
        host, port = parse_host_port(value)
        return format_host_port(str(ipaddress.ip_address(host)), port)


class ServerConfig(_Strict):
    listen: str = Field(default="127.0.0.1:9002", description="gRPC listen address ip:port")
    workers: int = Field(default=1, ge=1, le=64, description="processes sharing the port")
    admin_listen: str = Field(
        default="127.0.0.1:9003",
        description="HTTP admin address: /metrics, /healthz, /readyz, /debug/decisions ('' = off)",
    )
    body_mode: Literal["buffered", "full_duplex_streamed"] = Field(
        default="buffered",
        description="the Envoy filter's request_body_mode, used when Envoy does not announce "
        "it (protocol_config); keep them identical",
    )
    header_name: str = Field(default=DEFAULT_HEADER, description="decision header (and key)")
    served_header_name: str = Field(
        default=DEFAULT_HEADER + "-served",
        description="response header naming the endpoint that actually served",
    )
    metadata_namespace: str = Field(
        default="envoy.lb", description="dynamic-metadata namespace of the decision"
    )
    single_destination: bool = Field(
        default=False,
        description="emit only the primary endpoint, no fallback list (for original_dst)",
    )
    max_body_bytes: int = Field(
        default=64 * 1024 * 1024, gt=0, description="bodies above this pass through unrouted"
    )
    max_held_body_bytes: int = Field(
        default=512 * 1024 * 1024,
        gt=0,
        description="full-duplex request bodies held at once, all streams together; one that "
        "would go over passes through unrouted (slow senders cannot exhaust the memory)",
    )
    routable_paths: tuple[str, ...] = Field(
        default=("/v1/chat/completions", "/v1/completions", "/v1/responses"),
        description="POST paths that are routed; anything else passes through",
    )
    decisions_kept: int = Field(
        default=256, ge=0, le=100_000, description="recent decisions kept for /debug/decisions"
    )
    grace_seconds: float = Field(default=10.0, ge=0, description="drain time on SIGTERM")
    worker_hang_seconds: float = Field(
        default=30.0,
        ge=0,
        description="with workers: a worker silent this long (its event loop hung) is killed "
        "and restarted (0 = never; else at least 5; under a CPU limit, well above the longest "
        "request's CPU time over the limit)",
    )

    @field_validator("listen")
    @classmethod
    def _listen_is_ip_port(cls, value: str) -> str:
        parse_host_port(value, allow_port_zero=True)
        return value

    @field_validator("admin_listen")
    @classmethod
    def _admin_is_ip_port_or_off(cls, value: str) -> str:
        if value:  # "" turns the admin endpoint off
            parse_host_port(value, allow_port_zero=True)
        return value

    @field_validator("worker_hang_seconds")
    @classmethod
    def _hang_longer_than_reports(cls, value: float) -> float:
        if 0 < value < 5:
            raise ValueError(
                "must be 0 (never) or at least 5 seconds: a worker's heartbeat moves every "
                "second and after each ext_proc message, and one long request holds it"
            )
        return value

    @field_validator("header_name", "served_header_name")
    @classmethod
    def _lowercase_header(cls, value: str) -> str:
        if not value or value != value.strip() or any(c.isspace() for c in value):
            raise ValueError("must be a non-empty header name without spaces")
        return value.lower()


class RoutingConfig(_Strict):
    block_size_bytes: int = Field(
        default=64, ge=8, le=65536, description="prompt bytes per hashed block (~16 tokens)"
    )
    # 8,192 blocks of 64 bytes: a prompt's first ~131k tokens. Long-context traffic
    # (Mooncake: 15k tokens on average, up to 190k) shares prefixes past 16k tokens, where
    # the old cap of 1,024 stopped; hashing and indexing cost ~0.3 us per block past it
    # (docs/benchmarks.md, item 28).
    max_blocks: int = Field(
        default=8192,
        ge=1,
        description="cap on blocks hashed per request (the first ~131k tokens at 64 bytes a "
        "block); a longer prompt is placed by that much of it",
    )
    bytes_per_token: float = Field(default=4.0, gt=0, description="to convert tokens to bytes")
    default_capacity_tokens: int = Field(
        default=500_000, gt=0, description="index size for endpoints without capacity_tokens"
    )
    # eps 2 and slack 8: the in-flight count is the secondary signal; queued prefill work
    # (below) keeps the tails short. In the simulator (docs/benchmarks.md) a tighter count
    # guard moved requests off their prefix, costing up to 3 points of hit ratio at K=1 and
    # 7 at K=4 on the GAIE shape; eps 1 was needed while new conversations followed a
    # shared system prompt's holders (spread_popular_prefixes ends that), and cost the GAIE
    # shape 0.004 of hit ratio at 16 replicas (0.013 at K=4).
    load_epsilon: float = Field(
        default=2.0, ge=0, description="bounded-load guard: cap = (1+eps) x mean load"
    )
    load_slack: int = Field(
        default=8, ge=1, description="in-flight requests any endpoint may take above the mean"
    )
    # The cost model (scheduler.CostModel), in token-equivalents: prefill of n prompt tokens
    # with u uncached = base + u + context_factor * u * (n - u/2). Defaults: an 8B model on
    # one H200 (36 ms + 0.01672 ms/token + attention, docs/benchmarks.md).
    prefill_base_tokens: float = Field(
        default=2150.0, ge=0, description="fixed cost of a prefill, in token-equivalents"
    )
    prefill_context_factor: float = Field(
        default=1.26e-4, ge=0, description="attention term per uncached token per context token"
    )
    prefill_tokens_per_second: float = Field(
        default=60_000.0,
        ge=0,
        description="prefill throughput of one endpoint: queued work drains at this rate, "
        "learned from vLLM's counters when learn_prefill_rate (0 = hold it until the request ends)",
    )
    # Engines batch prefills (vLLM fills a step with up to max_num_batched_tokens: 8,192 on an
    # H100/H200). Off by default: in the simulator, with steps of 8,192, setting it to 8,192
    # helped the overloaded GAIE 4 x 100k (0.454 / 8.4 s -> 0.508 / 5.8 s; GAIE's scorer still
    # better on both) but lengthened held-out tails by up to 36 % (GAIE low-cache 8 x 100k
    # 110 -> 150 ms): the queued work it sees is often one step already running, after which
    # a request pays the fixed cost anyway (docs/benchmarks.md, "Prefill steps batched as
    # vLLM fills them").
    prefill_batch_tokens: int = Field(
        default=0,
        ge=0,
        description="the servers' prefill step in tokens (vLLM's max_num_batched_tokens): a "
        "request sent where prefill work is queued, whose uncached tokens fit in it, is "
        "charged without prefill_base_tokens, as it joins a step that pays them anyway; 0: off",
    )
    learn_prefill_rate: bool = Field(
        default=True,
        description="learn prefill_tokens_per_second from the endpoints' prefill counters "
        "(vLLM); the configured value is the start",
    )
    stickiness: float = Field(
        default=8.0, ge=0, description="extra cost per token an endpoint lacks vs the best holder"
    )
    # A long held prefix (a long conversation, an agent's growing context) is reused by
    # requests as long as it: in the simulator, on the Mooncake trace at the server's block
    # size, 16 per token from 8,192 held tokens gained 0.004-0.012 of hit ratio with tails
    # 1-9% shorter in the three loaded cells (docs/benchmarks.md, item 29). 16 everywhere
    # doubled held-out tails; no generated shape's figures moved (tuned or held-out grid).
    long_prefix_tokens: int = Field(
        default=8192,
        ge=0,
        description="a request whose longest held prefix is at least this many tokens pays "
        "long_prefix_stickiness instead of stickiness; 0: off",
    )
    long_prefix_stickiness: float = Field(
        default=16.0, ge=0, description="stickiness for a held prefix of long_prefix_tokens"
    )
    # When every endpoint is backlogged, a copy's recomputed prefix is work that everything
    # queued behind it waits for, and in a full cache it evicts another prefix that will be
    # recomputed in turn; the queue difference it escapes is passing. 1 since 2026-12-06
    # (0 before): with prefill steps batched as vLLM's are, the simulator's overloaded GAIE
    # shape 4 x 100k went from 0.454 / 8.4 s to 0.522 / 4.8 s (GAIE's scorer 0.531 / 5.1 s,
    # no longer better on both) and Mooncake 4 x 1M from 0.354 / 5.7 s to 0.361 / 5.3 s; on
    # the held-out shapes nothing moved at 8 replicas and no count at 4/16, where tails grew
    # 0.1-6 % in nine 4-replica entries (llm-d tiered 4 x 400k also -0.002 of hit ratio) and
    # GAIE long questions 4 x 600k gained on both (+0.019, -4 %); on two real vLLM servers
    # no measurable difference (docs/benchmarks.md, "A backlog everywhere, again"). Under
    # the older one-prefill-at-a-time model 3 lengthened held-out tails by up to 19 %.
    # Since the thirtieth session other routers' requests waiting on every endpoint count
    # as that backlog, and a cold start of a key placed before keeps to its rendezvous pick
    # past cold_margin by this many times their common queue: four router replicas on the
    # overloaded GAIE shape went from 0.292 / 18.8 s to 0.418 / 12.2 s (one router: 0.523 /
    # 4.7 s; docs/benchmarks.md, "Other routers' queues are a backlog too").
    backlog_stickiness: float = Field(
        default=1.0,
        ge=0,
        description="stickiness added, in multiples of the stickiness, per request's worth of "
        "prefill (this request's, cold) queued on the least-queued eligible endpoint (other "
        "routers' requests waiting on every endpoint included); and the cold-start margin of "
        "a key placed before grows by this many times those others' common queue; 0: off",
    )
    # A continuing conversation's later turns follow its history, so moving it loses no
    # later reuse. Off by default: in the simulator 2 trades 0.001-0.016 of chat hit ratio
    # for tails up to 12% shorter (chat 4 x 400k: 0.814 / 108 ms -> 0.808 / 94), but on two
    # real vLLM servers its moves cost 0.008-0.023 of hit ratio for mixed TTFT
    # (docs/benchmarks.md, item 22).
    session_stickiness: float | None = Field(
        default=None,
        ge=0,
        description="stickiness for a continuing conversation's own history toward an "
        "endpoint with nothing queued (one router alone); unset: stickiness",
    )
    # A copy into free room evicts nothing, and on an endpoint with nothing queued it delays
    # nobody. Off by default: in the simulator 1 trades hit ratio for tail (GAIE 16 x 400k:
    # 0.924 / 88 ms -> 0.921 / 81), but on two real vLLM servers it cost 0.02-0.06 of hit
    # ratio for mixed tails (docs/benchmarks.md, item 13).
    stickiness_fill: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="estimated cache fill at which a copy costs the full stickiness; below "
        "it, less (one router alone, an endpoint without queued work); 0: off, always full",
    )
    # 0.1 since 2026-11-30 (0.5 before): over five draws of the simulator's grid one router's
    # GAIE tails at 16 replicas fell 95 -> 87 ms; worse on both metrics only in the overloaded
    # GAIE 4 x 100k cell (docs/benchmarks.md, item 10). Several router replicas widen it to
    # shared_cold_margin by themselves.
    cold_margin: float = Field(
        default=0.1,
        ge=0,
        description="cold start: skip a hashed pick queued this many cold prefills past the least",
    )
    shared_cold_margin: float = Field(
        default=1.0,
        ge=0,
        description="cold_margin once this router sends at most half of what the endpoints "
        "serve (several router replicas); linear in between; = cold_margin: off",
    )
    # 4 since 2026-12-06 (Dec 6, thirty-second session): four router replicas on the
    # simulator's grids kept more of one router's hit ratio where keys come back (documents,
    # conversations: llm-d's tiered shape 4 x 1M 0.740 -> 0.829), mostly by their first
    # placements (the share reads 0.5 until measured); the Mooncake trace's mostly one-off
    # keys keep the queues' margin once measured, but its first placements cost it tail
    # (4 x 1M p99 +9.6 %, docs/benchmarks.md).
    recurring_cold_margin: float = Field(
        default=4.0,
        ge=0,
        description="cold prefills added to the shared cold-start margin when every request "
        "comes back to a placement key this router has seen; from none at a recurrence of "
        "0.3, linear; a router alone: none",
    )
    min_match_blocks: int = Field(
        default=1, ge=1, description="fewest matched blocks that count as holding a prefix"
    )
    shared_prefix_fraction: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="a shared prefix covering this much of the prompt attracts new sessions",
    )
    spread_popular_prefixes: bool = Field(
        default=True,
        description="a shared prefix drawing over 1/endpoints of the new sessions (one system "
        "prompt for all) places them as cold starts instead of on its holders",
    )
    spread_popular_completions: bool = Field(
        default=True,
        description="a completion whose held prefix is under shared_prefix_fraction of it "
        "and popular is placed as a new session by its own first blocks after that prefix",
    )
    popularity_window: int = Field(
        default=256, ge=1, description="new sessions over which that share is measured"
    )
    balance_cold_starts: bool = Field(
        default=True,
        description="a router that sends at least balance_min_share of what the endpoints "
        "serve places cold starts on endpoints whose recent cold starts (prefill work) are "
        "at most the mean, and sends a placement key back where it placed it; router "
        "replicas sharing placements (peers) take a key's second rendezvous pick when, by "
        "all of their cold starts, the first has two of its cold prefills more",
    )
    off_pick_aging: float = Field(
        default=1.0,
        ge=0,
        description="a router sending under balance_min_share of what the endpoints serve "
        "enters a request placed off every rendezvous pick of its keys in the index as if "
        "this fraction of (1 - share) x the endpoint's cache had turned over since (other "
        "routers' new blocks, unseen, evict a copy only this router refreshes); 0: off",
    )
    balance_min_share: float = Field(
        default=0.9,
        ge=0,
        le=1,
        description="least measured traffic share at which balance_cold_starts applies "
        "(router replicas without peers must agree on rendezvous picks instead)",
    )
    cold_start_key: Literal["first_turn", "blocks"] = Field(
        default="first_turn",
        description="session key: prompt up to the first user turn, or the first blocks",
    )
    cold_start_blocks: int = Field(
        default=4, ge=1, description="blocks in the session key without turns (completions)"
    )
    fallbacks: int = Field(default=2, ge=0, le=16, description="extra endpoints in the header")
    peer_work_weight: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="share of the queued work peers report that counts (peers section); "
        "under 1 damps routers moving sessions on second-old figures",
    )
    count_unseen_waiting: bool = Field(
        default=True,
        description="count requests an endpoint reports waiting beyond this router's own, "
        "or the others' share of what the endpoints report, as queued work (several "
        "router replicas)",
    )
    kv_blocked_fraction: float = Field(
        default=0.9,
        ge=0,
        le=1,
        description="reported KV usage at which an endpoint's waiting requests wait for memory: "
        "all of them count as queued work, this router's own too, while another endpoint "
        "has room (0 = off)",
    )
    slot_blocked_fraction: float = Field(
        default=0.95,
        ge=0,
        le=1,
        description="running requests, as a share of the most the endpoint was seen running "
        "(its batch slots, vLLM's max_num_seqs), at which its waiting requests wait for a "
        "slot and count like those waiting for memory (0 = off)",
    )
    slot_ceiling_min: int = Field(
        default=32,
        ge=1,
        description="fewest running requests taken as an endpoint's batch-slot ceiling "
        "(slot_blocked_fraction); a lower peak is more likely the load than a limit",
    )
    kv_wait_from_admissions: bool = Field(
        default=True,
        description="price the wait at an endpoint waiting for KV memory by its admission "
        "rate (requests it finishes per second plus the growth of its running ones), not by "
        "the prefills of its waiting requests; until it has one, their prefills' price holds "
        "past the endpoint's next reading",
    )
    kv_saturated_fraction: float = Field(
        # 0.98 until item 25 (docs/benchmarks.md): a cache a little short of full still takes
        # new sessions, whose wait for memory kv_blocked_fraction prices.
        default=1.0,
        gt=0,
        le=1,
        description="reported KV usage at which an endpoint takes no new sessions while others can",
    )


class HealthCheckConfig(_Strict):
    """Active HTTP probes of the endpoints (the router stops picking a failing one)."""

    enabled: bool = Field(default=True, description="probe endpoints over HTTP")
    path: str = Field(default="/health", description="probe path (vLLM, SGLang, TGI serve it)")
    interval_seconds: float = Field(default=1.0, gt=0, description="time between probes")
    timeout_seconds: float = Field(default=1.0, gt=0, description="probe timeout")
    unhealthy_threshold: int = Field(
        default=2, ge=1, description="consecutive failures before an endpoint is skipped"
    )
    healthy_threshold: int = Field(
        default=1, ge=1, description="consecutive successes before it is used again"
    )


_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_PORT_NAME = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class DiscoveryConfig(_Strict):
    """Where the replica set comes from: the static `endpoints` list, DNS, or Kubernetes.

    kind=dns polls A/AAAA records of `dns_name` (port `dns_port`), or SRV records (port from
    the record) with `srv: true`. kind=kubernetes lists and watches the EndpointSlices of
    Service `service` in `namespace` and keeps the ready endpoints' `port`. Discovered
    endpoints replace the static list; `capacity_tokens`/`weight` apply to each of them.
    """

    kind: Literal["static", "dns", "kubernetes"] = Field(
        default="static",
        description="where the endpoints come from: static (the endpoints list), dns or kubernetes",
    )
    # kubernetes
    namespace: str | None = Field(
        default=None, description="namespace of the Service (default: the pod's own namespace)"
    )
    service: str | None = Field(default=None, description="Service whose EndpointSlices to watch")
    port: int | str | None = Field(
        default=None,
        description="port name or target port number in the EndpointSlices (default: the only one)",
    )
    api_url: str | None = Field(
        default=None,
        description="Kubernetes API base URL (default: in-cluster https://$KUBERNETES_SERVICE_HOST)",
    )
    token_file: str = Field(
        default=SERVICE_ACCOUNT_DIR + "/token",
        description="bearer token for the Kubernetes API, read on every request (bound tokens "
        "rotate)",
    )
    ca_file: str = Field(
        default=SERVICE_ACCOUNT_DIR + "/ca.crt",
        description="CA bundle the Kubernetes API's certificate must chain to (the system's "
        "if the file is absent)",
    )
    watch_timeout_seconds: int = Field(
        default=300, ge=10, le=3600, description="server-side watch expiry; then watch again"
    )
    # dns
    dns_name: str | None = Field(default=None, description="name to resolve (A/AAAA or SRV)")
    dns_port: int | None = Field(
        default=None, ge=1, le=65535, description="port of A/AAAA endpoints (not with srv)"
    )
    srv: bool = Field(default=False, description="resolve SRV records (needs dnspython)")
    address_family: Literal["any", "ipv4", "ipv6"] = Field(
        default="any",
        description="addresses kept: any (dns: both; kubernetes: IPv4 when a dual-stack "
        "Service has it, so a pod is one endpoint), ipv4 or ipv6",
    )
    interval_seconds: float = Field(default=5.0, gt=0, description="DNS polling interval")
    # retries (both)
    backoff_initial_seconds: float = Field(
        default=0.5,
        gt=0,
        description="wait before retrying a failed lookup, list or watch; doubles per "
        "failure (jittered)",
    )
    backoff_max_seconds: float = Field(default=30.0, gt=0, description="longest such wait")
    # applied to every discovered endpoint
    capacity_tokens: int | None = Field(
        default=None,
        gt=0,
        description="KV-cache size in tokens of each discovered endpoint (unset: the size "
        "vLLM reports, else routing.default_capacity_tokens)",
    )
    weight: float = Field(
        default=1.0, gt=0, description="relative share of load each discovered endpoint takes"
    )

    @field_validator("namespace", "service")
    @classmethod
    def _dns_label(cls, value: str | None) -> str | None:
        if value is not None and (len(value) > 63 or not _DNS_LABEL.fullmatch(value)):
            raise ValueError(f"{value!r} is not a Kubernetes name (lowercase DNS label)")
        return value

    @field_validator("port")
    @classmethod
    def _port_name_or_number(cls, value: int | str | None) -> int | str | None:
        if isinstance(value, str) and value.isdigit():
            value = int(value)
        if isinstance(value, int):
            if not 1 <= value <= 65535:
                raise ValueError(f"port {value} out of range 1-65535")
        elif value is not None and (len(value) > 15 or not _PORT_NAME.fullmatch(value)):
            raise ValueError(f"{value!r} is neither a port number nor a port name")
        return value

    @field_validator("api_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"{value!r} must start with http:// or https://")
        return value.rstrip("/") if value else value

    @field_validator("dns_name")
    @classmethod
    def _dns_name(cls, value: str | None) -> str | None:
        return _dns_name_or_none(value)

    @model_validator(mode="after")
    def _required_for_kind(self) -> DiscoveryConfig:
        if self.kind == "kubernetes" and not self.service:
            raise ValueError("service: required when kind is 'kubernetes'")
        if self.kind == "dns":
            if not self.dns_name:
                raise ValueError("dns_name: required when kind is 'dns'")
            if not self.srv and self.dns_port is None:
                raise ValueError("dns_port: required when kind is 'dns' without srv")
            if self.srv and self.dns_port is not None:
                raise ValueError("dns_port: SRV records carry the port; remove dns_port")
        if self.backoff_max_seconds < self.backoff_initial_seconds:
            raise ValueError("backoff_max_seconds: must be >= backoff_initial_seconds")
        return self


class SignalsConfig(_Strict):
    """Scraping the endpoints' own Prometheus metrics (vLLM or SGLang names)."""

    enabled: bool = Field(default=True, description="scrape each endpoint's metrics")
    path: str = Field(default="/metrics", description="metrics path on the endpoint")
    interval_seconds: float = Field(default=0.5, gt=0, description="time between scrapes")
    timeout_seconds: float = Field(default=1.0, gt=0, description="scrape timeout")


class ModelsConfig(_Strict):
    """Which models each endpoint serves, read from its OpenAI-style model list (vLLM lists
    its served names and LoRA adapters there): a request goes only to endpoints serving its
    model, so one router serves several model pools."""

    enabled: bool = Field(default=True, description="read each endpoint's model list")
    path: str = Field(default="/v1/models", description="model list path on the endpoint")
    interval_seconds: float = Field(
        default=2.0,
        gt=0,
        description="time between reads (a model no list names has them read at once)",
    )
    timeout_seconds: float = Field(default=1.0, gt=0, description="read timeout")
    unknown_wait_seconds: float = Field(
        default=0.5,
        ge=0,
        lt=1.0,
        description="a request naming a model no list names waits up to this long for the "
        "lists read again at once (an adapter loaded at run time then goes to its server from "
        "its first request); 0: it does not wait. Below Envoy's ext_proc message_timeout "
        "(1 s in this project's configs; a lower --message-timeout-ms needs a lower wait)",
    )
    api_key_env: str = Field(
        default="",
        description="environment variable holding the key the lists need (vLLM's --api-key "
        "guards /v1/models), sent as a bearer token",
    )

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, value: str) -> str:
        if value and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
            raise ValueError(f"{value!r} is not an environment variable name")
        return value


class PeersConfig(_Strict):
    """Other replicas of this router, whose own queued work is counted as this one's and
    whose placements go into this one's index (off while no address or DNS name is set).
    Each replica exports its charges per endpoint on its admin /metrics
    (``prefix_router_own_queued_work``) and its recent placements on /peer/placements, and
    reads the others' every interval, so a long prefill one replica sent, and a conversation
    it placed, are known to all within about a second."""

    addresses: tuple[str, ...] = Field(
        default=(), description="admin host:port of each other replica (its own is skipped)"
    )
    dns_name: str | None = Field(
        default=None, description="name resolving to every replica (a headless Service)"
    )
    dns_port: int | None = Field(
        default=None, ge=1, le=65535, description="admin port of the replicas behind dns_name"
    )
    interval_seconds: float = Field(default=1.0, gt=0, description="time between reads")
    timeout_seconds: float = Field(default=0.5, gt=0, description="read timeout")
    share_placements: bool = Field(
        default=True,
        description="also read the peers' placements (block hashes and endpoint of each "
        "request they routed) into this replica's index",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.addresses) or self.dns_name is not None

    @field_validator("addresses", mode="before")
    @classmethod
    def _addresses_from_string(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("addresses")
    @classmethod
    def _host_ports(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        """host:port, where the host may be a name (the admin HTTP client resolves it)."""
        for address in value:
            host, sep, port = address.rpartition(":")
            if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"{address!r} is not 'host:port' (IPv6 as '[addr]:port')")
        return value

    @field_validator("dns_name")
    @classmethod
    def _dns_name(cls, value: str | None) -> str | None:
        return _dns_name_or_none(value)

    @model_validator(mode="after")
    def _dns_complete(self) -> PeersConfig:
        if (self.dns_name is None) != (self.dns_port is None):
            raise ValueError("dns_name and dns_port: set both (or neither)")
        return self


_PORT_FIELD = re.compile(r"\{port([+-]\d+)?\}")


class WarmStartConfig(_Strict):
    """An index for a router that starts (warm_start.py): from the file its predecessor
    wrote, or from a peer's admin port. A fresh router knows nothing of what the endpoints
    hold until its own placements refill its index (simulated: a lone router restarted
    lost 0.06-0.13 of the hit ratio in the minutes after)."""

    path: str | None = Field(
        default=None,
        description="file the index is written to (every interval_seconds and at stop) and "
        "read from at start; unset: none. With --workers N > 1 each worker has a file of its "
        "own: this path with '.worker-K' appended (K: its slot, 0 to N-1, kept by a worker "
        "started again in its place)",
    )
    interval_seconds: float = Field(
        default=30.0, ge=0, description="time between writes of path (0: only at stop)"
    )
    max_age_seconds: float = Field(
        default=600.0,
        gt=0,
        description="an older file is not used (the servers' caches have turned over)",
    )
    from_peers: bool = Field(
        default=True,
        description="with peers set, a router starting reads one answering peer's index "
        "(GET /peer/index on its admin port) once, in its first rounds of reads",
    )
    from_peers_seconds: float = Field(
        default=30.0,
        gt=0,
        description="how long a starting router looks for a peer's index; meanwhile (and "
        "while a handed index goes in) it answers its own peers' asks with 503, its index "
        "being young",
    )

    @field_validator("path")
    @classmethod
    def _a_file_name(cls, value: str | None) -> str | None:
        """Whether its directory exists is checked when the router starts (serve), where
        the file is: a configuration is also checked elsewhere (a CI job, a ConfigMap)."""
        if value is None or not value.strip():
            return None
        if value.endswith("/"):
            raise ValueError(f"{value} names a directory, not a file")
        return value


def fill_address(template: str, host: str, port: int) -> str:
    """A ZMQ address for one endpoint: ``{host}`` and ``{port}`` filled from the endpoint's
    address, ``{port+N}`` / ``{port-N}`` with the port moved by N (vLLM ranks started with
    ``--data-parallel-external-lb`` serve on consecutive ports and publish on the
    configured events port plus their rank: API 8000 + r publishes on 5557 + r, so
    ``tcp://{host}:{port-2443}``)."""
    filled = _PORT_FIELD.sub(lambda m: str(port + int(m.group(1) or 0)), template)
    return filled.format(host=f"[{host}]" if ":" in host else host)


class CacheEventsConfig(_Strict):
    """The endpoints' own KV-cache events (vLLM's ``--kv-events-config``, ZMQ publisher):
    blocks each endpoint stored and evicted, whoever routed the request, translated into
    this router's block hashes (extproc/cache_events.py); off while ``publisher`` is ''.
    A router that places (nearly) all the traffic itself ignores stored and evicted blocks
    (docs/benchmarks.md, "KV-cache events"); a cleared cache always empties its index."""

    publisher: str = Field(
        default="",
        description="ZMQ address of each endpoint's event publisher, {host} and {port} "
        "taken from the endpoint's address: tcp://{host}:5557, or ipc:///run/kv-{port}.ipc; "
        "{port+N} / {port-N} for a port N away (data-parallel ranks as endpoints of their "
        "own publish on the events port plus their rank: tcp://{host}:{port-2443} for "
        "API ports 8000, 8001, … and events 5557, 5558, …)",
    )
    replay: str = Field(
        default="",
        description="ZMQ address of each endpoint's replay socket (vLLM's replay_endpoint), "
        "{host} and {port} filled likewise: messages missed (sequence gaps, a late start) "
        "are asked for there ('' = none)",
    )
    topic: str = Field(default="", description="topic prefix to subscribe to ('' = all)")
    model_dir: str = Field(
        default="",
        description="directory with the served model's tokenizer.json and "
        "tokenizer_config.json (its chat template): the files the model server loads",
    )
    model: str = Field(
        default="", description="the model name clients send (it keys the block hashes)"
    )

    @property
    def enabled(self) -> bool:
        return bool(self.publisher)

    @field_validator("publisher", "replay")
    @classmethod
    def _zmq_address(cls, value: str) -> str:
        if value and not value.startswith(("tcp://", "ipc://")):
            raise ValueError(f"{value!r} is not a tcp:// or ipc:// address")
        try:
            fill_address(value, "h", 1)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(
                f"{value!r}: only {{host}}, {{port}} and {{port+N}} / {{port-N}} may be "
                f"filled ({exc})"
            ) from None
        return value

    @model_validator(mode="after")
    def _complete(self) -> CacheEventsConfig:
        if self.enabled and not (self.model_dir and self.model):
            raise ValueError("publisher is set: set model_dir and model too")
        return self


class TLSConfig(_Strict):
    """TLS (and mTLS) on the gRPC port Envoy connects to; off while cert_file is unset.

    The files are PEM. They are re-read when their modification time changes (checked at
    most every `reload_seconds`, on the next new connection), so a rotated certificate is
    served without a restart; connections already open keep the certificate they began with.
    With `client_ca_file` every client must present a certificate signed by that CA (mTLS).
    The admin HTTP port is not covered: keep it on loopback or a private interface.
    """

    cert_file: str | None = Field(
        default=None, description="server certificate chain (PEM); set to serve TLS"
    )
    key_file: str | None = Field(default=None, description="private key of cert_file (PEM)")
    client_ca_file: str | None = Field(
        default=None, description="CA bundle (PEM) that client certificates must chain to (mTLS)"
    )
    reload_seconds: float = Field(
        default=10.0, gt=0, description="how often the files are checked for a new version"
    )

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None

    @model_validator(mode="after")
    def _complete(self) -> TLSConfig:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file: set both (or neither)")
        if self.client_ca_file is not None and self.cert_file is None:
            raise ValueError("client_ca_file: mTLS needs cert_file and key_file as well")
        for name in ("cert_file", "key_file", "client_ca_file"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ValueError(f"{name}: must be a file path")
        return self


class Config(_Strict):
    server: ServerConfig = ServerConfig()
    routing: RoutingConfig = RoutingConfig()
    health: HealthCheckConfig = HealthCheckConfig()
    signals: SignalsConfig = SignalsConfig()
    models: ModelsConfig = ModelsConfig()
    peers: PeersConfig = PeersConfig()
    endpoints: tuple[EndpointConfig, ...] = Field(
        default=(),
        description="the model servers when discovery.kind is static: ip:port strings or "
        "{address, capacity_tokens, weight, models, ready}",
    )
    discovery: DiscoveryConfig = DiscoveryConfig()
    tls: TLSConfig = TLSConfig()
    cache_events: CacheEventsConfig = CacheEventsConfig()
    warm_start: WarmStartConfig = WarmStartConfig()

    @field_validator("endpoints", mode="before")
    @classmethod
    def _endpoints_from_strings(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [part for part in value.split(",") if part.strip()]
        if isinstance(value, list | tuple):
            return [{"address": v} if isinstance(v, str) else v for v in value]
        return value

    @field_validator("endpoints")
    @classmethod
    def _unique_addresses(cls, value: tuple[EndpointConfig, ...]) -> tuple[EndpointConfig, ...]:
        seen: set[str] = set()
        for endpoint in value:
            if endpoint.address in seen:
                raise ValueError(f"duplicate endpoint {endpoint.address}")
            seen.add(endpoint.address)
        return value


def _get_path(tree: dict[str, Any], path: list[str]) -> Any:
    node: Any = tree
    for key in path:
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return node


def _set_path(tree: dict[str, Any], path: list[str], value: Any) -> None:
    node = tree
    for key in path[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(path)}: {key} is not a section")
        node = child
    node[path[-1]] = value


# Kubernetes puts these in every pod for each Service of the namespace (docker-link style):
# a Service named prefix-router gives PREFIX_ROUTER_SERVICE_HOST, PREFIX_ROUTER_PORT_9002_TCP…
_SERVICE_LINK = re.compile(
    r"^(?:[A-Z0-9_]+_)?(?:SERVICE_HOST|SERVICE_PORT(?:_[A-Z0-9_]+)?"
    r"|PORT(?:_\d+_(?:TCP|UDP|SCTP)(?:_(?:PROTO|PORT|ADDR))?)?)$"
)


def _env_overrides(environ: Mapping[str, str]) -> list[tuple[list[str], Any]]:
    """PREFIX_ROUTER_SERVER__LISTEN=... → (['server', 'listen'], value); values parse as YAML.
    Kubernetes' service-link variables (no ``__`` in them) are not settings: skipped."""
    overrides = []
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        key = name[len(ENV_PREFIX) :]
        if "__" not in key and _SERVICE_LINK.match(key):
            continue
        path = [part.lower() for part in key.split("__") if part]
        if path:
            overrides.append((path, yaml.safe_load(raw) if raw else raw))
    return overrides


def _format_error(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "(top level)"
        lines.append(f"config field {where}: {item['msg']}")
    return "\n".join(lines)


def parse_assignments(items: Iterable[str], flag: str, prefix: str = "") -> dict[str, Any]:
    """``KEY=VALUE`` strings from a command line (``flag``) as load_config overrides, the
    values parsed as YAML like the environment's; ``prefix`` is prepended to each key."""
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"{flag} {item!r}: expected KEY=VALUE")
        overrides[prefix + key.strip()] = yaml.safe_load(value)
    return overrides


def routing_overrides(pairs: Iterable[str], flag: str = "--routing") -> dict[str, Any]:
    """``KEY=VALUE`` routing settings from a benchmark's command line, checked as the
    server checks ``--set routing.KEY=VALUE``: the validated values of the keys given."""
    pairs = list(pairs)
    try:
        overrides = parse_assignments(pairs, flag, prefix="routing.")
        routing = load_config(None, overrides, environ={}).routing
    except ConfigError as error:
        raise SystemExit(f"{flag} {' '.join(pairs)}: {error}") from None
    return routing.model_dump(include={key.removeprefix("routing.") for key in overrides})


def load_config(
    path: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """File < environment < overrides (dotted keys, e.g. {'server.workers': 2})."""
    tree: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path}: top level must be a mapping")
        tree = loaded
    for key_path, value in _env_overrides(os.environ if environ is None else environ):
        in_file = _get_path(tree, key_path)
        if in_file is not None and in_file != value:
            # (The container image sets server.listen and server.admin_listen this way.)
            log.warning(
                "%s: the environment's %r overrides the config file's %r",
                ".".join(key_path),
                value,
                in_file,
            )
        _set_path(tree, key_path, value)
    for dotted, value in (overrides or {}).items():
        if value is not None:
            _set_path(tree, dotted.split("."), value)
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc)) from None
