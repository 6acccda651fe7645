"""Kubernetes discovery: a pod that fails its readiness probe for a while, then passes it.

The router process reads EndpointSlices from a local list/watch API server; a real Envoy
(override-host) sends it three stand-in replicas' traffic. A pod failing readiness (a stall,
an overloaded API server, its container restarting in place) is marked not ready in its
slice, not removed: it stays a member the router probes and scrapes but does not pick, and
as its metrics tell restarts its index is kept. Ready again, it is picked once its metrics
have been read: the conversations that paused while it was out come back to it; had it
restarted meanwhile, its index is emptied first and none comes back to an empty server on a
stale entry. Before, a not-ready pod left the endpoint set and its index with it.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from extproc.stack import LOOPBACK, Stack, free_port, python_cli, wait_for_port, wait_ready

from .conftest import (
    FAST,
    REQUEST_TIMEOUT,
    chat,
    report,
    router_samples,
    settled,
    total,
    wait_until,
)

pytestmark = [pytest.mark.envoy]

PATH = "/apis/discovery.k8s.io/v1/namespaces/llm/endpointslices"


class ApiServer:
    """EndpointSlices of service ``vllm``, one slice a pod, listed and watched (a thread)."""

    def __init__(self) -> None:
        self.slices: dict[str, dict[str, Any]] = {}
        self.version = 1
        self._watchers: list[asyncio.Queue[dict[str, Any]]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self.port = free_port()

    def put(self, name: str, port: int, ready: bool) -> None:
        """Add or modify pod ``name``'s slice (thread-safe)."""
        self.version += 1
        obj = {
            "kind": "EndpointSlice",
            "apiVersion": "discovery.k8s.io/v1",
            "metadata": {
                "name": name,
                "namespace": "llm",
                "resourceVersion": str(self.version),
                "labels": {"kubernetes.io/service-name": "vllm"},
            },
            "addressType": "IPv4",
            "endpoints": [
                {
                    "addresses": [LOOPBACK],
                    "conditions": {"ready": ready, "serving": ready, "terminating": False},
                }
            ],
            "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        }
        kind = "MODIFIED" if name in self.slices else "ADDED"

        def publish() -> None:
            self.slices[name] = obj
            for queue in self._watchers:
                queue.put_nowait({"type": kind, "object": obj})

        if self._loop is None:
            publish()
        else:
            self._loop.call_soon_threadsafe(publish)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.query.get("watch") not in ("1", "true"):
            return web.json_response(
                {
                    "kind": "EndpointSliceList",
                    "apiVersion": "discovery.k8s.io/v1",
                    "metadata": {"resourceVersion": str(self.version)},
                    "items": list(self.slices.values()),
                }
            )
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._watchers.append(queue)
        try:
            while True:
                await response.write(orjson.dumps(await queue.get()) + b"\n")
        finally:
            self._watchers.remove(queue)

    @contextmanager
    def running(self) -> Iterator[ApiServer]:
        started, stop = threading.Event(), threading.Event()

        async def serve() -> None:
            self._loop = asyncio.get_running_loop()
            app = web.Application()
            app.router.add_get(PATH, self._handle)
            runner = web.AppRunner(app)
            await runner.setup()
            await web.TCPSite(runner, LOOPBACK, self.port).start()
            started.set()
            while not stop.is_set():
                await asyncio.sleep(0.05)
            await runner.cleanup()

        thread = threading.Thread(target=lambda: asyncio.run(serve()), daemon=True)
        thread.start()
        assert started.wait(10)
        try:
            yield self
        finally:
            stop.set()
            thread.join(10)


@pytest.mark.slow
@pytest.mark.parametrize("restarted", [False, True], ids=["stalled", "restarted in place"])
def test_a_pod_not_ready_for_a_while_keeps_its_index(tmp_path: Path, restarted: bool) -> None:
    from tests.integration.conftest import request

    with Stack() as stack, ApiServer().running() as api:
        replicas = stack.start_replicas(3, FAST)
        names = {f"replica-{i + 1}": a for i, a in enumerate(replicas)}
        ports = {name: int(a.rsplit(":", 1)[1]) for name, a in names.items()}
        for name, port in ports.items():
            api.put(name, port, ready=True)
        token = tmp_path / "token"
        token.write_text("t\n")
        listen, admin = free_port(), free_port()
        router = stack._spawn(
            "router",
            python_cli(
                "serve",
                "--listen",
                f"{LOOPBACK}:{listen}",
                *("--set", f"server.admin_listen={LOOPBACK}:{admin}"),
                *("--set", "discovery.kind=kubernetes"),
                *("--set", f"discovery.api_url=http://{LOOPBACK}:{api.port}"),
                *("--set", "discovery.namespace=llm", "--set", "discovery.service=vllm"),
                *("--set", "discovery.port=http", "--set", f"discovery.token_file={token}"),
            ),
        )
        wait_for_port(listen, router)
        wait_ready(admin, router)
        envoy, _ = stack.start_proxy("override-host", replicas, f"{LOOPBACK}:{listen}")

        def send(body: bytes):
            response = request(envoy, body, timeout=REQUEST_TIMEOUT)
            assert response.status == 200
            return response

        def gauge(name: str, replica: str) -> float:
            return total(router_samples(admin), name, endpoint=names[replica])

        # The first scrape sizes each endpoint's index by its KV cache, and a resized index
        # starts empty: placements recorded before it would be lost (a race at start-up).
        up = "prefix_router_endpoint_metrics_up"
        assert wait_until(lambda: all(gauge(up, r) == 1 for r in names), 10)
        homes = {c: send(chat(c, 0)).replica for c in range(12)}
        victim = max(set(homes.values()), key=list(homes.values()).count)
        paused = [c for c, home in homes.items() if home == victim]
        held = settled(lambda: gauge("prefix_router_index_entries", victim))
        assert held > 0

        api.put(victim, ports[victim], ready=False)
        assert wait_until(lambda: gauge("prefix_router_endpoint_healthy", victim) == 0, 5)
        if restarted:  # its container restarted in place while it was not ready
            process = stack.process(victim)
            process.signal(signal.SIGKILL)
            process.process.wait(5)
            stack.respawn(process, ports[victim])
            restarts = "prefix_router_endpoint_restarts_total"
            assert wait_until(lambda: gauge(restarts, victim) == 1, 10)
        others = [send(chat(c, 1)).replica for c in homes if c not in paused]
        assert victim not in others  # not picked while not ready
        time.sleep(1.2)
        kept = gauge("prefix_router_index_entries", victim)
        assert kept == (0 if restarted else held)  # kept unless its metrics told a restart

        api.put(victim, ports[victim], ready=True)
        assert wait_until(lambda: gauge("prefix_router_endpoint_healthy", victim) == 1, 5)
        back = [send(chat(c, 1)).replica for c in paused]
        report(
            "kubernetes_not_ready",
            restarted=restarted,
            index_entries_before=held,
            index_entries_while_not_ready=kept,
            conversations=len(paused),
            back_on_it=back.count(victim),
        )
        if not restarted:  # (restarted, its index was emptied: they go where load sends them)
            assert back == [victim] * len(paused)
