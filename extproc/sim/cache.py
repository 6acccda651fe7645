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
from collections.abc import Sequence


class ChunkLRU:
    """Bounded LRU of chunk id → held units; ``used`` is the sum of held units."""

    __slots__ = ("_held", "capacity", "used")

    def __init__(self, capacity: float = math.inf) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be > 0")
        self.capacity = capacity
        self.used = 0
        self._held: OrderedDict[int, int] = OrderedDict()

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

    def touch(self, ids: Sequence[int], full: int, last: int) -> None:
        """Insert or refresh the chunks (last to first), then evict down to capacity."""
        held = self._held
        move = held.move_to_end
        final = len(ids) - 1
        for i in range(final, -1, -1):
            chunk = ids[i]
            need = last if i == final else full
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
