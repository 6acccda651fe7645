"""How often new sessions arrive drawn by each shared prefix: a decaying count per prefix.

A shared prefix that new sessions follow is one of two things. A group's document (many
documents, each asked a few questions) should stay on the endpoint that holds it: copying it
costs a prefill and cache room for every copy. A preamble nearly every conversation starts
with (one system prompt, an agent's tool list) draws more new sessions than one endpoint's
share: following it piles the conversations, and later all their turns, onto its first
holders. What tells the two apart is the share of new sessions the prefix draws, which this
measures. Counts decay per new session, not per second, so the measure is the same at any
request rate and the same for every router replica that sees a random part of the traffic.
"""

from __future__ import annotations

# Prefixes tracked at most; beyond it the least-drawn half is dropped.
MAX_PREFIXES = 4096
# Shares are taken over at least this many new sessions: the first few say little (the
# second request of a group's document would otherwise hold half of all the sessions seen).
MIN_NEW_SESSIONS = 16


class PrefixPopularity:
    """Decayed counts of new sessions per shared prefix (keyed by the hash of its last
    block) and of all new sessions; share = the first over the second."""

    __slots__ = ("_counts", "_events", "_keep", "_total")

    def __init__(self, window: int) -> None:
        # Each new session multiplies every count by keep: a count forgets in ~window events.
        self._keep = 1.0 - 1.0 / window
        self._counts: dict[int, tuple[float, int]] = {}
        self._events = 0
        self._total = 0.0

    def _now(self, count: float, at: int) -> float:
        return count * self._keep ** (self._events - at)

    def new_session(self, prefix: int | None) -> float:
        """Count one new session, drawn by ``prefix`` (None: by no shared prefix), and return
        that prefix's share of the recent new sessions (this one included)."""
        self._events += 1
        self._total = self._total * self._keep + 1.0
        if prefix is None:
            return 0.0
        count, at = self._counts.get(prefix, (0.0, self._events))
        count = self._now(count, at) + 1.0
        self._counts[prefix] = (count, self._events)
        if len(self._counts) > MAX_PREFIXES:
            self._prune()
        return count / max(self._total, MIN_NEW_SESSIONS)

    def _prune(self) -> None:
        ranked = sorted(self._counts.items(), key=lambda kv: self._now(*kv[1]), reverse=True)
        self._counts = dict(ranked[: MAX_PREFIXES // 2])
