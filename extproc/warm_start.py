"""An index handed to a router that starts, so that it does not start knowing nothing.

A fresh router's index is empty: until its own placements fill it, conversations and shared
prefixes go where the rendezvous order says rather than where they are cached. Simulated, a
lone router restarted without KV-cache events lost 0.06-0.13 of the hit ratio in the 20-120 s
after (docs/benchmarks.md, "Router replicas restarting or scaling"). Two sources:

- a file (``warm_start.path``): the router writes its index there every ``interval_seconds``
  and when it stops, and reads it at start (a container or process restarted in place, a
  Compose service recreated on a volume); one older than ``max_age_seconds`` is not used;
- a peer (``warm_start.from_peers``, with ``peers`` set): a router starting beside others (a
  rollout's surge pod beside the one it replaces) reads one answering peer's index from its
  admin port (``GET /peer/index``) once, at its first round of reads.

The handed index goes in endpoint by endpoint, each at that endpoint's first metrics
reading by this router: only if the index region has the same size (the same KV capacity)
and the server is the one the snapshot saw (``signals.restarted_between``: the same start
time, or counters that did not go down) — a server restarted meanwhile holds nothing. With
metrics off, at once. What this router routed itself before then counts as newer than
anything handed over (``PrefixIndex.make_room_below``). The rest of a router's state (load,
the traffic share, popularity, placement keys) is not handed over: it is measured again in
seconds, where the index takes the cache's whole turnover to refill.

Format: a NumPy ``.npz`` archive (no pickles), a JSON header (``header``) and each region's
fingerprints and stamps (``fingerprints_<n>``, ``stamps_<n>``); 12 bytes per block of
capacity, as the index itself.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import tempfile
import time
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from .index import WAYS, RegionCopy, _buckets_for
from .signals import EndpointSignals, restarted_between

if TYPE_CHECKING:
    from .router import Router

log = logging.getLogger(__name__)

INDEX_PATH = "/peer/index"
VERSION = 1
# A snapshot read is refused past this size (an index of 64 endpoints x 1M blocks is 770 MB;
# the default capacity gives far less: 12 bytes per block of capacity).
MAX_SNAPSHOT_BYTES = 1024 * 2**20
# Regions not yet applied are dropped this long after the snapshot came: an endpoint this
# router has not read by then is not one the snapshot knew.
APPLY_WITHIN_SECONDS = 120.0
# The fields of a metrics reading that tell the server apart from a restarted one.
_SERVER_FIELDS = ("started", "queries", "hits", "prefills", "prefill_tokens", "prompt_tokens")


@dataclass
class IndexSnapshot:
    scheme: str  # placements.hash_scheme: the block hashes' meaning
    created: float  # Unix time
    clock: int  # the index clock when taken: every stamp is below it
    regions: dict[str, RegionCopy]
    # Per endpoint, the server as last read (the _SERVER_FIELDS of its metrics), if read.
    servers: dict[str, dict[str, float | None]] = field(default_factory=dict)
    router: str = ""  # the router instance whose index it is (a reader skips its own)

    def age(self, now: float | None = None) -> float:
        return (time.time() if now is None else now) - self.created


def take(
    router: Router, scheme: str, readings: Mapping[str, EndpointSignals], now: float | None = None
) -> IndexSnapshot:
    """The router's index now, with what the endpoints' metrics said of their servers."""
    clock, regions = router.index_regions()
    servers = {
        address: {name: getattr(reading, name) for name in _SERVER_FIELDS}
        for address, reading in readings.items()
        if address in regions and reading.read_at is not None
    }
    created = time.time() if now is None else now
    return IndexSnapshot(scheme, created, clock, regions, servers, router.instance)


def encode(snapshot: IndexSnapshot) -> bytes:
    endpoints = []
    arrays: dict[str, np.ndarray] = {}
    for n, (address, region) in enumerate(snapshot.regions.items()):
        endpoints.append(
            {
                "address": address,
                "capacity": region.capacity,
                "stamps_seen": region.stamps_seen,
                "new_seen": region.new_seen,
                "server": snapshot.servers.get(address),
            }
        )
        arrays[f"fingerprints_{n}"] = region.fingerprints
        arrays[f"stamps_{n}"] = region.stamps
    header = {
        "version": VERSION,
        "scheme": snapshot.scheme,
        "created": snapshot.created,
        "clock": snapshot.clock,
        "router": snapshot.router,
        "endpoints": endpoints,
    }
    arrays["header"] = np.frombuffer(orjson.dumps(header), dtype=np.uint8)
    out = io.BytesIO()
    np.savez(out, **arrays)
    return out.getvalue()


def decode(data: bytes, limit: int = MAX_SNAPSHOT_BYTES) -> IndexSnapshot:
    """A snapshot, checked; ValueError for anything else (garbled, cut, another version,
    arrays not the shape their capacity gives, more than ``limit`` bytes unpacked)."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as archive:
            if sum(info.file_size for info in archive.zip.infolist()) > limit:
                raise ValueError(f"unpacks to more than {limit} bytes")
            header: Any = orjson.loads(archive["header"].tobytes())
            if not isinstance(header, dict) or header.get("version") != VERSION:
                raise ValueError("not a version-1 snapshot")
            scheme, created, clock = header["scheme"], header["created"], header["clock"]
            router = header.get("router", "")
            if not (
                isinstance(scheme, str)
                and isinstance(router, str)
                and isinstance(created, int | float)
                and isinstance(clock, int)
                and clock >= 1
            ):
                raise ValueError("scheme, created or clock has the wrong type")
            regions: dict[str, RegionCopy] = {}
            servers: dict[str, dict[str, float | None]] = {}
            for n, entry in enumerate(header["endpoints"]):
                address, capacity = entry["address"], entry["capacity"]
                if not isinstance(address, str) or not isinstance(capacity, int) or capacity < 1:
                    raise ValueError("an endpoint's address or capacity is wrong")
                fingerprints = archive[f"fingerprints_{n}"]
                stamps = archive[f"stamps_{n}"]
                shape = (_buckets_for(capacity), WAYS)
                if (
                    fingerprints.shape != shape
                    or stamps.shape != shape
                    or fingerprints.dtype != np.uint32
                    or stamps.dtype != np.uint64
                ):
                    raise ValueError(f"{address}: arrays are not {shape} uint32 / uint64")
                if stamps.size and int(stamps.max()) >= clock:
                    raise ValueError(f"{address}: a stamp is not below the clock")
                regions[address] = RegionCopy(
                    capacity,
                    fingerprints,
                    stamps,
                    float(entry["stamps_seen"]),
                    float(entry["new_seen"]),
                )
                server = entry.get("server")
                if server is not None:
                    servers[address] = {
                        name: None if server.get(name) is None else float(server[name])
                        for name in _SERVER_FIELDS
                    }
    except (
        OSError,
        EOFError,
        KeyError,
        TypeError,
        AttributeError,
        zipfile.BadZipFile,
        orjson.JSONDecodeError,
        ValueError,
    ) as exc:
        raise ValueError(f"not an index snapshot: {exc}") from exc
    return IndexSnapshot(scheme, float(created), clock, regions, servers, router)


def path_problem(path: str) -> str | None:
    """Why the router could not keep its snapshot at ``path`` (checked at start), or None."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"{path} is a directory, not a file"
    if not os.path.isdir(directory):
        return f"directory {directory} does not exist"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"directory {directory} is not writable by this process"
    return None


def write_file(path: str, data: bytes) -> None:
    """Write whole or not at all: a reader never finds half a snapshot."""
    target = Path(path)
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def read_file(path: str, scheme: str, max_age_seconds: float) -> IndexSnapshot | None:
    """The snapshot in ``path`` if it is one this router can use, else None (logged why)."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        log.info("warm start: no index snapshot at %s yet; starting empty", path)
        return None
    except OSError as exc:
        log.warning("warm start: cannot read %s (%s); starting empty", path, exc)
        return None
    return _usable(data, f"file {path}", scheme, max_age_seconds)


def _usable(data: bytes, source: str, scheme: str, max_age_seconds: float) -> IndexSnapshot | None:
    try:
        snapshot = decode(data)
    except ValueError as exc:
        log.warning("warm start: %s is not usable (%s); starting empty", source, exc)
        return None
    if snapshot.scheme != scheme:
        log.warning(
            "warm start: %s hashes prompts as %s, this router as %s (another "
            "routing.block_size_bytes?); starting empty",
            source,
            snapshot.scheme,
            scheme,
        )
        return None
    age = snapshot.age()
    if age > max_age_seconds:
        log.warning(
            "warm start: %s is %.0f s old, over warm_start.max_age_seconds (%.0f); starting empty",
            source,
            age,
            max_age_seconds,
        )
        return None
    return snapshot


def usable_answer(data: bytes, source: str, scheme: str) -> IndexSnapshot | None:
    """A peer's answer (``GET /peer/index``), taken whatever its age: it was made just now."""
    return _usable(data, source, scheme, float("inf"))


class Handover:
    """A snapshot going into a router's index, endpoint by endpoint (the module docstring).

    ``reads_metrics``: each endpoint's region waits for this router's first metrics reading
    of it (``endpoint_read``); without, regions go in as soon as their endpoint is a member
    (``apply_members``)."""

    def __init__(
        self,
        snapshot: IndexSnapshot,
        source: str,
        router: Router,
        reads_metrics: bool,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source = source
        self.router = router
        self.reads_metrics = reads_metrics
        self.clock = clock
        self.deadline = clock() + APPLY_WITHIN_SECONDS
        self._pending = dict(snapshot.regions)
        self._servers = snapshot.servers
        self.applied: dict[str, int] = {}  # endpoint -> index slots taken
        self.skipped: dict[str, str] = {}  # endpoint -> why not
        router.make_room_for_handover(snapshot.clock)
        log.info(
            "warm start: taking %s's index of %d endpoints (%.0f s old)",
            source,
            len(self._pending),
            snapshot.age(),
        )
        if not reads_metrics:
            self.apply_members()

    @property
    def done(self) -> bool:
        return not self._pending

    def expire(self) -> None:
        """Drop what is still pending once APPLY_WITHIN_SECONDS have passed."""
        if self._pending and self.clock() >= self.deadline:
            for address in self._pending:
                self.skipped[address] = "not read in time"
            log.info(
                "warm start: %d endpoint(s) of %s's index were never read here: %s",
                len(self._pending),
                self.source,
                ", ".join(sorted(self._pending)),
            )
            self._pending.clear()

    def apply_members(self) -> None:
        for address in list(self._pending):
            if self.router.is_member(address):
                self._apply(address)

    def endpoint_read(self, address: str, reading: EndpointSignals) -> None:
        """This router's metrics reading of ``address`` (after Router.observe_signals)."""
        self.expire()
        if address not in self._pending or not reading.up or not self.router.is_member(address):
            return
        server = self._servers.get(address)
        if server is not None:
            then = EndpointSignals(**{name: server.get(name) for name in _SERVER_FIELDS})
            if then.tells_restarts and restarted_between(then, reading):
                del self._pending[address]
                self.skipped[address] = "its server restarted since"
                log.info("warm start: %s restarted since the snapshot; not taken", address)
                return
        self._apply(address)

    def _apply(self, address: str) -> None:
        copy = self._pending.pop(address)
        try:
            taken = self.router.adopt_index_region(address, copy)
        except Exception:  # (never the router's end: it routes on without this region)
            log.exception("warm start: %s's region could not be taken", address)
            self.skipped[address] = "failed"
            return
        if taken is None:
            self.skipped[address] = "another KV capacity"
            log.info("warm start: %s has another KV capacity here; not taken", address)
            return
        self.applied[address] = taken
        if self.done:
            log.info(
                "warm start: %s's index taken for %d endpoint(s) (%d blocks)",
                self.source,
                len(self.applied),
                sum(self.applied.values()),
            )
