"""An index handed to a router that starts, so that it does not start knowing nothing.

A fresh router's index is empty: until its own placements fill it, conversations and shared
prefixes go where the rendezvous order says rather than where they are cached. Simulated, a
lone router restarted with nothing handed over lost 0.06-0.15 of the hit ratio in the
20-120 s after, and at most 0.003 with its predecessor's index (docs/benchmarks.md,
"Restarts keep the index"). Two sources:

- a file (``warm_start.path``): the router writes its index there every ``interval_seconds``
  and after the drain when it stops, and reads it at start (a container or process
  restarted in place, a Compose service recreated on a volume); one older than
  ``max_age_seconds`` is not used;
- a peer (``warm_start.from_peers``, with ``peers`` set): a router starting beside others (a
  rollout's surge pod beside the one it replaces) reads one established peer's index from
  its admin port (``GET /peer/index``) once, within ``from_peers_seconds`` of its start; a
  peer starting itself answers 503 (its index is young) and is asked again later.

The handed index goes in endpoint by endpoint, each at this router's next metrics reading
of it (Handover): only if the index region has the same size (the same KV capacity) and
both readings tell the same server (``signals.restarted_between``: the same start time, or
counters that did not go down) — a server restarted meanwhile holds nothing, and one that
cannot be told apart is not taken. With metrics off, at once. What this router routed
itself before then counts as newer than anything handed over
(``PrefixIndex.make_room_below``). The rest of a router's state (load, the traffic share,
popularity, placement keys) is not handed over: it is measured again in seconds, where the
index takes the cache's whole turnover to refill.

Anything read (a file, a peer's answer) is input: ``decode`` refuses whatever is not a
snapshot this version wrote, before allocating what its headers claim, and the router
starts empty.

Format: a NumPy ``.npz`` archive (no pickles), a JSON header (``header``) and each region's
fingerprints and stamps (``fingerprints_<n>``, ``stamps_<n>``); 12 bytes per block of
capacity, as the index itself.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import tempfile
import time
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

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

    def holds_anything(self) -> bool:
        """An empty index (a router that had routed nothing) is no handover: a start's one
        handover is kept for one that holds something."""
        return any(region.fingerprints.any() for region in self.regions.values())


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


def _save(snapshot: IndexSnapshot, out: BinaryIO) -> None:
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
    np.savez(out, **arrays)


def encode(snapshot: IndexSnapshot) -> bytes:
    out = io.BytesIO()
    _save(snapshot, out)
    return out.getvalue()


# An index clock beyond this is refused: a router adds it to its own (make_room_below), and
# uint64 stamps must not wrap. Real clocks grow by a few blocks per request.
MAX_CLOCK = 2**62
_MAX_HEADER_BYTES = 16 * 2**20


def _member(
    archive: zipfile.ZipFile, name: str, dtype: Any, shape: tuple[int, ...] | None, most: int
) -> np.ndarray:
    """Member ``name``.npy, only if its header says ``dtype`` and ``shape`` (or, without
    one, a single dimension of at most ``most`` elements), checked before anything is
    allocated: a header may claim any shape. Members are stored, not compressed (the only
    kind ``decode`` opens), so a read is bounded by the input's own size."""
    with archive.open(f"{name}.npy") as member:
        version = np.lib.format.read_magic(member)
        read_header = (
            np.lib.format.read_array_header_1_0
            if version == (1, 0)
            else np.lib.format.read_array_header_2_0
        )
        found_shape, fortran, found_dtype = read_header(member)
        found_shape = tuple(found_shape)
        wanted = shape if shape is not None else found_shape
        if (
            found_shape != wanted
            or len(found_shape) != (len(shape) if shape is not None else 1)
            or (shape is None and not 0 <= found_shape[0] <= most)
            or fortran
            or found_dtype != np.dtype(dtype)
        ):
            raise ValueError(f"{name} is {found_shape} {found_dtype}, not {shape} {dtype}")
        size = int(np.prod(found_shape)) * np.dtype(dtype).itemsize
        if size > most * np.dtype(dtype).itemsize:
            raise ValueError(f"{name} is larger than the limit")
        raw = member.read(size + 1)
    if len(raw) != size:
        raise ValueError(f"{name} is not as long as its header says")
    return np.frombuffer(raw, dtype=dtype).reshape(found_shape)


def decode(data: bytes, limit: int = MAX_SNAPSHOT_BYTES) -> IndexSnapshot:
    """A snapshot, checked; ValueError for anything else (garbled, cut, encrypted or
    compressed members, another version, arrays not the shape their capacity gives, more
    than ``limit`` bytes in all, figures out of range): a file or a peer's answer is input,
    and whatever it holds the router starts (empty, if it must)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            infos = archive.infolist()
            if sum(info.file_size for info in infos) > limit:
                raise ValueError(f"unpacks to more than {limit} bytes")
            for info in infos:
                # np.savez stores; a compressed member could unpack to far more than it says.
                if info.flag_bits & 0x1 or info.compress_type != zipfile.ZIP_STORED:
                    raise ValueError(f"{info.filename} is encrypted or compressed")
            header_bytes = _member(archive, "header", np.uint8, None, _MAX_HEADER_BYTES).tobytes()
            header: Any = orjson.loads(header_bytes)
            if not isinstance(header, dict) or header.get("version") != VERSION:
                raise ValueError("not a version-1 snapshot")
            scheme, created, clock = header["scheme"], header["created"], header["clock"]
            router = header.get("router", "")
            if not (
                isinstance(scheme, str)
                and isinstance(router, str)
                and isinstance(created, int | float)
                and math.isfinite(created)
                and isinstance(clock, int)
                and 1 <= clock < MAX_CLOCK
            ):
                raise ValueError("scheme, created or clock is wrong")
            regions: dict[str, RegionCopy] = {}
            servers: dict[str, dict[str, float | None]] = {}
            for n, entry in enumerate(header["endpoints"]):
                address, capacity = entry["address"], entry["capacity"]
                if not isinstance(address, str) or not isinstance(capacity, int) or capacity < 1:
                    raise ValueError("an endpoint's address or capacity is wrong")
                shape = (_buckets_for(capacity), WAYS)
                slots = shape[0] * WAYS
                if slots * 12 > limit:
                    raise ValueError(f"{address}: a capacity of {capacity} is over the limit")
                fingerprints = _member(archive, f"fingerprints_{n}", np.uint32, shape, slots)
                stamps = _member(archive, f"stamps_{n}", np.uint64, shape, slots)
                if stamps.size and int(stamps.max()) >= clock:
                    raise ValueError(f"{address}: a stamp is not below the clock")
                turnover = [entry["stamps_seen"], entry["new_seen"]]
                if not all(
                    isinstance(v, int | float) and math.isfinite(v) and v >= 0 for v in turnover
                ):
                    raise ValueError(f"{address}: its turnover figures are wrong")
                regions[address] = RegionCopy(
                    capacity, fingerprints, stamps, float(turnover[0]), float(turnover[1])
                )
                server = entry.get("server")
                if server is not None:
                    values = {name: server.get(name) for name in _SERVER_FIELDS}
                    if not all(
                        v is None or (isinstance(v, int | float) and math.isfinite(v))
                        for v in values.values()
                    ):
                        raise ValueError(f"{address}: its server's figures are wrong")
                    servers[address] = {
                        name: None if v is None else float(v) for name, v in values.items()
                    }
    except Exception as exc:  # (MemoryError, zlib.error, NotImplementedError, ... too)
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


def write_file(path: str, snapshot: IndexSnapshot) -> None:
    """Write whole or not at all (a temporary file renamed over it): a reader never finds
    half a snapshot. Saved straight to the file, not held encoded in memory first."""
    target = Path(path)
    handle, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    try:
        with os.fdopen(handle, "wb") as out:
            _save(snapshot, out)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def remove_leftovers(path: str) -> int:
    """Temporary files a write killed midway left beside ``path`` (SIGKILL, an OOM kill):
    removed at start, so that they do not fill the volume. Returns how many."""
    target = Path(path)
    removed = 0
    for leftover in target.parent.glob(f".{target.name}.*"):
        with contextlib.suppress(OSError):
            leftover.unlink()
            removed += 1
    if removed:
        log.info("warm start: removed %d unfinished snapshot file(s) beside %s", removed, path)
    return removed


def read_file(path: str, scheme: str, max_age_seconds: float) -> IndexSnapshot | None:
    """The snapshot in ``path`` if it is one this router can use, else None (logged why)."""
    try:
        size = Path(path).stat().st_size
        if size > MAX_SNAPSHOT_BYTES:
            log.warning("warm start: %s is %d bytes, over the limit; starting empty", path, size)
            return None
        data = Path(path).read_bytes()
    except FileNotFoundError:
        log.info("warm start: no index snapshot at %s yet; starting empty", path)
        return None
    except Exception as exc:  # (a directory, no permission, out of memory: it starts empty)
        log.warning("warm start: cannot read %s (%s); starting empty", path, exc)
        return None
    return _usable(data, f"file {path}", scheme, max_age_seconds)


def _usable(
    data: bytes, source: str, scheme: str, max_age_seconds: float, limit: int = MAX_SNAPSHOT_BYTES
) -> IndexSnapshot | None:
    try:
        snapshot = decode(data, limit)
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


def usable_answer(
    data: bytes, source: str, scheme: str, limit: int = MAX_SNAPSHOT_BYTES
) -> IndexSnapshot | None:
    """A peer's answer (``GET /peer/index``), taken whatever its age (it was made just
    now), unpacking to at most ``limit`` bytes."""
    return _usable(data, source, scheme, float("inf"), limit)


class Handover:
    """A snapshot going into a router's index, endpoint by endpoint (the module docstring).

    ``reads_metrics``: each endpoint's region waits for this router's next metrics reading
    of it (``endpoint_read``), and goes in only if that reading and the snapshot's tell the
    same server (a server whose metrics tell no restarts — neither a start time nor
    counters — is not taken); without metrics, regions go in as soon as their endpoint is a
    member (``apply_members``), with only ``max_age_seconds`` against a restart. A region
    whose endpoint is not a member, not ready, or not yet sized waits; one of another KV
    capacity is dropped; whatever waits is dropped after APPLY_WITHIN_SECONDS."""

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
        try:
            router.index.make_room_below(snapshot.clock)  # (its own stays newer)
        except Exception:  # (a clock that would wrap: nothing is taken, the router routes on)
            log.exception("warm start: %s's index cannot be taken", source)
            self.skipped = dict.fromkeys(self._pending, "failed")
            self._pending.clear()
            return
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
                self.skipped[address] = "not taken in time"
            log.info(
                "warm start: %d endpoint(s) of %s's index could not be taken in %.0f s: %s",
                len(self._pending),
                self.source,
                APPLY_WITHIN_SECONDS,
                ", ".join(sorted(self._pending)),
            )
            self._pending.clear()

    def apply_members(self) -> None:
        for address in list(self._pending):
            self._apply(address)

    def endpoint_read(self, address: str, reading: EndpointSignals) -> None:
        """This router's metrics reading of ``address`` (after Router.observe_signals)."""
        self.expire()
        if address not in self._pending or not reading.up:
            return
        server = self._servers.get(address)
        then = None if server is None else EndpointSignals(**server)
        if then is None or not (then.tells_restarts and reading.tells_restarts):
            self._drop(address, "its server cannot be told from a restarted one")
            return
        if restarted_between(then, reading):
            self._drop(address, "its server restarted since")
            return
        self._apply(address)

    def _drop(self, address: str, why: str) -> None:
        del self._pending[address]
        self.skipped[address] = why
        log.info("warm start: %s's part of %s's index not taken: %s", address, self.source, why)

    def _apply(self, address: str) -> None:
        copy = self._pending[address]
        try:
            refusal = self.router.handover_refusal(address, copy)
            if refusal == "another KV capacity":
                self._drop(address, refusal)
                return
            if refusal is not None:
                return  # (it may pass: tried again at its next reading, until expired)
            self.applied[address] = self.router.index.adopt_region(address, copy)
        except Exception:  # (never the router's end: it routes on without this region)
            log.exception("warm start: %s's region could not be taken", address)
            self.skipped[address] = "failed"
        del self._pending[address]
        if self.done:
            log.info(
                "warm start: %s's index taken for %d endpoint(s) (%d blocks)",
                self.source,
                len(self.applied),
                sum(self.applied.values()),
            )
