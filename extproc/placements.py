"""What went where, kept for the other router replicas to read into their indexes.

Each router replica has its own index, built from the requests it routed. With K replicas each
sees 1/K of the traffic: a conversation whose first turn another replica placed looks cold,
and an endpoint's index region forgets nothing it does not see (the others' requests evict
blocks there too). Reading each other's placements fixes both: in the simulator, K=4 router
replicas came within 3% of one router's hit ratio in 16 of 18 cells against 12 without
(docs/benchmarks.md). A placement is the request's block hashes and the endpoint; the log is
numbered so that a reader asks only for what it has not seen, and bounded by blocks (a
prompt's hashes are at most routing.max_blocks x 8 bytes, 64 kB), so memory stays fixed
whatever the traffic.

Wire format (``GET /peer/placements?after=N&log=ID`` on the admin port), JSON:
``{"log": ID, "last": N, "scheme": S, "placements": [[router, endpoint, base64 of uint64 LE],
...]}``, oldest first. ``log`` names the log (a restarted replica starts a new one, numbered
from 1), so a reader that sends another log's number gets the newest placements instead.
``scheme`` names how the hashes were made (hash_scheme): a peer configured with another
block size hashes the same prompt differently, and its placements would only take index
slots that nothing matches (during a rolling change of routing.block_size_bytes, say).
"""

from __future__ import annotations

import base64
import threading
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import orjson

PLACEMENTS_PATH = "/peer/placements"
# The log keeps at most this many placements and block hashes (8 bytes each), ~15 MB in all;
# at the server's few thousand decisions a second that is several seconds of traffic, and
# peers read every second.
LOG_PLACEMENTS = 16_384
LOG_BLOCKS = 1_000_000
# At most this many block hashes in one answer (2 MB before base64): a reader that fell far
# behind (or has just started) gets the newest placements, which are the ones still cached.
ANSWER_BLOCKS = 262_144
# A reader takes answers up to this size (a full answer, base64 in JSON, is ~3 MB plus 100
# bytes a placement); a larger one is dropped like a garbled one.
MAX_ANSWER_BYTES = 16 * 2**20


def hash_scheme(block_size_bytes: int) -> str:
    """What two routers' block hashes must share to mean the same prompt blocks."""
    return f"xxh3-64/{block_size_bytes}"


@dataclass(frozen=True, slots=True)
class Placement:
    router: str  # the router instance that made it
    endpoint: str
    hashes: np.ndarray  # uint64 block hashes of the request's prompt, in order


class PlacementLog:
    def __init__(
        self, scheme: str = "", max_blocks: int = LOG_BLOCKS, max_placements: int = LOG_PLACEMENTS
    ) -> None:
        self.id = uuid.uuid4().hex[:12]
        self.scheme = scheme
        self.max_blocks = max_blocks
        self.max_placements = max_placements
        self._entries: deque[tuple[int, Placement]] = deque()
        self._blocks = 0
        self.last = 0
        # The supervisor of --workers N adds in one thread and answers in another.
        self._lock = threading.Lock()

    def add(self, placement: Placement) -> None:
        with self._lock:
            self.last += 1
            self._entries.append((self.last, placement))
            self._blocks += len(placement.hashes)
            entries = self._entries
            while len(entries) > 1 and (
                self._blocks > self.max_blocks or len(entries) > self.max_placements
            ):
                _, dropped = self._entries.popleft()
                self._blocks -= len(dropped.hashes)

    def after(self, seq: int, max_blocks: int = ANSWER_BLOCKS) -> list[Placement]:
        """The placements numbered after ``seq``, oldest first: the newest that fit in
        ``max_blocks`` block hashes (always at least one)."""
        out: list[Placement] = []
        blocks = 0
        with self._lock:
            for number, placement in reversed(self._entries):
                if number <= seq or (out and blocks + len(placement.hashes) > max_blocks):
                    break
                out.append(placement)
                blocks += len(placement.hashes)
        out.reverse()
        return out

    def answer(self, after: int, log: str | None) -> bytes:
        """The JSON answer to a reader that has seen up to ``after`` of log ``log``."""
        last = self.last  # read first: a placement added meanwhile is sent again, not lost
        since = after if log == self.id else 0
        return encode(PlacementAnswer(self.id, last, self.scheme, self.after(since)))


class PlacementAnswer(NamedTuple):
    log: str
    last: int
    scheme: str
    placements: list[Placement]


def encode(answer: PlacementAnswer) -> bytes:
    rows = [
        [p.router, p.endpoint, base64.b64encode(p.hashes.astype("<u8").tobytes()).decode()]
        for p in answer.placements
    ]
    return orjson.dumps(
        {"log": answer.log, "last": answer.last, "scheme": answer.scheme, "placements": rows}
    )


def decode(body: str | bytes) -> PlacementAnswer:
    """An answer, parsed; ValueError for anything malformed."""
    try:
        doc: Any = orjson.loads(body)
        log, last, scheme, rows = doc["log"], doc["last"], doc["scheme"], doc["placements"]
        if not (
            isinstance(log, str)
            and isinstance(last, int)
            and isinstance(scheme, str)
            and isinstance(rows, list)
        ):
            raise ValueError("log, last, scheme or placements has the wrong type")
        out = []
        for router, endpoint, hashes in rows:
            raw = base64.b64decode(hashes, validate=True)
            if not isinstance(router, str) or not isinstance(endpoint, str) or len(raw) % 8:
                raise ValueError("a placement is not [router, endpoint, hashes]")
            out.append(
                Placement(router, endpoint, np.frombuffer(raw, dtype="<u8").astype(np.uint64))
            )
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"not a placements answer: {exc}") from exc
    return PlacementAnswer(log, last, scheme, out)
