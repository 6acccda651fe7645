"""The share of a router's requests that come back to a key it has seen (extproc.recurrence)."""

from __future__ import annotations

import pytest

from extproc.recurrence import RECURRENCE_KEYS, RECURRENCE_PRIOR, KeyRecurrence


def test_until_measured_a_key_is_as_likely_to_come_back_as_not():
    recurrence = KeyRecurrence(window=64)
    assert recurrence.rate == RECURRENCE_PRIOR == 0.5
    recurrence.observe(1)  # a new key: the prior weighs a window's requests
    assert recurrence.rate == pytest.approx(0.5 * 63 / 64)


def test_keys_that_come_once_read_near_zero_and_keys_that_recur_near_one():
    once, again = KeyRecurrence(window=64), KeyRecurrence(window=64)
    for i in range(400):
        once.observe(i)
        again.observe(i % 4)
    assert once.rate < 0.01 and again.rate > 0.99


def test_a_mix_reads_the_share_that_comes_back():
    recurrence = KeyRecurrence(window=256)
    for i in range(3000):
        # Every fourth request is a document's next question; the rest come once.
        recurrence.observe(i % 8 if i % 4 == 3 else 1000 + i)
    assert recurrence.rate == pytest.approx(0.25, abs=0.03)


def test_a_key_seen_longer_ago_than_the_keys_remembered_counts_as_new():
    recurrence = KeyRecurrence(window=64)
    recurrence.observe(-1)
    for i in range(RECURRENCE_KEYS):
        recurrence.observe(i)
    recurrence.observe(-1)  # forgotten: new again
    assert recurrence.rate < 1e-6
    recurrence.observe(RECURRENCE_KEYS - 1)  # remembered: seen
    assert recurrence.rate == pytest.approx(1 / 64, rel=0.01)
