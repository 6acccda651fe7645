"""Pick an endpoint: prefix affinity, balanced by load, with a bounded-load guard.

The algorithm, top to bottom:
1. Guard: an endpoint may take this request only if its load stays under
   max((1+eps) x its weighted share of (total load + 1), share + slack). If no endpoint is
   under the guard, the guard is lifted (it can only spread load, never refuse it).
2. Affinity: if an eligible endpoint holds the request's session prefix (the blocks up to the
   end of the first user turn; at least min_match_blocks), score every eligible endpoint as
   prefix_weight x matched fraction - load_weight x load / cap and take the best.
   Rule 'prefix_affinity', or 'load_guard' when a better-matching endpoint was skipped.
3. Cold start: nobody eligible holds the session → rendezvous-hash the placement key over
   the eligible endpoints (highest hash wins). Independent router replicas with empty
   indexes agree on this choice, so a conversation's turns meet on one endpoint without
   shared state. A match on a shared preamble alone (one system prompt for every
   conversation) does not count: following it would pile every new conversation onto the
   first endpoint that saw the preamble, while spreading costs one preamble prefill per
   endpoint, once.
Ties are broken by the rendezvous order, never by list order, for the same reason.
Fallbacks are the next endpoints in the same ranking.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from xxhash import xxh3_64_intdigest

from .config import RoutingConfig

RULE_AFFINITY = "prefix_affinity"
RULE_COLD_START = "cold_start_hash"
RULE_LOAD_GUARD = "load_guard"
RULE_NO_ENDPOINT = "no_endpoint"


@dataclass(frozen=True, slots=True)
class EndpointView:
    """What the scheduler needs to know about one endpoint at decision time."""

    address: str
    load: float
    weight: float = 1.0
    # xxh3 of the address, precomputed once per endpoint for rendezvous hashing.
    address_hash: int = 0


def address_hash(address: str) -> int:
    return xxh3_64_intdigest(address.encode())


def rendezvous_score(key: int, endpoint_hash: int) -> int:
    return xxh3_64_intdigest(endpoint_hash.to_bytes(8, "little"), key)


@dataclass(slots=True)
class Candidate:
    address: str
    matched_blocks: int
    load: float
    cap: float
    eligible: bool
    score: float
    rendezvous: int

    def explain(self) -> dict[str, Any]:
        return {
            "endpoint": self.address,
            "matched_blocks": self.matched_blocks,
            "load": self.load,
            "load_cap": round(self.cap, 3),
            "eligible": self.eligible,
            "score": round(self.score, 4),
        }


@dataclass(slots=True)
class Decision:
    endpoint: str | None
    rule: str
    fallbacks: list[str] = field(default_factory=list)
    total_blocks: int = 0
    matched_blocks: int = 0
    placement_key: int = 0
    candidates: list[Candidate] = field(default_factory=list)
    # Kept for correcting the index if Envoy reports another served endpoint.
    hashes: Sequence[int] = ()
    # Where Envoy says the request really went, when that differs from ``endpoint``.
    served: str | None = None

    def explain(self, top_k: int | None = None) -> dict[str, Any]:
        ranked = sorted(self.candidates, key=_rank_key)
        if top_k is not None:
            ranked = ranked[:top_k]
        return {
            "endpoint": self.endpoint,
            "served": self.served,
            "fallbacks": self.fallbacks,
            "rule": self.rule,
            "total_blocks": self.total_blocks,
            "matched_blocks": self.matched_blocks,
            "placement_key": f"{self.placement_key:016x}",
            "candidates": [c.explain() for c in ranked],
        }


def _rank_key(candidate: Candidate) -> tuple[bool, float, int]:
    return (not candidate.eligible, -candidate.score, -candidate.rendezvous)


class Scheduler:
    def __init__(self, config: RoutingConfig) -> None:
        self.config = config

    def pick(
        self,
        endpoints: Sequence[EndpointView],
        matches: dict[str, int],
        total_blocks: int,
        key: int,
        session_blocks: int = 0,
    ) -> Decision:
        if not endpoints:
            return Decision(None, RULE_NO_ENDPOINT, total_blocks=total_blocks, placement_key=key)
        cfg = self.config
        total_load = sum(e.load for e in endpoints) + 1
        total_weight = sum(e.weight for e in endpoints)
        candidates = []
        for e in endpoints:
            share = total_load * e.weight / total_weight
            cap = max((1 + cfg.load_epsilon) * share, share + cfg.load_slack)
            candidates.append(
                Candidate(
                    address=e.address,
                    matched_blocks=matches.get(e.address, 0),
                    load=e.load,
                    cap=cap,
                    eligible=e.load + 1 <= cap,
                    score=0.0,
                    rendezvous=rendezvous_score(key, e.address_hash),
                )
            )
        if not any(c.eligible for c in candidates):
            for c in candidates:
                c.eligible = True

        best_eligible_match = max((c.matched_blocks for c in candidates if c.eligible), default=0)
        needed = max(cfg.min_match_blocks, session_blocks)
        if best_eligible_match >= needed and total_blocks:
            for c in candidates:
                c.score = (
                    cfg.prefix_weight * c.matched_blocks / total_blocks
                    - cfg.load_weight * c.load / c.cap
                )
            ranked = sorted(candidates, key=_rank_key)
            chosen = ranked[0]
            best_overall = max(c.matched_blocks for c in candidates)
            rule = RULE_LOAD_GUARD if best_overall > chosen.matched_blocks else RULE_AFFINITY
        else:
            # Cold start: rendezvous order alone, so replicas agree.
            for c in candidates:
                c.score = 0.0
            ranked = sorted(candidates, key=_rank_key)
            chosen = ranked[0]
            skipped = any(not c.eligible and c.matched_blocks >= needed for c in candidates)
            rule = RULE_LOAD_GUARD if skipped else RULE_COLD_START
        return Decision(
            endpoint=chosen.address,
            rule=rule,
            fallbacks=[c.address for c in ranked[1 : 1 + cfg.fallbacks]],
            total_blocks=total_blocks,
            matched_blocks=chosen.matched_blocks,
            placement_key=key,
            candidates=candidates,
        )
