"""A chunk-level LRU over chained block ids: the one cache model behind every simulated index.

Workloads describe a prompt as chained chunk ids (a Mooncake hash id covers 512 tokens, a
generated chunk 16): equal id at position i means an equal prefix up to i, so matching and
eviction can run per chunk instead of per 16-token KV block, which keeps a 15k-token request
at ~30 dictionary operations. Each entry remembers how many *units* (tokens, KV blocks,
characters...) of its chunk are held, because the last chunk of a prompt may be partial.
Chunks are touched last-to-first, so eviction takes chains from their tail (as vLLM does)
and the held set stays prefix-closed.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence


def _tail_first(ids: Sequence[int], full: int, last: int) -> Iterator[tuple[int, int]]:
    """(chunk, units it needs), last chunk first: both caches touch chains in that order so
    that eviction takes them from the tail."""
    final = len(ids) - 1
    for i in range(final, -1, -1):
        yield ids[i], last if i == final else full


class _HeldChunks:
    """Chunk id → held units, and the longest held prefix of a chain: what both caches share."""

    __slots__ = ("_held", "capacity", "used")

    def __init__(self, capacity: float, held: dict[int, int]) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be > 0")
        self.capacity = capacity
        self.used = 0
        self._held = held

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, chunk: int) -> bool:
        return chunk in self._held

    def match(self, ids: Sequence[int], full: int, last: int) -> int:
        """Units of the longest held prefix; ``full`` units per chunk, ``last`` for the last."""
        held = self._held
        final = len(ids) - 1
        total = 0
        for i, chunk in enumerate(ids):
            have = held.get(chunk)
            if have is None:
                break
            need = last if i == final else full
            if have < need:
                return total + have
            total += need
        return total


class ChunkLRU(_HeldChunks):
    """Bounded LRU of chunk id → held units; ``used`` is the sum of held units."""

    __slots__ = ()
    _held: OrderedDict[int, int]

    def __init__(self, capacity: float = math.inf) -> None:
        super().__init__(capacity, OrderedDict())

    def touch(self, ids: Sequence[int], full: int, last: int) -> None:
        """Insert or refresh the chunks (last to first), then evict down to capacity."""
        held = self._held
        move = held.move_to_end
        for chunk, need in _tail_first(ids, full, last):
            have = held.get(chunk)
            if have is None:
                held[chunk] = need
                self.used += need
            else:
                if have < need:
                    held[chunk] = need
                    self.used += need - have
                move(chunk)
        while self.used > self.capacity and held:
            _, units = held.popitem(last=False)
            self.used -= units


class KVPool(_HeldChunks):
    """vLLM's one KV block pool: what a model server really holds, as the replicas use it.

    A running request pins the chunks of its prompt; a chunk two running requests share is
    held once (vLLM's block reference counts). ``private`` units of a request (its output
    and the partial last block, which nobody else can reuse) are pinned beside them. When the
    last request using a chunk finishes, the chunk stays in the pool as prefix cache and joins
    the free queue, tail chunks first (vLLM frees a sequence's blocks in reverse), so eviction
    takes chains from their tail; a cached chunk that a new request pins leaves the queue.
    Only free chunks are evicted, and only when the pool is over capacity. ``pinned`` is what
    vLLM exports as KV-cache usage; ``used`` adds the free cached chunks.
    """

    __slots__ = ("_free", "_refs", "events", "pinned")

    def __init__(self, capacity: float) -> None:
        super().__init__(capacity, {})  # chunk -> units held, pinned or free
        self.pinned = 0
        # What vLLM's KV-cache events would report, when someone listens (None: nobody):
        # (stored, chunk, units held), in order; a hit announces nothing, as in vLLM.
        self.events: list[tuple[bool, int, int]] | None = None
        self._refs: dict[int, int] = {}  # chunk -> running requests using it (> 0 only)
        self._free: OrderedDict[int, None] = OrderedDict()  # unpinned chunks, evicted first

    def pin_cost(self, ids: Sequence[int], full: int, last: int, private: int) -> int:
        """Units ``pin`` would add to ``pinned``: what admitting the request takes from the
        pool that running requests do not already hold."""
        held, refs = self._held, self._refs
        extra = private
        for chunk, need in _tail_first(ids, full, last):
            have = held.get(chunk, 0)
            extra += max(0, need - have) if chunk in refs else max(have, need)
        return extra

    def pin(self, ids: Sequence[int], full: int, last: int, private: int) -> None:
        """A request starts: hold its chunks (adding the missing ones) and its private units,
        then evict free chunks down to capacity."""
        held, refs, free, events = self._held, self._refs, self._free, self.events
        for chunk, need in _tail_first(ids, full, last):
            have = held.get(chunk)
            if have is None:
                held[chunk] = need
                self.used += need
                self.pinned += need
                refs[chunk] = 1
                if events is not None:
                    events.append((True, chunk, need))
                continue
            if have < need:
                held[chunk] = need
                self.used += need - have
                if events is not None:
                    events.append((True, chunk, need))
            count = refs.get(chunk, 0)
            if count:
                self.pinned += max(0, need - have)
            else:
                del free[chunk]
                self.pinned += max(have, need)
            refs[chunk] = count + 1
        self.pinned += private
        self.used += private
        self._evict()

    def grow(self, private: int) -> None:
        """A running request takes ``private`` more units (its next output block)."""
        self.pinned += private
        self.used += private
        self._evict()

    def release(
        self, ids: Sequence[int], private: int, outputs: Sequence[tuple[int, int]] = ()
    ) -> None:
        """A request finished: its private units go; chunks nobody else runs become cache.
        ``outputs``: (chunk, units) of its reply's full blocks, which stay as cache after its
        prompt (the chain's tail, so freed first), as vLLM v1 caches a sequence's computed
        blocks; the units they take were among its private ones."""
        held, refs, free = self._held, self._refs, self._free
        for chunk, units in reversed(outputs):
            if chunk not in held and units > 0:  # held already: another request computed it
                held[chunk] = units
                self.used += units  # the private units it came from are released below
                free[chunk] = None
                if self.events is not None:
                    self.events.append((True, chunk, units))
        for chunk in reversed(ids):  # tail first, as vLLM frees a sequence's blocks
            count = refs[chunk] - 1
            if count:
                refs[chunk] = count
            else:
                del refs[chunk]
                self.pinned -= held[chunk]
                free[chunk] = None
        self.pinned -= private
        self.used -= private
        self._evict()  # a request larger than the pool (admitted alone) leaves the excess

    def forget(self, ids: Sequence[int]) -> None:
        """Drop the chunks of ``ids`` that no running request pins: a prefill stopped before
        its end (a preempted request) computed none of them."""
        held, refs, free = self._held, self._refs, self._free
        for chunk in ids:
            if chunk in held and chunk not in refs:
                del free[chunk]
                self.used -= held.pop(chunk)
                if self.events is not None:
                    self.events.append((False, chunk, 0))

    def _evict(self) -> None:
        held, free = self._held, self._free
        while self.used > self.capacity and free:
            chunk, _ = free.popitem(last=False)
            self.used -= held.pop(chunk)
            if self.events is not None:
                self.events.append((False, chunk, 0))
