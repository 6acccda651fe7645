"""Subscribe to every endpoint's KV-cache event publisher and feed the router's index.

One ZMQ SUB socket per endpoint (vLLM publishes on a PUB socket it binds), read on the
event loop (zmq.asyncio) and reconciled with the endpoint set every second, as discovery
adds and removes endpoints. A message's events are translated (cache_events.py) and handed
to the router, a long stored chain a piece at a time (``in_pieces``), with decisions let run
after each; a malformed message is counted and skipped. A gap in the sequence
numbers (messages a slow subscriber lost, or all those before a late start) is asked for on
the endpoint's replay socket when one is configured (vLLM keeps its last 10,000 messages),
else counted: what it missed, the index then learns only from the router's own records and
the endpoint's later events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np
import zmq
import zmq.asyncio

from .cache_events import (
    EMPTY,
    EndpointCacheEvents,
    Translation,
    decode_message,
    in_pieces,
    message_sequence,
)
from .config import CacheEventsConfig, fill_address, parse_host_port

log = logging.getLogger("extproc.cache_events")

Changes = Sequence[tuple[bool | None, np.ndarray]]
RECONCILE_SECONDS = 1.0
# A stored chain longer than this is translated and applied in pieces of at most this many
# tokens, with decisions let run between them (cache_events.in_pieces).
PIECE_TOKENS = 8192
REPLAY_TIMEOUT_SECONDS = 2.0
RETRY_SECONDS = 5.0
# ZMTP heartbeats on the SUB connection: a publisher's host that vanished without closing it
# (a crash, a network split, an idle timeout in between) is dropped after this long without
# an answer, and ZMQ connects again; without them a restarted server at the same address
# was never read again.
HEARTBEAT_INTERVAL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)  # vLLM's end-of-replay sequence


async def _let_decisions_run() -> None:
    """Yield to the event loop after each message or piece of one. A socket with messages
    waiting returns them without yielding, so a backlog (a burst, a replay) would otherwise
    be translated in one go while decisions wait: 100 messages of 32 KiB prompts held the loop ~135 ms
    (`bench events --backlog`; docs/benchmarks.md, "KV-cache events read by the server")."""
    await asyncio.sleep(0)


def publisher_address(template: str, endpoint: str) -> str:
    """The publisher of one endpoint: ``cache_events.publisher`` with its host and port."""
    return fill_address(template, *parse_host_port(endpoint))


class CacheEventSubscriber:
    def __init__(
        self,
        config: CacheEventsConfig,
        translation: Translation,
        addresses: Callable[[], list[str]],
        on_changes: Callable[[str, Changes, bool], set[bool | None]],
        on_count: Callable[[str, str, int], None] | None = None,
    ) -> None:
        """``on_changes(endpoint, changes, replayed)`` applies them (``replayed``: read from
        the endpoint's replay socket, its history in order) and returns the kinds it applied
        (True: stores, False: evictions, None: a clear); the rest the router ignored.
        ``on_count(endpoint, kind, n)``: each addition to ``counts`` (the metrics)."""
        self.config = config
        self.translation = translation
        self._addresses = addresses
        self._on_changes = on_changes
        self._on_count = on_count
        self._context = zmq.asyncio.Context()
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._task: asyncio.Task[None] | None = None
        self.counts: Counter[tuple[str, str]] = Counter()  # (endpoint, kind)
        self.tables: dict[str, EndpointCacheEvents] = {}
        self._restarted: set[str] = set()  # endpoints whose server restarted, by its metrics
        # endpoint -> when (Unix time) its sequence was last seen starting over
        self._sequence_restarts: dict[str, float] = {}
        self.clock: Callable[[], float] = time.time

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._reconcile(), name="cache-events")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._tasks.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task  # (a task's own failure was logged when it happened)
        self._task = None
        self._tasks.clear()
        self._context.destroy(linger=0)

    async def _reconcile(self) -> None:
        while True:
            self.follow(self._addresses())
            await asyncio.sleep(RECONCILE_SECONDS)

    def follow(self, endpoints: list[str]) -> None:
        """Subscribe to new endpoints, drop removed ones (their tables go with them)."""
        for endpoint in set(self._tasks) - set(endpoints):
            self._tasks.pop(endpoint).cancel()
            self.tables.pop(endpoint, None)
            self._sequence_restarts.pop(endpoint, None)
            self._restarted.discard(endpoint)
        for endpoint in endpoints:
            task = self._tasks.get(endpoint)
            if task is None or task.done():  # (a task that ended is started again)
                self.tables[endpoint] = EndpointCacheEvents(self.translation)
                self._tasks[endpoint] = asyncio.create_task(
                    self._read(endpoint), name=f"cache-events {endpoint}"
                )

    def restarted(self, endpoint: str, started: float | None = None) -> bool:
        """The endpoint's metrics show its server restarted (no earlier than ``started``,
        Unix time, if known: its start time, or else when the old server was last read).
        Its publisher's sequence then starts over, which tells the same unless the new
        server published past the number last read before this subscriber heard from it
        again (it reconnects within a few seconds); so the next message empties the table
        and is read as a first one (asking the replay socket, if any, for everything the new
        server buffered).

        Returns False if the sequence already told this restart: it started over after
        ``started`` (a server loads its model for seconds before it publishes, far more than
        the clocks of two NTP-kept hosts differ). The table and the router's index then hold
        the new server's own blocks, read since, and are kept; emptied again, up to a scrape
        interval of them would be lost and the restart counted twice."""
        if endpoint not in self.tables:
            return True
        seen = self._sequence_restarts.get(endpoint)
        if started is not None and seen is not None and started <= seen:
            return False
        self._restarted.add(endpoint)
        return True

    def _socket(self, kind: int, address: str) -> zmq.asyncio.Socket:
        socket = self._context.socket(kind)
        if "[" in address:
            socket.setsockopt(zmq.IPV6, 1)
        return socket

    async def _read(self, endpoint: str) -> None:
        """Follow one endpoint's publisher for as long as it is an endpoint; a socket error
        (an address ZMQ refuses) is logged and counted, and the socket made again; so is
        any other fault, which would otherwise end the reading for good, silently."""
        while True:
            try:
                await self._follow_publisher(endpoint)
            except zmq.ZMQError as exc:
                self._count(endpoint, "socket_errors", 1)
                log.error("KV-cache events of %s: %s", endpoint, exc)
                await asyncio.sleep(RETRY_SECONDS)
            except Exception:
                self._count(endpoint, "reader_errors", 1)
                log.exception("KV-cache events of %s: reading failed; starting again", endpoint)
                await asyncio.sleep(RETRY_SECONDS)

    async def _follow_publisher(self, endpoint: str) -> None:
        address = publisher_address(self.config.publisher, endpoint)
        socket = self._socket(zmq.SUB, address)
        try:
            socket.setsockopt(zmq.SUBSCRIBE, self.config.topic.encode())
            socket.setsockopt(zmq.RCVHWM, 100_000)
            socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_INTERVAL_MS)
            socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
            socket.connect(address)
            log.info("reading %s's KV-cache events from %s", endpoint, address)
            expected: int | None = None
            while True:
                frames = await socket.recv_multipart()
                if endpoint in self._restarted:
                    # (The router forgot the endpoint's entries when it heard: those it
                    # recorded since are the new server's, so only the table goes.)
                    self._restarted.discard(endpoint)
                    if expected is not None:
                        expected = None
                        self._count(endpoint, "restarts", 1)
                        self.tables[endpoint].cleared()
                sequence = message_sequence(frames)
                if self.config.replay and sequence is not None and sequence > (expected or 0):
                    # A late start or lost messages: what the endpoint still buffers, first.
                    expected = await self._replay(endpoint, expected, sequence)
                expected = await self.handle(endpoint, frames, expected)
        finally:
            socket.close(linger=0)

    async def _replay(self, endpoint: str, expected: int | None, stop: int) -> int | None:
        """Ask the endpoint's replay socket for the messages from ``expected`` (from its
        oldest, after a start) up to ``stop``, and apply them; returns the next expected."""
        address = publisher_address(self.config.replay, endpoint)
        dealer = self._socket(zmq.DEALER, address)
        try:
            dealer.connect(address)
            await dealer.send_multipart([b"", (expected or 0).to_bytes(8, "big")])
            while True:
                reply = await asyncio.wait_for(dealer.recv_multipart(), REPLAY_TIMEOUT_SECONDS)
                if len(reply) != 4 or reply[2] == END_OF_REPLAY:
                    break
                sequence = int.from_bytes(reply[2], "big")
                if sequence < stop and (expected is None or sequence >= expected):
                    expected = await self.handle(endpoint, reply[1:], expected, replayed=True)
                    self._count(endpoint, "replayed_messages", 1)
        except TimeoutError:
            self._count(endpoint, "replay_timeouts", 1)
        finally:
            dealer.close(linger=0)
        return expected

    def _count(self, endpoint: str, kind: str, n: int) -> None:
        if n:
            self.counts[endpoint, kind] += n
            if self._on_count is not None:
                self._on_count(endpoint, kind, n)

    async def handle(
        self, endpoint: str, frames: list[bytes], expected: int | None, replayed: bool = False
    ) -> int | None:
        """One message (``replayed``: from the replay socket): translated and applied, a
        long stored chain a piece at a time with decisions let run after each piece
        (``in_pieces``) and after the message; returns the sequence number expected next."""
        table = self.tables.get(endpoint)
        if table is None:
            return expected
        try:
            sequence, events = decode_message(frames)
        except ValueError:
            self._count(endpoint, "malformed_messages", 1)
            return expected
        if expected is not None and sequence > expected:
            self._count(endpoint, "missed_messages", sequence - expected)
        elif expected is not None and sequence < expected:
            # The sequence starts over: the publisher restarted, and its cache with it.
            self._sequence_restarts[endpoint] = self.clock()
            self._count(endpoint, "restarts", 1)
            table.cleared()
            self._on_changes(endpoint, [(None, EMPTY)], replayed)
        ignored = False
        for part in in_pieces(events, PIECE_TOKENS):
            untranslated = table.untranslated
            try:
                changes = table.apply(part)
            except Exception as exc:  # events of a shape it does not know (another vLLM)
                if not self.counts[endpoint, "malformed_messages"]:
                    log.warning("KV-cache events of %s: unreadable event (%r)", endpoint, exc)
                self._count(endpoint, "malformed_messages", 1)
                break
            self._count(endpoint, "untranslated_blocks", table.untranslated - untranslated)
            applied = self._on_changes(endpoint, changes, replayed) if changes else set()
            for held, hashes in changes:
                if held is not None and not len(hashes):
                    continue  # (blocks that gave the router none: untranslated_blocks)
                if held not in applied:
                    ignored = True
                    continue
                kind = "cleared" if held is None else "stored_blocks" if held else "removed_blocks"
                self._count(endpoint, kind, 1 if held is None else len(hashes))
            await _let_decisions_run()
        if ignored:
            self._count(endpoint, "ignored_messages", 1)
        return sequence + 1
