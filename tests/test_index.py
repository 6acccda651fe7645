"""The fingerprint-table index: longest prefix per endpoint, bounds, eviction, memory."""

import random

import numpy as np
import pytest

from extproc.index import GAP, GAP_CAP, GAP_SPAN, WAYS, PrefixIndex, gap_for, split_hashes


def chain(rng: random.Random, length: int) -> np.ndarray:
    return np.array([rng.getrandbits(64) for _ in range(length)], dtype=np.uint64)


def one(capacity: int) -> PrefixIndex:
    index = PrefixIndex()
    index.set_endpoints({"a": capacity})
    return index


def test_matched_prefix_is_the_held_part_of_the_chain():
    rng = random.Random(1)
    blocks = chain(rng, 6)
    index = one(1000)
    index.record("a", blocks[:4])
    assert index.match(blocks, ["a"]) == {"a": 4}
    assert index.match(np.concatenate([blocks[:2], chain(rng, 1)]), ["a"]) == {"a": 2}
    assert index.match(chain(rng, 3), ["a"]) == {}  # another prefix: other hashes throughout
    assert index.match(blocks[:0], ["a"]) == {}


def test_a_full_bucket_evicts_its_least_recent_block_and_chains_lose_their_tail_first():
    rng = random.Random(2)
    index = one(WAYS)  # a single bucket: exact LRU
    old, new = chain(rng, WAYS), chain(rng, 2)
    index.record("a", old)
    index.record("a", np.concatenate([old[:2], new]))  # the shared head becomes most recent
    assert index.stats().entries == WAYS
    assert index.match(old, ["a"]) == {"a": WAYS - 2}  # its last two blocks went
    assert index.match(np.concatenate([old[:2], new]), ["a"]) == {"a": 4}


def test_a_record_entered_as_touched_long_ago_is_evicted_before_older_ones():
    """``age``: blocks entered as if touched that many stamps ago (Router._age_off_pick: a
    copy only this router refreshes), new and refreshed alike, go before blocks recorded
    earlier, unless touched lately without age; the turnover a stamp age is measured in
    follows the endpoint's new blocks."""
    rng = random.Random(3)
    for aged in (False, True):
        index = PrefixIndex()
        index.set_endpoints({"a": WAYS, "b": 1000})  # a: a single bucket, an exact LRU
        index.record("b", chain(rng, 200))  # stamps to reach back over
        first, copy, later = chain(rng, 2), chain(rng, 2), chain(rng, 4)
        index.record("a", first)
        index.record_position(0, copy, age=50 if aged else 0)  # new
        index.record_position(0, copy, age=50 if aged else 0)  # refreshed (held already)
        index.record("a", later)
        index.record("a", chain(rng, 2))  # a full bucket: two go
        assert index.match(copy, ["a"]) == ({} if aged else {"a": 2})
        assert index.match(first, ["a"]) == ({"a": 2} if aged else {})
        assert index.match(later, ["a"]) == {"a": 4}
        # An aged refresh of blocks touched lately without age leaves them as new as they were.
        first, shared, later = chain(rng, 2), chain(rng, 2), chain(rng, 4)
        index.record("a", first)
        index.record("a", shared)
        index.record_position(0, shared, age=50 if aged else 0)
        index.record("a", later)
        index.record("a", chain(rng, 2))
        assert (index.match(first, ["a"]), index.match(shared, ["a"])) == ({}, {"a": 2})
    blocks = chain(rng, 4)
    index.record_position(0, blocks, age=50)  # new blocks, aged past every one in "a"
    index.record("a", chain(rng, 4))
    index.record("a", chain(rng, 4))  # evicts the aged ones, not the four after them
    assert index.match(blocks, ["a"]) == {}
    # Records of 4 new blocks, 5 stamps apart (4 blocks + 1): 1.25 stamps per new block;
    # a record of held blocks adds stamps only.
    index = one(1000)
    for _ in range(200):
        index.record("a", chain(rng, 4))
    assert index.stamps_per_new_block(0) == pytest.approx(1.25, rel=0.02)
    index, held = one(1000), chain(rng, 4)
    index.record("a", held)
    for _ in range(200):
        index.record("a", held)
        index.record("a", chain(rng, 4))
    assert index.stamps_per_new_block(0) == pytest.approx(2.5, rel=0.1)
    # An endpoint added later counts from then, not from the first stamp there ever was.
    index.set_endpoints({"a": 1000, "late": 1000})
    for _ in range(40):
        index.record("late", chain(rng, 4))
    assert index.stamps_per_new_block(1) == pytest.approx(1.25, rel=0.05)


def test_a_match_bridges_short_holes_and_ends_at_gap_missing_blocks():
    """Bucket-local eviction drops single blocks the endpoint still holds: fewer than GAP
    missing in a row are bridged. A model server evicts from the tail: GAP in a row end it."""
    rng = random.Random(9)
    blocks = chain(rng, 2 * GAP + 6)
    short_hole = list(range(2, 2 + GAP - 1))
    long_hole = list(range(2, 2 + GAP))
    for direct_pairs in (0, 1_000_000):  # galloping and direct lookups agree
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("extproc.index._DIRECT_PAIRS", direct_pairs)
            index = one(10_000)
            index.record("a", np.delete(blocks[: GAP + 4], short_hole))
            assert index.match(blocks, ["a"]) == {"a": GAP + 4}
    index = one(10_000)  # few blocks: looked up one by one
    index.record("a", np.delete(blocks[: GAP + 4], long_hole))  # the rest: stale survivors
    assert index.match(blocks, ["a"]) == {"a": 2}


@pytest.mark.parametrize("direct_pairs", [0, 1_000_000], ids=["galloping", "direct"])
def test_a_long_chain_bridges_longer_holes(monkeypatch, direct_pairs):
    """A 1,000-block chain (a 16,000-token system prompt at 64-byte blocks) loses scattered
    runs of GAP or more blocks in busy buckets while its endpoint holds it whole; a short
    chain's match still ends at GAP."""
    monkeypatch.setattr("extproc.index._DIRECT_PAIRS", direct_pairs)
    rng = random.Random(11)
    length = 1000
    gap = gap_for(length)
    assert gap == length // GAP_SPAN > GAP and gap_for(5 * GAP_SPAN - 1) == GAP
    blocks = chain(rng, length)
    holes = {i for start in range(50, length - gap, 97) for i in range(start, start + gap - 1)}
    index = one(10_000)
    index.record("a", blocks[[i for i in range(length) if i not in holes]])
    assert index.match(blocks, ["a"]) == {"a": length}
    index = one(10_000)  # the same holes, and the tail from block 500 evicted
    index.record("a", blocks[[i for i in range(500) if i not in holes]])
    assert index.match(blocks, ["a"]) == {"a": 500}
    if direct_pairs:  # (galloping reads runs from its probes, the tail is what it finds)
        index = one(10_000)
        index.record("a", np.delete(blocks, range(500, 500 + gap)))
        assert index.match(blocks, ["a"]) == {"a": 500}
        short = blocks[:100]  # gap_for(100) == GAP: a run of GAP ends it
        index = one(10_000)
        index.record("a", np.delete(short, range(30, 30 + GAP)))
        assert index.match(short, ["a"]) == {"a": 30}


def test_a_very_long_chain_still_ends_at_a_bounded_run(monkeypatch):
    """Past GAP_CAP x GAP_SPAN blocks the run that ends a match stops growing: a
    12,000-block prompt (190k tokens) ends at GAP_CAP missing blocks, not at 187."""
    monkeypatch.setattr("extproc.index._DIRECT_PAIRS", 1_000_000)
    assert gap_for(12_000) == GAP_CAP < 12_000 // GAP_SPAN
    assert gap_for(GAP_CAP * GAP_SPAN) == GAP_CAP and gap_for(1000) < GAP_CAP
    rng = random.Random(5)
    blocks = chain(rng, 4000)
    index = one(40_000)
    index.record("a", np.delete(blocks, range(2000, 2000 + GAP_CAP)))
    assert index.match(blocks, ["a"]) == {"a": 2000}
    index = one(40_000)  # one block fewer missing: bridged
    index.record("a", np.delete(blocks, range(2000, 2000 + GAP_CAP - 1)))
    assert index.match(blocks, ["a"]) == {"a": 4000}


def test_a_long_prompt_is_read_whole_until_its_endpoint_would_have_evicted_it():
    """A 1,000-block prompt, then other requests' blocks: an LRU cache of 20,000 blocks
    holds it whole after 16,000 (the old run of 4 read 39 blocks of it), and none of it after
    30,000, when the match must not run on through the blocks a quiet bucket kept."""
    rng = random.Random(7)
    for inserted_after, held in ((16_000, 1000), (30_000, None)):
        index = one(20_000)
        prompt = chain(rng, 1000)
        index.record("a", prompt)
        for _ in range(inserted_after // 250):
            index.record("a", chain(rng, 250))
        matched = index.match(prompt, ["a"]).get("a", 0)
        assert matched == held if held else matched < 100


def test_a_request_never_evicts_its_own_blocks():
    rng = random.Random(3)
    index = one(WAYS)
    long_chain = chain(rng, 10)  # more blocks than the one bucket has slots
    index.record("a", long_chain)
    assert index.match(long_chain, ["a"]) == {"a": WAYS}  # the head is kept, not the tail


def test_entries_never_exceed_capacity_and_the_latest_chain_is_held():
    rng = random.Random(7)
    index = one(400)
    chains = [chain(rng, rng.randint(1, 30)) for _ in range(60)]
    for _ in range(1500):
        c = rng.choice(chains)
        held = c[: rng.randint(1, len(c))]
        index.record("a", held)
        assert index.stats().entries <= 400
        assert index.match(held, ["a"]) == {"a": len(held)}
    assert index.stats().entries > 0.9 * 400  # the table fills before it evicts


def test_index_matches_per_endpoint_and_forgets():
    rng = random.Random(4)
    blocks = chain(rng, 3)
    index = PrefixIndex()
    index.set_endpoints({"a": 100, "b": 100})
    index.record("a", blocks)
    index.record("b", blocks[:1])
    assert index.match(blocks, ["a", "b"]) == {"a": 3, "b": 1}
    assert index.match(blocks, ["b"]) == {"b": 1}
    index.forget("a")
    assert index.match(blocks, ["a", "b"]) == {"b": 1}
    assert index.entries_by_endpoint() == {"a": 0, "b": 1}
    index.record("unknown", blocks)  # ignored, never grows an entry for a non-member
    assert index.match(blocks, ["unknown"]) == {}
    assert index.stats().endpoints == 2


def test_removed_blocks_leave_their_endpoint_only_and_free_their_slots():
    """An endpoint's own eviction report (a KV-cache event) empties those blocks' slots: the
    match ends where the chain lost its tail, the fill falls, another endpoint holding the
    same blocks keeps them, and the freed slots take new blocks first."""
    rng = random.Random(11)
    blocks = chain(rng, 12)
    index = PrefixIndex()
    index.set_endpoints({"a": 100, "b": 100})
    index.record("a", blocks)
    index.record("b", blocks)
    assert index.remove_position(0, blocks[6:]) == 6
    assert index.match(blocks, ["a", "b"]) == {"a": 6, "b": 12}
    assert index.entries_by_endpoint() == {"a": 6, "b": 12}
    assert index.remove_position(0, blocks[6:]) == 0  # gone already: nothing to empty
    assert index.remove_position(0, blocks[:0]) == 0
    index.remove_position(0, blocks[:6])  # the rest went too (tail first, as vLLM evicts)
    assert index.match(blocks, ["a", "b"]) == {"b": 12}
    assert index.entries_by_endpoint()["a"] == 0
    full = one(WAYS)  # one bucket: a removed block's slot is the next one filled
    first, new = chain(rng, WAYS), chain(rng, 1)
    full.record("a", first)
    full.remove_position(0, first[3:4])
    full.record("a", new)  # into the freed slot, evicting none of the others
    assert full.stats().entries == WAYS
    assert full.match(first[:3], ["a"]) == {"a": 3}
    assert full.match(first[4:], ["a"]) == {"a": WAYS - 4}
    assert full.match(new, ["a"]) == {"a": 1}


def test_fill_is_the_share_of_slots_in_use_per_endpoint():
    rng = random.Random(7)
    index = PrefixIndex()
    index.set_endpoints({"a": 8 * WAYS, "b": 8 * WAYS})
    both = np.arange(2)
    assert index.fill_positions(both).tolist() == [0.0, 0.0]
    index.record("a", chain(rng, 16))
    fill = index.fill_positions(both)
    assert fill[1] == 0.0 and fill[0] == index.entries_by_endpoint()["a"] / (8 * WAYS) > 0
    for _ in range(20):  # many more blocks than slots: full, never more
        index.record_position(0, chain(rng, 16))
    assert index.fill_positions(np.array([0])).tolist() == [1.0]
    index.set_endpoints({"a": 8 * WAYS, "b": 8 * WAYS, "c": WAYS})  # survivors keep it
    assert index.fill_positions(np.arange(3)).tolist() == [1.0, 0.0, 0.0]
    index.forget("a")
    assert index.fill_positions(np.array([0])).tolist() == [0.0]


def test_set_endpoints_keeps_unchanged_drops_removed_and_empties_resized():
    rng = random.Random(5)
    blocks = chain(rng, 10)
    index = PrefixIndex()
    index.set_endpoints({"a": 100, "b": 100, "c": 100})
    for address in "abc":
        index.record(address, blocks)
    index.set_endpoints({"c": 100, "a": 200})  # order changes, b goes, a is resized
    assert index.match(blocks, ["a", "b", "c"]) == {"c": 10}
    assert index.capacity("a") == 200 and index.capacity("b") is None
    stats = index.stats()
    assert stats.endpoints == 2 and stats.entries == 10 and stats.capacity == 300


@pytest.mark.parametrize("direct_pairs", [0, 1_000_000], ids=["galloping", "direct"])
def test_lookup_agrees_with_a_linear_scan_for_every_endpoint(monkeypatch, direct_pairs):
    """Each endpoint holds a prefix of one chain with isolated holes (what bucket-local
    eviction leaves); the match is the blocks before the first GAP missing in a row."""
    monkeypatch.setattr("extproc.index._DIRECT_PAIRS", direct_pairs)
    rng = random.Random(3)
    for _ in range(200):
        base = chain(rng, rng.randint(1, 120))
        endpoints = [f"e{i}" for i in range(rng.randint(1, 12))]
        index = PrefixIndex()
        index.set_endpoints({e: 10_000 for e in endpoints})
        holdings = {}
        for e in endpoints:
            length = rng.randint(0, len(base))
            holes = {i for i in range(1, length - 1, 3) if rng.random() < 0.3}  # isolated
            holdings[e] = {i for i in range(length) if i not in holes}
            index.record(e, base[sorted(holdings[e])])
        query_length = rng.randint(0, len(base))
        query = np.concatenate([base[:query_length], chain(rng, rng.randint(0, 3))])
        expected = {}
        for e in endpoints:
            # Past the end counts as missing: pad with gap False.
            gap = gap_for(len(query))
            held = [i < query_length and i in holdings[e] for i in range(len(query))]
            held += [False] * gap
            run = next(i for i in range(len(query) + 1) if not any(held[i : i + gap]))
            if run:
                expected[e] = run
        assert index.match(query, endpoints) == expected


def _record_block_by_block(index: PrefixIndex, position: int, hashes: np.ndarray) -> None:
    """The insertion rule, one block at a time, on the index's own arrays: refresh every slot
    already holding a block; then each new block, earliest first, replaces its bucket's least
    recently touched slot (lowest way on ties) unless this request touched that slot."""
    region = index._by_position[position]
    base = index._clock
    index._clock += len(hashes) + 1
    fingerprints, keys = split_hashes(hashes)
    rows = [region.offset + (int(k) * region.buckets >> 32) for k in keys]
    stamps = [base + len(hashes) - i for i in range(len(hashes))]  # block 0 newest
    before = index._fingerprints.copy()
    new_blocks = []
    for i, row in enumerate(rows):
        ways = [w for w in range(WAYS) if before[row, w] == fingerprints[i]]
        for w in ways:
            index._stamps[row, w] = stamps[i]
        if not ways:
            new_blocks.append(i)
    for i in new_blocks:
        row = rows[i]
        way = min(range(WAYS), key=lambda w: (int(index._stamps[row, w]), w))
        if index._stamps[row, way] > base:
            continue  # every slot of the bucket is this request's
        index._entries[position] += int(index._fingerprints[row, way] == 0)
        index._fingerprints[row, way] = fingerprints[i]
        index._stamps[row, way] = stamps[i]


def test_recording_inserts_as_block_by_block_would():
    """The vectorised insertion (all buckets at once) leaves the table as the plain rule
    would: small regions, so buckets overflow and requests collide with their own blocks."""
    rng = random.Random(11)
    for _ in range(60):
        capacities = {f"e{i}": rng.randint(1, 120) for i in range(rng.randint(1, 4))}
        index, reference = PrefixIndex(), PrefixIndex()
        index.set_endpoints(capacities)
        reference.set_endpoints(capacities)
        chains = [chain(rng, rng.randint(1, 300)) for _ in range(5)]
        for _ in range(30):
            c = rng.choice(chains)
            hashes = c[: rng.randint(1, len(c))]
            if rng.random() < 0.3:
                hashes = np.concatenate([hashes, chain(rng, rng.randint(1, 40))])
            if rng.random() < 0.1 and len(hashes) > 2:
                hashes = np.concatenate([hashes[:2], hashes[1:]])  # one block twice
            position = rng.randrange(len(capacities))
            index.record_position(position, hashes)
            _record_block_by_block(reference, position, hashes)
            assert np.array_equal(index._fingerprints, reference._fingerprints)
            assert np.array_equal(index._stamps, reference._stamps)
            assert np.array_equal(index._entries, reference._entries)


def test_memory_is_allocated_up_front_at_twelve_bytes_per_block_of_capacity():
    import tracemalloc

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = PrefixIndex()
        index.set_endpoints({f"e{i}": 100_000 for i in range(64)})
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    reported = index.stats().approx_bytes
    assert reported == 12 * 64 * 100_000
    assert 0.95 * used <= reported <= 1.05 * used
    assert reported <= 100 * 2**20  # the budget: 100 MB at 64 x 100k blocks
