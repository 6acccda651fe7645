"""Endpoint health: active HTTP probes that take dead replicas out of the candidate set.

Envoy's override_host cluster already falls back from a dead pick; the original_dst cluster
cannot (a retry re-reads the same header), so the router must stop picking a dead replica
itself. A probe failure is a refused or timed-out connection or a non-2xx answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

import aiohttp

from .config import HealthCheckConfig

log = logging.getLogger(__name__)


class HealthChecker:
    def __init__(
        self,
        config: HealthCheckConfig,
        addresses: Callable[[], list[str]],
        set_health: Callable[[str, bool], None],
    ) -> None:
        self.config = config
        self._addresses = addresses
        self._set_health = set_health
        self._failures: dict[str, int] = {}
        self._successes: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.config.enabled and self._task is None:
            self._task = asyncio.create_task(self._loop(), name="endpoint-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.timeout_seconds)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                await self.probe_all(session)
                await asyncio.sleep(self.config.interval_seconds)

    async def probe_all(self, session: aiohttp.ClientSession) -> None:
        addresses = self._addresses()
        results = await asyncio.gather(*(self._probe(session, a) for a in addresses))
        for address, ok in zip(addresses, results, strict=True):
            self._record(address, ok)

    async def _probe(self, session: aiohttp.ClientSession, address: str) -> bool:
        try:
            async with session.get(f"http://{address}{self.config.path}") as response:
                return 200 <= response.status < 300
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    def _record(self, address: str, ok: bool) -> None:
        if ok:
            self._failures[address] = 0
            self._successes[address] = self._successes.get(address, 0) + 1
            if self._successes[address] >= self.config.healthy_threshold:
                self._set_health(address, True)
        else:
            self._successes[address] = 0
            self._failures[address] = self._failures.get(address, 0) + 1
            if self._failures[address] >= self.config.unhealthy_threshold:
                self._set_health(address, False)
