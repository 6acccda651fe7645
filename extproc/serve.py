"""`prefix-router serve`: run the ext_proc service, optionally as several processes.

Python serves about one core's worth of gRPC streams per process, so ``--workers N`` starts
N processes that bind the same port with SO_REUSEPORT and the kernel spreads Envoy's
connections over them. Each worker has its own index and in-flight counts; rendezvous
placement keeps them in agreement on new prefixes (see scheduler.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import os
import signal
import sys
import time
from collections import Counter
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from .config import Config, ConfigError, load_config
from .endpoints import HealthChecker
from .router import Router
from .server import ExternalProcessorService, Outcome

log = logging.getLogger("extproc")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE)


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


class RouterService:
    """The gRPC server, router and endpoint health checks of one worker process."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.router = Router(config.routing, config.endpoints)
        self.outcomes = OutcomeCounter()
        self.health = health.aio.HealthServicer()
        self.checker = HealthChecker(
            config.health, lambda: self.router.endpoints, self.router.set_health
        )
        self.server: grpc.aio.Server | None = None
        self.port = 0

    async def start(self) -> int:
        max_message = self.config.server.max_body_bytes + 1024 * 1024
        self.server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", 1),
                ("grpc.max_receive_message_length", max_message),
                ("grpc.max_send_message_length", max_message),
            ]
        )
        service = ExternalProcessorService(self.router, self.config.server, self.outcomes)
        ext_grpc.add_ExternalProcessorServicer_to_server(service, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(self.config.server.listen)
        if self.port == 0:
            raise RuntimeError(f"cannot listen on {self.config.server.listen}")
        await self.server.start()
        await self._set_serving(bool(self.config.endpoints))
        self.checker.start()
        return self.port

    async def _set_serving(self, ready: bool) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set("liveness", serving)
        for name in ("", "readiness", EXT_PROC_SERVICE):
            await self.health.set(name, serving if ready else not_serving)

    async def stop(self, grace: float | None = None) -> None:
        """Report not-ready first so Envoy stops opening streams, then drain."""
        await self._set_serving(False)
        await self.checker.stop()
        if self.server is not None:
            await self.server.stop(self.config.server.grace_seconds if grace is None else grace)


async def serve_until_signalled(config: Config) -> None:
    service = RouterService(config)
    port = await service.start()
    log.info(
        "pid %d serving ext_proc on %s (port %d), %d endpoints, body mode %s",
        os.getpid(),
        config.server.listen,
        port,
        len(config.endpoints),
        config.server.body_mode,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("pid %d draining (up to %.0fs)", os.getpid(), config.server.grace_seconds)
    await service.stop()


def _worker_main(config_data: dict[str, Any], log_level: str) -> None:
    _setup_logging(log_level)
    asyncio.run(serve_until_signalled(Config.model_validate(config_data)))


def run_workers(config: Config, log_level: str) -> int:
    """Supervise N worker processes; restart one that dies, stop all on a signal."""
    ctx = multiprocessing.get_context("spawn")
    data = config.model_dump(mode="json")
    stopping = False

    def spawn() -> multiprocessing.process.BaseProcess:
        process = ctx.Process(target=_worker_main, args=(data, log_level), daemon=False)
        process.start()
        return process

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        for p in workers:
            if p.is_alive() and p.pid:
                os.kill(p.pid, signum)

    workers = [spawn() for _ in range(config.server.workers)]
    started = [time.monotonic()] * len(workers)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    quick_failures = 0
    while True:
        time.sleep(0.2)
        if stopping:
            for p in workers:
                p.join()
            return 0
        for i, p in enumerate(workers):
            if p.is_alive():
                continue
            if time.monotonic() - started[i] < 5:
                quick_failures += 1
            if quick_failures > 3 * config.server.workers:
                log.error("workers keep failing at start-up; giving up")
                on_signal(signal.SIGTERM, None)
                for q in workers:
                    q.join()
                return 1
            log.warning("worker pid %s exited with %s; restarting", p.pid, p.exitcode)
            workers[i], started[i] = spawn(), time.monotonic()


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
        help="any config field by dotted path, e.g. routing.load_weight=0.3",
    )
    parser.add_argument("--log-level", default="info")


def config_from_args(args: argparse.Namespace) -> Config:
    import yaml

    overrides: dict[str, Any] = {
        "server.listen": args.listen,
        "server.workers": args.workers,
        "endpoints": args.endpoints,
        "server.body_mode": args.body_mode,
        "server.header_name": args.header_name,
    }
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE")
        overrides[key.strip()] = yaml.safe_load(value)
    return load_config(args.config, overrides)


def run(args: argparse.Namespace) -> int:
    _setup_logging(args.log_level)
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"prefix-router: invalid configuration\n{exc}", file=sys.stderr)
        return 2
    if not config.endpoints:
        log.warning("no endpoints configured: every routable request will get a 503")
    if config.server.workers > 1:
        return run_workers(config, args.log_level)
    try:
        asyncio.run(serve_until_signalled(config))
    except RuntimeError as exc:
        log.error("%s", exc)
        return 1
    return 0
