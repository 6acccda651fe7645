"""Endpoint health: active HTTP probes that take dead replicas out of the candidate set.

Envoy's override_host cluster already falls back from a dead pick; the original_dst cluster
cannot (a retry re-reads the same header), so the router must stop picking a dead replica
itself. A probe failure is a refused or timed-out connection or a non-2xx answer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import aiohttp

from .config import HealthCheckConfig
from .poller import EndpointPoller

log = logging.getLogger(__name__)


class HealthChecker(EndpointPoller[bool]):
    task_name = "endpoint-health"

    def __init__(
        self,
        config: HealthCheckConfig,
        addresses: Callable[[], list[str]],
        set_health: Callable[[str, bool], None],
    ) -> None:
        super().__init__(addresses, config.interval_seconds, config.timeout_seconds)
        self.config = config
        self._set_health = set_health
        self._failures: dict[str, int] = {}
        self._successes: dict[str, int] = {}

    def start(self) -> None:
        if self.config.enabled:
            super().start()

    async def poll(self, session: aiohttp.ClientSession, address: str) -> bool:
        try:
            async with session.get(f"http://{address}{self.config.path}") as response:
                return 200 <= response.status < 300
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    def forget(self, gone: set[str]) -> None:
        for address in gone:  # (an address back later starts its counts over)
            self._failures.pop(address, None)
            self._successes.pop(address, None)

    def record(self, address: str, ok: bool) -> None:
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
