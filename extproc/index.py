"""Which endpoint probably holds which prefix blocks: one bounded LRU per endpoint.

Blocks of a request are touched last-to-first, so within a chain an earlier block is always
at least as recent as a later one and the LRU evicts chains from their tail, as vLLM does.
Each endpoint's set therefore stays prefix-closed: if it holds block i of a chain it holds
blocks 0..i-1, and the longest consecutive match is found by a galloping search.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Memory per entry of an OrderedDict[int, None] with its 64-bit int key, measured with
# tracemalloc (tests/test_index.py checks it): 141 B at 100k entries, 127 B at 1M (the hash
# table's fill varies). Used to report index memory without walking the index.
_BYTES_PER_ENTRY = 140


@dataclass(frozen=True, slots=True)
class IndexStats:
    endpoints: int
    entries: int
    capacity: int
    approx_bytes: int


class EndpointBlocks:
    """A bounded LRU set of block hashes for one endpoint."""

    __slots__ = ("_blocks", "capacity")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def matched_prefix(self, hashes: Sequence[int]) -> int:
        """Length of the longest held prefix of ``hashes`` (prefix-closed, so a galloping
        search: O(log m) lookups for a match of m blocks; most endpoints match only a
        shared preamble of a few blocks)."""
        blocks = self._blocks
        count = len(hashes)
        if not count or hashes[0] not in blocks:
            return 0
        low, step = 1, 1  # invariant: hashes[:low] held
        while low < count:
            probe = min(low + step, count)
            if hashes[probe - 1] not in blocks:
                high = probe - 1  # answer < probe
                break
            low, step = probe, step * 2
        else:
            return count
        while low < high:  # answer in [low, high]
            mid = (low + high + 1) // 2
            if hashes[mid - 1] in blocks:
                low = mid
            else:
                high = mid - 1
        return low

    def touch(self, hashes: Sequence[int]) -> None:
        blocks = self._blocks
        move = blocks.move_to_end
        for block in reversed(hashes):
            if block in blocks:
                move(block)
            else:
                blocks[block] = None
        overflow = len(blocks) - self.capacity
        for _ in range(overflow):
            blocks.popitem(last=False)


class PrefixIndex:
    """Per-endpoint LRUs keyed by endpoint address."""

    def __init__(self) -> None:
        self._endpoints: dict[str, EndpointBlocks] = {}

    def set_endpoints(self, capacities: dict[str, int]) -> None:
        """Add new endpoints, resize kept ones, and drop the entries of removed ones."""
        for address in list(self._endpoints):
            if address not in capacities:
                del self._endpoints[address]
        for address, capacity in capacities.items():
            current = self._endpoints.get(address)
            if current is None:
                self._endpoints[address] = EndpointBlocks(capacity)
            elif current.capacity != capacity:
                current.capacity = capacity
                current.touch(())  # evict down to the new size

    def forget(self, address: str) -> None:
        """Drop everything known about one endpoint (it died or was restarted)."""
        blocks = self._endpoints.get(address)
        if blocks is not None:
            self._endpoints[address] = EndpointBlocks(blocks.capacity)

    def match(self, hashes: Sequence[int], addresses: Iterable[str]) -> dict[str, int]:
        """Matched prefix length (blocks) per endpoint, only for endpoints matching >= 1."""
        if not hashes:
            return {}
        first = hashes[0]
        matches = {}
        for address in addresses:
            blocks = self._endpoints.get(address)
            if blocks is not None and first in blocks:
                matches[address] = blocks.matched_prefix(hashes)
        return matches

    def record(self, address: str, hashes: Sequence[int]) -> None:
        blocks = self._endpoints.get(address)
        if blocks is not None and hashes:
            blocks.touch(hashes)

    def entries_by_endpoint(self) -> dict[str, int]:
        return {address: len(blocks) for address, blocks in self._endpoints.items()}

    def stats(self) -> IndexStats:
        entries = sum(len(b) for b in self._endpoints.values())
        return IndexStats(
            endpoints=len(self._endpoints),
            entries=entries,
            capacity=sum(b.capacity for b in self._endpoints.values()),
            approx_bytes=entries * _BYTES_PER_ENTRY,
        )
