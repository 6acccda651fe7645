"""Poll every endpoint over HTTP on a timer, in one background task.

The health probes and the metrics scraper share this loop: one aiohttp session, all
endpoints polled concurrently each round, results recorded in order. A poll never raises
(subclasses turn failures into results), and routing never waits for one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Generic, TypeVar

import aiohttp

Result = TypeVar("Result")
Parsed = TypeVar("Parsed")


async def fetch_parsed(
    session: aiohttp.ClientSession,
    url: str,
    parse: Callable[[str], Parsed],
    max_bytes: int | None = None,
) -> Parsed | None:
    """GET ``url`` and parse its text; None for a non-200 answer, a network failure, a body
    over ``max_bytes`` or a page ``parse`` rejects (ValueError), so that a poll never raises."""
    try:
        async with session.get(url) as response:
            if response.status != 200:
                return None
            if max_bytes is None:
                return parse(await response.text())
            body = await response.content.read(max_bytes + 1)
            if len(body) > max_bytes:
                return None
            return parse(body.decode(response.charset or "utf-8"))
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError, LookupError):
        return None


class EndpointPoller(Generic[Result]):
    task_name = "endpoint-poller"

    def __init__(
        self, addresses: Callable[[], list[str]], interval_seconds: float, timeout_seconds: float
    ) -> None:
        self._addresses = addresses
        self.interval = interval_seconds
        self.timeout = timeout_seconds
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name=self.task_name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                await self.poll_all(session)
                await asyncio.sleep(self.interval)

    async def poll_all(self, session: aiohttp.ClientSession) -> None:
        addresses = self._addresses()
        results = await asyncio.gather(*(self.poll(session, a) for a in addresses))
        for address, result in zip(addresses, results, strict=True):
            self.record(address, result)

    async def poll(self, session: aiohttp.ClientSession, address: str) -> Result:
        raise NotImplementedError

    def record(self, address: str, result: Result) -> None:
        raise NotImplementedError
