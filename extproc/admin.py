"""The admin HTTP endpoint: Prometheus metrics, liveness, readiness, recent decisions.

GET /metrics           Prometheus text (all workers' totals with --workers N)
GET /healthz           200 while the process runs
GET /readyz            200 when a ready endpoint is known (with workers: a live worker says so); else 503
GET /debug/decisions   the last N decisions with their full explanation, newest first
                       (?limit=K, ?outcome=routed|pass_through|no_endpoint|error)
GET /peer/placements   this replica's recent placements for its peers (placements.py;
                       ?after=N&log=ID); an empty log unless peers are configured
GET /peer/index        this replica's index for a router starting (warm_start.py), with peers
                       set; 503 while it is starting itself; 404 without peers and from the
                       supervisor of --workers N
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from .metrics import WorkerRestarts, exposition
from .placements import PLACEMENTS_PATH, PlacementLog
from .warm_start import INDEX_PATH

if TYPE_CHECKING:
    from .server import Outcome


def decision_record(outcome: Outcome) -> dict[str, Any]:
    """A JSON-ready record of one request: what came in, what was decided, and why."""
    record: dict[str, Any] = {
        "time": round(time.time(), 3),
        "outcome": outcome.kind,
        "reason": outcome.decision.rule if outcome.decision is not None else outcome.detail,
        "path": outcome.headers.get(":path", ""),
        "api": outcome.api,
        "model": outcome.model,
        "body_bytes": outcome.body_bytes,
        "prompt_bytes": outcome.prompt_bytes,
        "decision_ms": round(outcome.decide_seconds * 1000, 3),
        "served": outcome.served,
        "status": outcome.status,
    }
    if outcome.list_wait:  # its model was in no list: it waited for them read again
        record["list_wait"] = outcome.list_wait
        record["list_wait_ms"] = round(outcome.list_wait_seconds * 1000, 3)
    if outcome.decision is not None:
        record["decision"] = outcome.decision.explain()
    return record


class DecisionLog:
    """Bounded ring of recent decision records."""

    def __init__(self, size: int) -> None:
        self._records: deque[dict[str, Any]] = deque(maxlen=max(size, 1))
        self.enabled = size > 0

    def add(self, record: dict[str, Any]) -> None:
        if self.enabled:
            self._records.append(record)

    def recent(self, limit: int, outcome: str | None = None) -> list[dict[str, Any]]:
        records = [r for r in reversed(self._records) if outcome in (None, r["outcome"])]
        return records[:limit]


def build_admin_app(
    decisions: DecisionLog,
    ready: Callable[[], bool],
    placements: PlacementLog | None = None,
    worker_restarts: WorkerRestarts | None = None,
    index_snapshot: Callable[[], Awaitable[bytes | None]] | None = None,
) -> web.Application:
    async def metrics(_request: web.Request) -> web.Response:
        body, content_type = exposition(worker_restarts)
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def healthz(_request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_request: web.Request) -> web.Response:
        if ready():
            return web.Response(text="ready\n")
        return web.Response(status=503, text="not ready\n")

    async def recent(request: web.Request) -> web.Response:
        try:
            limit = max(0, int(request.query.get("limit", "50")))
        except ValueError:
            return web.json_response({"error": "limit must be an integer"}, status=400)
        records = decisions.recent(limit, request.query.get("outcome"))
        return web.Response(
            body=orjson.dumps({"decisions": records}), content_type="application/json"
        )

    shared = placements if placements is not None else PlacementLog()  # empty: not shared

    async def peer_placements(request: web.Request) -> web.Response:
        try:
            after = int(request.query.get("after", "0"))
        except ValueError:
            return web.json_response({"error": "after must be an integer"}, status=400)
        body = shared.answer(after, request.query.get("log"))
        return web.Response(body=body, content_type="application/json")

    async def peer_index(_request: web.Request) -> web.Response:
        if index_snapshot is None:
            return web.json_response({"error": "no index is served here"}, status=404)
        body = await index_snapshot()
        if body is None:
            return web.json_response({"error": "starting: its index is young"}, status=503)
        return web.Response(body=body, content_type="application/octet-stream")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/debug/decisions", recent)
    app.router.add_get(PLACEMENTS_PATH, peer_placements)
    app.router.add_get(INDEX_PATH, peer_index)
    return app


async def start_admin(app: web.Application, listen: str) -> tuple[web.AppRunner, int]:
    from .config import parse_host_port

    host, port = parse_host_port(listen, allow_port_zero=True)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    server = site._server
    bound = server.sockets[0].getsockname()[1] if server and server.sockets else port
    return runner, bound
