"""Per-endpoint LRU index: longest consecutive prefix, bounds, eviction from the tail."""

from extproc.index import EndpointBlocks, PrefixIndex


def test_matched_prefix_is_longest_consecutive_run():
    blocks = EndpointBlocks(100)
    blocks.touch([1, 2, 3, 4])
    assert blocks.matched_prefix([1, 2, 3, 4, 5, 6]) == 4
    assert blocks.matched_prefix([1, 2, 9]) == 2
    assert blocks.matched_prefix([9, 1, 2]) == 0
    assert blocks.matched_prefix([]) == 0


def test_capacity_is_respected_and_tails_are_evicted_first():
    blocks = EndpointBlocks(5)
    blocks.touch([1, 2, 3, 4])
    blocks.touch([1, 2, 7, 8])  # shared head 1,2 becomes most recent
    assert len(blocks) == 5
    # The old chain lost its tail (4, then 3), never its head.
    assert blocks.matched_prefix([1, 2, 3, 4]) == 3
    assert blocks.matched_prefix([1, 2, 7, 8]) == 4
    assert 4 not in blocks


def test_index_stays_prefix_closed_under_heavy_eviction():
    import random

    rng = random.Random(7)
    blocks = EndpointBlocks(50)
    chains = [[rng.getrandbits(64) for _ in range(rng.randint(1, 30))] for _ in range(40)]
    for _ in range(500):
        chain = rng.choice(chains)
        blocks.touch(chain[: rng.randint(1, len(chain))])
        assert len(blocks) <= 50
        for c in chains:
            held = [h in blocks for h in c]
            # prefix-closed: once a block is missing, every later one is missing too
            assert held == sorted(held, reverse=True)


def test_index_matches_per_endpoint_and_forgets():
    index = PrefixIndex()
    index.set_endpoints({"a": 10, "b": 10})
    index.record("a", [1, 2, 3])
    index.record("b", [1])
    assert index.match([1, 2, 3], ["a", "b"]) == {"a": 3, "b": 1}
    assert index.match([1, 2, 3], ["b"]) == {"b": 1}
    index.forget("a")
    assert index.match([1, 2, 3], ["a", "b"]) == {"b": 1}
    index.record("unknown", [1])  # ignored, never grows an entry for a non-member
    assert index.stats().endpoints == 2


def test_set_endpoints_drops_removed_and_resizes():
    index = PrefixIndex()
    index.set_endpoints({"a": 10, "b": 10})
    index.record("a", list(range(10)))
    index.set_endpoints({"a": 4})
    stats = index.stats()
    assert stats.endpoints == 1 and stats.entries == 4 and stats.capacity == 4
    assert index.match(list(range(10)), ["a"]) == {"a": 4}
    assert stats.approx_bytes > 0


def test_galloping_search_agrees_with_a_linear_scan():
    import random

    rng = random.Random(3)
    for _ in range(300):
        chain = [rng.getrandbits(64) for _ in range(rng.randint(1, 80))]
        blocks = EndpointBlocks(1000)
        held = rng.randint(0, len(chain))
        blocks.touch(chain[:held])
        query = chain[: rng.randint(0, len(chain))] + [rng.getrandbits(64)] * rng.randint(0, 3)
        expected = 0
        while expected < len(query) and query[expected] in blocks:
            expected += 1
        assert blocks.matched_prefix(query) == expected


def test_reported_memory_matches_tracemalloc_within_a_quarter():
    import random
    import tracemalloc

    rng = random.Random(5)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = PrefixIndex()
        index.set_endpoints({"a": 200_000})
        for _ in range(2000):
            index.record("a", [rng.getrandbits(64) for _ in range(100)])
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    reported = index.stats().approx_bytes
    assert index.stats().entries == 200_000
    assert 0.75 * used <= reported <= 1.25 * used
