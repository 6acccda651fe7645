"""Routing policies behind one interface: route(request, now) → (replica, handle); finish.

``ours`` drives extproc.router.Router itself (prompt bytes derived from the chunk ids, so
the core's hashing, index and scheduler run unchanged). The peers are re-implemented from
their public descriptions (/work/shared/notes/peer-policies.md); each docstring cites the
parameters used. Indexes of the peers work on the workload's chunk ids (see cache.py),
which is exact for chained ids and approximates their character- or 64-char-block
granularity at the chunk size (16 tokens for generated workloads, 512 for Mooncake).
Router-tracked state (in-flight counts, predicted caches) is per policy instance; with
K router replicas each instance sees only the requests sent through it. Metrics a real
router scrapes from the model servers (queue length, KV usage) are read as often as it
scrapes them: ours every ``signals.interval_seconds``, GAIE every 50 ms (its default);
the others read none.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from xxhash import xxh3_64_intdigest

from .. import warm_start
from ..config import EndpointConfig, PeersConfig, RoutingConfig, SignalsConfig
from ..placements import PlacementLog
from ..prompt import LLMRequest
from ..router import Router
from ..scheduler import CostModel as RouterCostModel
from ..signals import EndpointSignals, prefill_window
from .cache import ChunkLRU
from .replica import Replica, cache_units
from .workloads import SimRequest

BYTES_PER_TOKEN = 4


class Policy(Protocol):
    def route(self, request: SimRequest, now: float) -> tuple[int, Any]: ...

    def finish(self, handle: Any) -> None: ...


@dataclass
class PolicyContext:
    replicas: list[Replica]
    rng: random.Random
    capacity_tokens: int
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    kv_block_tokens: int = 16
    # The router's own cost estimate (extproc.scheduler.CostModel; None = its defaults).
    router_cost: RouterCostModel | None = None
    # Simulated time in seconds, kept current by the engine: the clock ``ours`` runs on.
    now: float = 0.0
    # K router replicas of ours read each other's queued work (config ``peers``).
    share_queues: bool = False
    share_placements: bool = False
    # Ours keeps its configured block size (SimParams.server_blocks).
    server_blocks: bool = False
    # Ours' router replicas read the replicas' KV-cache events this long (seconds) after
    # they happen (SimParams.kv_events_ms); None: they do not.
    cache_events_delay: float | None = None
    # ... and a router that starts late reads the last this-many messages of each replica
    # first (SimParams.kv_events_replay); 0: only what is published after it starts.
    cache_events_replay: int = 0
    # Which names the replicas go by (0: the names of every run before Dec 7's fortieth
    # session). Policies that hash names (ours' rendezvous order, the hash ring) place keys
    # by them, so each naming is one draw of a deployment's addresses; the engine draws it
    # from the seed for a trace, which the seed does not change otherwise.
    labelling: int = 0
    # What a router of ours that starts during the run is handed (SimParams.warm_start).
    warm_start: str = "none"

    @property
    def n(self) -> int:
        return len(self.replicas)

    def address(self, replica: int) -> str:
        """Replica ``replica``'s address as ours knows it."""
        port = 8000 + self.labelling % 50_000
        return f"10.0.{replica // 250}.{replica % 250 + 1}:{port}"

    def ring_name(self, replica: int) -> str:
        """Replica ``replica``'s name on the consistent-hashing ring."""
        return f"replica-{replica}" + (f"@{self.labelling}" if self.labelling else "")


def _argbest(values: Sequence[float], rng: random.Random, highest: bool = True) -> int:
    """Index of the best value, ties broken at random (as the Go and Rust pickers do)."""
    best = max(values) if highest else min(values)
    ties = [i for i, v in enumerate(values) if v == best]
    return ties[0] if len(ties) == 1 else rng.choice(ties)


class _Tracked:
    """Router-tracked in-flight count per replica (what SGLang & co call 'load')."""

    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx
        self.load = [0] * ctx.n

    def _sent(self, replica: int) -> tuple[int, Any]:
        self.load[replica] += 1
        return replica, replica

    def finish(self, handle: Any) -> None:
        self.load[handle] -= 1


class RandomPolicy(_Tracked):
    def route(self, request: SimRequest, now: float) -> tuple[int, Any]:
        return self._sent(self.ctx.rng.randrange(self.ctx.n))


class RoundRobinPolicy(_Tracked):
    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self.next = ctx.rng.randrange(ctx.n)

    def route(self, request: SimRequest, now: float) -> tuple[int, Any]:
        replica, self.next = self.next, (self.next + 1) % self.ctx.n
        return self._sent(replica)


class LeastLoadedPolicy(_Tracked):
    """Fewest router-tracked in-flight requests; ties at random."""

    def route(self, request: SimRequest, now: float) -> tuple[int, Any]:
        return self._sent(_argbest(self.load, self.ctx.rng, highest=False))


class ConsistentHashPolicy(_Tracked):
    """Hash ring (160 virtual nodes per replica, xxh3) keyed on the prompt's first block."""

    VNODES = 160

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        points = sorted(
            (xxh3_64_intdigest(f"{ctx.ring_name(r)}#{v}".encode()), r)
            for r in range(ctx.n)
            for v in range(self.VNODES)
        )
        self.keys = [p for p, _ in points]
        self.owners = [r for _, r in points]

    def route(self, request: SimRequest, now: float) -> tuple[int, Any]:
        key = xxh3_64_intdigest(request.ids[0].to_bytes(8, "little"))
        slot = bisect.bisect(self.keys, key) % len(self.keys)
        return self._sent(self.owners[slot])


def _truncate(request: SimRequest, unit_tokens: int, max_units: int) -> tuple[list[int], int, int]:
    """Chunk ids covering at most ``max_units`` units; (ids, units per chunk, last units)."""
    full = request.chunk_tokens // unit_tokens
    last = request.last_tokens // unit_tokens
    ids = list(request.ids)
    total = full * (len(ids) - 1) + last
    if total > max_units and full:
        keep = min(len(ids), max_units // full)
        if keep == 0:
            return ids[:1], full, max_units
        ids, last = ids[:keep], full
    return ids, full, last


class GaiePolicy:
    """Gateway API Inference Extension endpoint picker, default profile (2025-11).

    Weighted sum of scorers, each in [0, 1], max-score pick (random ties):
    prefix-cache ×3 (consecutive matched 64-char blocks / total blocks, at most 256 blocks,
    per-endpoint LRU of block hashes, updated for the picked endpoint at send),
    queue ×2 (min-max normalised waiting requests, 1.0 = shortest, all 1.0 if equal),
    kv-cache-utilization ×2 (1 − KV usage). 64 chars = 16 tokens at 4 chars/token.
    The LRU holds as many blocks as the server's KV cache (the prefix plugin's AutoTune,
    on by default upstream: sized from each server's reported GPU blocks); the notes' fixed
    31,250 blocks (``LRU_BLOCKS``) was the earlier default and what the figures before Dec 5
    used (docs/benchmarks.md, "Peers made faithful to their current sources").
    The queue and KV figures are the servers' metrics as last scraped: upstream refreshes
    them every 50 ms (``--refresh-metrics-interval``, default and floor; the picker counts
    none of its own picks in between), here taken at the first decision at least
    ``REFRESH_SECONDS`` after the last (a few ms fresher than a fixed tick: a bound in its
    favour). Until Dec 5 (night) it read them exact at every decision.
    """

    PREFIX_W, QUEUE_W, KV_W = 3.0, 2.0, 2.0
    BLOCK_TOKENS, MAX_BLOCKS, LRU_BLOCKS = 16, 256, 31_250
    REFRESH_SECONDS = 0.05

    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx
        blocks = max(1, ctx.capacity_tokens // self.BLOCK_TOKENS)
        self.index = [ChunkLRU(blocks) for _ in range(ctx.n)]
        self.waiting: list[int] = []
        self.kv_usage: list[float] = []
        self.next_refresh = -math.inf

    def route(self, request: SimRequest, now: float) -> tuple[int, Any]:
        if now >= self.next_refresh:
            self.waiting = [len(r.waiting) for r in self.ctx.replicas]
            self.kv_usage = [r.kv_usage() for r in self.ctx.replicas]
            self.next_refresh = now + self.REFRESH_SECONDS
        ids, full, last = _truncate(request, self.BLOCK_TOKENS, self.MAX_BLOCKS)
        total = full * (len(ids) - 1) + last
        waiting = self.waiting
        lo, hi = min(waiting), max(waiting)
        scores = []
        for r in range(self.ctx.n):
            prefix = self.index[r].match(ids, full, last) / total if total else 0.0
            queue = 1.0 if hi == lo else (hi - waiting[r]) / (hi - lo)
            kv = 1.0 - self.kv_usage[r]
            scores.append(self.PREFIX_W * prefix + self.QUEUE_W * queue + self.KV_W * kv)
        chosen = _argbest(scores, self.ctx.rng)
        if total:
            self.index[chosen].touch(ids, full, last)
        return chosen, None

    def finish(self, handle: Any) -> None:
        pass


class SglangCacheAwarePolicy(_Tracked):
    """SGLang router ``cache_aware`` with the CLI defaults: cache_threshold 0.3,
    balance_abs_threshold 64, balance_rel_threshold 1.5, max_tree_size 2^26 chars per tenant.

    If max_load − min_load > 64 and max_load > 1.5 × min_load: least-loaded (still inserted
    into its tree). Else the worker with the longest match if matched/total > 0.3, otherwise
    the worker with the smallest tree. Load = router-tracked in-flight. The radix tree is
    approximated over chunk ids (exact for chained ids, at chunk granularity); eviction is
    applied on insert rather than every 120 s.
    """

    CACHE_THRESHOLD, BALANCE_ABS, BALANCE_REL = 0.3, 64, 1.5
    MAX_TREE_TOKENS = 2**26 // BYTES_PER_TOKEN

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self.trees = [ChunkLRU(self.MAX_TREE_TOKENS) for _ in range(ctx.n)]

    def route(self, request: SimRequest, now: float) -> tuple[int, Any]:
        full, last = request.chunk_tokens, request.last_tokens
        lo, hi = min(self.load), max(self.load)
        if hi - lo > self.BALANCE_ABS and hi > self.BALANCE_REL * lo:
            chosen = self.load.index(lo)
        else:
            matched = [t.match(request.ids, full, last) for t in self.trees]
            best = max(range(self.ctx.n), key=lambda r: matched[r])
            if matched[best] / request.input_tokens > self.CACHE_THRESHOLD:
                chosen = best
            else:
                chosen = min(range(self.ctx.n), key=lambda r: self.trees[r].used)
        self.trees[chosen].touch(request.ids, full, last)
        return self._sent(chosen)


class DynamoPolicy:
    """NVIDIA Dynamo KV router, approximate mode (no engine KV events), as its source has it
    (``selector.rs`` ``select_worker``, ``sequence.rs`` ``potential_blocks_and_tokens``):
    cost = overlap_weight (1.0) × (the worker's tokens still in prefill + this request's
    tokens not cached there) / block size + the worker's active blocks with this request's
    added (each block once: requests sharing a prefix share its blocks); temperature 0 →
    lowest cost (random ties). A request's prefill tokens count until its first token (the
    router sees it stream by), its blocks until it ends. The index predicts from the
    router's own decisions with a 120 s TTL. Blocks are KV blocks of 16 tokens. (Before Dec 5
    the cost was uncached blocks + the sum of in-flight prompt blocks: no prefill term, no
    sharing; the notes' reading.)
    """

    OVERLAP_WEIGHT, TTL_S = 1.0, 120.0

    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx
        self.block = ctx.kv_block_tokens
        self.seen: list[dict[int, tuple[int, float]]] = [{} for _ in range(ctx.n)]
        self.prefill_tokens = [0] * ctx.n
        # Per worker: chunk id -> [requests holding it, blocks of it held]; and their sum.
        self.active: list[dict[int, list[int]]] = [{} for _ in range(ctx.n)]
        self.active_blocks = [0] * ctx.n

    def _cached(self, r: int, request: SimRequest, full: int, last: int, now: float) -> int:
        seen, final, total = self.seen[r], len(request.ids) - 1, 0
        for i, chunk in enumerate(request.ids):
            entry = seen.get(chunk)
            if entry is None or entry[1] < now:
                break
            need = last if i == final else full
            if entry[0] < need:
                return total + entry[0]
            total += need
        return total

    def _added_blocks(self, r: int, request: SimRequest, full: int, last: int) -> int:
        """Blocks this request adds to worker ``r``'s active ones (its shared ones once)."""
        active, final, added = self.active[r], len(request.ids) - 1, 0
        for i, chunk in enumerate(request.ids):
            need = last if i == final else full
            held = active.get(chunk)
            added += need - min(need, held[1]) if held else need
        return added

    def route(self, request: SimRequest, now: float) -> tuple[int, Any]:
        full = request.chunk_tokens // self.block
        last = request.last_tokens // self.block
        costs, new_tokens = [], []
        for r in range(self.ctx.n):
            cached = self._cached(r, request, full, last, now) * self.block
            new = max(0, request.input_tokens - cached)
            new_tokens.append(new)
            prefill = (self.prefill_tokens[r] + new) / self.block
            active = self.active_blocks[r] + self._added_blocks(r, request, full, last)
            costs.append(self.OVERLAP_WEIGHT * prefill + active)
        chosen = _argbest(costs, self.ctx.rng, highest=False)
        seen, expiry, final = self.seen[chosen], now + self.TTL_S, len(request.ids) - 1
        active = self.active[chosen]
        for i, chunk in enumerate(request.ids):
            need = last if i == final else full
            held = seen.get(chunk)
            seen[chunk] = (max(need, held[0]) if held else need, expiry)
            entry = active.setdefault(chunk, [0, 0])
            entry[0] += 1
            if need > entry[1]:
                self.active_blocks[chosen] += need - entry[1]
                entry[1] = need
        self.prefill_tokens[chosen] += new_tokens[chosen]
        return chosen, _DynamoRequest(chosen, new_tokens[chosen], request.ids)

    def prefill_done(self, handle: _DynamoRequest) -> None:
        if not handle.prefilled:
            handle.prefilled = True
            self.prefill_tokens[handle.worker] -= handle.new_tokens

    def finish(self, handle: _DynamoRequest) -> None:
        self.prefill_done(handle)
        active = self.active[handle.worker]
        for chunk in handle.chunks:
            entry = active.get(chunk)
            if entry is None:
                continue
            entry[0] -= 1
            if entry[0] == 0:
                self.active_blocks[handle.worker] -= entry[1]
                del active[chunk]


class DynamoEventsPolicy(DynamoPolicy):
    """Dynamo's KV router as it runs by default: its index is fed by the engines' KV-cache
    events (``--kv-events``, on unless ``--no-kv-events``), so the overlap it scores is each
    worker's true prefix cache, not its own prediction; the cost and the active-sequence
    counting are ``DynamoPolicy``'s. The simulator gives it the caches at the instant of the
    decision (no event delay): an upper bound of what its events tell it."""

    def _cached(self, r: int, request: SimRequest, full: int, last: int, now: float) -> int:
        return self.ctx.replicas[r].cached_tokens(request) // self.block


@dataclass(slots=True)
class _DynamoRequest:
    worker: int
    new_tokens: int
    chunks: Sequence[int]
    prefilled: bool = False


class ProductionStackPolicy:
    """vLLM production-stack ``prefixaware``: hash trie of 128-char chunks (xxhash64),
    longest prefix match, random choice among the endpoints holding it (all endpoints when
    nothing matches); no eviction, no load guard. Trie nodes are the workload's chunk ids.
    """

    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx
        self.trie: dict[int, set[int]] = {}
        self.everyone = frozenset(range(ctx.n))

    def route(self, request: SimRequest, now: float) -> tuple[int, Any]:
        holders: frozenset[int] | set[int] = self.everyone
        for chunk in request.ids:
            node = self.trie.get(chunk)
            if not node:
                break
            holders = node
        chosen = self.ctx.rng.choice(sorted(holders))
        for chunk in request.ids:
            self.trie.setdefault(chunk, set()).add(chosen)
        return chosen, None

    def finish(self, handle: Any) -> None:
        pass


class OraclePolicy:
    """Upper bound: knows every replica's true cache; most cached tokens, then least loaded
    (waiting + running), then random."""

    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx

    def route(self, request: SimRequest, now: float) -> tuple[int, Any]:
        scores = [(r.cached_tokens(request), -r.in_flight) for r in self.ctx.replicas]
        return _argbest(scores, self.ctx.rng), None  # type: ignore[arg-type]

    def finish(self, handle: Any) -> None:
        pass


class PromptBytes:
    """Deterministic prompt bytes for chunk ids: each id → bytes_per_token × chunk tokens
    bytes (its 8-byte id repeated), the last chunk truncated. Cached per id."""

    def __init__(self) -> None:
        self._chunks: dict[tuple[int, int], bytes] = {}

    def chunk(self, chunk: int, size: int) -> bytes:
        key = (chunk, size)
        data = self._chunks.get(key)
        if data is None:
            pattern = chunk.to_bytes(8, "little")
            data = (pattern * (size // 8 + 1))[:size]
            self._chunks[key] = data
        return data

    def request(self, request: SimRequest) -> LLMRequest:
        size = request.chunk_tokens * BYTES_PER_TOKEN
        parts = [self.chunk(c, size) for c in request.ids[:-1]]
        parts.append(self.chunk(request.ids[-1], size)[: request.last_tokens * BYTES_PER_TOKEN])
        return LLMRequest(
            api="chat" if request.first_turn_tokens else "completions",
            model="sim-model",
            cache_salt="",
            prompt=b"".join(parts),
            first_turn_end=request.first_turn_tokens * BYTES_PER_TOKEN,
            preamble_end=request.preamble_tokens * BYTES_PER_TOKEN,
            stream=True,
        )


def sim_routing_config(base: RoutingConfig, chunk_tokens: int) -> RoutingConfig:
    """The router's config for a workload: blocks no smaller than one workload chunk.

    Hashing a Mooncake prompt (15k tokens) in 64-byte blocks costs ~1k hashes and index
    touches per request; one 2,048-byte block per 512-token id gives the same matches (ids
    are the trace's own sharing granularity) ~30× faster. cold_start_blocks is scaled to
    keep its span in bytes (at least one block).
    """
    chunk_bytes = chunk_tokens * BYTES_PER_TOKEN
    if chunk_bytes <= base.block_size_bytes:
        return base
    span = base.block_size_bytes * base.cold_start_blocks
    return base.model_copy(
        update={
            "block_size_bytes": chunk_bytes,
            "cold_start_blocks": max(1, span // chunk_bytes),
        }
    )


class CacheEventFeed:
    """The replicas' KV-cache events (vLLM's BlockStored / BlockRemoved over ZMQ) as ours'
    router replicas would read them: every subscriber gets every event ``delay`` seconds
    after it happened, in block hashes of the router's own (what a router that tokenises
    and hashes the events' tokens as it hashes prompts computes). A chunk's hashes are
    learnt from the requests that carried it (as many whole blocks as any of them had); a
    block never hashed by a router (a reply not yet carried back, a prompt's partial last
    chunk) is left out."""

    def __init__(self, ctx: PolicyContext, delay: float, replay: int = 0) -> None:
        self.ctx = ctx
        self.delay = delay
        self.queues: list[deque[tuple[float, int, list[tuple[bool, int, int]]]]] = []
        # Each replica's last ``replay`` messages, for a subscriber that starts late (vLLM's
        # replay_endpoint keeps buffer_steps of them; the server's subscriber asks for them
        # when its first message shows a gap, cache_subscriber.py). A message here is one
        # batch a replica publishes (a prefill's stored blocks, an eviction's removals).
        self.replay = replay
        self.buffers: list[deque[tuple[float, int, list[tuple[bool, int, int]]]]] = [
            deque(maxlen=replay) for _ in ctx.replicas
        ]
        # chunk id -> the router's block hashes of its whole blocks
        self.chunk_hashes: dict[int, np.ndarray] = {}
        for r, replica in enumerate(ctx.replicas):
            replica.listen_cache_events(lambda events, r=r: self._publish(r, events))

    def _publish(self, replica: int, events: list[tuple[bool, int, int]]) -> None:
        message = (self.ctx.now, replica, events)
        for queue in self.queues:
            queue.append(message)
        if self.replay:
            self.buffers[replica].append(message)

    def subscribe(self) -> deque[tuple[float, int, list[tuple[bool, int, int]]]]:
        """A new subscriber's queue; with replay, what the replicas still buffer comes first
        (in time order), as a router started late asks for it."""
        queue: deque[tuple[float, int, list[tuple[bool, int, int]]]] = deque(
            heapq.merge(*self.buffers, key=lambda message: message[0])
        )
        self.queues.append(queue)
        return queue

    def unsubscribe(self, queue: deque[tuple[float, int, list[tuple[bool, int, int]]]]) -> None:
        self.queues = [q for q in self.queues if q is not queue]

    def learn(self, ids: Sequence[int], hashes: np.ndarray, per_chunk: int) -> None:
        """The hashes a router computed for a request's chunks (per_chunk blocks each)."""
        known = self.chunk_hashes
        for i, chunk in enumerate(ids):
            blocks = hashes[i * per_chunk : (i + 1) * per_chunk]
            if not len(blocks):
                break
            if len(blocks) > len(known.get(chunk, ())):
                known[chunk] = blocks

    def hashes(
        self, events: list[tuple[bool, int, int]], block_tokens: int
    ) -> list[tuple[bool, np.ndarray]]:
        """(stored, router block hashes) of each event: a stored chunk's whole blocks of
        ``block_tokens`` among the units it holds, a removed chunk's every block."""
        out = []
        for stored, chunk, units in events:
            blocks = self.chunk_hashes.get(chunk)
            if blocks is None:
                continue
            if stored:
                blocks = blocks[: units // block_tokens]
            if len(blocks):
                out.append((stored, blocks))
        return out


# A replica's prefill counters before its first request.


class OursPolicy:
    """extproc.router.Router, unchanged: route() on an LLMRequest, finish() on completion."""

    def __init__(
        self,
        ctx: PolicyContext,
        prompts: PromptBytes,
        chunk_tokens: int,
        cache_events: CacheEventFeed | None = None,
    ) -> None:
        self.ctx = ctx
        self.prompts = prompts
        config = ctx.routing if ctx.server_blocks else sim_routing_config(ctx.routing, chunk_tokens)
        # KV-cache events: this replica's queue of them, and the router's blocks per chunk.
        self.cache_events = cache_events
        self.event_queue = cache_events.subscribe() if cache_events is not None else None
        # The messages queued at subscribing are the replayed ones (the replicas' buffers).
        self.replayed_left = len(self.event_queue) if self.event_queue is not None else 0
        self.block_tokens = config.block_size_bytes // BYTES_PER_TOKEN
        if cache_events is not None and chunk_tokens % self.block_tokens:
            raise ValueError(
                f"cache events need whole router blocks per chunk: {chunk_tokens} tokens "
                f"against blocks of {self.block_tokens}"
            )
        self.blocks_per_chunk = max(1, chunk_tokens // self.block_tokens)
        addresses = [ctx.address(r) for r in range(ctx.n)]
        self.replica_of = {a: r for r, a in enumerate(addresses)}
        self.router = Router(
            config,
            [EndpointConfig(address=a, capacity_tokens=ctx.capacity_tokens) for a in addresses],
            cost=ctx.router_cost,
            clock=lambda: ctx.now,
        )
        self.rules: dict[str, int] = {}
        self.addresses = addresses
        # The server scrapes each model server's /metrics (signals.py); so does the simulator,
        # at the same default interval, with the replicas' exact figures at that moment.
        self.signals_every = SignalsConfig().interval_seconds
        self.next_scrape = 0.0
        self.prefill_counters: dict[str, EndpointSignals] = {}
        # An index handed over at its start (RouterGroup warm_start), going in at its scrapes.
        self.handover: warm_start.Handover | None = None
        # The other router replicas of the group (RouterGroup), when they share queued work.
        self.peers: list[OursPolicy] = []
        self.peer_every = PeersConfig().interval_seconds
        self.next_peer_poll = 0.0
        self.peer_seen: dict[str, int] = {}
        if ctx.share_placements:
            self.router.placements = PlacementLog()

    def _scrape(self, now: float) -> None:
        """What signals.py reads from each model server's /metrics: running and waiting
        requests, KV-cache usage, and the prefill counters' increase since the last scrape
        (computed tokens, prefills, seconds), which vLLM counts as requests finish."""
        for address, replica in zip(self.addresses, self.ctx.replicas, strict=True):
            counters = EndpointSignals(
                up=True,
                prefill_tokens=float(replica.finished_prefill_tokens),
                prefills=float(replica.finished_prefills),
                prefill_seconds=replica.finished_prefill_ms / 1000.0,
            )
            # A router's first reading of a server gives no window, as signals.py's: the
            # counters' whole history is not this router's (one started mid-run had read
            # every prefill since the start as arrivals in its first second, and taken
            # itself for one router of very many).
            before = self.prefill_counters.get(address)
            counters.read_at = now
            self.prefill_counters[address] = counters
            self.router.observe_signals(
                address,
                True,
                running=replica.running,
                waiting=len(replica.waiting),
                kv_usage=replica.kv_usage(),
                prefill_window=None if before is None else prefill_window(before, counters),
                counts_finished=True,
            )
            if self.handover is not None:
                self.handover.endpoint_read(address, counters)
        if self.handover is not None and self.handover.done:
            self.handover = None
        self.next_scrape = now + self.signals_every

    def route(self, request: SimRequest, now: float) -> tuple[int, Any]:
        if now >= self.next_scrape:
            self._scrape(now)
        if self.peers and now >= self.next_peer_poll:
            # What peers.py reads from each other replica's admin endpoint, every interval.
            for peer in self.peers:
                if self.ctx.share_queues:
                    work = peer.router.own_queued_work()
                    self.router.observe_peer_work(peer.router.instance, work)
                if self.ctx.share_placements:
                    log = peer.router.placements
                    assert log is not None
                    self.router.observe_peer_placements(log.after(self.peer_seen.get(log.id, 0)))
                    self.router.observe_peer_placed(
                        peer.router.instance, peer.router.own_placed_work()
                    )
                    self.peer_seen[log.id] = log.last
            self.next_peer_poll = now + self.peer_every
        if self.event_queue is not None:
            self._read_cache_events(now)
        decision = self.router.route(self.prompts.request(request))
        if self.cache_events is not None:
            self.cache_events.learn(request.ids, decision.hashes, self.blocks_per_chunk)
        self.rules[decision.rule] = self.rules.get(decision.rule, 0) + 1
        assert decision.endpoint is not None
        return self.replica_of[decision.endpoint], decision

    def _read_cache_events(self, now: float) -> None:
        """Every event that reached this router by ``now``, one batch per replica and kind
        (the replayed ones, queued first when it subscribed, then live)."""
        queue, feed = self.event_queue, self.cache_events
        assert queue is not None and feed is not None
        due: dict[tuple[bool, int], list[tuple[bool, int, int]]] = {}
        while queue and queue[0][0] + feed.delay <= now:
            _, replica, events = queue.popleft()
            replayed = self.replayed_left > 0
            self.replayed_left -= replayed
            due.setdefault((replayed, replica), []).extend(events)
        for (replayed, replica), events in due.items():
            self.router.observe_cache_events(
                self.addresses[replica], feed.hashes(events, self.block_tokens), replayed
            )

    def finish(self, handle: Any) -> None:
        self.router.finish(handle)

    def hand_index_to(self, fresh: OursPolicy) -> None:
        """warm_start.py's handover, as the server makes it: this router's index now (what
        it writes at its stop, or serves a peer starting), encoded and decoded, goes into
        the fresh router's endpoint by endpoint at its first reading of each, where that
        reading and this one's tell the same server (warm_start.Handover)."""
        snapshot = warm_start.take(self.router, "", self.prefill_counters)
        snapshot = warm_start.decode(warm_start.encode(snapshot))
        fresh.handover = warm_start.Handover(
            snapshot, "simulated", fresh.router, reads_metrics=True, clock=lambda: fresh.ctx.now
        )

    def retire(self) -> None:
        """Taken out of the group: no more KV-cache events to queue for it."""
        if self.cache_events is not None and self.event_queue is not None:
            self.cache_events.unsubscribe(self.event_queue)
            self.event_queue = None


# What a router that starts is handed (SimParams.warm_start).
WARM_STARTS = ("none", "file", "peer")


class RouterGroup:
    """K independent instances of one policy; each request goes to one at random.

    With ``build`` the group can change during a run (``resize``, ``restart``): the router
    replicas of a deployment that scales or rolls. A retired instance routes nothing more
    but still hears its own requests finish."""

    def __init__(
        self,
        instances: list[Any],
        rng: random.Random,
        build: Callable[[], Any] | None = None,
        link_peers: bool = False,
        warm_start: str = "none",
    ) -> None:
        if warm_start not in WARM_STARTS:
            raise ValueError(f"warm start {warm_start!r}: choose from {', '.join(WARM_STARTS)}")
        self.instances = instances
        self.rng = rng
        self.build = build
        self.link_peers = link_peers
        self.warm_start = warm_start
        # The instances that take requests, oldest first.
        self.active: list[int] = list(range(len(instances)))
        if link_peers:
            self._link_peers()

    def route(self, request: SimRequest, now: float) -> tuple[int, Any]:
        active = self.active
        k = active[self.rng.randrange(len(active))] if len(active) > 1 else active[0]
        replica, handle = self.instances[k].route(request, now)
        return replica, (k, handle)

    @property
    def changeable(self) -> bool:
        return self.build is not None

    def resize(self, count: int) -> None:
        """Scale to ``count`` instances: fresh ones (empty state) join, or the newest leave
        (as a Kubernetes ReplicaSet scales in: the pods ready for the shortest time first)."""
        if self.build is None or count < 1:
            raise ValueError(f"cannot resize this group to {count}")
        while len(self.active) < count:
            self._add()
        while len(self.active) > count:
            self._retire(self.active.pop())
        if self.link_peers:
            self._link_peers()

    def restart(self) -> None:
        """A rolling restart's step: the oldest instance leaves and a fresh one joins."""
        if self.build is None:
            raise ValueError("cannot restart this group")
        oldest = self.active.pop(0)
        self._retire(oldest)
        self._add(predecessor=oldest)
        if self.link_peers:
            self._link_peers()

    def join(self) -> None:
        """A fresh instance joins (a surge pod, before the one it replaces leaves)."""
        if self.build is None:
            raise ValueError("cannot add to this group")
        self._add()
        if self.link_peers:
            self._link_peers()

    def leave(self, k: int) -> None:
        """Instance ``k`` leaves, if it still routes and is not the last."""
        if k in self.active and len(self.active) > 1:
            self.active.remove(k)
            self._retire(k)
            if self.link_peers:
                self._link_peers()

    def _add(self, predecessor: int | None = None) -> None:
        """A fresh instance joins; ``predecessor``: the one it replaces in place (a restart),
        whose index it is handed with warm_start "file"."""
        assert self.build is not None
        fresh = self.build()
        source = None
        if self.warm_start == "file" and predecessor is not None:
            source = self.instances[predecessor]
        elif self.warm_start == "peer" and self.active:
            source = self.instances[self.active[0]]  # (the oldest still routing)
        if source is not None and hasattr(source, "hand_index_to"):
            source.hand_index_to(fresh)
        self.instances.append(fresh)
        self.active.append(len(self.instances) - 1)

    def _retire(self, k: int) -> None:
        retire = getattr(self.instances[k], "retire", None)
        if retire is not None:
            retire()

    def _link_peers(self) -> None:
        """Ours' peers (config ``peers``): each active instance reads the other active ones.
        A retired one is read no more; its last figures count until the others forget it
        (PEER_FORGET_SECONDS), as a silent peer's do."""
        active = [self.instances[k] for k in self.active]
        for instance in active:
            instance.peers = [p for p in active if p is not instance]
        for k, instance in enumerate(self.instances):
            if k not in self.active:
                instance.peers = []

    def finish(self, handle: Any) -> None:
        k, inner = handle
        self.instances[k].finish(inner)

    def prefill_done(self, handle: Any) -> None:
        """The request's first token passed the router (policies that stream responses
        through themselves and count prefill work until then: Dynamo)."""
        k, inner = handle
        done = getattr(self.instances[k], "prefill_done", None)
        if done is not None:
            done(inner)

    def rules(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for instance in self.instances:
            for rule, count in getattr(instance, "rules", {}).items():
                total[rule] = total.get(rule, 0) + count
        return total


PolicyFactory = Callable[[PolicyContext], Any]

PEERS: dict[str, PolicyFactory] = {
    "random": RandomPolicy,
    "round-robin": RoundRobinPolicy,
    "least-loaded": LeastLoadedPolicy,
    "consistent-hash": ConsistentHashPolicy,
    "gaie": GaiePolicy,
    "sglang": SglangCacheAwarePolicy,
    "dynamo": DynamoPolicy,
    "dynamo-events": DynamoEventsPolicy,
    "production-stack": ProductionStackPolicy,
}
# Policies that know the truth: never replicated over K router instances.
BOUNDS: dict[str, PolicyFactory] = {"oracle": OraclePolicy}
ALL_POLICIES: list[str] = ["ours", *PEERS, *BOUNDS]


def make_policy(
    name: str, ctx: PolicyContext, router_replicas: int, chunk_tokens: int
) -> RouterGroup:
    prompts = PromptBytes()
    if name == "ours":
        feed = (
            CacheEventFeed(ctx, ctx.cache_events_delay, ctx.cache_events_replay)
            if ctx.cache_events_delay is not None
            else None
        )

        def build() -> Any:
            return OursPolicy(ctx, prompts, chunk_tokens, feed)
    elif name in PEERS:

        def build() -> Any:
            return PEERS[name](ctx)
    elif name in BOUNDS:
        return RouterGroup([BOUNDS[name](ctx)], ctx.rng)
    else:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(ALL_POLICIES)}")
    linked = name == "ours" and (ctx.share_queues or ctx.share_placements)
    return RouterGroup(
        [build() for _ in range(max(1, router_replicas))],
        ctx.rng,
        build,
        link_peers=linked,
        warm_start=ctx.warm_start,
    )


def ideal_hit_tokens(
    requests: Sequence[SimRequest], block_tokens: int, cache_outputs: bool = False
) -> int:
    """Bound: one infinite cache shared by everyone (hit ratio only, no time). With
    ``cache_outputs`` a reply is cached as soon as its request arrives: still a bound."""
    cache = ChunkLRU(math.inf)
    hits = 0
    for request in requests:
        full, last = cache_units(request, block_tokens)
        hits += cache.match(request.ids, full, last)
        cache.touch(request.ids, full, last)
        if cache_outputs and request.output_ids:
            cache.touch(request.output_ids, full, full)
    return hits


def ideal_hit_ratio(
    requests: Sequence[SimRequest], block_tokens: int, cache_outputs: bool = False
) -> float:
    """``ideal_hit_tokens`` over all prompt tokens: the hit-ratio bound every run reports."""
    prompt = sum(r.input_tokens for r in requests)
    return ideal_hit_tokens(requests, block_tokens, cache_outputs) / max(1, prompt)
