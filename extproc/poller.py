"""Poll every endpoint over HTTP on a timer, in one background task.

The health probes and the metrics scraper share this loop: one aiohttp session, all
endpoints polled concurrently each round, each result recorded as it arrives. A poll never raises
(subclasses turn failures into results), and routing never waits for one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

import aiohttp

log = logging.getLogger(__name__)
Result = TypeVar("Result")
Parsed = TypeVar("Parsed")


# A page larger than this is not read (a metrics page is ~100 KB per engine; it is parsed
# on the event loop that makes the routing decisions, 30 MB held it ~0.3 s).
MAX_PAGE_BYTES = 8 * 2**20


async def read_at_most(response: aiohttp.ClientResponse, max_bytes: int) -> bytes | None:
    """The whole body, or None past ``max_bytes`` (``content.read(n)`` returns only what has
    arrived so far: a large answer came back cut at ~64 KB)."""
    if response.content_length is not None and response.content_length > max_bytes:
        return None
    body = bytearray()
    async for chunk in response.content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > max_bytes:
            return None
    return bytes(body)


async def fetch_parsed(
    session: aiohttp.ClientSession,
    url: str,
    parse: Callable[[str], Parsed],
    max_bytes: int | None = None,
    headers: Mapping[str, str] | None = None,
) -> Parsed | None:
    """GET ``url`` and parse its text; None for a non-200 answer, a network failure, a body
    over ``max_bytes`` or a page ``parse`` rejects (ValueError), so that a poll never raises."""
    try:
        async with session.get(url, headers=headers) as response:
            if response.status != 200:
                return None
            body = await read_at_most(response, max_bytes or MAX_PAGE_BYTES)
            if body is None:
                return None
            return parse(body.decode(response.charset or "utf-8"))
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError, LookupError):
        return None


class EndpointPoller(Generic[Result]):
    task_name = "endpoint-poller"
    # If set, addresses not polled yet (new, or ``unpolled``) are looked for this often,
    # during rounds too, and polled at once, not at the next round.
    new_address_seconds: float | None = None

    def __init__(
        self, addresses: Callable[[], list[str]], interval_seconds: float, timeout_seconds: float
    ) -> None:
        self._addresses = addresses
        self.interval = interval_seconds
        self.timeout = timeout_seconds
        self._task: asyncio.Task[None] | None = None
        self._polled: set[str] = set()
        self._eager: set[str] = set()  # to poll at once though polled before (``unpolled``)
        self.session: aiohttp.ClientSession | None = None  # while the loop runs

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
        # No pool limit: aiohttp's default of 100 connections made the 101st endpoint's
        # poll wait for a connection inside its timeout, and fail.
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            self.session = session
            watcher = None
            if self.new_address_seconds is not None:
                watcher = asyncio.create_task(self._poll_new(session), name=self.task_name)
            try:
                while True:
                    await self.poll_all(session)
                    await asyncio.sleep(self.interval)
            finally:
                self.session = None
                if watcher is not None:
                    watcher.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await watcher

    async def _poll_new(self, session: aiohttp.ClientSession) -> None:
        """Beside the rounds (one that waits for a hung endpoint included): addresses not
        polled yet, or ``unpolled``, are polled at once, each on its own (a hung one holds
        up no later at-once poll; one still under way is not asked again meanwhile: it is
        asked once it answered, if wanted again)."""
        assert self.new_address_seconds is not None
        under_way: dict[str, asyncio.Task[None]] = {}
        try:
            while True:
                await asyncio.sleep(self.new_address_seconds)
                current = self._addresses()
                if self.wants_all():
                    self._eager.update(current)
                self._eager.intersection_update(current)  # (removed meanwhile: not kept)
                new = [
                    a
                    for a in current
                    if (a not in self._polled or a in self._eager) and a not in under_way
                ]
                self._eager.difference_update(new)
                self._polled.update(new)
                for address in new:
                    task = asyncio.create_task(self._poll_and_record(session, address))
                    under_way[address] = task
                    task.add_done_callback(lambda _, a=address: under_way.pop(a, None))
        finally:
            for task in list(under_way.values()):
                task.cancel()

    def wants_all(self) -> bool:
        """Whether every endpoint is to be polled again at once (checked as often as
        ``new_address_seconds``)."""
        return False

    def unpolled(self, address: str) -> None:
        """Poll ``address`` again at once, as a new one (``new_address_seconds``)."""
        self._eager.add(address)

    async def poll_all(self, session: aiohttp.ClientSession) -> None:
        """One round: every endpoint polled at once, each answer recorded as it comes (an
        endpoint that hangs until the timeout holds back no other's)."""
        addresses = self._addresses()
        await asyncio.gather(*(self._poll_and_record(session, a) for a in addresses))
        current = set(self._addresses())
        polled = self._polled | set(addresses)
        self.forget(polled - current)
        self._polled = polled & current

    async def _poll_and_record(self, session: aiohttp.ClientSession, address: str) -> Result:
        result = await self.poll(session, address)
        try:
            self.record(address, result)
        except Exception:
            # A fault in what a result feeds (an answer nobody foresaw) must not end the
            # polling of every endpoint, silently.
            log.exception("%s: recording %s's answer failed", self.task_name, address)
        return result

    def forget(self, gone: set[str]) -> None:
        """Addresses no longer polled: what is kept per address goes (pod churn)."""

    async def poll(self, session: aiohttp.ClientSession, address: str) -> Result:
        raise NotImplementedError

    def record(self, address: str, result: Result) -> None:
        raise NotImplementedError
