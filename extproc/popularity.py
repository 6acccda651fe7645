"""How often new sessions arrive drawn by each shared prefix: a decaying count per prefix.

A shared prefix that new sessions follow is one of two things. A group's document (many
documents, each asked a few questions) should stay on the endpoint that holds it: copying it
costs a prefill and cache room for every copy. A preamble nearly every conversation starts
with (one system prompt, an agent's tool list) draws more new sessions than one endpoint's
share: following it piles the conversations, and later all their turns, onto its first
holders. What tells the two apart is the share of new sessions the prefix draws, which this
measures. Counts decay per new session, not per second, so the measure is the same at any
request rate and the same for every router replica that sees a random part of the traffic.
A document is spread only when its share is beyond chance (draws_more_than): a copy of one
is most of a prompt, and a few documents' shares over a few dozen sessions are noise.
"""

from __future__ import annotations

import math

# Prefixes tracked at most; beyond it the least-drawn half is dropped.
MAX_PREFIXES = 4096
# Shares are taken over at least this many new sessions: the first few say little (the
# second request of a group's document would otherwise hold half of all the sessions seen).
MIN_NEW_SESSIONS = 16
# A prefix draws more than a share only when its count exceeds what that share would draw by
# this many standard deviations (draws_more_than).
SIGNIFICANCE = 3.0


class PrefixPopularity:
    """Decayed counts of new sessions per shared prefix (keyed by the hash of its last
    block) and of all new sessions; share = the first over the second."""

    __slots__ = ("_counts", "_events", "_keep", "_last", "_total", "_total_sq")

    def __init__(self, window: int) -> None:
        # Each new session multiplies every count by keep: a count forgets in ~window events.
        self._keep = 1.0 - 1.0 / window
        self._counts: dict[int, tuple[float, int]] = {}
        self._events = 0
        self._total = 0.0
        # Sum of the squared decay weights: the variance of a decayed count (draws_more_than).
        self._total_sq = 0.0
        self._last = 0.0

    def _now(self, count: float, at: int) -> float:
        return count * self._keep ** (self._events - at)

    def new_session(self, prefix: int | None) -> float:
        """Count one new session, drawn by ``prefix`` (None: by no shared prefix), and return
        that prefix's share of the recent new sessions (this one included)."""
        self._events += 1
        self._total = self._total * self._keep + 1.0
        self._total_sq = self._total_sq * self._keep * self._keep + 1.0
        if prefix is None:
            self._last = 0.0
            return 0.0
        count, at = self._counts.get(prefix, (0.0, self._events))
        count = self._now(count, at) + 1.0
        self._counts[prefix] = (count, self._events)
        self._last = count
        if len(self._counts) > MAX_PREFIXES:
            self._prune()
        return count / max(self._total, MIN_NEW_SESSIONS)

    def draws_more_than(self, share: float) -> bool:
        """Whether the prefix of the last new_session draws more than ``share`` of the new
        sessions beyond chance: its count exceeds what that share would draw by SIGNIFICANCE
        standard deviations. A bare share over a dozen sessions is noise: six documents
        asked in turn over four endpoints (1/6 each) showed more than 1/4 to one router in 80%
        of shuffles; one system prompt for every conversation passes at its fourth session
        (docs/benchmarks.md, item 23)."""
        expected = share * self._total
        spread = math.sqrt(share * (1.0 - share) * self._total_sq)
        return self._last > expected + SIGNIFICANCE * spread + 1e-9

    def _prune(self) -> None:
        ranked = sorted(self._counts.items(), key=lambda kv: self._now(*kv[1]), reverse=True)
        self._counts = dict(ranked[: MAX_PREFIXES // 2])
