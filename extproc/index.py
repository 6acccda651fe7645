"""Which endpoint probably holds which prefix blocks, in a fixed budget of memory.

Every endpoint owns a region of one table of 8-way buckets; a slot holds a 32-bit
fingerprint of a block's prefix hash and a 64-bit stamp of when it was last touched.
A block of endpoint e lives in bucket ``offset_e + low32(hash) x buckets_e / 2^32``; a new block
replaces the least recently touched slot of its bucket. An endpoint gets one slot per block
of capacity (rounded down to whole buckets), so the index costs 12 bytes per block of
capacity, allocated up front (64 endpoints x 100k blocks: 77 MB), where a dict-based LRU
costs ~140.

The price is approximation, in the same direction as the index already errs (it is a guess
at the endpoint's real cache): eviction is least-recently-used within a bucket, not across
the endpoint, so a chain can lose a middle block before its tail, and two blocks whose
fingerprints (32 bits) and buckets agree are confused. A match therefore bridges short
holes and ends at GAP missing blocks in a row, more in a long chain (gap_for; see
match_positions), found with a galloping search done for all endpoints at once, so a
decision costs a fixed number of numpy operations whatever the endpoint count.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

WAYS = 8
# WAYS booleans read as one integer: nonzero = any way matched.
_ANY = {4: np.uint32, 8: np.uint64}[WAYS]
_LOW32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)
# Up to this many (endpoint, block) pairs a lookup checks every block (a few numpy
# operations); beyond it, a galloping search (more operations, fewer pairs).
_DIRECT_PAIRS = 4096
# Missing blocks in a row that end a match (fewer are this index's own holes: match_positions).
GAP = 4
# A longer chain ends its match at a longer run: GAP, or one block in GAP_SPAN of the chain,
# but never more than GAP_CAP.
GAP_SPAN = 64
GAP_CAP = 16


def gap_for(count: int) -> int:
    """Missing blocks in a row that end the match of a chain of ``count`` blocks.

    A chain the endpoint still holds loses scattered blocks in busy buckets; the longer the
    chain, the likelier a run of GAP of them somewhere. A 16,000-token system prompt is
    1,000 blocks of 64 bytes: with its endpoint's cache near full the index read 5 to 79
    of them while the replica held all (simulated llm-d tiered shape, 4 replicas), and
    the router moved its group to a cold replica. Chains under 5 x GAP_SPAN blocks (5,120
    tokens at 64-byte blocks), the lengths GAP = 4 was measured on, keep it. Past
    GAP_CAP x GAP_SPAN blocks the run stays GAP_CAP: on the Mooncake trace's prompts of up
    to 12,000 blocks an uncapped run (187) read so far past what a replica's pool (shared
    with its running requests) still held that groups stuck to overloaded holders (4
    replicas x 1M tokens: p99 31 s against 8.4 s capped at 16; docs/benchmarks.md, item 28)."""
    return max(GAP, min(count // GAP_SPAN, GAP_CAP))


@dataclass(frozen=True, slots=True)
class IndexStats:
    endpoints: int
    entries: int
    capacity: int
    approx_bytes: int


# An endpoint's turnover (PrefixIndex.stamps_per_new_block): decaying sums over about this
# many of its latest records.
TURNOVER_RECORDS = 1024


@dataclass(slots=True)
class _Region:
    offset: int  # first bucket
    buckets: int
    capacity: int  # blocks, as configured
    # Turnover: stamps passed and blocks new to this region, decaying sums, and the
    # stamp of its latest record.
    stamps_seen: float = 0.0
    new_seen: float = 0.0
    last_stamp: int = 0


@dataclass(frozen=True, slots=True)
class RegionCopy:
    """One endpoint's slots as another index held them (PrefixIndex.export_region)."""

    capacity: int  # blocks
    fingerprints: np.ndarray  # (buckets, WAYS) uint32, 0 = empty
    stamps: np.ndarray  # (buckets, WAYS) uint64, on the other index's clock
    stamps_seen: float = 0.0  # its turnover sums (_Region)
    new_seen: float = 0.0


def split_hashes(hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(fingerprints, bucket keys): the high 32 bits (never 0, which marks an empty slot)
    and the low 32 bits of each 64-bit block hash."""
    fingerprints = (hashes >> _SHIFT32).astype(np.uint32) | np.uint32(1)
    return fingerprints, hashes & _LOW32


def _gap_starts(missing: np.ndarray, gap: int, room: np.ndarray | None = None) -> np.ndarray:
    """Whether ``gap`` missing blocks in a row start at each block (rows of ``missing``).
    Past the end of a row, or of ``room`` blocks from an element, counts as missing.
    A missing block starts one when the next held block is at least ``gap`` (or ``room``)
    blocks on: a few array passes whatever the gap."""
    width = missing.shape[-1]
    blocks = np.arange(width)
    where_held = np.where(missing, width + gap, blocks)
    next_held = np.minimum.accumulate(where_held[..., ::-1], axis=-1)[..., ::-1]
    distance = next_held - blocks
    limit = gap if room is None else np.minimum(gap, room)
    return missing & (distance >= limit)


def _bucket_rows(offsets: np.ndarray, sizes: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """The bucket (table row) of each block key in its endpoint's region (arrays broadcast):
    offset + key x buckets / 2^32, a multiply instead of a (slow) 64-bit modulo."""
    return (offsets + ((keys * sizes) >> _SHIFT32)).astype(np.intp)


@lru_cache(maxsize=64)
def _probes(count: int) -> np.ndarray:
    """Galloping probe positions for a request of ``count`` blocks: 0, 1, 3, 7, ..., last."""
    return np.unique(np.minimum(2 ** np.arange(count.bit_length() + 1) - 1, count - 1))


def _buckets_for(capacity: int) -> int:
    """Never more slots than blocks of capacity (but at least one bucket)."""
    return max(1, capacity // WAYS)


class PrefixIndex:
    """Per-endpoint regions of one fingerprint table. Endpoints are known by address and by
    position (their order in ``set_endpoints``, which the router keeps for its own arrays)."""

    def __init__(self) -> None:
        self._regions: dict[str, _Region] = {}
        self._by_position: list[_Region] = []
        self._positions: dict[str, int] = {}
        self._offsets = np.zeros(0, dtype=np.uint64)
        self._sizes = np.zeros(0, dtype=np.uint64)
        self._entries = np.zeros(0, dtype=np.int64)  # slots in use, per position
        self._fingerprints = np.zeros((0, WAYS), dtype=np.uint32)
        self._stamps = np.zeros((0, WAYS), dtype=np.uint64)
        self._clock = 1  # stamp 0 marks a never-used slot
        self._split_of: object = None
        self._split_value = (np.zeros(0, dtype=np.uint32), np.zeros(0, dtype=np.uint64))

    # -- membership -----------------------------------------------------------------------
    def set_endpoints(self, capacities: dict[str, int]) -> None:
        """Add new endpoints, drop removed ones; an endpoint whose capacity changed starts
        empty (a fingerprint cannot be moved to a differently sized region)."""
        if [(a, r.capacity) for a, r in self._regions.items()] == list(capacities.items()):
            return
        for address, capacity in capacities.items():
            if capacity < 1:
                raise ValueError(f"capacity of {address} must be >= 1 block")
        regions: dict[str, _Region] = {}
        offset = 0
        for address, capacity in capacities.items():
            buckets = _buckets_for(capacity)
            # (turnover counted from now: an endpoint added later has no stamps before)
            regions[address] = _Region(offset, buckets, capacity, last_stamp=self._clock - 1)
            offset += buckets
        fingerprints = np.zeros((offset, WAYS), dtype=np.uint32)
        stamps = np.zeros((offset, WAYS), dtype=np.uint64)
        entries = np.zeros(len(regions), dtype=np.int64)
        for position, (address, new) in enumerate(regions.items()):
            old = self._regions.get(address)
            if old is not None and old.capacity == new.capacity:
                new.stamps_seen, new.new_seen = old.stamps_seen, old.new_seen
                new.last_stamp = old.last_stamp
                source = slice(old.offset, old.offset + old.buckets)
                target = slice(new.offset, new.offset + new.buckets)
                fingerprints[target] = self._fingerprints[source]
                stamps[target] = self._stamps[source]
                entries[position] = self._entries[self._positions[address]]
        self._regions = regions
        self._by_position = list(regions.values())
        self._positions = {a: i for i, a in enumerate(regions)}
        self._offsets = np.array([r.offset for r in regions.values()], dtype=np.uint64)
        self._sizes = np.array([r.buckets for r in regions.values()], dtype=np.uint64)
        self._entries = entries
        self._fingerprints, self._stamps = fingerprints, stamps

    def forget(self, address: str) -> None:
        """Drop everything known about one endpoint (it died or was restarted)."""
        region = self._regions.get(address)
        if region is not None:
            rows = slice(region.offset, region.offset + region.buckets)
            self._fingerprints[rows] = 0
            self._stamps[rows] = 0
            self._entries[self._positions[address]] = 0

    def fill_positions(self, positions: np.ndarray) -> np.ndarray:
        """Share of each endpoint's slots in use (0 to 1), by position: how much a new copy
        there would evict. Slots are emptied only by ``forget`` and ``remove_position`` (an
        endpoint's own eviction reports); otherwise this only rises."""
        return self._entries[positions] / (self._sizes[positions] * WAYS)

    def capacity(self, address: str) -> int | None:
        region = self._regions.get(address)
        return None if region is None else region.capacity

    # -- lookups --------------------------------------------------------------------------
    def _held(
        self, offsets: np.ndarray, sizes: np.ndarray, fingerprints: np.ndarray, keys: np.ndarray
    ) -> np.ndarray:
        """Whether each (endpoint region, block) pair is in the table (arrays broadcast)."""
        slots = np.take(self._fingerprints, _bucket_rows(offsets, sizes, keys), axis=0)
        equal = slots == fingerprints[..., None]
        return equal.view(_ANY)[..., 0] != 0  # any of the ways (WAYS bools = one integer)

    def match_positions(self, hashes: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Matched prefix length (blocks) of each endpoint at ``positions`` (int64 array):
        the blocks before the first gap_for(len(hashes)) consecutive missing ones.

        Bucket-local eviction drops scattered blocks of a chain the endpoint still holds (a
        busy bucket), and keeps scattered blocks of a chain the endpoint evicted long ago (a
        quiet bucket). A model server evicts chains from the tail, so a short hole is this
        index's error and is bridged, while a run of missing blocks ends the match (GAP,
        or longer in a long chain: gap_for).
        Stopping at the first hole under-reads what the endpoint holds and costs hits;
        running to the last held block over-reads it and costs tail latency (GAP = 4 was the
        best of 1, 2, 3, 4 and "last held" in the simulator, docs/benchmarks.md).
        Beyond ``_DIRECT_PAIRS`` (endpoint, block) pairs it gallops: probes at blocks
        0, 1, 3, 7, ... for every endpoint at once; a missing probe p starts a gap when
        blocks p .. p+gap-1 are all missing; then every block between an endpoint's last
        probe before its first gap and that gap is checked.
        """
        count, endpoints = len(hashes), len(positions)
        if not count or not endpoints:
            return np.zeros(endpoints, dtype=np.int64)
        gap_blocks = gap_for(count)
        fingerprints, keys = self._split(hashes)
        offsets = self._offsets[positions][:, None]
        sizes = self._sizes[positions][:, None]
        if count * endpoints <= _DIRECT_PAIRS:
            gaps = _gap_starts(~self._held(offsets, sizes, fingerprints, keys), gap_blocks)
            return np.where(gaps.any(axis=1), gaps.argmax(axis=1), count)
        probes = _probes(count)
        width = len(probes)
        held = self._held(offsets, sizes, fingerprints[probes][None, :], keys[probes][None, :])
        # The first probe that starts a gap: a missing probe p is one when blocks
        # p+1 .. p+gap-1 are missing too; else it is a short hole, bridged, and the next
        # missing probe is checked (rarely more than one round).
        first_gap = np.full(endpoints, width)
        pending = np.arange(endpoints)
        after = np.zeros(endpoints, dtype=np.int64)  # probes before this one were bridged
        columns = np.arange(width)
        while len(pending):
            missing = ~held[pending] & (columns >= after[pending, None])
            has_missing = missing.any(axis=1)
            pending, probe = pending[has_missing], missing[has_missing].argmax(axis=1)
            if not len(pending):
                break
            window = probes[probe][:, None] + np.arange(1, gap_blocks)  # the blocks after the probe
            inside = window < count
            window_held = self._held(
                offsets[pending],
                sizes[pending],
                fingerprints[np.minimum(window, count - 1)],
                keys[np.minimum(window, count - 1)],
            )
            gap = ~(window_held & inside).any(axis=1)
            first_gap[pending[gap]] = probe[gap]
            after[pending[~gap]] = probe[~gap] + 1
            pending = pending[~gap]
        matched = np.where(first_gap == width, count, 0)
        partial = np.flatnonzero((first_gap > 0) & (first_gap < width))
        if not len(partial):
            return matched
        # Every block from the last probe without a gap to the end of the first gap.
        first = probes[first_gap[partial] - 1]
        spans = np.minimum(probes[first_gap[partial]] + gap_blocks, count) - first
        owners = np.repeat(partial, spans)
        starts = np.cumsum(spans) - spans
        blocks = np.arange(int(spans.sum())) + np.repeat(first - starts, spans)
        missing = ~self._held(
            offsets[owners, 0], sizes[owners, 0], fingerprints[blocks], keys[blocks]
        )
        room = np.repeat(starts + spans, spans) - np.arange(len(blocks))  # blocks left in span
        gaps = np.where(_gap_starts(missing[None, :], gap_blocks, room)[0], blocks, count)
        matched[partial] = np.minimum.reduceat(gaps, starts)
        return matched

    def _split(self, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """split_hashes, remembered for the last array: a decision matches and then records
        the same hashes."""
        if hashes is not self._split_of:
            self._split_of = hashes
            self._split_value = split_hashes(np.asarray(hashes, dtype=np.uint64))
        return self._split_value

    def match(self, hashes: np.ndarray, addresses: Iterable[str]) -> dict[str, int]:
        """Matched prefix length (blocks) per endpoint, only for endpoints matching >= 1."""
        names = [a for a in addresses if a in self._regions]
        positions = np.array([self._positions[a] for a in names], dtype=np.intp)
        matched = self.match_positions(hashes, positions)
        return {a: m for a, m in zip(names, matched.tolist(), strict=True) if m}

    # -- updates --------------------------------------------------------------------------
    def record(self, address: str, hashes: np.ndarray) -> None:
        position = self._positions.get(address)
        if position is not None:
            self._record(position, hashes)

    def record_position(self, position: int, hashes: np.ndarray, age: int = 0) -> None:
        self._record(position, hashes, age)

    def stamps_per_new_block(self, position: int) -> float:
        """Stamps (blocks recorded anywhere, held or new, one apart per record) that pass
        while one block new to this endpoint is recorded there, lately: an age in new
        blocks x this is an age in stamps (``record_position``'s ``age``)."""
        region = self._by_position[position]
        return region.stamps_seen / max(1.0, region.new_seen)

    def _record(self, position: int, hashes: np.ndarray, age: int = 0) -> None:
        """The endpoint now holds these blocks: refresh the held ones, insert the rest.

        Stamps are touch order, earlier blocks of a request newer than later ones (an LRU
        then drops a chain's tail first, as vLLM does). A new block takes an empty slot or
        the least recently touched one in its bucket, never one this request touched.
        ``age`` (stamps): the blocks are entered as if touched that long ago, so that they
        are evicted that much sooner (Router: a copy only this router refreshes); a held
        block keeps its stamp if that is newer.
        """
        count = len(hashes)
        if not count:
            return
        region = self._by_position[position]
        base = self._clock
        self._clock += count + 1
        # Stamps are unsigned and 0 marks an empty slot: an age reaches back to stamp 1.
        back = np.uint64(min(age, base - 1))
        fingerprints, keys = self._split(hashes)
        order = np.arange(base + count, base, -1, dtype=np.uint64)  # block 0 newest
        rows = _bucket_rows(np.uint64(region.offset), np.uint64(region.buckets), keys)
        stamps = self._stamps.reshape(-1)  # a view
        hit = np.take(self._fingerprints, rows, axis=0) == fingerprints[:, None]
        # (block, way) of every hit: one flat pass (2-D np.nonzero took ~6x as long).
        hit_slots = np.flatnonzero(hit)
        hit_blocks = hit_slots // WAYS
        held = rows[hit_blocks] * WAYS + hit_slots % WAYS
        before = stamps[held] if back else None
        stamps[held] = order[hit_blocks]
        pending = np.flatnonzero(hit.view(_ANY)[:, 0] == 0)
        keep = 1.0 - 1.0 / TURNOVER_RECORDS
        region.stamps_seen = keep * region.stamps_seen + (base - region.last_stamp)
        region.new_seen = keep * region.new_seen + len(pending)
        region.last_stamp = base
        entered = self._insert(position, rows, fingerprints, order, pending, base)
        if back:  # after the insertion, which keeps to slots this request did not touch
            stamps[entered] -= back
            # An aged refresh never makes a block older than it was (another request,
            # not aged, may have touched it lately).
            stamps[held] = np.maximum(before, order[hit_blocks] - back)

    def _insert(
        self,
        position: int,
        rows: np.ndarray,
        fingerprints: np.ndarray,
        order: np.ndarray,
        pending: np.ndarray,
        base: int,
    ) -> np.ndarray:
        """Enter a request's blocks not held (``pending``) in their buckets (``_record``);
        returns the slots they took."""
        if not len(pending):
            return pending
        table, stamps = self._fingerprints.reshape(-1), self._stamps.reshape(-1)  # views
        # In each bucket, its k-th new block (earliest first, so a chain keeps its head when
        # a bucket overflows) takes the bucket's k-th least recently touched slot, unless
        # this request touched that slot (stamp above base): then it and the later ones of
        # the bucket are dropped. All buckets in a fixed number of array passes, with the
        # slots a block-by-block insertion gives (tests/test_index.py); one round per block
        # of the fullest bucket made recording a 512 KiB prompt ~1.6x as slow (docs/benchmarks.md).
        by_bucket = np.argsort(rows[pending], kind="stable")
        pending = pending[by_bucket]
        pending_rows = rows[pending]
        at = np.arange(len(pending))
        starts = np.zeros(len(pending), dtype=np.intp)  # where each block's bucket begins
        starts[1:] = np.where(pending_rows[1:] != pending_rows[:-1], at[1:], 0)
        rank = at - np.maximum.accumulate(starts)
        within = rank < WAYS
        pending, pending_rows, rank = pending[within], pending_rows[within], rank[within]
        ages = np.take(self._stamps, pending_rows, axis=0)
        ways = ages.argmin(axis=1)  # a bucket's first new block (most are the only one)
        later = np.flatnonzero(rank)
        if len(later):
            ranked = np.argsort(ages[later], axis=1, kind="stable")  # ties: lowest way first
            ways[later] = ranked[np.arange(len(later)), rank[later]]
        free = ages[np.arange(len(ways)), ways] <= np.uint64(base)
        now, slots = pending[free], pending_rows[free] * WAYS + ways[free]
        self._entries[position] += int(np.count_nonzero(table[slots] == 0))
        table[slots] = fingerprints[now]
        stamps[slots] = order[now]
        return slots

    def remove_position(self, position: int, hashes: np.ndarray) -> int:
        """The endpoint no longer holds these blocks (its own report: a KV-cache event):
        empty their slots. Returns how many slots were emptied. A block whose fingerprint
        and bucket another block shares takes that one too, as a lookup confuses them."""
        if not len(hashes):
            return 0
        region = self._by_position[position]
        fingerprints, keys = split_hashes(np.asarray(hashes, dtype=np.uint64))
        rows = _bucket_rows(np.uint64(region.offset), np.uint64(region.buckets), keys)
        hit = np.take(self._fingerprints, rows, axis=0) == fingerprints[:, None]
        hit_slots = np.flatnonzero(hit)
        flat = np.unique(rows[hit_slots // WAYS] * WAYS + hit_slots % WAYS)
        self._fingerprints.reshape(-1)[flat] = 0
        self._stamps.reshape(-1)[flat] = 0
        self._entries[position] -= len(flat)
        return len(flat)

    # -- handover (warm_start.py) ----------------------------------------------------------
    @property
    def clock(self) -> int:
        """The stamp the next record starts from: every stamp in the table is below it."""
        return self._clock

    def export_region(self, address: str) -> RegionCopy | None:
        """A copy of one endpoint's region, for a router that starts after this one."""
        region = self._regions.get(address)
        if region is None:
            return None
        rows = slice(region.offset, region.offset + region.buckets)
        return RegionCopy(
            capacity=region.capacity,
            fingerprints=self._fingerprints[rows].copy(),
            stamps=self._stamps[rows].copy(),
            stamps_seen=region.stamps_seen,
            new_seen=region.new_seen,
        )

    def make_room_below(self, stamps: int) -> None:
        """Move every stamp of this index up by ``stamps``, so that a region copied from an
        index whose clock was at most that many reads as older than anything this one
        recorded (``adopt_region``): what a router saw itself is newer than what it was
        handed. Differences between its own stamps, which turnover is measured by, stay."""
        if stamps <= 0:
            return
        if self._clock + stamps >= 2**63:
            raise OverflowError(f"an index clock of {self._clock + stamps} would wrap")
        shift = np.uint64(stamps)
        used = self._stamps != 0
        self._stamps[used] += shift
        self._clock += stamps
        for region in self._by_position:
            region.last_stamp += stamps

    def adopt_region(self, address: str, copy: RegionCopy) -> int:
        """Merge a region copied from another index (``export_region``, of the same
        capacity) into this endpoint's: per bucket the newest WAYS slots of both, its own
        first where a block is in both. Call ``make_room_below(the other clock)`` first, once
        per copy handed over, so that the copied stamps read as older than this index's
        own. Returns the slots taken; 0 for an endpoint not here or of another capacity
        (a fingerprint cannot be moved to a differently sized region)."""
        region = self._regions.get(address)
        if region is None or region.capacity != copy.capacity:
            return 0
        if copy.fingerprints.shape != (region.buckets, WAYS) or copy.stamps.shape != (
            region.buckets,
            WAYS,
        ):
            return 0
        position = self._positions[address]
        rows = slice(region.offset, region.offset + region.buckets)
        own_fingerprints, own_stamps = self._fingerprints[rows], self._stamps[rows]
        fingerprints = copy.fingerprints.astype(np.uint32, copy=False)
        stamps = np.where(fingerprints != 0, copy.stamps.astype(np.uint64, copy=False), 0)
        stamps = np.minimum(stamps, np.uint64(max(1, self._clock - 1)))  # (never the future)
        # A copied block this index holds already keeps its own slot and stamp.
        duplicate = (fingerprints[:, :, None] == own_fingerprints[:, None, :]).any(axis=2)
        stamps = np.where(duplicate, 0, stamps)
        fingerprints = np.where(stamps != 0, fingerprints, 0)
        both_fingerprints = np.concatenate([own_fingerprints, fingerprints], axis=1)
        both_stamps = np.concatenate([own_stamps, stamps], axis=1)
        newest = np.argsort(both_stamps, axis=1, kind="stable")[:, ::-1][:, :WAYS]
        merged_stamps = np.take_along_axis(both_stamps, newest, axis=1)
        merged = np.where(
            merged_stamps != 0, np.take_along_axis(both_fingerprints, newest, axis=1), 0
        )
        before = int(np.count_nonzero(own_fingerprints))
        self._fingerprints[rows] = merged
        self._stamps[rows] = np.where(merged != 0, merged_stamps, 0)
        after = int(np.count_nonzero(merged))
        self._entries[position] += after - before
        if region.new_seen == 0:  # (nothing recorded here yet: the other's turnover holds)
            region.stamps_seen, region.new_seen = copy.stamps_seen, copy.new_seen
        return after - before

    # -- reporting ------------------------------------------------------------------------
    def entries_by_endpoint(self) -> dict[str, int]:
        return {address: int(self._entries[i]) for address, i in self._positions.items()}

    def stats(self) -> IndexStats:
        return IndexStats(
            endpoints=len(self._regions),
            entries=int(self._entries.sum()),
            capacity=sum(r.capacity for r in self._regions.values()),
            approx_bytes=self._fingerprints.nbytes + self._stamps.nbytes,
        )


class Journal:
    """One endpoint's index updates, in order, up to ``limit`` blocks and ``MAX_UPDATES``
    updates (the oldest dropped first), kept while its region's size is provisional. A
    resized region starts empty (a fingerprint cannot be moved to a differently sized
    one), so the updates are replayed into it: a router that placed requests on new
    endpoints before their first scrape told their KV size lost those placements, and
    the next turns of those conversations matched nothing (a fresh-clone run of the
    Kubernetes readiness test lost 3 of them). It ends with the endpoint's first readable
    scrape, however late (a server loading its model for minutes); the limits bound what it
    holds and what a replay costs."""

    MAX_UPDATES = 1024  # (a replay costs ~10-40 us an update, on the event loop)

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._updates: deque[tuple[bool, np.ndarray]] = deque()
        self._blocks = 0

    def add(self, stored: bool, hashes: np.ndarray) -> None:
        """Blocks stored (recorded) or evicted (removed) at the endpoint."""
        if not len(hashes):
            return
        self._updates.append((stored, hashes))
        self._blocks += len(hashes)
        while len(self._updates) > 1 and (
            self._blocks > self.limit or len(self._updates) > self.MAX_UPDATES
        ):
            self._blocks -= len(self._updates.popleft()[1])

    def clear(self) -> None:
        self._updates.clear()
        self._blocks = 0

    def replay(self, index: PrefixIndex, position: int) -> None:
        for stored, hashes in self._updates:
            if stored:
                index.record_position(position, hashes)
            else:
                index.remove_position(position, hashes)
