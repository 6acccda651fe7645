"""Pick an endpoint: prefix affinity weighed against queued prefill work, with a bounded-load guard.

Load has two units. ``load`` is the number of requests in flight (the router counts them
from the decision to the end of the stream). ``work`` is the prefill work queued ahead of a
new request, in token-equivalents: the router charges every request it sends the estimated
cost of its uncached prefill, prefill(n, u) = base + u + ctx·u·(n − u/2) for n prompt tokens
of which u are not held by that endpoint, and drains the charge at the configured prefill
throughput (or takes it back when the request finishes, whichever is first). A request
count cannot tell a 191k-token prompt from a 30-token one; the work can.

The algorithm, top to bottom:
1. Guard (counts, the secondary signal: it bounds concurrent sequences, which queued prefill
   work does not show): an endpoint may take this request only if its in-flight count stays under
   max((1+eps) x its weighted share of (total count + 1), share + slack), and its KV cache is
   not reported saturated. The count is this router's in-flight requests, or the endpoint's
   own running + waiting when it reports more (other routers' traffic, server queues). If no
   endpoint is under the guard, the guard is lifted (it can only spread load, never refuse it).
2. Affinity: if an eligible endpoint holds the request's session prefix (the blocks up to the
   end of the first user turn, or the first cold_start_blocks; at least min_match_blocks) —
   or a shared prefix covering at least shared_prefix_fraction of the prompt —
   every eligible endpoint gets an estimated cost = its queued work + this request's
   prefill there (cheaper where more of the prompt is cached) + stickiness x the tokens it
   lacks compared with the best-matching eligible endpoint; the cheapest wins. So a request
   stays with its prefix unless the queue there costs more than the prefill it would save
   (plus the stickiness premium, which stands for the later requests that reuse the prefix).
   Rule 'prefix_affinity', or 'load_guard' when a better-matching endpoint was passed over.
3. Cold start: nobody eligible holds the session → rendezvous-hash the placement key over
   the eligible endpoints (highest hash wins), skipping an endpoint whose queued work
   exceeds the least-loaded one's by more than cold_margin x the request's own cold
   prefill. Queued work only: a cheaper prefill where a shared preamble is cached must not
   count (see below). Independent router replicas with empty indexes agree on this choice
   whenever the top endpoint is not overloaded, so a conversation's turns meet on one endpoint
   without shared state. A match on a short shared preamble alone (one system prompt for
   every conversation, under shared_prefix_fraction of the prompt) does not count:
   following it would pile every new conversation onto the first endpoint that saw the
   preamble, while spreading costs one preamble prefill per endpoint, once. A long shared
   prefix (a document with short questions) does count: there following it saves most of
   the prefill and keeps one copy of the document instead of one per endpoint.
Ties are broken by the rendezvous order, never by list order, for the same reason.
Fallbacks are the next endpoints in the same ranking.
"""

from __future__ import annotations

import math
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
    # Prefill work queued on this endpoint (token-equivalents, see CostModel).
    work: float = 0.0
    # Its KV cache is (nearly) full of running requests, as the endpoint reports.
    saturated: bool = False


def address_hash(address: str) -> int:
    return xxh3_64_intdigest(address.encode())


def rendezvous_score(key: int, endpoint_hash: int) -> int:
    return xxh3_64_intdigest(endpoint_hash.to_bytes(8, "little"), key)


@dataclass(frozen=True, slots=True)
class CostModel:
    """The router's estimate of prefill cost and how it weighs stickiness.

    Units are token-equivalents: one uncached prompt token at short context = 1. Defaults
    are the simulator's calibrated fit (8B model, one H200, docs/benchmarks.md):
    36 ms fixed + 0.01672 ms per uncached token + 2.105e-6 ms per uncached token per token
    of context, divided by 0.01672 ms.
    """

    base_tokens: float = 2150.0
    ctx_factor: float = 1.26e-4
    # Prefill throughput, token-equivalents per second: the rate queued work drains at.
    # 0 = never drain, hold each charge until its request finishes.
    drain_per_second: float = 60_000.0
    # Extra cost per token an endpoint lacks against the best-matching eligible endpoint.
    stickiness: float = 4.0
    # Cold start: skip rendezvous picks whose cost exceeds the cheapest by more than this
    # fraction of the request's own cold prefill.
    cold_margin: float = 0.5

    @classmethod
    def from_config(cls, config: RoutingConfig) -> CostModel:
        return cls(
            base_tokens=config.prefill_base_tokens,
            ctx_factor=config.prefill_context_factor,
            drain_per_second=config.prefill_tokens_per_second,
            stickiness=config.stickiness,
            cold_margin=config.cold_margin,
        )

    def prefill(self, tokens: float, cached: float) -> float:
        """Estimated prefill of ``tokens`` prompt tokens with ``cached`` of them held."""
        new = max(1.0, tokens - cached)
        return self.base_tokens + new + self.ctx_factor * new * (tokens - new / 2)


@dataclass(slots=True)
class Candidate:
    address: str
    matched_blocks: int
    load: float
    cap: float
    eligible: bool
    score: float
    rendezvous: int
    work: float = 0.0
    cost: float = 0.0

    def explain(self) -> dict[str, Any]:
        return {
            "endpoint": self.address,
            "matched_blocks": self.matched_blocks,
            "load": self.load,
            "load_cap": round(self.cap, 3),
            "eligible": self.eligible,
            "score": round(self.score, 4),
            "queued_work": round(self.work),
            "est_cost": round(self.cost),
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
    # Estimated prompt tokens and the prefill work charged to the endpoint (token-equivalents).
    prompt_tokens: float = 0.0
    work: float = 0.0
    # Router-private bookkeeping for taking the charge back (see Router.finish).
    charged_at: float = 0.0
    queued_before: float = 0.0
    # The endpoint answered (first byte): the prefill work charge was taken back already.
    work_released: bool = False

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
            "prompt_tokens": round(self.prompt_tokens),
            "work": round(self.work),
            "candidates": [c.explain() for c in ranked],
        }


def _rank_key(candidate: Candidate) -> tuple[bool, float, int]:
    return (not candidate.eligible, -candidate.score, -candidate.rendezvous)


class Scheduler:
    def __init__(self, config: RoutingConfig, cost: CostModel | None = None) -> None:
        self.config = config
        self.cost = cost or CostModel.from_config(config)

    def pick(
        self,
        endpoints: Sequence[EndpointView],
        matches: dict[str, int],
        total_blocks: int,
        key: int,
        session_blocks: int = 0,
        prompt_tokens: float | None = None,
        block_tokens: float = 1.0,
    ) -> Decision:
        """``prompt_tokens`` defaults to ``total_blocks`` x ``block_tokens``."""
        if prompt_tokens is None:
            prompt_tokens = total_blocks * block_tokens
        if not endpoints:
            return Decision(
                None,
                RULE_NO_ENDPOINT,
                total_blocks=total_blocks,
                placement_key=key,
                prompt_tokens=prompt_tokens,
            )
        cfg, model = self.config, self.cost
        n = prompt_tokens
        total_load = sum(e.load for e in endpoints) + 1
        total_weight = sum(e.weight for e in endpoints)
        candidates = []
        for e in endpoints:
            share = total_load * e.weight / total_weight
            cap = max((1 + cfg.load_epsilon) * share, share + cfg.load_slack)
            matched = matches.get(e.address, 0)
            candidates.append(
                Candidate(
                    address=e.address,
                    matched_blocks=matched,
                    load=e.load,
                    cap=cap,
                    eligible=e.load + 1 <= cap and not e.saturated,
                    score=0.0,
                    rendezvous=rendezvous_score(key, e.address_hash),
                    work=e.work,
                    cost=e.work + model.prefill(n, min(n, matched * block_tokens)),
                )
            )
        if not any(c.eligible for c in candidates):
            for c in candidates:
                c.eligible = True
        eligible = [c for c in candidates if c.eligible]

        best_eligible_match = max(c.matched_blocks for c in eligible)
        # Holding the session prefix, or a shared prefix that is most of the prompt (a long
        # document or system prompt before a short question): following the latter saves
        # most of the prefill, and spreading such requests would copy it to every endpoint.
        needed = max(
            cfg.min_match_blocks,
            min(session_blocks, math.ceil(cfg.shared_prefix_fraction * total_blocks)),
        )
        if best_eligible_match >= needed and total_blocks:
            best_tokens = min(n, best_eligible_match * block_tokens)
            for c in candidates:
                lacking = max(0.0, best_tokens - min(n, c.matched_blocks * block_tokens))
                c.score = -(c.cost + model.stickiness * lacking)
            ranked = sorted(candidates, key=_rank_key)
            chosen = ranked[0]
            best_overall = max(c.matched_blocks for c in candidates)
            rule = RULE_LOAD_GUARD if best_overall > chosen.matched_blocks else RULE_AFFINITY
        else:
            # Cold start: rendezvous order among the endpoints whose cost is within the
            # margin of the cheapest, so replicas agree unless the top one is overloaded.
            # Queued work only: a cheaper prefill where a shared preamble is held must not
            # pull new sessions onto the holders (the herding described above).
            limit = min(c.work for c in eligible) + model.cold_margin * model.prefill(n, 0)
            for c in candidates:
                c.score = 1.0 if c.work <= limit else 0.0
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
            prompt_tokens=n,
            work=chosen.cost - chosen.work,
        )
