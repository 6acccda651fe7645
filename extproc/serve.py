"""`prefix-router serve`: run the ext_proc service, optionally as several processes.

Python serves about one core's worth of gRPC streams per process, so ``--workers N`` starts
N processes that bind the same port with SO_REUSEPORT and the kernel spreads Envoy's
connections over them. Each worker has its own index and in-flight counts; rendezvous
placement keeps them in agreement on new prefixes (see scheduler.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import glob
import logging
import math
import multiprocessing
import os
import queue
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client.multiprocess import mark_process_dead

from .admin import DecisionLog, build_admin_app, decision_record, start_admin
from .cache_events import Translation, translation_from_config
from .cache_subscriber import CacheEventSubscriber
from .config import (
    Config,
    ConfigError,
    EndpointConfig,
    format_host_port,
    load_config,
    parse_assignments,
    parse_host_port,
)
from .discovery import EndpointSource, source_from_config
from .endpoints import HealthChecker
from .metrics import MULTIPROC_ENV, RouterMetrics, WorkerRestarts
from .peers import PeerReader
from .placements import Placement, PlacementLog, hash_scheme
from .router import Router
from .served_models import ModelLister, auth_headers
from .server import ExternalProcessorService, Outcome
from .signals import EndpointSignals, MetricsScraper
from .telemetry import DecisionTracer, tracer_from_env
from .tls import CertificateReloader, TLSFilesError, server_credentials
from .warm_start import (
    Handover,
    IndexSnapshot,
    encode,
    path_problem,
    read_file,
    remove_leftovers,
    take,
    usable_answer,
    write_file,
)

log = logging.getLogger("extproc")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE)
# Peers asking for this router's index within this many seconds get the same encoding.
SERVED_SNAPSHOT_SECONDS = 5.0
# On SIGTERM the router first reports NOT_SERVING (gRPC health and /readyz) and keeps
# accepting streams this long (capped by server.grace_seconds), so that Envoy's health check
# of the router cluster (every 0.5 s, see envoyconf) moves new requests elsewhere before the
# port closes; then it stops accepting and waits up to the rest of the grace for in-flight
# streams. Kubernetes needs longer (its readiness probe period): use a preStop sleep there.
READINESS_NOTICE_SECONDS = 1.5


class OutcomeCounter:
    """Counts outcomes by kind/detail and logs the first pass-through of each kind."""

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()

    def __call__(self, outcome: Outcome) -> None:
        detail = outcome.decision.rule if outcome.decision is not None else outcome.detail
        key = (outcome.kind, detail)
        self.counts[key] += 1
        if self.counts[key] == 1 and outcome.kind != "routed":
            log.info("first %s request (%s); further ones are only counted", *key)


_METRICS: RouterMetrics | None = None


def process_metrics() -> RouterMetrics:
    """One metrics object per process (prometheus_client registers names globally)."""
    global _METRICS
    if _METRICS is None:
        _METRICS = RouterMetrics()
    return _METRICS


class RouterService:
    """The gRPC server, router, probes, scraper and (single-process) admin of one worker.

    ``decision_sink`` replaces the local decision log in worker processes: the supervisor
    owns the admin endpoint and collects every worker's decisions; ``readiness_sink`` is
    told this worker's readiness (at each change, and every second), which the supervisor's
    /readyz answers by; ``heartbeat`` is called every second and after every ext_proc
    message handled (the supervisor kills a worker whose loop stops calling it).
    """

    def __init__(
        self,
        config: Config,
        decision_sink: Callable[[dict[str, Any]], None] | None = None,
        serve_admin: bool = True,
        tracer: DecisionTracer | None = None,
        placement_sink: Callable[[list[Placement]], None] | None = None,
        translation: Translation | None = None,
        readiness_sink: Callable[[bool], None] | None = None,
        heartbeat: Callable[[], None] | None = None,
    ) -> None:
        """``translation``: the KV-cache events' translation, when start-up already loaded
        it to check the configuration (else loaded here)."""
        self.config = config
        self._heartbeat = heartbeat or (lambda: None)
        # Under discovery the list is not known until its first answer: a worker started
        # beside others that serve (a respawn) gets streams before then.
        self.router = Router(
            config.routing,
            config.endpoints,
            learns_capacity=config.signals.enabled,
            endpoints_known=config.discovery.kind == "static",
        )
        self.outcomes = OutcomeCounter()
        self.metrics = process_metrics()
        self.decisions = DecisionLog(config.server.decisions_kept)
        self._decision_sink = decision_sink or self.decisions.add
        self._readiness_sink = readiness_sink
        self.tracer = tracer if tracer is not None else DecisionTracer(tracer_from_env())
        self.health = health.aio.HealthServicer()
        self.checker = HealthChecker(config.health, lambda: self.router.endpoints, self._on_health)
        self.model_lister = ModelLister(
            config.models,
            lambda: self.router.endpoints,
            self._on_models,
            unknown_models=self.router.models.take_unknown,
        )
        self.scraper = MetricsScraper(
            lambda: self.router.endpoints,
            self._on_signals,
            config.signals.path,
            config.signals.interval_seconds,
            config.signals.timeout_seconds,
        )
        sharing = config.peers.enabled and config.peers.share_placements
        scheme = hash_scheme(config.routing.block_size_bytes)
        self.scheme = scheme
        # The index handed over at start (warm_start.py): one per start, from the file or a
        # peer; ``handover`` while its regions are going in.
        self.handover: Handover | None = None
        self._handed_over = False
        self._handover_kind = ""  # file or peer
        self._handover_counted = 0
        self._peer_index_until = 0.0  # (set at start)
        self._snapshot_writer: asyncio.Task[None] | None = None
        self._write_lock = asyncio.Lock()  # (a write at stop waits for one under way)
        self._serve_lock = asyncio.Lock()  # (peers asking at once share one encoding)
        self._served: tuple[float, bytes] | None = None
        from_peers = config.warm_start.from_peers
        self.peers = PeerReader(
            config.peers,
            self.router.observe_peer_work,
            self._on_peer_placements if sharing else None,
            scheme=scheme,
            on_placed=self.router.observe_peer_placed if sharing else None,
            wants_index=self._wants_peer_index if from_peers else None,
            on_index=self._take_peer_index if from_peers else None,
        )
        # A starting router reads at most this much of a peer's index: four times its own,
        # and 64 MiB at least (its own regions may still have their provisional sizes).
        self.peers.max_index_bytes = lambda: max(
            64 * 2**20, 4 * self.router.index_stats().approx_bytes
        )
        if sharing:
            self.router.placements = PlacementLog(scheme)
        self.cache_events: CacheEventSubscriber | None = None
        if config.cache_events.enabled:
            self.cache_events = CacheEventSubscriber(
                config.cache_events,
                translation or translation_from_config(config),
                self._endpoints_of_the_events_model,
                self.router.observe_cache_events,
                self._count_cache_events,
            )
        # A worker hands its placements to the supervisor, whose admin port serves them.
        self._placement_sink = placement_sink if sharing else None
        self._placements_forwarded = 0
        self.serve_admin = serve_admin and bool(config.server.admin_listen)
        self.server: grpc.aio.Server | None = None
        self.admin_runner: Any = None
        self.port = 0
        self.admin_port = 0
        self._refresher: asyncio.Task[None] | None = None
        self._discovery: asyncio.Task[None] | None = None
        self._discovery_source: EndpointSource | None = None
        self._discovery_failures_seen = 0
        self._background: set[asyncio.Task[None]] = set()
        self._ready = False
        self._back_since: dict[str, float] = {}  # endpoint back -> when (scraper.monotonic)
        self._stopping = False
        self.tls: CertificateReloader | None = None
        self.service: ExternalProcessorService | None = None

    def _count_cache_events(self, endpoint: str, kind: str, n: int) -> None:
        if self.router.is_member(endpoint):  # (not a series for an endpoint just removed)
            self.metrics.cache_events.labels(endpoint, kind).inc(n)

    def _endpoints_of_the_events_model(self) -> list[str]:
        """The endpoints whose KV-cache events are read: those serving the one model they
        are translated for (another pool's server has another tokeniser), or whose models
        are not known."""
        model = self.config.cache_events.model
        return [
            address
            for address, models in self.router.served_models().items()
            if models is None or model in models
        ]

    def _on_models(self, address: str, models: frozenset[str] | None) -> None:
        if self.router.is_member(address):  # (not a list read as the endpoint was removed)
            self.router.observe_models(address, models)

    def _on_health(self, address: str, healthy: bool) -> None:
        if self.router.set_health(address, healthy):
            self._read_at_once(address)  # (picked again once its metrics are read)

    def _read_at_once(self, address: str) -> None:
        """Read an endpoint's metrics now (it is back: picked once they are read); a failed
        scrape asked before (during a network blip, answered only by the timeout) tells
        nothing about it now and is not taken for this reading."""
        self._back_since[address] = self.scraper.monotonic()
        self.scraper.unpolled(address)

    def _on_signals(self, address: str, signals: EndpointSignals) -> None:
        """An endpoint's own metrics: published, and fed to the scheduler (load, KV)."""
        if not self.router.is_member(address):
            return  # a scrape that was under way when the endpoint was removed
        self.metrics.record_signals(address, signals)
        back = self._back_since.get(address)
        if back is not None:
            if not signals.up and (signals.asked_at or 0.0) < back:
                return  # (asked before it was back: the reading asked since decides)
            del self._back_since[address]
        if signals.restarted:
            self.model_lister.unpolled(address)  # (adapters loaded at run time are gone)
            # Not if the events' sequence told it first: their table holds the new server's.
            events = self.cache_events
            if events is None or events.restarted(address, signals.started_after):
                self.router.restarted(address)
                self.metrics.endpoint_restarts.labels(address).inc()
        capacity = (
            signals.block_size * signals.num_blocks
            if signals.block_size and signals.num_blocks
            else None
        )
        self.router.observe_signals(
            address,
            signals.up,
            signals.running,
            signals.waiting,
            signals.kv_usage,
            capacity,
            prefill_window=signals.window_prefill,
            counts_finished=signals.prefills is not None,
            tells_restarts=signals.tells_restarts,
        )
        if self.handover is not None:  # (after: the reading sized the endpoint's region)
            self.handover.endpoint_read(address, signals)
            self._handover_progress()

    # -- warm start (warm_start.py) ---------------------------------------------------------
    def _begin_handover(self, snapshot: IndexSnapshot, kind: str, source: str) -> None:
        self._handed_over = True
        self._handover_kind = kind
        # (With metrics, each region at its endpoint's next reading: spread over the round.)
        self.handover = Handover(
            snapshot, source, self.router, reads_metrics=self.config.signals.enabled
        )
        self._handover_progress()

    def _handover_progress(self) -> None:
        handover = self.handover
        if handover is None:
            return
        if not handover.reads_metrics:
            handover.apply_members()
        handover.expire()
        taken = sum(handover.applied.values())
        if taken > self._handover_counted:
            self.metrics.warm_start_blocks.labels(self._handover_kind).inc(
                taken - self._handover_counted
            )
            self._handover_counted = taken
        if handover.done:
            self.handover = None

    def _wants_peer_index(self) -> bool:
        return not self._handed_over and time.monotonic() < self._peer_index_until

    def _starting(self) -> bool:
        """Its own index is young or still taking one: a peer starting beside it (a
        scale-out, a fresh deployment) should take an established peer's instead."""
        return self._wants_peer_index() or self.handover is not None

    async def _take_peer_index(self, address: str, data: bytes) -> bool:
        """A peer's index (PeerReader, while this router is starting): taken if usable."""
        source = f"peer {address}"
        limit = self.peers.max_index_bytes()
        snapshot = await asyncio.to_thread(usable_answer, data, source, self.scheme, limit)
        if snapshot is None or snapshot.router == self.router.instance:
            return False  # (its own admin port: a DNS name resolves to every replica)
        if not snapshot.holds_anything():
            return False  # (an empty index: another peer may have one)
        if self._handed_over:
            return True
        self._begin_handover(snapshot, "peer", source)
        return True

    async def index_snapshot(self) -> bytes | None:
        """This router's index for a peer starting (GET /peer/index); None (503) while it is
        starting itself. Peers asking within SERVED_SNAPSHOT_SECONDS of each other (a
        rollout's pods) share one encoding: one copy in memory, not one per peer."""
        if self._starting():
            return None
        async with self._serve_lock:
            served = self._served_still_fresh()
            if served is None:
                snapshot = take(self.router, self.scheme, self.scraper.latest)  # (on the loop)
                self._served = None  # (the old one may go before the new one is made)
                self._served = served = (
                    time.monotonic(),
                    await asyncio.to_thread(encode, snapshot),
                )
        self.metrics.index_snapshots.labels("served").inc()
        return served[1]

    def _served_still_fresh(self) -> tuple[float, bytes] | None:
        """The encoding last served to a peer, while peers may still share it."""
        served = self._served
        if served is None or time.monotonic() - served[0] > SERVED_SNAPSHOT_SECONDS:
            return None
        return served

    async def write_snapshot(self) -> bool:
        """Write the index to warm_start.path (whole or not at all); False if it failed."""
        path = self.config.warm_start.path
        if path is None:
            return False
        async with self._write_lock:
            try:
                snapshot = take(self.router, self.scheme, self.scraper.latest)
                await asyncio.to_thread(write_file, path, snapshot)
            except Exception as exc:  # (a full disk, a volume gone: the router routes on)
                log.warning("warm start: cannot write the index to %s: %s", path, exc)
                self.metrics.index_snapshots.labels("failed").inc()
                return False
        self.metrics.index_snapshots.labels("written").inc()
        return True

    async def _write_snapshots(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            if self.handover is None:  # (not while regions handed over wait to go in)
                await self.write_snapshot()

    def _on_peer_placements(self, placements: list[Placement]) -> None:
        self.metrics.peer_placements.inc(self.router.observe_peer_placements(placements))

    def _forward_placements(self) -> None:
        log = self.router.placements
        if self._placement_sink is None or log is None:
            return
        if log.last > self._placements_forwarded:
            self._placement_sink(log.after(self._placements_forwarded))
            self._placements_forwarded = log.last

    def observe(self, outcome: Outcome) -> None:
        self.outcomes(outcome)
        self.metrics.observe(outcome)
        if self.config.server.decisions_kept:
            self._decision_sink(decision_record(outcome))

    def ready(self) -> bool:
        return self._ready

    async def start(self) -> int:
        warm = self.config.warm_start
        if warm.path is not None:
            remove_leftovers(warm.path)
            snapshot = read_file(warm.path, self.scheme, warm.max_age_seconds)
            if snapshot is not None and snapshot.holds_anything():
                self._begin_handover(snapshot, "file", f"file {warm.path}")
        self._peer_index_until = time.monotonic() + warm.from_peers_seconds
        max_message = self.config.server.max_body_bytes + 1024 * 1024
        self.server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", 1),
                ("grpc.max_receive_message_length", max_message),
                ("grpc.max_send_message_length", max_message),
            ]
        )
        service = ExternalProcessorService(
            self.router,
            self.config.server,
            self.observe,
            self.tracer,
            self._heartbeat,
            probes=self.config.health.enabled,
            read_lists_for=self.model_lister.read_again_for if self.config.models.enabled else None,
            list_wait_seconds=self.config.models.unknown_wait_seconds,
            read_list_of=self.model_lister.unpolled if self.config.models.enabled else None,
        )
        self.service = service
        ext_grpc.add_ExternalProcessorServicer_to_server(service, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if self.config.tls.enabled:
            credentials, self.tls = server_credentials(self.config.tls)
            self.port = self.server.add_secure_port(self.config.server.listen, credentials)
        else:
            self.port = self.server.add_insecure_port(self.config.server.listen)
        if self.port == 0:
            raise RuntimeError(f"cannot listen on {self.config.server.listen}")
        await self.server.start()
        if self.serve_admin:
            app = build_admin_app(
                self.decisions,
                self.ready,
                self.router.placements,
                index_snapshot=self.index_snapshot if self.config.peers.enabled else None,
            )
            self.admin_runner, self.admin_port = await start_admin(
                app, self.config.server.admin_listen
            )
        await self._set_serving(any(e.ready for e in self.config.endpoints))
        self.checker.start()
        if self.config.signals.enabled:
            self.scraper.start()
        self.model_lister.start()
        if self.config.peers.enabled:
            self.peers.start()
        if self.cache_events is not None:
            self.cache_events.start()
        if self.config.discovery.kind != "static":
            source = source_from_config(self.config.discovery, self.config.endpoints)
            self._discovery_source = source
            self._discovery = asyncio.create_task(source.run(self._on_endpoints), name="discovery")
        self._refresher = asyncio.create_task(self._refresh_gauges(), name="gauges")
        if warm.path is not None and warm.interval_seconds > 0:
            self._snapshot_writer = asyncio.create_task(
                self._write_snapshots(warm.interval_seconds), name="index-snapshots"
            )
        return self.port

    def _on_endpoints(self, endpoints: list[EndpointConfig]) -> None:
        """Discovery changed the endpoint set: removed endpoints' index entries are dropped;
        one ready again is picked once its metrics have been read (at once)."""
        before = set(self.router.endpoints)
        ready_again = self.router.set_endpoints(endpoints)
        self._handover_progress()  # (metrics off: a handed region goes in once a member)
        for address in ready_again:  # ready again
            self._read_at_once(address)
            self.model_lister.unpolled(address)  # (a pod that was loading answered none)
        for endpoint in endpoints:
            if endpoint.address not in before:
                self.model_lister.unpolled(endpoint.address)
        members = set(self.router.endpoints)
        self._back_since = {a: t for a, t in self._back_since.items() if a in members}
        log.info(
            "endpoints now: %s",
            ", ".join(e.address + ("" if e.ready else " (not ready)") for e in endpoints)
            or "(none)",
        )
        ready = any(e.ready for e in endpoints)
        task = asyncio.get_running_loop().create_task(self._set_serving(ready))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _refresh_gauges(self) -> None:
        while True:
            self._heartbeat()  # (first: a fault below must not make the loop look hung)
            try:
                if self._readiness_sink is not None:
                    self._readiness_sink(self._ready)  # (again: a message may be dropped)
                self.metrics.refresh(self.router)
                self._forward_placements()
                self._handover_progress()
                self._served = self._served_still_fresh()  # (a whole index: not kept longer)
                source = self._discovery_source
                if source is not None and source.failures > self._discovery_failures_seen:
                    self.metrics.discovery_failures.inc(
                        source.failures - self._discovery_failures_seen
                    )
                    self._discovery_failures_seen = source.failures
            except Exception:  # (a fault here must not freeze every gauge, silently)
                log.exception("refreshing the gauges failed")
            await asyncio.sleep(1.0)

    async def _set_serving(self, ready: bool) -> None:
        ready = ready and not self._stopping  # discovery must not undo a drain
        self._ready = ready
        if self._readiness_sink is not None:
            self._readiness_sink(ready)
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set("liveness", serving)
        for name in ("", "readiness", EXT_PROC_SERVICE):
            await self.health.set(name, serving if ready else not_serving)

    async def stop(self, grace: float | None = None, notice: float | None = None) -> None:
        """Report not-ready first so Envoy stops opening streams, then drain.

        ``notice``: seconds to keep accepting streams after turning not-ready (default
        READINESS_NOTICE_SECONDS, never more than the grace); ``grace``: the whole budget,
        notice included, after which streams still open are cancelled (Envoy then continues
        those requests without the router: failure_mode_allow).
        """
        grace = self.config.server.grace_seconds if grace is None else grace
        notice = min(READINESS_NOTICE_SECONDS if notice is None else notice, grace)
        started = time.monotonic()
        self._stopping = True
        await self._set_serving(False)
        if notice > 0 and self.server is not None:
            await asyncio.sleep(notice)
        await self.checker.stop()
        await self.scraper.stop()
        await self.model_lister.stop()
        await self.peers.stop()
        if self.cache_events is not None:
            await self.cache_events.stop()
        for task in (self._refresher, self._discovery):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._snapshot_writer is not None:
            # (Under the lock: a write under way, in its thread, ends before the one below.)
            async with self._write_lock:
                self._snapshot_writer.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await self._snapshot_writer
        if self.server is not None:
            await self.server.stop(max(0.0, grace - (time.monotonic() - started)))
        if self.config.warm_start.path is not None:
            await self.write_snapshot()  # (after the drain: what its last requests placed too)
        if self.admin_runner is not None:
            await self.admin_runner.cleanup()


def freeze_start_up_heap() -> int:
    """Take what start-up built (imported modules, config, the events translation) out of
    the garbage collector's reach, and return how many objects that is. A full collection
    otherwise walks all of it while decisions wait: 13-34 ms for the ~67,000 objects of a
    plain router (docs/benchmarks.md, "Router overhead"). Its own garbage goes first."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def serve_until_signalled(
    config: Config,
    decision_sink: Callable[[dict[str, Any]], None] | None = None,
    serve_admin: bool = True,
    placement_sink: Callable[[list[Placement]], None] | None = None,
    translation: Translation | None = None,
    readiness_sink: Callable[[bool], None] | None = None,
    heartbeat: Callable[[], None] | None = None,
) -> None:
    service = RouterService(
        config,
        decision_sink,
        serve_admin,
        placement_sink=placement_sink,
        translation=translation,
        readiness_sink=readiness_sink,
        heartbeat=heartbeat,
    )
    port = await service.start()
    frozen = freeze_start_up_heap()
    log.info(
        "pid %d serving ext_proc on %s (port %d), %d endpoints, body mode %s%s; "
        "%d start-up objects frozen",
        os.getpid(),
        config.server.listen,
        port,
        len(config.endpoints),
        config.server.body_mode,
        f", admin on port {service.admin_port}" if service.admin_port else "",
        frozen,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    parent = multiprocessing.parent_process()
    if parent is not None:
        # A worker whose supervisor died (SIGKILL, OOM) drains and exits like on SIGTERM: it
        # kept serving the port, an orphan nothing would stop.
        loop.add_reader(parent.sentinel, stop.set)
    await stop.wait()
    log.info(
        "pid %d draining (not ready now; %d requests in flight; up to %.1fs)",
        os.getpid(),
        sum(service.router.in_flight().values()),
        config.server.grace_seconds,
    )
    await service.stop()
    log.info("pid %d drained, exiting", os.getpid())


# What a worker hands its supervisor, at most this many messages behind (then dropped).
WORKER_BACKLOG = 4096
# A worker's event loop stamps its heartbeat (and reports its readiness) every second; one
# silent this long (its event loop hung or stopped) is not counted ready by the supervisor's
# /readyz (and one silent for server.worker_hang_seconds is killed and restarted).
WORKER_SILENT_SECONDS = 10.0
# Workers that die within this long of their start, more than 3 per worker within
# FAILURE_WINDOW_SECONDS, make the supervisor give up.
QUICK_FAILURE_SECONDS = 5.0
FAILURE_WINDOW_SECONDS = 300.0


class _ToSupervisor:
    """A worker's one-way pipe to its supervisor, written by a thread of its own: the event
    loop only appends to a bounded queue (a message dropped when the supervisor lags), and
    nothing waits on the pipe at exit (a multiprocessing.Queue's feeder did: a worker
    finishing with the pipe full waited for a supervisor that was waiting for it)."""

    def __init__(self, connection: Any) -> None:
        self._connection = connection
        self._backlog: queue.Queue[tuple[str, Any]] = queue.Queue(WORKER_BACKLOG)
        threading.Thread(target=self._send, name="to-supervisor", daemon=True).start()

    def put(self, kind: str, item: Any) -> None:
        with contextlib.suppress(queue.Full):
            self._backlog.put_nowait((kind, item))

    def _send(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            while True:
                self._connection.send(self._backlog.get())


def worker_config_data(config_data: dict[str, Any], slot: int) -> dict[str, Any]:
    """The configuration of the worker in ``slot``: its own index file, as each worker has
    an index of its own (the workers' placements shared through the supervisor make them
    alike, not one); written in turn to one file, each restart would take one worker's."""
    path = config_data.get("warm_start", {}).get("path")
    if path is None:
        return config_data
    return {
        **config_data,
        "warm_start": {**config_data["warm_start"], "path": f"{path}.worker-{slot}"},
    }


def _worker_main(
    config_data: dict[str, Any], log_level: str, connection: Any, heartbeat: Any
) -> None:
    """``heartbeat``: a count in memory shared with the supervisor, which the event loop
    raises every second and after every ext_proc message (RouterService): not a message in the
    pipe, where it waited behind up to WORKER_BACKLOG decisions (seconds, with many
    workers)."""
    _setup_logging(log_level)
    to_supervisor = _ToSupervisor(connection)
    config = Config.model_validate(config_data)

    def beat() -> None:
        heartbeat.value += 1

    asyncio.run(
        serve_until_signalled(
            config,
            lambda record: to_supervisor.put("decision", record),
            serve_admin=False,
            placement_sink=lambda batch: to_supervisor.put("placements", batch),
            readiness_sink=lambda ready: to_supervisor.put("ready", ready),
            heartbeat=beat,
        )
    )


@dataclasses.dataclass(eq=False)
class _Worker:
    """One worker process and what the supervisor knows of it."""

    process: multiprocessing.process.BaseProcess
    heartbeat: Any  # the count its event loop raises (_worker_main)
    started: float  # on this process's clock
    # Its readiness as it last reported it; False once its pipe ended (_Supervisor._read).
    ready: bool = False
    # Its heartbeat count as last seen, and when that last moved, on this process's clock
    # (_Supervisor._watch_heartbeats).
    beats_seen: float = 0.0
    moved: float = 0.0
    hung: bool = False  # killed for its silence


class _Supervisor:
    """Runs N workers on one port, the shared admin endpoint, and restarts dead workers.

    Each worker has a pipe of its own to the supervisor, read by a thread of its own: a
    worker killed in the middle of a message ends only its own pipe (all workers shared
    one queue, whose lock and half-written message a killed writer left behind: every
    reader then waited for good)."""

    def __init__(self, config: Config, log_level: str) -> None:
        self.config = config
        self.log_level = log_level
        self.ctx = multiprocessing.get_context("spawn")
        self.data = config.model_dump(mode="json")
        self.decisions = DecisionLog(config.server.decisions_kept)
        # Every worker's placements (one batch a second each), served to peer routers.
        self.placements = PlacementLog(hash_scheme(config.routing.block_size_bytes))
        self.received: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self.stopping = False
        self.workers: list[_Worker] = []
        self.restarts = WorkerRestarts()

    def spawn(self, slot: int) -> _Worker:
        """The worker in ``slot`` (0 to N-1; one started again in a dead one's place takes its
        slot, and with it its index file: warm_start.path + '.worker-K')."""
        reader, writer = self.ctx.Pipe(duplex=False)
        heartbeat = self.ctx.Value("d", 0.0, lock=False)  # (0: no beat yet)
        process = self.ctx.Process(
            target=_worker_main,
            args=(worker_config_data(self.data, slot), self.log_level, writer, heartbeat),
        )
        worker = _Worker(process, heartbeat, started=time.monotonic())
        process.start()
        writer.close()  # the worker's copy is the only one: its death ends the pipe
        threading.Thread(
            target=self._read,
            args=(reader, worker),
            name=f"from-worker-{process.pid}",
            daemon=True,
        ).start()
        return worker

    def _read(self, reader: Any, worker: _Worker) -> None:
        try:
            with contextlib.closing(reader), contextlib.suppress(EOFError, OSError):
                while True:
                    kind, item = reader.recv()
                    if kind == "ready":
                        worker.ready = item
                    else:
                        self.received.put((kind, item))
        finally:
            worker.ready = False  # (the worker is gone)

    @staticmethod
    def _silent_for(worker: _Worker, now: float) -> float:
        """Seconds since the worker's heartbeat last moved (inf: it never beat)."""
        return now - worker.moved if worker.beats_seen else math.inf

    def _watch_heartbeats(self, now: float, woke: float) -> None:
        """Note which workers' heartbeats moved since the last round. Silence is timed on
        this process's clock, and counts from ``now`` for everyone when this process was
        away (its last round ``woke`` over a second ago): stopped, starved, or frozen with
        its workers (a paused container), when their loops had no chance to beat either.
        (Timed by the workers' own stamps, a thawed group killed every worker.)"""
        away = now - woke > 1.0
        for worker in self.workers:
            count = worker.heartbeat.value
            if count != worker.beats_seen or away:
                worker.moved = now
            worker.beats_seen = count

    def ready(self) -> bool:
        """A live worker said within WORKER_SILENT_SECONDS that it is ready: it serves its
        port and knows a ready endpoint (with discovery, only the workers know; this
        answered ready whatever they knew, and while every worker hung)."""
        now = time.monotonic()

        def says_ready(worker: _Worker) -> bool:
            silent = self._silent_for(worker, now)
            return worker.ready and silent < WORKER_SILENT_SECONDS and worker.process.is_alive()

        return not self.stopping and any(says_ready(w) for w in self.workers)

    def on_signal(self, signum: int, _frame: object) -> None:
        self.stopping = True
        for worker in self.workers:
            p = worker.process
            if p.is_alive() and p.pid:
                os.kill(p.pid, signum)

    def _admin_thread(self) -> None:
        async def main() -> None:
            app = build_admin_app(self.decisions, self.ready, self.placements, self.restarts)
            runner, port = await start_admin(app, self.config.server.admin_listen)
            log.info("admin endpoint on port %d (all workers)", port)
            while not self.stopping or any(w.process.is_alive() for w in self.workers):
                await asyncio.sleep(0.2)
            await runner.cleanup()

        asyncio.run(main())

    def _drain_decisions(self) -> None:
        with contextlib.suppress(queue.Empty):
            for _ in range(100_000):
                kind, item = self.received.get_nowait()
                if kind == "decision":
                    self.decisions.add(item)
                else:
                    for placement in item:
                        self.placements.add(placement)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.on_signal)
        signal.signal(signal.SIGINT, self.on_signal)
        self.workers = [self.spawn(slot) for slot in range(self.config.server.workers)]
        if self.config.server.admin_listen:
            threading.Thread(target=self._admin_thread, name="admin", daemon=True).start()
        quick_failures: list[float] = []
        woke = time.monotonic()
        while True:
            time.sleep(0.1)
            self._drain_decisions()
            if self.stopping:
                return self._wait_for_workers(0)
            # One reading of the clock for the round: a pause after it (this process stopped
            # or frozen) cannot make a worker look silent in this round's checks.
            now = time.monotonic()
            self._watch_heartbeats(now, woke)
            woke = now
            for i, worker in enumerate(self.workers):
                p = worker.process
                if p.is_alive():
                    self._kill_if_hung(worker, now)
                    continue
                mark_process_dead(p.pid)  # (its readiness goes with its pipe: _read)
                died = time.monotonic()  # (not ``now``: the workers after this one keep it)
                if died - worker.started < QUICK_FAILURE_SECONDS and not worker.hung:
                    # (A hung worker killed is replaced at most once per hang limit.)
                    quick_failures.append(died)
                quick_failures = [t for t in quick_failures if died - t < FAILURE_WINDOW_SECONDS]
                if len(quick_failures) > 3 * self.config.server.workers:
                    log.error("workers keep failing at start-up; giving up")
                    self.on_signal(signal.SIGTERM, None)
                    return self._wait_for_workers(1)
                log.warning("worker pid %s exited with %s; restarting", p.pid, p.exitcode)
                self.restarts.counts["hung" if worker.hung else "exited"] += 1
                self.workers[i] = self.spawn(i)

    def _kill_if_hung(self, worker: _Worker, now: float) -> None:
        """SIGKILL a worker whose heartbeat moved before and not for
        server.worker_hang_seconds (run() then starts another): its event loop raises it
        every second and after every ext_proc message, so a loop busy with long requests
        beats and one stuck in a callback does not. Its loop is hung or stopped:
        the kernel still hands it a share of the new connections, Envoy's health-check
        connection among them (one hung worker of two left the whole router unrouted), and
        the streams on them wait for Envoy's message timeout (BUFFERED: then served
        unrouted) or for good (FULL_DUPLEX_STREAMED); its death resets them and Envoy
        reconnects to a live worker. A worker whose heartbeat never moved is left alone: its
        start-up (imports, a tokenizer to load) can take long under a CPU limit. The
        heartbeat is shared memory (the pipe's backlog does not delay it) and its silence is
        timed on this process's clock (_watch_heartbeats)."""
        hang = self.config.server.worker_hang_seconds
        silent = self._silent_for(worker, now)
        if not hang or silent < hang or math.isinf(silent) or worker.hung:
            return
        log.warning(
            "worker pid %s silent for %.0fs (event loop hung or stopped); killing it",
            worker.process.pid,
            silent,
        )
        worker.hung = True
        worker.process.kill()

    def _wait_for_workers(self, code: int) -> int:
        """Until every worker has drained and exited, its messages still read. (Each is told
        again: one respawned while the signal came was not in the list it went through.)"""
        self.on_signal(signal.SIGTERM, None)
        while any(w.process.is_alive() for w in self.workers):
            self._drain_decisions()
            time.sleep(0.1)
        for worker in self.workers:
            worker.process.join()
            # (An operator's metrics directory outlives this run.)
            mark_process_dead(worker.process.pid)
        return code


def siblings_as_peers(config: Config) -> Config:
    """Worker processes are router replicas of one another: unless ``peers`` is set, they
    read each other's queued work and placements through the pod's own admin port (which
    serves all of them), so ``--workers N`` routes like one router rather than N
    uncoordinated ones (docs/benchmarks.md: K=4 router replicas with peers stay within 3%
    of one router's hit ratio in 16 of 18 simulated cells, 12 without)."""
    if config.server.workers < 2 or config.peers.enabled or not config.server.admin_listen:
        return config
    host, port = parse_host_port(config.server.admin_listen, allow_port_zero=True)
    if port == 0:
        return config  # the workers cannot know a port the supervisor has not bound yet
    loopback = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    own = format_host_port(loopback, port)
    log.info("workers read each other's queued work and placements at %s (peers)", own)
    return config.model_copy(
        update={"peers": config.peers.model_copy(update={"addresses": (own,)})}
    )


def run_workers(config: Config, log_level: str) -> int:
    """Supervise N worker processes; metrics from all of them through one admin endpoint."""
    config = siblings_as_peers(config)
    own_dir = None
    if not os.environ.get(MULTIPROC_ENV):
        own_dir = tempfile.mkdtemp(prefix="prefix-router-metrics-")
        os.environ[MULTIPROC_ENV] = own_dir  # inherited by the spawned workers
    else:
        # An operator's directory: what an earlier run left there would be exported (and read
        # by the workers as peers) for good; prometheus_client says to empty it at start.
        for stale in glob.glob(os.path.join(os.environ[MULTIPROC_ENV], "*.db")):
            with contextlib.suppress(OSError):
                os.remove(stale)
    try:
        return _Supervisor(config, log_level).run()
    finally:
        if own_dir is not None:
            shutil.rmtree(own_dir, ignore_errors=True)


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s",
        stream=sys.stderr,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML config file (see README: Configuration)")
    parser.add_argument("--listen", help="gRPC address ip:port (server.listen)")
    parser.add_argument("--workers", type=int, help="processes sharing the port")
    parser.add_argument("--endpoints", help="comma list of model servers ip:port")
    parser.add_argument("--body-mode", choices=["buffered", "full_duplex_streamed"])
    parser.add_argument("--header-name", help="decision header (default x-gateway-...)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any config field by dotted path, e.g. routing.stickiness=2",
    )
    parser.add_argument("--log-level", default="info")


def config_from_args(args: argparse.Namespace) -> Config:
    overrides: dict[str, Any] = {
        "server.listen": args.listen,
        "server.workers": args.workers,
        "endpoints": args.endpoints,
        "server.body_mode": args.body_mode,
        "server.header_name": args.header_name,
    }
    overrides.update(parse_assignments(args.set, "--set"))
    return load_config(args.config, overrides)


def run(args: argparse.Namespace) -> int:
    _setup_logging(args.log_level)
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"prefix-router: invalid configuration\n{exc}", file=sys.stderr)
        return 2
    if not config.endpoints and config.discovery.kind == "static":
        log.warning("no endpoints configured: every routable request will get a 503")
    try:  # fail fast, before any worker starts: the model lists' key must be there
        if config.models.enabled:
            auth_headers(config.models)
    except ConfigError as exc:
        print(f"prefix-router: invalid configuration\n{exc}", file=sys.stderr)
        return 2
    if config.tls.enabled:
        try:  # fail fast, before any worker starts, on unreadable or mismatched files
            CertificateReloader(config.tls)
        except TLSFilesError as exc:
            print(f"prefix-router: invalid TLS files\n{exc}", file=sys.stderr)
            return 2
    translation = None
    if config.cache_events.enabled:
        try:  # fail fast too: a tokeniser or chat template the translation cannot use
            translation = translation_from_config(config)
        except ConfigError as exc:
            print(f"prefix-router: invalid configuration\n{exc}", file=sys.stderr)
            return 2
    problem = config.warm_start.path and path_problem(config.warm_start.path)
    if problem:  # fail fast: an operator who set it expects restarts to keep the index
        print(f"prefix-router: invalid configuration\nwarm_start.path: {problem}", file=sys.stderr)
        return 2
    if config.server.workers > 1:
        return run_workers(config, args.log_level)
    try:
        asyncio.run(serve_until_signalled(config, translation=translation))
    except TLSFilesError as exc:
        print(f"prefix-router: invalid TLS files\n{exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        log.error("%s", exc)
        return 1
    return 0
