"""Prometheus metrics of the router (prometheus_client), correct across worker processes.

With ``--workers N`` the supervisor sets PROMETHEUS_MULTIPROC_DIR before starting the
workers; each worker's values live in memory-mapped files there and the supervisor's admin
endpoint sums them (gauges by their declared ``multiprocess_mode``).
Metric names are prefixed ``prefix_router_``; endpoint labels are endpoint addresses, and
a removed endpoint's series go with it (``refresh``), so cardinality is bounded by the
endpoint set. With workers a series cannot be removed (prometheus_client keeps it in the
worker's file): its gauges are zeroed instead, and its counters stay until the worker ends.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics_core import CounterMetricFamily, Metric

if TYPE_CHECKING:
    from .router import Router
    from .server import Outcome
    from .signals import EndpointSignals

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
DECISION_BUCKETS = (25e-6, 50e-6, 100e-6, 200e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 50e-3)
BODY_BUCKETS = tuple(float(2**k) for k in range(10, 27, 2))  # 1 KiB .. 64 MiB


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        def gauge(name: str, doc: str, labels: tuple[str, ...], mode: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry, multiprocess_mode=mode)

        self.requests = counter(
            "prefix_router_requests",
            "Requests seen, by outcome (routed, pass_through, no_endpoint, error) and "
            "reason (the rule that fired, the pass-through kind, or the error type)",
            ("outcome", "reason"),
        )
        self.decision_seconds = Histogram(
            "prefix_router_decision_seconds",
            "Time to parse, hash, match and schedule one request: what Envoy waits for (the "
            "index update comes after the answer)",
            buckets=DECISION_BUCKETS,
            registry=registry,
        )
        self.list_wait_seconds = Histogram(
            "prefix_router_model_list_wait_seconds",
            "Time a request naming a model no list named waited for the model lists read "
            "again (models.unknown_wait_seconds), by how it ended: listed (a list names it "
            "now: an adapter loaded at run time), not_listed, timeout, cancelled (the stream ended)",
            ("result",),
            buckets=(1e-3, 5e-3, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=registry,
        )
        self.body_bytes = Histogram(
            "prefix_router_request_body_bytes",
            "Request bodies the router read",
            buckets=BODY_BUCKETS,
            registry=registry,
        )
        self.endpoint_decisions = counter(
            "prefix_router_endpoint_decisions", "Requests routed to each endpoint", ("endpoint",)
        )
        self.endpoint_restarts = counter(
            "prefix_router_endpoint_restarts",
            "Restarts of an endpoint's server told by its metrics (another process start "
            "time): its index is emptied. Each worker process (serve --workers) counts those "
            "it reads; one the KV-cache events' sequence told first is counted only in "
            'prefix_router_cache_events{kind="restarts"}',
            ("endpoint",),
        )
        self.prompt_blocks = counter(
            "prefix_router_prompt_blocks",
            "Prompt blocks of routed requests, per chosen endpoint",
            ("endpoint",),
        )
        self.matched_blocks = counter(
            "prefix_router_matched_blocks",
            "Prompt blocks the index predicted cached on the chosen endpoint "
            "(predicted hit ratio = matched / prompt)",
            ("endpoint",),
        )
        self.served_elsewhere = counter(
            "prefix_router_served_elsewhere",
            "Requests Envoy served on another endpoint than the router chose (retry/fallback)",
        )
        self.in_flight = gauge(
            "prefix_router_endpoint_in_flight",
            "Requests in flight per endpoint, as tracked by the router (one with n samples "
            "counts n, as the server's running and waiting gauges do)",
            ("endpoint",),
            "livesum",
        )
        self.queued_work = gauge(
            "prefix_router_endpoint_queued_work",
            "Prefill work the router estimates queued per endpoint (its own requests and "
            "other routers' reported waiting ones), in token-equivalents",
            ("endpoint",),
            "livesum",
        )
        self.prefill_rate = gauge(
            "prefix_router_prefill_tokens_per_second",
            "Prefill throughput queued work drains at (learned from the endpoints' counters, "
            "token-equivalents per second)",
            (),
            "livemax",
        )
        self.own_queued_work = gauge(
            "prefix_router_own_queued_work",
            "Prefill work this router replica itself sent each endpoint and estimates still "
            "queued (token-equivalents): what its peers read (peers config)",
            ("router", "endpoint"),
            "liveall",
        )
        self.own_placed_work = gauge(
            "prefix_router_own_placed_work",
            "Prefill work of the cold starts this router replica placed on each endpoint "
            "lately (token-equivalents, decaying): what its peers balance new sessions by",
            ("router", "endpoint"),
            "liveall",
        )
        self.peer_placed_work = gauge(
            "prefix_router_peer_placed_work",
            "Prefill work of the cold starts peer router replicas report placing on each "
            "endpoint lately (token-equivalents; 0 while none reports): with its own, what "
            "this replica balances new sessions by",
            ("endpoint",),
            "livemax",
        )
        self._own_exported: set[str] = set()
        self._endpoints_exported: set[str] = set()
        self.discovery_failures = counter(
            "prefix_router_discovery_failures",
            "Endpoint lookups (DNS) or EndpointSlice lists/watches that failed; the last "
            "endpoint list stays in force meanwhile",
        )
        self.peer_placements = counter(
            "prefix_router_peer_placements",
            "Placements read from peer router replicas into this one's index (peers config)",
        )
        self.warm_start_blocks = counter(
            "prefix_router_warm_start_blocks",
            "Index slots a starting router took from the index it was handed (warm_start "
            "config), by source (file, peer)",
            ("source",),
        )
        self.index_snapshots = counter(
            "prefix_router_index_snapshots",
            "Index snapshots written to warm_start.path (outcome written / failed) and "
            "served to starting peers (outcome served)",
            ("outcome",),
        )
        self.cache_events = counter(
            "prefix_router_cache_events",
            "The endpoints' KV-cache events read (cache_events config), by kind: "
            "stored_blocks / removed_blocks (the router's blocks they gave), cleared, "
            "untranslated_blocks (the endpoint's blocks that gave none), ignored_messages "
            "(with events not applied: a router placing nearly all traffic ignores stores and "
            "evictions, one yet to measure its share evictions), "
            "replayed_messages, missed_messages (sequence gaps not replayed), "
            "replay_timeouts, restarts (the sequence started over), malformed_messages, "
            "socket_errors",
            ("endpoint", "kind"),
        )
        self.peers = gauge(
            "prefix_router_peers",
            "Other router replicas whose queued work this one counts (heard from recently)",
            (),
            "liveall",
        )
        self.traffic_share = gauge(
            "prefix_router_traffic_share",
            "This router's share of the requests its endpoints report finishing (1 = it "
            "places all of them; about 1/K with K router replicas)",
            (),
            "liveall",
        )
        self.cold_margin = gauge(
            "prefix_router_cold_margin",
            "Cold-start margin in use: routing.cold_margin alone, up to "
            "routing.shared_cold_margin as the traffic share falls to a half (before what "
            "recurring keys add: prefix_router_key_recurrence)",
            (),
            "liveall",
        )
        self.key_recurrence = gauge(
            "prefix_router_key_recurrence",
            "Share of this router's recent requests whose placement key it had seen before "
            "(0.5 until measured); over 0.3, a router sharing the endpoints widens its "
            "cold-start margin by up to routing.recurring_cold_margin cold prefills",
            (),
            "liveall",
        )
        self.healthy = gauge(
            "prefix_router_endpoint_healthy",
            "1 if the endpoint passes the router's health probes",
            ("endpoint",),
            "livemin",
        )
        self.endpoint_model = gauge(
            "prefix_router_endpoint_model",
            "1 for each model the endpoint is known to serve (configured, or read from its "
            "model list; models config): requests for a model go only to its endpoints, and "
            "to those whose list could not be read",
            ("endpoint", "model"),
            "livemax",
        )
        self._models_exported: set[tuple[str, str]] = set()
        self.index_entries = gauge(
            "prefix_router_index_entries",
            "Block hashes held in the index",
            ("endpoint",),
            "livesum",
        )
        self.index_bytes = gauge(
            "prefix_router_index_bytes", "Approximate memory of the index", (), "livesum"
        )
        self.realised_hit_ratio = gauge(
            "prefix_router_endpoint_realised_hit_ratio",
            "Prefix-cache hit ratio the endpoint itself reports (tokens, last scrape window)",
            ("endpoint",),
            "livemax",
        )
        self.metrics_up = gauge(
            "prefix_router_endpoint_metrics_up",
            "1 if the endpoint's /metrics answered at the last scrape",
            ("endpoint",),
            "livemin",
        )
        self.queue_depth = gauge(
            "prefix_router_endpoint_waiting_requests",
            "Requests waiting in the endpoint's queue (scraped)",
            ("endpoint",),
            "livemax",
        )
        self.kv_usage = gauge(
            "prefix_router_endpoint_kv_usage",
            "KV-cache usage fraction the endpoint reports (scraped)",
            ("endpoint",),
            "livemax",
        )

    @property
    def _endpoint_gauges(self) -> tuple[Gauge, ...]:
        return (
            self.in_flight,
            self.queued_work,
            self.peer_placed_work,
            self.healthy,
            self.index_entries,
            self.realised_hit_ratio,
            self.metrics_up,
            self.queue_depth,
            self.kv_usage,
        )

    def observe(self, outcome: Outcome) -> None:
        decision = outcome.decision
        reason = decision.rule if decision is not None else outcome.detail
        self.requests.labels(outcome.kind, reason).inc()
        if outcome.body_bytes:
            self.body_bytes.observe(outcome.body_bytes)
        if outcome.decide_seconds:
            self.decision_seconds.observe(outcome.decide_seconds)
        if outcome.list_wait:
            self.list_wait_seconds.labels(outcome.list_wait).observe(outcome.list_wait_seconds)
        if decision is not None and decision.endpoint:
            self.endpoint_decisions.labels(decision.endpoint).inc()
            self.prompt_blocks.labels(decision.endpoint).inc(decision.total_blocks)
            self.matched_blocks.labels(decision.endpoint).inc(decision.matched_blocks)
            if decision.served:
                self.served_elsewhere.inc()

    def refresh(self, router: Router) -> None:
        """Copy the router's state into gauges (called on a timer, not per request)."""
        for address, count in router.in_flight().items():
            self.in_flight.labels(address).set(count)
        for address, work in router.queued_work().items():
            self.queued_work.labels(address).set(work)
        self.prefill_rate.set(router.prefill_rate)
        own, placed = router.own_queued_work(), router.own_placed_work()
        for address, work in own.items():
            self.own_queued_work.labels(router.instance, address).set(work)
            self.own_placed_work.labels(router.instance, address).set(placed[address])
        # A removed endpoint's last figures must not stay exported: peers would count them,
        # undrained, for as long as they read them (e.g. after the address comes back).
        workers = bool(os.environ.get(MULTIPROC_ENV))
        for address in self._own_exported - own.keys():
            for gauge_ in (self.own_queued_work, self.own_placed_work):
                # Zero first: with --workers the value lives on in the worker's mmap file
                # (and prometheus_client cannot remove it there: it warns on every try).
                gauge_.labels(router.instance, address).set(0.0)
                if not workers:
                    gauge_.remove(router.instance, address)
        self._own_exported = set(own)
        for address, work in router.peer_placed_work().items():
            self.peer_placed_work.labels(address).set(work)
        self.peers.set(len(router.peers()))
        self.traffic_share.set(router.traffic_share)
        self.cold_margin.set(router.cold_margin)
        self.key_recurrence.set(router.key_recurrence)
        healthy = set(router.healthy_endpoints())
        for address in router.endpoints:
            self.healthy.labels(address).set(1 if address in healthy else 0)
        served = {
            (address, model)
            for address, models in router.served_models().items()
            for model in models or ()
        }
        for pair in served - self._models_exported:
            self.endpoint_model.labels(*pair).set(1)
        for pair in self._models_exported - served:
            if workers:  # (the value lives on in the worker's mmap file)
                self.endpoint_model.labels(*pair).set(0)
            else:
                self.endpoint_model.remove(*pair)
        self._models_exported = served
        for address, entries in router.index.entries_by_endpoint().items():
            self.index_entries.labels(address).set(entries)
        self.index_bytes.set(router.index_stats().approx_bytes)
        # A removed endpoint (a deleted pod) kept showing healthy=1, its last in-flight count
        # and so on, for as long as the router ran; with pod churn, series piled up.
        for address in self._endpoints_exported - set(router.endpoints):
            self.forget_endpoint(address)
        self._endpoints_exported = set(router.endpoints)

    def forget_endpoint(self, address: str) -> None:
        """Drop a removed endpoint's series (zero its gauges where they cannot be dropped)."""
        workers = bool(os.environ.get(MULTIPROC_ENV))
        for gauge_ in self._endpoint_gauges:
            if workers:
                gauge_.labels(address).set(0.0)
            else:
                gauge_.remove(address)
        if not workers:
            for counter_ in (
                self.endpoint_decisions,
                self.prompt_blocks,
                self.matched_blocks,
                self.endpoint_restarts,
            ):
                counter_.remove(address)
            self.cache_events.remove_by_labels({"endpoint": address})

    def record_signals(self, address: str, signals: EndpointSignals) -> None:
        self.metrics_up.labels(address).set(1 if signals.up else 0)
        if signals.window_hit_ratio is not None:
            self.realised_hit_ratio.labels(address).set(signals.window_hit_ratio)
        if signals.waiting is not None:
            self.queue_depth.labels(address).set(signals.waiting)
        if signals.kv_usage is not None:
            self.kv_usage.labels(address).set(signals.kv_usage)


# A worker's value file starts with 8 bytes: the used length and padding.
_VALUE_FILE_HEADER = 8


def _written(path: str) -> bool:
    """Whether a worker's value file has its header yet.

    A worker creates a file and only then sizes it. prometheus_client's collector fails
    on a file read in between, and that failed the whole /metrics page with a 500 while a
    worker started. Such a file holds no values yet, so it is left out.
    """
    try:
        return os.path.getsize(path) >= _VALUE_FILE_HEADER
    except OSError:
        return False


class _WorkerFilesCollector:
    """prometheus_client's multiprocess collector, reading only the files already written."""

    def __init__(self, path: str) -> None:
        self._path = path

    def collect(self) -> Iterable[Metric]:
        from prometheus_client.multiprocess import MultiProcessCollector

        files = [f for f in glob.glob(os.path.join(self._path, "*.db")) if _written(f)]
        return MultiProcessCollector.merge(files, accumulate=True)


class WorkerRestarts:
    """The supervisor's count of worker restarts (serve --workers), by reason: ``exited``
    (died: crashed, killed, out of memory) or ``hung`` (silent for
    server.worker_hang_seconds, killed). A collector of plain counts rather than a Counter:
    the supervisor's own metric values are not in the workers' multiprocess files."""

    REASONS = ("exited", "hung")

    def __init__(self) -> None:
        self.counts = dict.fromkeys(self.REASONS, 0)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "prefix_router_worker_restarts",
            "Worker processes the supervisor (serve --workers) restarted, by reason: exited "
            "(died) or hung (silent for server.worker_hang_seconds, killed)",
            labels=("reason",),
        )
        for reason, count in self.counts.items():
            family.add_metric((reason,), count)
        yield family


def exposition(supervisor: WorkerRestarts | None = None) -> tuple[bytes, str]:
    """The text to serve on /metrics: this process, or every worker's in multiprocess mode
    (and the supervisor's own counts, when given)."""
    path = os.environ.get(MULTIPROC_ENV)
    if path:
        registry = CollectorRegistry()
        registry.register(_WorkerFilesCollector(path))
        if supervisor is not None:
            registry.register(supervisor)
        return generate_latest(registry), CONTENT_TYPE_LATEST
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST
