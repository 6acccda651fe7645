"""Read the other router replicas' own queued work and placements from their admin port.

Each replica exports the prefill work it sent each endpoint and still counts as queued
(``prefix_router_own_queued_work{router, endpoint}`` on /metrics, refreshed every second),
and the prefill work of the cold starts it placed lately (``prefix_router_own_placed_work``).
Reading the others' makes a long prefill that one replica sent visible to all of them within
about ``interval_seconds`` + 1 s; without it each sees only its own charges and the endpoints'
waiting counts (docs/benchmarks.md: K=4 Mooncake p99 several times K=1's). With
``share_placements`` each also reads the placements the others made since its last read
(``/peer/placements``, placements.py) into its index, so a conversation another replica
started is found where it was placed, and the others' placed work, so that new sessions
balance over what all of them placed (as one router's do) instead of following the
rendezvous order alone. Peers come from a static list of admin addresses
and/or a DNS name (a headless Service) resolved every round; this replica's own figures
(same ``router`` label) are skipped, its sibling worker processes' are not. A peer that does
not answer is skipped until it does; its last report drains away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from .config import PeersConfig
from .discovery import getaddrinfo_resolver
from .placements import MAX_ANSWER_BYTES, PLACEMENTS_PATH, Placement, PlacementAnswer, decode
from .poller import EndpointPoller, fetch_parsed, read_at_most
from .warm_start import INDEX_PATH, MAX_SNAPSHOT_BYTES

log = logging.getLogger(__name__)

OWN_WORK_METRIC = "prefix_router_own_queued_work"
OWN_PLACED_METRIC = "prefix_router_own_placed_work"
# Peers' placements go into the index in slices of about this many blocks, the event loop
# free in between: recording costs ~0.5 us a block plus ~20 us a placement, and a decision
# must not wait for a whole second's worth (a slice: 1.5-2.6 ms here, `bench core
# --peer-placements`).
BLOCKS_PER_SLICE = 2048
# Reading a peer's whole index (warm_start.py) may take longer than a round's read: 12 bytes
# per block of its capacity (~6 MB for 8 servers of 1M tokens at the default block size).
INDEX_TIMEOUT_SECONDS = 20.0

PeerWork = dict[str, dict[str, float]]  # router instance -> endpoint address -> work


def placement_slices(
    placements: list[Placement], blocks: int | None = None
) -> Iterator[list[Placement]]:
    """Consecutive slices of about ``blocks`` (BLOCKS_PER_SLICE) block hashes each."""
    limit = blocks or BLOCKS_PER_SLICE
    start, count = 0, 0
    for end, placement in enumerate(placements, 1):
        count += len(placement.hashes)
        if count >= limit or end == len(placements):
            yield placements[start:end]
            start, count = end, 0


@dataclass(frozen=True, slots=True)
class PeerFigures:
    """What one /metrics page says of each router instance, per endpoint."""

    work: PeerWork  # its own queued prefill work
    placed: PeerWork  # the prefill work of the cold starts it placed lately (decaying)


def parse_peer_figures(text: str) -> PeerFigures:
    """Every router instance's own queued and placed work per endpoint in one /metrics page."""
    out: dict[str, PeerWork] = {OWN_WORK_METRIC: {}, OWN_PLACED_METRIC: {}}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            figures = out.get(sample.name)
            if figures is None:
                continue
            router, endpoint = sample.labels.get("router"), sample.labels.get("endpoint")
            if router and endpoint:
                figures.setdefault(router, {})[endpoint] = float(sample.value)
    return PeerFigures(out[OWN_WORK_METRIC], out[OWN_PLACED_METRIC])


class _AskAgain:
    """fetch_index's answer from a peer that is starting itself (503), or whose index is
    over the bound this router set (which grows as its own regions get their real sizes):
    ask it again in a later round."""


ASK_AGAIN = _AskAgain()


async def fetch_index(
    session: aiohttp.ClientSession, address: str, max_bytes: int = MAX_SNAPSHOT_BYTES
) -> bytes | _AskAgain | None:
    """A peer's index snapshot (warm_start.py); ASK_AGAIN if the peer is starting itself
    (503: its index is young) or its index is over ``max_bytes``; None: no answer, another
    status (a supervisor of --workers N, an older router, a router without peers: 404)."""
    url = f"http://{address}{INDEX_PATH}"
    try:
        timeout = aiohttp.ClientTimeout(total=INDEX_TIMEOUT_SECONDS)
        async with session.get(url, timeout=timeout) as response:
            if response.status == 503:
                return ASK_AGAIN
            if response.status != 200:
                log.info(
                    "peer router %s keeps no index to hand over (%d)", address, response.status
                )
                return None
            body = await read_at_most(response, max_bytes)
            if body is None:
                log.warning(
                    "peer router %s: its index is over %d bytes; not read now", address, max_bytes
                )
                return ASK_AGAIN
            return body
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        log.info("peer router %s: its index could not be read (%s)", address, exc)
        return None


def parse_peer_work(text: str) -> PeerWork:
    """Every router instance's own queued work per endpoint in one /metrics page."""
    return parse_peer_figures(text).work


@dataclass(frozen=True, slots=True)
class PeerAnswer:
    work: PeerWork | None  # None: /metrics did not answer (or not in the format)
    # From /peer/placements; None when not read or not answered.
    placements: PlacementAnswer | None = None
    # Each router instance's placed cold-start work (same page as ``work``); None with it.
    placed: PeerWork | None = None


class PeerReader(EndpointPoller[PeerAnswer]):
    task_name = "peer-work"

    def __init__(
        self,
        config: PeersConfig,
        on_work: Callable[[str, dict[str, float]], None],
        on_placements: Callable[[list[Placement]], None] | None = None,
        scheme: str = "",
        on_placed: Callable[[str, dict[str, float]], None] | None = None,
        wants_index: Callable[[], bool] | None = None,
        on_index: Callable[[str, bytes], Awaitable[bool]] | None = None,
    ) -> None:
        """``on_placements`` gets the placements of peers whose hashes are made as
        ``scheme`` says (placements.hash_scheme); others are skipped, with a warning.
        ``on_placed`` gets each router instance's placed cold-start work (with placements
        shared, cold starts balance over all the replicas' placements)."""
        # The addresses of this round: the static list plus what dns_name resolved to.
        self._addresses_now: list[str] = list(config.addresses)
        super().__init__(
            lambda: list(self._addresses_now), config.interval_seconds, config.timeout_seconds
        )
        self.config = config
        self._on_work = on_work
        self._on_placements = on_placements
        self._on_placed = on_placed
        self._scheme = scheme
        self._foreign: set[str] = set()  # peers warned about for another hash scheme
        self._unread: set[str] = set()  # peers whose placements page could not be read
        self._answering: dict[str, bool] = {}
        # Per peer address: the placement log read and the last placement number seen.
        self._seen: dict[str, tuple[str, int]] = {}
        self._pending: list[Placement] = []  # read this round, not yet recorded
        self._wants_index = wants_index
        self._on_index = on_index
        self._index_asked: set[str] = set()
        self._index_task: asyncio.Task[None] | None = None
        self.max_index_bytes: Callable[[], int] = lambda: MAX_SNAPSHOT_BYTES

    async def poll_all(self, session: aiohttp.ClientSession) -> None:
        addresses = list(self.config.addresses)
        if self.config.dns_name is not None and self.config.dns_port is not None:
            try:
                addresses += await getaddrinfo_resolver(self.config.dns_name, self.config.dns_port)
            except OSError as exc:
                log.warning("peers: cannot resolve %s: %s", self.config.dns_name, exc)
        self._addresses_now = sorted(set(addresses))
        await super().poll_all(session)
        self._start_reading_an_index(session)
        pending, self._pending = self._pending, []
        if self._on_placements is None:
            return
        for piece in placement_slices(pending):
            self._on_placements(piece)
            await asyncio.sleep(0)

    def _start_reading_an_index(self, session: aiohttp.ClientSession) -> None:
        """Beside the rounds (a peer's whole index may take seconds to read; the rounds,
        and the placements they read, do not wait for it)."""
        if self._on_index is None or self._wants_index is None or not self._wants_index():
            return
        if self._index_task is not None and not self._index_task.done():
            return
        if any(self._answering.get(a) and a not in self._index_asked for a in self._addresses_now):
            self._index_task = asyncio.create_task(self._read_an_index(session), name="peer-index")

    async def _read_an_index(self, session: aiohttp.ClientSession) -> None:
        if self._on_index is None or self._wants_index is None:
            return
        for address in list(self._addresses_now):
            if not self._wants_index():
                return
            if not self._answering.get(address) or address in self._index_asked:
                continue
            self._index_asked.add(address)
            try:
                data = await fetch_index(session, address, self.max_index_bytes())
                if data is ASK_AGAIN:
                    self._index_asked.discard(address)  # (asked again next round)
                elif isinstance(data, bytes) and await self._on_index(address, data):
                    return
            except Exception:  # (the peers' reads go on whatever this one did)
                log.exception("peer router %s: its index could not be taken", address)

    async def stop(self) -> None:
        task, self._index_task = self._index_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await super().stop()

    async def poll(self, session: aiohttp.ClientSession, address: str) -> PeerAnswer:
        figures = await fetch_parsed(session, f"http://{address}/metrics", parse_peer_figures)
        if figures is None:
            return PeerAnswer(None)
        if self._on_placements is None:
            return PeerAnswer(figures.work, placed=figures.placed)
        log_id, last = self._seen.get(address, ("", 0))
        url = f"http://{address}{PLACEMENTS_PATH}?after={last}&log={log_id}"
        placements = await fetch_parsed(session, url, decode, MAX_ANSWER_BYTES)
        return PeerAnswer(figures.work, placements, figures.placed)

    def forget(self, gone: set[str]) -> None:
        for address in gone:  # (a peer pod replaced: its log and warnings go with it)
            self._seen.pop(address, None)
            self._answering.pop(address, None)
            self._unread.discard(address)
            self._foreign.discard(address)

    def record(self, address: str, result: PeerAnswer) -> None:
        answering = result.work is not None
        if self._answering.get(address) != answering:
            log.log(
                logging.INFO if answering else logging.WARNING,
                "peer router %s %s",
                address,
                "answers" if answering else "does not answer; its queued work fades out",
            )
            self._answering[address] = answering
        for router, work in (result.work or {}).items():
            self._on_work(router, work)
        if self._on_placed is not None:
            for router, placed in (result.placed or {}).items():
                self._on_placed(router, placed)
        answer = result.placements
        if self._on_placements is None:
            return
        unread = answering and answer is None
        if unread != (address in self._unread):
            log.log(
                logging.WARNING if unread else logging.INFO,
                "peer router %s: its placements %s",
                address,
                "could not be read (too large, garbled or cut)" if unread else "are read again",
            )
            (self._unread.add if unread else self._unread.discard)(address)
        if answer is None:
            return
        self._seen[address] = (answer.log, answer.last)
        if answer.scheme == self._scheme:
            self._pending += answer.placements
            self._foreign.discard(address)
        elif address not in self._foreign:
            log.warning(
                "peer router %s hashes prompts as %s, this one as %s (another "
                "routing.block_size_bytes?): its placements are skipped",
                address,
                answer.scheme,
                self._scheme,
            )
            self._foreign.add(address)
