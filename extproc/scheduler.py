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
   max((1+eps) x its weighted share of (total count + 1), share + slack). The count is this
   router's in-flight requests, or the endpoint's own running + waiting when it reports more
   (other routers' traffic, server queues). If no endpoint is under the guard, the guard is
   lifted (it can only spread load, never refuse it).
2. Affinity: if an eligible endpoint holds the request's session prefix (the blocks up to the
   end of the first user turn, or the first cold_start_blocks; at least min_match_blocks) —
   or a shared prefix covering at least shared_prefix_fraction of the prompt, or the first
   cold_start_blocks of a document-like preamble (rule 3's preamble key) —
   every eligible endpoint gets an estimated cost = its queued work + this request's
   prefill there (cheaper where more of the prompt is cached) + stickiness x the tokens it
   lacks compared with the best-matching eligible endpoint; the cheapest wins. So a request
   stays with its prefix unless the queue there costs more than the prefill it would save
   (plus the stickiness premium, which stands for the later requests that reuse the prefix:
   long_prefix_stickiness instead when some endpoint holds at least long_prefix_tokens of
   the prompt, a long conversation or agent context that every later request extends;
   with stickiness_fill set, off by default, a router alone scales it by the estimated fill
   of an endpoint with nothing queued: a copy into free room evicts nothing; with
   session_stickiness set, off by default, a router alone charges a continuing
   conversation that much per token toward an endpoint with nothing queued: its later
   turns follow the copy; and when even the least-queued eligible endpoint has a
   backlog (this router's requests, or other routers' waiting on every endpoint), the
   premium grows by backlog_stickiness (1) x stickiness per request's worth
   of it: every endpoint is busy, so a copy's extra prefill delays all that queue behind
   it and, in a full cache, evicts a prefix recomputed in turn, while the queue
   difference it escapes passes).
   A new session drawn by a shared prefix alone (held, but not its own first turn) goes by
   the rendezvous order among the endpoints whose cost is within cold_margin x its cold
   prefill of the cheapest, as a cold start would: another router replica that sees only
   its later turns cold-starts them by that same order (rule 3).
   Rule 'prefix_affinity', or 'load_guard' when a better-matching endpoint was passed over.
   New sessions (here and in rule 3) also skip endpoints that report their KV cache full,
   while another eligible endpoint has room; a request whose own prefix is held does not.
   Except a popular preamble: a shared prefix that draws more than one endpoint's share of
   the recent new sessions (popularity.py; one system prompt for every conversation) does
   not attract them: they go as cold starts (rule 3), rule 'shared_prefix_spread'. A
   preamble that is most of the prompt (a document) must draw that share beyond chance
   (PrefixPopularity.draws_more_than): spreading copies it whole, and over the first few
   dozen sessions a few documents' shares are noise.
   A completion shows no turns (its session key is its first cold_start_blocks, which a
   shared system prompt covers): one whose held prefix is under shared_prefix_fraction of it
   is a new session of that prefix too, and when the prefix is popular it is placed by its
   own first blocks after it, which its later requests (the prompt extended) share.
3. Cold start: nobody eligible holds the session → rendezvous-hash the placement key over
   the eligible endpoints (highest hash wins), skipping an endpoint whose queued work
   exceeds the least-loaded one's by more than cold_margin x the request's own cold
   prefill (for a key this router placed before, plus backlog_stickiness x the queue other
   routers' requests make on every endpoint: while that lasts, the pick's extra queue
   passes and a copy elsewhere stays; and for a router among several, plus up to
   recurring_cold_margin cold prefills as its requests come back to keys it has seen:
   a copy off the pick then serves its requests alone, recurrence.py). For a new
   conversation whose preamble (system prompt, tools) is at least shared_prefix_fraction
   of its first turn and not popular, the key is the preamble's (hashing.group_key),
   here and for rule 2's new sessions.
   Queued work only: a cheaper prefill where a shared preamble is cached must not count
   (see below). Independent router replicas with empty indexes agree on this choice
   whenever the top endpoint is not overloaded, so a conversation's turns meet on one
   endpoint without shared state. A match on a short shared preamble alone (one system
   prompt for every conversation, under shared_prefix_fraction of the prompt) does not
   count: following it would pile every new conversation onto the first endpoint that saw the
   preamble, while spreading costs one preamble prefill per endpoint, once. A long shared
   prefix (a document with short questions) does count: there following it saves most of
   the prefill and keeps one copy of the document instead of one per endpoint.
   A router that places (nearly) all the traffic (balance_cold_starts; the router measures
   its share) prefers, among the endpoints within the margin, the one this key was placed
   on before, else those whose recent cold starts add up to at most the mean prefill work:
   rendezvous hashing alone spreads a few groups unevenly, and router replicas without
   shared placements keep to it, so that they agree.
Ties are broken by the rendezvous order, never by list order, for the same reason.
Fallbacks are the next endpoints in the same ranking.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from xxhash import xxh3_64_intdigest

from .config import RoutingConfig
from .popularity import PrefixPopularity
from .recurrence import KeyRecurrence

RULE_AFFINITY = "prefix_affinity"
RULE_COLD_START = "cold_start_hash"
RULE_LOAD_GUARD = "load_guard"
RULE_SPREAD = "shared_prefix_spread"
RULE_NO_ENDPOINT = "no_endpoint"

# Router replicas sharing placements move a new session off its rendezvous pick (to the
# second) only when the pick has placed more work than the second by more than this many
# cold prefills of the session's prompt (Scheduler._balance). On two real vLLM servers with
# the margin at 0, the pair lost 0.02 of chat hit ratio in 3 of 3 runs: a next turn that
# reached the other router within the second before the placement did was placed apart.
SHARED_BALANCE_MARGIN = 2.0
# Cold starts remember where they placed this many placement keys (least recently placed
# forgotten first), ~6 MB: a key cold-started again (its prefix evicted, or a document's next
# question before its first was indexed) goes back to its endpoint, which the balance, unlike
# the rendezvous order alone, would not otherwise find again; and while other routers'
# requests wait on every endpoint, a key placed before keeps to its rendezvous pick.
HOME_KEYS = 65_536
# Router replicas without shared placements widen a cold start's margin only when more than
# this share of the requests come back to a key seen before (CostModel.recurring_margin):
# one router's share of the Mooncake trace at K=4 reads about 0.2 (0.2-0.4 late in the
# trace), of the GAIE and llm-d shapes' 0.78, and of GAIE's long questions 0.89.
RECURRENCE_THRESHOLD = 0.3


@dataclass(frozen=True, slots=True)
class EndpointTable:
    """What the scheduler needs to know about the candidate endpoints at decision time, one
    array entry per endpoint: the whole decision is a fixed number of numpy operations,
    whatever the endpoint count (bench core: 64 and 512 endpoints)."""

    # Row i is endpoint addresses[rows[i]] (or addresses[i] without ``rows``): the router
    # passes its whole address list and the rows in use, so nothing here is O(endpoints)
    # in Python.
    addresses: Sequence[str]
    load: np.ndarray  # float64: in-flight requests (or the endpoint's own count, if higher)
    work: np.ndarray  # float64: prefill work queued there (token-equivalents, see CostModel)
    matched: np.ndarray  # int64: blocks of this request's prefix it probably holds
    weight: np.ndarray | None = None  # float64; None = all 1
    # uint64 xxh3 of each address (address_hash), for rendezvous hashing.
    address_hash: np.ndarray | None = None
    # bool: its KV cache is (nearly) full of running requests, as the endpoint reports.
    saturated: np.ndarray | None = None
    # float64 0..1: share of its cache in use, as the index estimates it; None = all full.
    fill: np.ndarray | None = None
    # float64: prefill work of the cold starts recently placed there (Router, decaying);
    # None = cold starts do not balance them (balance_cold_starts off, or router replicas
    # that must agree on rendezvous picks).
    placed: np.ndarray | None = None
    # 0: balance over every endpoint (at most the mean placed work); n: among the key's n
    # first rendezvous picks within the margin, the first unless another has less placed
    # work by SHARED_BALANCE_MARGIN cold prefills (router replicas sharing placements).
    placed_choices: int = 0
    rows: np.ndarray | None = None
    # float64 (or one figure for all): queued work each endpoint has beyond ``work``, the
    # waiting requests the router counts beyond its own charges (other routers', or those
    # waiting for KV memory; Router._unseen) up to their median over the endpoints, which
    # ``work`` leaves out: a queue every endpoint has does not say where to send. It does say
    # whether every endpoint is busy (the backlog rules of Scheduler.pick).
    backlog: np.ndarray | float = 0.0

    def __len__(self) -> int:
        return len(self.load)

    def address(self, i: int) -> str:
        return self.addresses[i if self.rows is None else int(self.rows[i])]


def address_hash(address: str) -> int:
    return xxh3_64_intdigest(address.encode())


_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def rendezvous_scores(key: int, address_hashes: np.ndarray) -> np.ndarray:
    """Rendezvous (highest random weight) score of every endpoint for ``key``: the splitmix64
    finaliser of key XOR the endpoint's address hash, a well-mixed 64-bit value that every
    router replica computes alike."""
    z = address_hashes ^ np.uint64(key)
    z = (z ^ (z >> _S30)) * _MIX1
    z = (z ^ (z >> _S27)) * _MIX2
    return z ^ (z >> _S31)


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
    stickiness: float = 8.0
    # Cold start: skip rendezvous picks whose cost exceeds the cheapest by more than this
    # fraction of the request's own cold prefill.
    cold_margin: float = 0.1
    # Estimated cache fill at which a copy costs the full stickiness (0: always full), and
    # the least share of it charged whatever the fill (the router raises it to 1 when other
    # router replicas share the endpoints: its index then sees only its own insertions).
    stickiness_fill: float = 0.0
    stickiness_floor: float = 0.0
    # Stickiness for a continuing conversation's own history (None: the stickiness).
    session_stickiness: float | None = None
    # A request whose longest held prefix is at least long_prefix_tokens pays
    # long_prefix_stickiness instead of the stickiness (0 tokens: never).
    long_prefix_tokens: float = 8192.0
    long_prefix_stickiness: float = 16.0
    # Stickiness added per request's worth of prefill queued everywhere (see backlog_premium).
    backlog_stickiness: float = 1.0
    # Cold prefills added to a shared cold-start margin when every key recurs (see
    # recurring_margin).
    recurring_cold_margin: float = 4.0
    # Engines batch the prefills queued together (vLLM fills a step with up to
    # max_num_batched_tokens): a request sent where prefill work is queued, whose uncached
    # tokens fit in a step, adds them to one, not a step's fixed cost (0: every request pays it).
    batch_tokens: float = 0.0

    @classmethod
    def from_config(cls, config: RoutingConfig) -> CostModel:
        return cls(
            base_tokens=config.prefill_base_tokens,
            ctx_factor=config.prefill_context_factor,
            drain_per_second=config.prefill_tokens_per_second,
            stickiness=config.stickiness,
            cold_margin=config.cold_margin,
            stickiness_fill=config.stickiness_fill,
            session_stickiness=config.session_stickiness,
            long_prefix_tokens=config.long_prefix_tokens,
            long_prefix_stickiness=config.long_prefix_stickiness,
            backlog_stickiness=config.backlog_stickiness,
            recurring_cold_margin=config.recurring_cold_margin,
            batch_tokens=config.prefill_batch_tokens,
        )

    def recurring_margin(self, recurrence: float) -> float:
        """Cold prefills a cold start's margin widens by when this router shares the
        endpoints (stickiness_floor) and ``recurrence`` of its requests come back to a key
        it has seen (recurrence.py): none up to RECURRENCE_THRESHOLD, recurring_cold_margin
        at 1, linear in between. A copy off the rendezvous pick then serves this router's
        later requests alone while the other routers' go to the pick."""
        if not self.recurring_cold_margin or not self.stickiness_floor:
            return 0.0
        over = (recurrence - RECURRENCE_THRESHOLD) / (1.0 - RECURRENCE_THRESHOLD)
        return self.recurring_cold_margin * self.stickiness_floor * max(0.0, over)

    def for_held(self, held_tokens: float) -> CostModel:
        """The model that prices a request whose longest held prefix is ``held_tokens``: a
        long one (a long conversation, an agent's growing context) is reused by later
        requests as long as it, so leaving it costs long_prefix_stickiness per token."""
        if not self.long_prefix_tokens or held_tokens < self.long_prefix_tokens:
            return self
        return dataclasses.replace(self, stickiness=self.long_prefix_stickiness)

    def prefill(self, tokens: float, cached: float) -> float:
        """Estimated prefill of ``tokens`` prompt tokens with ``cached`` of them held."""
        new = max(1.0, tokens - cached)
        return self.base_tokens + new + self.ctx_factor * new * (tokens - new / 2)

    def prefill_many(
        self, tokens: float, cached: np.ndarray, work: np.ndarray | None = None
    ) -> np.ndarray:
        """``prefill`` for an array of cached token counts; with ``work``, each endpoint's
        queued work: where something is queued and the request's uncached tokens fit in
        ``batch_tokens``, it joins a prefill step that pays the fixed cost anyway."""
        new = np.maximum(1.0, tokens - cached)
        base = self.base_tokens
        if self.batch_tokens and work is not None:
            base = np.where(self.queued(work) & (new <= self.batch_tokens), 0.0, base)
        return base + new + self.ctx_factor * new * (tokens - new / 2)

    def queued(self, work: np.ndarray) -> np.ndarray:
        """Whether each endpoint has anything queued: more work than one request's fixed
        cost (less is a request about to finish, or the drain's rounding)."""
        return work > self.base_tokens

    def premium(self, fill: np.ndarray | None, work: np.ndarray) -> np.ndarray | float:
        """Stickiness per lacking token on each endpoint. A copy there evicts other blocks
        (when its cache is full) and delays the requests queued behind its longer prefill;
        on an endpoint with free room and less queued work than one request's fixed cost,
        neither, and the later requests of the prefix can use either copy: it pays in
        proportion to its fill. Without fills (``fill`` None): the full premium."""
        if fill is None or self.stickiness_fill <= 0 or self.stickiness_floor >= 1:
            return self.stickiness
        share = np.maximum(self.stickiness_floor, np.minimum(1.0, fill / self.stickiness_fill))
        return self.stickiness * np.where(self.queued(work), 1.0, share)

    def backlog_premium(self, tokens: float, least_work: float) -> float:
        """Stickiness added per lacking token when even the least-queued eligible endpoint
        has ``least_work`` queued: every endpoint is backlogged, so a copy's extra prefill
        is work that all the requests queued behind it wait for, and in a full cache it
        evicts a prefix that is recomputed in turn, while the queue difference it escapes
        passes. backlog_stickiness x the stickiness per request's worth of queued prefill,
        counted in this request's cold prefills (the requests that wait behind the copy)."""
        if not self.backlog_stickiness or least_work <= 0:
            return 0.0
        requests = least_work / self.prefill(tokens, 0)
        return self.stickiness * self.backlog_stickiness * requests

    def continuing_premium(
        self, premium: np.ndarray | float, work: np.ndarray
    ) -> np.ndarray | float:
        """Stickiness for a continuing conversation (its own first turn held): its later turns
        follow its history, so a copy loses no later reuse, only the room it takes. Toward an
        endpoint with nothing queued (the copy delays nobody) it pays session_stickiness,
        when set; router replicas that share the endpoints pay in full (stickiness_floor),
        since another replica sends the next turn where its own index saw the history."""
        if self.session_stickiness is None:
            return premium
        own = self.session_stickiness
        own += (self.stickiness - own) * self.stickiness_floor
        return np.where(self.queued(work), premium, np.minimum(premium, own))


@dataclass(slots=True)
class _Ranking:
    """The scheduler's per-endpoint figures, kept to explain a decision on demand."""

    table: EndpointTable
    cap: np.ndarray
    eligible: np.ndarray
    score: np.ndarray
    cost: np.ndarray
    order: np.ndarray

    def candidate(self, i: int) -> dict[str, Any]:
        figures = {
            "endpoint": self.table.address(i),
            "matched_blocks": int(self.table.matched[i]),
            "load": float(self.table.load[i]),
            "load_cap": round(float(self.cap[i]), 3),
            "eligible": bool(self.eligible[i]),
            "score": round(float(self.score[i]), 4),
            "queued_work": round(float(self.table.work[i])),
            "est_cost": round(float(self.cost[i])),
        }
        if self.table.placed is not None:
            figures["placed_work"] = round(float(self.table.placed[i]))
        return figures


@dataclass(slots=True)
class Decision:
    endpoint: str | None
    rule: str
    fallbacks: list[str] = field(default_factory=list)
    total_blocks: int = 0
    matched_blocks: int = 0
    placement_key: int = 0
    # The keys a cold start of its session would be placed by (its own, its preamble's):
    # Router._age_off_pick.
    home_keys: tuple[int, ...] = ()
    # The endpoints ready to serve its model when it was routed (a mask by router position).
    home_pool: np.ndarray | None = None
    # Kept for correcting the index if Envoy reports another served endpoint.
    hashes: Sequence[int] | np.ndarray = ()
    # Where Envoy says the request really went, when that differs from ``endpoint``.
    served: str | None = None
    # Estimated prompt tokens and the prefill work charged to the endpoint (token-equivalents).
    prompt_tokens: float = 0.0
    work: float = 0.0
    # Router-private bookkeeping for taking the charge back (see Router.finish).
    charged_at: float = 0.0
    queued_before: float = 0.0
    # Which incarnation of the endpoint it was charged to (an endpoint removed and added
    # again is another: the old one's requests are not the new one's to finish).
    charged_generation: int = -1
    # The endpoint answered (first byte): the prefill work charge was taken back already.
    work_released: bool = False
    # Placed as a cold start (rule 3): counted in the endpoints' placed work.
    cold_start: bool = False
    # The blocks wait to be entered in the index as held at ``endpoint`` (Router.record).
    unrecorded: bool = False
    # Requests the server runs for it (n samples; LLMRequest.engine_requests): what it
    # counts in flight, as the server's running and waiting gauges do.
    engine_requests: int = 1
    ranking: _Ranking | None = None

    def explain(self, top_k: int | None = None) -> dict[str, Any]:
        """Candidates best first (top_k of them), with the figures they were ranked by."""
        ranking = self.ranking
        order = [] if ranking is None else ranking.order[:top_k].tolist()
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
            "candidates": [ranking.candidate(i) for i in order] if ranking else [],
        }


def _with_room(eligible: np.ndarray, saturated: np.ndarray | None) -> np.ndarray:
    """A new session avoids KV caches reported full while another eligible one has room. A
    request whose own prefix is held is not moved for it: in the simulator's overloaded
    cells that cost up to 0.22 of hit ratio and lengthened the tail by up to 60%
    (docs/benchmarks.md)."""
    if saturated is None:
        return eligible
    roomy = eligible & ~saturated
    return roomy if roomy.any() else eligible


class Scheduler:
    def __init__(self, config: RoutingConfig, cost: CostModel | None = None) -> None:
        self.config = config
        self.cost = cost or CostModel.from_config(config)
        self.popularity = PrefixPopularity(config.popularity_window)
        self.recurrence = KeyRecurrence()
        # Placement key -> address hash of the endpoint a cold start placed it on.
        self.homes: OrderedDict[int, int] = OrderedDict()

    def pick(
        self,
        table: EndpointTable,
        total_blocks: int,
        key: int,
        session_blocks: int = 0,
        prompt_tokens: float | None = None,
        block_tokens: float = 1.0,
        hashes: np.ndarray | None = None,
        group_key: int = 0,
        turnless: bool = False,
        index_shared: bool = False,
    ) -> Decision:
        """``prompt_tokens`` defaults to ``total_blocks`` x ``block_tokens``. ``hashes`` (the
        request's block hashes) name the shared prefix a new session matches, for
        ``popularity``; without them every shared prefix counts as a group's. ``group_key``
        (hashing.group_key; 0: none) places a new session instead of ``key`` while its
        preamble is not popular. ``turnless``: a completion, whose session the router cannot
        tell by its turns (session_blocks is then the first cold_start_blocks).
        ``index_shared``: the router's index is told of more than its own placements (peers'
        placements, KV-cache events): a copy off the pick is then found by the others too,
        and recurring keys add nothing to the cold-start margin."""
        if prompt_tokens is None:
            prompt_tokens = total_blocks * block_tokens
        count = len(table)
        if not count:
            return Decision(
                None,
                RULE_NO_ENDPOINT,
                total_blocks=total_blocks,
                placement_key=key,
                prompt_tokens=prompt_tokens,
            )
        cfg = self.config
        n = prompt_tokens
        load, work, matched = table.load, table.work, table.matched
        model = self.cost.for_held(float(matched.max()) * block_tokens)
        weight = table.weight if table.weight is not None else np.ones(count)
        # Guard: at most (1+eps) x the weighted share of the load (or share + slack).
        share = (float(load.sum()) + 1) / float(weight.sum()) * weight
        cap = np.maximum((1 + cfg.load_epsilon) * share, share + cfg.load_slack)
        eligible = load + 1 <= cap
        if not eligible.any():
            eligible = np.ones(count, dtype=bool)
        cached = np.minimum(n, matched * block_tokens)
        cost = work + model.prefill_many(n, cached, work)

        best_eligible_match = int(matched[eligible].max())
        # Holding the session prefix, or a shared prefix that is most of the prompt (a long
        # document or system prompt before a short question): following the latter saves
        # most of the prefill, and spreading such requests would copy it to every endpoint.
        needed = max(
            cfg.min_match_blocks,
            min(session_blocks, math.ceil(cfg.shared_prefix_fraction * total_blocks)),
        )
        # A new session (its own prefix held by no eligible endpoint) is counted, with the
        # shared prefix it matches, if any: one that draws more than one endpoint's share of
        # the new sessions (one system prompt for every conversation) is placed as a cold
        # start, so that its conversations spread and it is copied to every endpoint once.
        # Following its holders piled the conversations onto them, with all their later
        # turns (simulated chat, 16 replicas: max/mean 7.8 requests without the count guard,
        # which had to move them back), and another router replica, which cold-starts a
        # later turn it sees first, looked for them elsewhere. A group's document (many
        # documents, each drawing a few sessions) is still followed. Once every endpoint
        # holds the preamble, the two rules pick alike. A session whose preamble is not
        # popular is placed by that preamble's key (group_key), so that every router replica
        # sends one document's questions to the same endpoint.
        popular = False
        new_or_cold = best_eligible_match < session_blocks or best_eligible_match < needed
        # A completion has no turns to tell its own session from a preamble it shares with
        # others by: one whose held prefix is under shared_prefix_fraction of it is a new
        # session of that prefix too, for the popularity measure below.
        shared_preamble = (
            turnless
            and cfg.spread_popular_completions
            and 0 < best_eligible_match < math.ceil(cfg.shared_prefix_fraction * total_blocks)
        )
        new_or_cold = new_or_cold or shared_preamble
        if cfg.spread_popular_prefixes and new_or_cold:
            shared = group_key or None
            if shared is None and hashes is not None and best_eligible_match:
                shared = int(hashes[best_eligible_match - 1])
            popular = self.popularity.new_session(shared) * count > 1 + 1e-9
            if popular and group_key:
                # The preamble is most of the prompt (a document): spreading copies it whole,
                # once per endpoint a question lands on, so its share must be beyond chance.
                popular = self.popularity.draws_more_than(1.0 / count)
            if popular and shared_preamble and hashes is not None:
                # Placed by its own first blocks after the preamble, which its later
                # requests (the same prompt, extended) share: the key of its first blocks
                # lies inside the preamble and would send every such session to one endpoint.
                after = min(total_blocks, best_eligible_match + cfg.cold_start_blocks)
                key = int(hashes[after - 1])
        if new_or_cold and group_key and not popular:
            key = group_key
            # A question on a document holds its group once the document's first blocks are
            # held, as a completion's does: a tight cache evicts a document's tail first, and
            # asking for half the prompt re-placed it by rendezvous, away from a holder the
            # queued-work margin had chosen (chat-form GAIE 8 x 100k: 0.855 -> 0.876).
            needed = max(cfg.min_match_blocks, min(needed, cfg.cold_start_blocks))
        self.recurrence.observe(key)
        rendezvous = rendezvous_scores(key, table.address_hash)
        if best_eligible_match >= needed and total_blocks and not popular:
            # Only a shared prefix is held, not the session's own: a new session.
            new_session = best_eligible_match < session_blocks
            if new_session:
                eligible = _with_room(eligible, table.saturated)
            best_tokens = min(n, best_eligible_match * block_tokens)
            premium = model.premium(table.fill, work)
            if not new_session and not turnless:
                premium = model.continuing_premium(premium, work)
            if model.backlog_stickiness:
                least = float((work + table.backlog)[eligible].min())
                premium = premium + model.backlog_premium(n, least)
            score = -(cost + premium * np.maximum(0.0, best_tokens - cached))
            if new_session:
                # The rendezvous order among the endpoints within the cold-start margin of
                # the best, not simply the best: another router replica that sees a later
                # turn (and not this one) cold-starts it by the same rendezvous order.
                top = float(score[eligible].max())
                score = (score >= top - model.cold_margin * model.prefill(n, 0)).astype(float)
            # Eligible first, then the highest score, then the rendezvous order.
            order = np.lexsort((~rendezvous, -score, ~eligible))
            chosen = int(order[0])
            rule = RULE_LOAD_GUARD if matched.max() > matched[chosen] else RULE_AFFINITY
            cold_start = False
        else:
            # Cold start: rendezvous order among the endpoints whose cost is within the
            # margin of the cheapest, so replicas agree unless the top one is overloaded.
            # Queued work only: a cheaper prefill where a shared preamble is held must not
            # pull new sessions onto the holders (the herding described above).
            eligible = _with_room(eligible, table.saturated)
            cold_prefill = model.prefill(n, 0)
            limit = float(work[eligible].min()) + model.cold_margin * cold_prefill
            if key in self.homes:
                # A key this router placed before (a document's next question, a session whose
                # prefix its index lost) while other routers' requests wait on every endpoint:
                # the rendezvous pick's extra queue passes, a copy elsewhere stays, and other
                # router replicas, which see the same servers' queues, keep to the pick alike.
                # A key seen first is placed by the queues as before: most of the Mooncake
                # trace's keys come once or twice, and there the queues keep the tails short.
                others = np.broadcast_to(table.backlog, work.shape)[eligible]
                limit += model.backlog_stickiness * float(others.min())
            if not index_shared:
                limit += model.recurring_margin(self.recurrence.rate) * cold_prefill
            score = (work <= limit).astype(np.float64)
            if table.placed is not None:
                score = 3.0 * score + self._balance(
                    table, eligible, score > 0, key, rendezvous, cold_prefill
                )
            order = np.lexsort((~rendezvous, -score, ~eligible))
            chosen = int(order[0])
            self._remember_home(key, table, chosen)
            cold_start = True
            skipped = bool((~eligible & (matched >= needed)).any())
            spread = popular and best_eligible_match >= needed
            rule = RULE_LOAD_GUARD if skipped else RULE_SPREAD if spread else RULE_COLD_START
        return Decision(
            endpoint=table.address(chosen),
            rule=rule,
            fallbacks=[table.address(i) for i in order[1 : 1 + cfg.fallbacks].tolist()],
            total_blocks=total_blocks,
            matched_blocks=int(matched[chosen]),
            placement_key=key,
            prompt_tokens=n,
            work=float(cost[chosen] - work[chosen]),
            cold_start=cold_start,
            ranking=_Ranking(table, cap, eligible, score, cost, order),
        )

    def _balance(
        self,
        table: EndpointTable,
        eligible: np.ndarray,
        within: np.ndarray,
        key: int,
        rendezvous: np.ndarray,
        cold_prefill: float,
    ) -> np.ndarray:
        """Rule 3's preference after the queued-work margin, for a router that places (nearly)
        all the traffic: the endpoint this key was placed on before (2), else every endpoint
        whose placed work is at most the eligible mean (1); the rendezvous order decides
        among equals. The rendezvous order alone spreads few groups unevenly (64 groups over 8
        replicas: 277 to 665 requests each, max/mean 1.17-1.39, against SGLang's 1.04 for
        placing each new group on its least-filled replica); each replica's share of the
        groups, not its queue, then sets its tail (docs/benchmarks.md). With
        ``placed_choices`` n (router replicas sharing placements): the first of the key's n
        first rendezvous picks among the eligible within the margin (1), unless another of
        them has less placed work by more than SHARED_BALANCE_MARGIN cold prefills of this
        request. The replicas' views of the placed work differ by their last second's
        placements; a choice among two, and only past that margin, keeps them picking alike
        when a conversation's next turn reaches another replica before its placement does."""
        placed = table.placed
        assert placed is not None
        home = self.homes.get(key) if self.config.balance_cold_starts else None
        if home is not None and table.address_hash is not None:
            return (table.address_hash == np.uint64(home)).astype(np.float64) * 2.0
        if table.placed_choices:
            candidates = np.flatnonzero(eligible & within)
            first = candidates[np.argsort(~rendezvous[candidates], kind="stable")]
            first = first[: table.placed_choices]
            preferred = np.zeros(len(placed))
            if len(first):
                # The first pick unless another has less placed work by more than the margin.
                margin = SHARED_BALANCE_MARGIN * cold_prefill
                pick = first[0]
                for other in first[1:]:
                    if placed[pick] > placed[other] + margin:
                        pick = other
                preferred[pick] = 1.0
            return preferred
        fair = float(placed[eligible].sum()) / max(1, int(eligible.sum()))
        return (placed <= fair + 1e-9).astype(np.float64)

    def _remember_home(self, key: int, table: EndpointTable, chosen: int) -> None:
        if table.address_hash is None:
            return
        self.homes[key] = int(table.address_hash[chosen])
        self.homes.move_to_end(key)
        if len(self.homes) > HOME_KEYS:
            self.homes.popitem(last=False)
