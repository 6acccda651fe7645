"""The share of new sessions each shared prefix draws (extproc.popularity)."""

from __future__ import annotations

import pytest

from extproc.popularity import MAX_PREFIXES, MIN_NEW_SESSIONS, PrefixPopularity


def test_a_preamble_every_session_follows_holds_nearly_all_of_them():
    popularity = PrefixPopularity(window=64)
    popularity.new_session(None)  # the first conversation: nothing held yet
    shares = [popularity.new_session(7) for _ in range(200)]
    assert shares[-1] == pytest.approx(1.0, abs=0.01)
    # Over the first few sessions the share is taken over MIN_NEW_SESSIONS, not one or two.
    assert shares[0] == pytest.approx(1 / MIN_NEW_SESSIONS)


def test_many_group_documents_each_hold_a_small_share():
    popularity = PrefixPopularity(window=256)
    shares = {}
    for i in range(64 * 40):
        shares[i % 64] = popularity.new_session(i % 64)
    # Just after its own draw a prefix's share is a little above its mean (1/64).
    assert all(1 / 64 < share < 1.5 / 64 for share in shares.values())


def test_sessions_drawn_by_no_shared_prefix_count_in_the_whole():
    popularity = PrefixPopularity(window=64)
    for i in range(400):
        share = popularity.new_session(1 if i % 4 == 3 else None)
    assert share == pytest.approx(0.25, rel=0.1)


def test_a_prefix_nobody_draws_any_more_is_forgotten_within_the_window():
    popularity = PrefixPopularity(window=64)
    for _ in range(200):
        popularity.new_session(1)
    for _ in range(3 * 64):
        popularity.new_session(2)
    # One more session drawn by 1: its old count has decayed to e^-3 of what it was.
    assert popularity.new_session(1) < 0.08


def test_the_table_stays_bounded_and_keeps_the_prefixes_drawn_most():
    popularity = PrefixPopularity(window=10_000)
    for _ in range(50):
        popularity.new_session(-1)  # a popular preamble
    for prefix in range(MAX_PREFIXES + 10):
        popularity.new_session(prefix)  # each drawn once
    assert len(popularity._counts) <= MAX_PREFIXES
    assert -1 in popularity._counts


def test_a_share_counts_as_more_than_another_only_beyond_chance():
    """draws_more_than: a count beyond what the given share would draw by SIGNIFICANCE
    standard deviations. One prefix in every session passes it at the fourth against a
    quarter; one in every sixth never does against a quarter, one in every fourth does
    against an eighth once enough sessions are counted; no prefix (None) never does."""
    popularity = PrefixPopularity(window=256)
    passed = []
    for _ in range(6):
        popularity.new_session(1)
        passed.append(popularity.draws_more_than(0.25))
    assert passed == [False, False, False, True, True, True]

    sixth, quarter = PrefixPopularity(window=256), PrefixPopularity(window=256)
    against_a_quarter, against_an_eighth = [], []
    for i in range(3000):
        sixth.new_session(i % 6)
        against_a_quarter.append(sixth.draws_more_than(0.25))
        quarter.new_session(i % 4)
        against_an_eighth.append(quarter.draws_more_than(1 / 8))
    assert not any(against_a_quarter)
    assert not any(against_an_eighth[:12]) and all(against_an_eighth[-600:])

    quarter.new_session(None)
    assert not quarter.draws_more_than(0.01)
