"""How often a router's requests come back to a placement key it has seen before.

With several router replicas and no shared placements, a cold start that leaves the key's
rendezvous pick (its queue is past the margin) makes a copy the other routers never look
for: their requests for the key keep going to the pick, and the copy takes cache room for
this router's later requests alone. When keys come back (questions on a few hundred
documents, conversations' later turns), that copy and the prefix it evicts cost more than
the queue it escapes; when most keys come once (the Mooncake trace: about 0.2 of one
router's requests at K=4, up to 0.4 late in the trace), there is little to meet and the
queues should decide.
Counts decay per request, not per second, so the measure is the same at any rate.
"""

from __future__ import annotations

from collections import OrderedDict

# Requests over which the share is measured (a count forgets in about this many).
RECURRENCE_WINDOW = 512
# Keys remembered; a key seen longer ago than this many distinct keys counts as new.
RECURRENCE_KEYS = 4096
# Until measured, a key is taken to be as likely to come back as not: a router's first
# cold starts place the keys every later request looks for, and a start from 0 left the
# GAIE and llm-d shapes' first placements to the queues (docs/benchmarks.md).
RECURRENCE_PRIOR = 0.5


class KeyRecurrence:
    """Decayed counts of requests whose key was seen before and of all requests, started
    at RECURRENCE_PRIOR over a window's weight; rate = the first over the second."""

    __slots__ = ("_keep", "_keys", "_seen", "_total")

    def __init__(self, window: int = RECURRENCE_WINDOW) -> None:
        self._keep = 1.0 - 1.0 / window
        self._keys: OrderedDict[int, None] = OrderedDict()
        self._total = float(window)
        self._seen = RECURRENCE_PRIOR * self._total

    def observe(self, key: int) -> None:
        """Count one request placed by ``key``."""
        seen = key in self._keys
        self._keys[key] = None
        if seen:
            self._keys.move_to_end(key)
        elif len(self._keys) > RECURRENCE_KEYS:
            self._keys.popitem(last=False)
        self._seen = self._seen * self._keep + float(seen)
        self._total = self._total * self._keep + 1.0

    @property
    def rate(self) -> float:
        """The share of recent requests whose key had been seen before."""
        return self._seen / self._total
