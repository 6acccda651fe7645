"""The routing core's one entry point: request → hashes → index → scheduler → decision.

No gRPC or Envoy here: the ext_proc server and the simulator drive this same object.
A request is in flight on its endpoint from ``route`` until ``finish``; the server calls
``finish`` when Envoy's processing stream for that request ends. Besides the count, each
endpoint carries the estimated prefill work of what was sent to it (scheduler.CostModel),
drained at the configured throughput and taken back at ``finish``.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
import uuid
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from .config import EndpointConfig, RoutingConfig
from .hashing import (
    block_hashes,
    group_key,
    keyed_by_turns,
    placement_key,
    root_hash,
    session_blocks,
)
from .index import IndexStats, Journal, PrefixIndex, RegionCopy
from .model_pools import ModelPools
from .placements import Placement, PlacementLog
from .prompt import LLMRequest
from .scheduler import (
    RULE_NO_ENDPOINT,
    CostModel,
    Decision,
    EndpointTable,
    Scheduler,
    address_hash,
    rendezvous_scores,
)

log = logging.getLogger(__name__)

# The prefill throughput (Router._learn_prefill_rate) remembers about this many scrape windows
# of any endpoint, and moves once they hold this many finished prefills.
PREFILL_RATE_WINDOWS = 32
PREFILL_RATE_MIN_PREFILLS = 16
# A window whose prefills took longer than this on average teaches no rate: vLLM 0.32 records
# a request that failed before it was scheduled (a grammar that did not compile, a KV load
# that failed) with a prefill time equal to its monotonic clock, the host's uptime.
PREFILL_SECONDS_MAX = 600.0
# This router's share of the requests that reach the endpoints (Router._learn_traffic_share):
# sums decaying with this time constant, however many endpoints are read and however often
# (64 readings of one endpoint scraped every 0.5 s), trusted once they hold this many.
TRAFFIC_SHARE_SECONDS = 32.0
TRAFFIC_SHARE_MIN_REQUESTS = 16
# A peer router replica silent for this long no longer counts (observe_peer_work).
PEER_FORGET_SECONDS = 30.0
# A router yet to measure its traffic share skips the KV-cache events' evictions for at most
# this long after its first events (Router.observe_cache_events): at low traffic the share
# may stay unmeasured, and a router of several must not go without them for good.
UNMEASURED_EVICTIONS_SKIP_SECONDS = 120.0
# The mean of this router's last this-many prefill charges (a plain mean until then):
# Router._unseen prices another router's waiting request at it.
TYPICAL_WORK_REQUESTS = 50
# An endpoint's admission rate (Router._learn_admissions): decaying sums over about this many
# of its scrape windows.
ADMISSION_WINDOWS = 8
# Cold starts balance the prefill work placed on each endpoint over about this many of the
# latest cold starts (Scheduler._balance).
BALANCE_COLD_STARTS = 512
# Router replicas sharing placements balance a cold start between this many of its key's
# first rendezvous picks (Router._placed_view).
SHARED_BALANCE_CHOICES = 2
# A blocked endpoint's wait priced without an admission rate holds past its next reading
# (Router._blocked_hold): this long after its first reading, twice the time between its
# readings after that, at most the second figure.
BLOCKED_HOLD_SECONDS = 1.0
BLOCKED_HOLD_MAX_SECONDS = 5.0


class _DrainingWork:
    """Prefill work per endpoint, set at a clock time and draining at the prefill throughput
    from then on, with the time after which none is left anywhere (so that the usual case,
    none, costs one comparison on the decision path)."""

    __slots__ = ("amount", "since", "until")

    def __init__(self) -> None:
        self.amount = np.zeros(0)
        self.since = np.zeros(0)
        self.until = 0.0

    def left(self, positions: np.ndarray, now: float, rate: float) -> np.ndarray | float:
        if now >= self.until:
            return 0.0
        elapsed = now - self.since[positions]
        return np.maximum(0.0, self.amount[positions] - rate * elapsed)

    def set(self, i: int, amount: float, now: float, rate: float) -> None:
        self.amount[i], self.since[i] = amount, now
        self.until = max(self.until, now + amount / rate if rate > 0 else math.inf)

    def set_all(self, amounts: np.ndarray, now: float, rate: float) -> None:
        self.amount[:], self.since[:] = amounts, now
        peak = float(amounts.max(initial=0.0))
        self.until = now + peak / rate if rate > 0 else (math.inf if peak > 0 else now)

    def rate_changed(self, rate: float) -> None:
        """What is left drains at ``rate`` from each start time: the end time moves."""
        if len(self.amount):
            self.until = float((self.since + self.amount / rate).max())


class _HeldWork(_DrainingWork):
    """Work that may stay whole for a while before it drains (``hold``)."""

    __slots__ = ()

    def left(self, positions: np.ndarray, now: float, rate: float) -> np.ndarray | float:
        if now >= self.until:
            return 0.0
        elapsed = np.maximum(0.0, now - self.since[positions])
        return np.maximum(0.0, self.amount[positions] - rate * elapsed)

    def hold(self, i: int, amount: float, now: float, rate: float, seconds: float) -> None:
        self.set(i, amount, now + seconds, rate)


class Router:
    """Endpoint state lives in arrays (one entry per endpoint, in ``endpoints`` order, the
    same order as the index's regions), so a decision never loops over endpoints in Python."""

    def __init__(
        self,
        config: RoutingConfig,
        endpoints: Sequence[EndpointConfig] = (),
        cost: CostModel | None = None,
        clock: Callable[[], float] = time.monotonic,
        learns_capacity: bool = True,
        endpoints_known: bool = True,
    ) -> None:
        """``learns_capacity``: endpoints' KV sizes will be read (observe_signals), so an
        endpoint without a configured one has a provisional index size until then.
        ``endpoints_known``: False under discovery, whose first answer (set_endpoints) tells
        what is there; no endpoint before that is "not known yet", not "none" (server.py
        passes such requests through)."""
        self.config = config
        self.learns_capacity = learns_capacity
        self.cost = cost or CostModel.from_config(config)
        self.clock = clock
        self.scheduler = Scheduler(config, self.cost)
        self.index = PrefixIndex()
        self.models = ModelPools()  # which endpoints serve which model
        self._addresses: list[str] = []
        self._position: dict[str, int] = {}
        self._weight = np.zeros(0)
        self._address_hash = np.zeros(0, dtype=np.uint64)
        self._capacity_blocks: list[int] = []
        self._largest_capacity = 0
        # capacity_tokens came from the config, so a scraped KV size must not override it.
        self._capacity_configured: list[bool] = []
        # Endpoints whose index region has its provisional size, until their first scrape.
        self._unsized: dict[str, Journal] = {}
        self._in_flight = np.zeros(0, dtype=np.int64)
        # Each endpoint's incarnation, a fresh number whenever it is added
        # (Decision.charged_generation).
        self._generation = np.zeros(0, dtype=np.int64)
        self._generations = 0
        # Requests each endpoint reported beyond this router's in flight there (at its scrape).
        self._others_load = np.zeros(0)
        self._healthy = np.zeros(0, dtype=bool)
        # Whether the endpoint's last metrics reading had its process start time: a restart
        # is then told by the metrics, and a failed probe need not empty its index.
        self._tells_restarts = np.zeros(0, dtype=bool)
        # Healthy again by its probes, its index kept: picked once a metrics reading tells
        # whether it restarted (set_health).
        self._returning = np.zeros(0, dtype=bool)
        # Members not to be picked (EndpointConfig.ready false: a not-ready pod).
        self._held = np.zeros(0, dtype=bool)
        # Clock time of each endpoint's last passing probe (-inf: none yet).
        self._probe_passed_at = np.zeros(0)
        # Estimated prefill work queued (token-equivalents) as of ``_work_at`` (clock time).
        self._work = np.zeros(0)
        self._work_at = np.zeros(0)
        # From the endpoint's own /metrics (signals.py); NaN/False when unknown or unreachable.
        self._reported_load = np.zeros(0)
        self._saturated = np.zeros(0, dtype=bool)
        # Other routers' queued work as of the last scrape (``_unseen``), and the charges of
        # requests that ended before their prefill may have (``_detached_now``).
        self._unseen_work = _DrainingWork()
        # Requests waiting for KV memory or a batch slot that this router sent
        # (``_memory_bound``, ``_slot_bound``), and which endpoints have no room for more.
        self._blocked_work = _HeldWork()
        self._no_room = np.zeros(0, dtype=bool)
        # The most requests each endpoint was seen running (its batch-slot ceiling, as far
        # as this router can tell: ``_slot_bound``).
        self._running_ceiling = np.zeros(0)
        # Requests each endpoint admitted and the time it took, decaying sums over its last
        # ADMISSION_WINDOWS scrapes, and the clock time of its last scrape (NaN: none yet).
        self._admitted = np.zeros(0)
        self._admitted_seconds = np.zeros(0)
        self._scraped_at = np.zeros(0)
        self._detached = _DrainingWork()
        # Other router replicas' own queued work, as they last reported it (observe_peer_work):
        # per peer (work per endpoint address, clock time), and their sum as of the last report.
        self._peer_reports: dict[str, tuple[dict[str, float], float]] = {}
        self._peer_work = _DrainingWork()
        # This replica's name among its peers (the ``router`` label of its exported work).
        self.instance = uuid.uuid4().hex[:12]
        # What this router placed where, for its peers to read (placements.py); None = not
        # shared (the server sets a log when peers are configured).
        self.placements: PlacementLog | None = None
        # Prefill work done and time spent, as the endpoints report it (decaying sums).
        self._rate_work = self._rate_seconds = self._rate_prefills = 0.0
        # A typical prefill charge of this router's, to price other routers' requests with.
        self._typical_work = 0.0
        self._charges = 0
        # Requests this router sent each endpoint since its share was last read there, and
        # decaying sums of those and of the requests that reached the endpoints.
        self._sent = np.zeros(0, dtype=np.int64)
        # Each endpoint's running and waiting requests at its last up scrape, where it counts
        # finished requests (NaN: no such reading), which arrivals and admissions grow from.
        self._running_read = np.zeros(0)
        self._waiting_read = np.zeros(0)
        self._share_sent = self._share_arrived = 0.0
        self._share_decayed_at = -math.inf
        self._traffic_share = 1.0
        self._share_measured = False
        # Prefill work of the cold starts this router placed on each endpoint, decaying.
        self._placed = np.zeros(0)
        # The same, as peer router replicas last reported theirs (observe_peer_placed): per
        # peer (placed work per endpoint address, clock time), their sum, and the clock time
        # until which the newest report counts.
        self._peer_placed: dict[str, tuple[dict[str, float], float]] = {}
        self._peer_placed_total = np.zeros(0)
        self._peer_placed_until = -math.inf
        # Until when the index is told of more than this router's own placements (KV-cache
        # events, peers' placements): _index_shared.
        self._index_shared_until = -math.inf
        self._events_first_read: float | None = None  # clock time of the first KV-cache events
        self._alone_cold_margin = self.cost.cold_margin
        self.set_endpoints(endpoints)
        self.endpoints_known = endpoints_known  # (set_endpoints sets it)

    # -- endpoint set -------------------------------------------------------------------
    def capacity_blocks(self, capacity_tokens: int | None) -> int:
        tokens = capacity_tokens or self.config.default_capacity_tokens
        return max(1, int(tokens * self.config.bytes_per_token) // self.config.block_size_bytes)

    def set_endpoints(self, endpoints: Sequence[EndpointConfig]) -> list[str]:
        """Replace the endpoint set; keeps load and index of endpoints that stay. A member
        no longer ready is not picked, and keeps its index only while its metrics tell
        restarts (as a member that fails its probes: ``set_health``); one ready again is
        picked once its metrics have been read. Returns the endpoints ready again: the
        caller reads their metrics and model lists at once."""
        self.endpoints_known = True
        addresses = [e.address for e in endpoints]
        keep = [self._position.get(a, -1) for a in addresses]
        capacities, configured = [], []
        for e, old in zip(endpoints, keep, strict=True):
            capacity = self.capacity_blocks(e.capacity_tokens)
            if old >= 0 and e.capacity_tokens is None and not self._capacity_configured[old]:
                capacity = self._capacity_blocks[old]  # keep a size learned from the endpoint
            capacities.append(capacity)
            configured.append(e.capacity_tokens is not None)
        # Provisional sizes (new, or no longer configured) are journalled until read.
        self._unsized = {
            e.address: self._unsized.get(e.address) or Journal(capacity)
            for e, old, capacity in zip(endpoints, keep, capacities, strict=True)
            if self.learns_capacity
            and e.capacity_tokens is None
            and (old < 0 or self._capacity_configured[old] or e.address in self._unsized)
        }

        def carried(values: np.ndarray, default: float | bool, dtype: type) -> np.ndarray:
            out = np.full(len(addresses), default, dtype=dtype)
            for i, old in enumerate(keep):
                if old >= 0:
                    out[i] = values[old]
            return out

        self._generation = carried(self._generation, -1, np.int64)
        added = self._generation < 0
        self._generation[added] = np.arange(int(added.sum())) + self._generations
        self._generations += int(added.sum())
        self._in_flight = carried(self._in_flight, 0, np.int64)
        self._others_load = carried(self._others_load, 0.0, np.float64)
        self._sent = carried(self._sent, 0, np.int64)
        self._running_read = carried(self._running_read, np.nan, np.float64)
        self._waiting_read = carried(self._waiting_read, np.nan, np.float64)
        self._healthy = carried(self._healthy, True, bool)
        self._tells_restarts = carried(self._tells_restarts, False, bool)
        self._returning = carried(self._returning, False, bool)
        self._probe_passed_at = carried(self._probe_passed_at, -np.inf, np.float64)
        was_held = carried(self._held, False, bool)
        self._held = np.array([not e.ready for e in endpoints], dtype=bool)
        self._work = carried(self._work, 0.0, np.float64)
        self._placed = carried(self._placed, 0.0, np.float64)
        self._peer_placed_total = carried(self._peer_placed_total, 0.0, np.float64)
        self._work_at = carried(self._work_at, 0.0, np.float64)
        self._reported_load = carried(self._reported_load, np.nan, np.float64)
        self._saturated = carried(self._saturated, False, bool)
        self._no_room = carried(self._no_room, False, bool)
        self._running_ceiling = carried(self._running_ceiling, 0.0, np.float64)
        self._admitted = carried(self._admitted, 0.0, np.float64)
        self._admitted_seconds = carried(self._admitted_seconds, 0.0, np.float64)
        self._scraped_at = carried(self._scraped_at, np.nan, np.float64)
        for draining in (self._unseen_work, self._blocked_work, self._detached, self._peer_work):
            draining.amount = carried(draining.amount, 0.0, np.float64)
            draining.since = carried(draining.since, 0.0, np.float64)
        self._weight = np.array([float(e.weight) for e in endpoints], dtype=np.float64)
        self._address_hash = np.array([address_hash(a) for a in addresses], dtype=np.uint64)
        self._addresses = addresses
        self._position = {a: i for i, a in enumerate(addresses)}
        self._capacity_blocks = capacities
        self._largest_capacity = max(capacities, default=0)
        self._capacity_configured = configured
        self.index.set_endpoints(dict(zip(addresses, capacities, strict=True)))
        self.models.set_endpoints(addresses, [e.models for e in endpoints], keep, self.clock())
        ready_again = []
        for i in np.flatnonzero(was_held != self._held).tolist():
            address = addresses[i]
            if self._held[i]:
                kept = bool(self._tells_restarts[i])
                if not kept:
                    self._forget(address)  # (it may be restarting: nothing would tell)
                log.warning(
                    "endpoint %s is not ready%s",
                    address,
                    "; its index is kept (its metrics tell a restart)" if kept else "",
                )
            elif self._healthy[i] and self._tells_restarts[i]:
                self._healthy[i] = False  # picked once its metrics are read (_returned)
                self._returning[i] = True
                ready_again.append(address)
                log.warning("endpoint %s is ready again; reading its metrics", address)
            else:
                ready_again.append(address)
                log.warning("endpoint %s is ready again", address)
        return ready_again

    def observe_signals(
        self,
        address: str,
        up: bool,
        running: float | None = None,
        waiting: float | None = None,
        kv_usage: float | None = None,
        kv_capacity_tokens: int | None = None,
        prefill_window: tuple[float, float, float] | None = None,
        counts_finished: bool = False,
        tells_restarts: bool = False,
    ) -> None:
        """What the endpoint itself reports. Its running + waiting requests count as its load
        when they exceed this router's own in-flight count (other routers' traffic, or
        requests queued in the server); a KV cache nearly full of running requests takes no
        new sessions while another endpoint can (requests whose prefix it holds still go
        there); the KV size sizes the index when the config did not. ``up=False`` (scrape
        failed) falls back to in-flight counts only. ``prefill_window``: (computed tokens,
        prefills, seconds) of the requests it finished since the last scrape, which the
        prefill throughput is learned from (``_learn_prefill_rate``); ``counts_finished``:
        it exports that counter (no window: none finished), so its queues tell arrivals;
        ``tells_restarts``: a restart would show in its metrics (``set_health``)."""
        i = self._position.get(address)
        if i is None:
            return
        if self._returning[i]:
            self._returned(i, read=up)
        journal = None
        if up:
            self._tells_restarts[i] = tells_restarts
            journal = self._unsized.pop(address, None)  # its size is what this reading says
        finished = 0.0 if prefill_window is None else prefill_window[1]
        if prefill_window is not None:
            self._learn_prefill_rate(*prefill_window)
        # A finished count (a window, or none finished) makes the queues' growth arrivals.
        counts_finished = counts_finished or prefill_window is not None
        grew_running = grew = np.nan
        read_before = self._scraped_at[i]
        if up:
            was_running, was_waiting = self._running_read[i], self._waiting_read[i]
            for read, value in ((self._running_read, running), (self._waiting_read, waiting)):
                read[i] = value if counts_finished and value is not None else np.nan
            grew_running = self._running_read[i] - was_running
            grew = grew_running + self._waiting_read[i] - was_waiting
            self._learn_admissions(i, self._arrivals(finished, grew_running))
        if counts_finished and (up or prefill_window is not None):
            self._learn_traffic_share(i, self._arrivals(finished, grew))
        self._unseen_work.amount[i] = self._blocked_work.amount[i] = 0.0
        if up and running is not None:
            self._running_ceiling[i] = max(self._running_ceiling[i], running)
        self._no_room[i] = up and (
            self._memory_bound(kv_usage) or self._slot_bound(i, running, waiting)
        )
        if not up:
            self._reported_load[i], self._saturated[i] = np.nan, False
            self._others_load[i] = 0.0
            return
        known = [v for v in (running, waiting) if v is not None]
        reported = sum(known)
        self._reported_load[i] = reported if known else np.nan
        self._others_load[i] = max(0.0, reported - float(self._in_flight[i]))
        if waiting is not None:
            now, rate = self.clock(), self.cost.drain_per_second
            unseen = self._unseen_waiting(i, waiting)
            if self.config.count_unseen_waiting:
                self._unseen_work.set(i, unseen * self._typical_work, now, rate)
            if self._no_room[i] and waiting > unseen:
                blocked = (waiting - unseen) * self._typical_work
                admitted = self._admitted[i] / max(1e-9, self._admitted_seconds[i])
                learned = self.config.kv_wait_from_admissions and admitted > 0
                if learned:
                    # Memory frees as running requests finish: a newcomer waits until the
                    # endpoint has admitted the requests ahead of it, at its admission rate.
                    waits = waiting / admitted * rate
                    if self.config.count_unseen_waiting:
                        waits -= unseen * self._typical_work
                    blocked = max(blocked, waits)
                if learned or not self.config.kv_wait_from_admissions:
                    self._blocked_work.set(i, blocked, now, rate)
                else:
                    hold = self._blocked_hold(now, read_before)
                    self._blocked_work.hold(i, blocked, now, rate, hold)
        self._saturated[i] = kv_usage is not None and kv_usage >= self.config.kv_saturated_fraction
        if kv_capacity_tokens and not self._capacity_configured[i]:
            blocks = self.capacity_blocks(kv_capacity_tokens)
            if blocks != self._capacity_blocks[i]:
                self._capacity_blocks[i] = blocks
                self._largest_capacity = max(self._capacity_blocks)
                self.index.set_endpoints(
                    dict(zip(self._addresses, self._capacity_blocks, strict=True))
                )
                if journal is not None:
                    journal.replay(self.index, i)

    @staticmethod
    def _blocked_hold(now: float, read_before: float) -> float:
        """How long a blocked endpoint's wait, priced without its admission rate (none seen
        yet: a router's first seconds, one restarted beside saturated servers, or a server
        that does not count finished requests), stays whole: past its next reading, which
        re-prices it (a down reading zeroes it), so twice the time between its readings —
        the poller's interval plus its round's scrapes, which vary — and at most
        BLOCKED_HOLD_MAX_SECONDS should the readings stop. Drained at the prefill rate, as a
        prefill queue's price is, 8 requests waiting for batch slots at a CPU vLLM server
        were priced at ~0.15 s of work, gone long before the server admitted any of them
        (a failure on CI of tests/e2e/test_vllm.py's test of that server, Dec 6)."""
        if np.isnan(read_before) or now <= read_before:
            return BLOCKED_HOLD_SECONDS
        return min(2.0 * (now - read_before), BLOCKED_HOLD_MAX_SECONDS)

    def _unseen_waiting(self, i: int, waiting: float) -> float:
        """How many of the requests endpoint ``i`` reports waiting other routers sent: at
        least those beyond everything this router has in flight there, and at least the
        others' share of the requests every endpoint reported (running + waiting beyond
        this router's in flight, each taken when that endpoint was scraped). The first
        alone counted none wherever this router's own running requests outnumbered the
        waiting ones: two uncoordinated routers kept sending sessions to replicas queued
        behind each other's long prompts (simulated Mooncake 8 x 1M, K=2, seed 0: p99
        15.6 s against 4.1 at K=1). One router, whose in-flight count covers what the
        endpoints report, counts none either way (docs/benchmarks.md, item 21)."""
        beyond = max(0.0, waiting - float(self._in_flight[i]))
        reported = float(np.nansum(self._reported_load))
        if reported <= 0:
            return beyond
        others = min(1.0, float(self._others_load.sum()) / reported)
        return max(beyond, waiting * others)

    def _learn_admissions(self, i: int, admitted: float) -> None:
        """How many requests the endpoint admits per second: what prices the wait there
        (``observe_signals``). Those it finished plus the growth of its running ones (vLLM
        counts a request's prefill when it finishes, so finishes alone lag admissions by a
        request's decode: in the simulator, counting as vLLM does, GAIE 4 x 400k's p99 went
        245 -> 259 ms with finishes alone and back to 244 with this; docs/benchmarks.md).
        Where finished requests are not counted, running's growth alone is not the rate."""
        now = self.clock()
        since, self._scraped_at[i] = self._scraped_at[i], now
        if np.isnan(since) or now <= since:
            return
        keep = 1.0 - 1.0 / ADMISSION_WINDOWS
        self._admitted[i] = keep * self._admitted[i] + admitted
        self._admitted_seconds[i] = keep * self._admitted_seconds[i] + (now - since)

    def _memory_bound(self, kv_usage: float | None) -> bool:
        """Requests waiting there wait for KV memory, not for the prefills ahead of them:
        this router's charges for its own drained on its clock as if they were being
        prefilled, so each of them counts again, priced and drained like another router's
        (``_unseen``), while another endpoint has room. A tight KV cache under multi-turn
        chat (simulator, 4 x 50k tokens) queued sessions behind full caches while the others
        had room (docs/benchmarks.md, item 15)."""
        fraction = self.config.kv_blocked_fraction
        return fraction > 0 and kv_usage is not None and kv_usage >= fraction

    def _slot_bound(self, i: int, running: float | None, waiting: float | None) -> bool:
        """Requests waiting there wait for a batch slot (vLLM's max_num_seqs), which frees
        as running requests finish, like KV memory (``_memory_bound``). vLLM does not export
        the limit, so it is learned as the most requests the endpoint was seen running.
        Multi-turn chat with long answers at 4 x 4M tokens (simulator) held one replica at
        its 128 slots with KV usage 0.29 and 10-12 waiting, and second rounds queued there
        3.3 s on average while this router priced them as its own drained prefills."""
        ceiling, fraction = self._running_ceiling[i], self.config.slot_blocked_fraction
        return (
            fraction > 0
            and running is not None
            and bool(waiting)
            and ceiling >= self.config.slot_ceiling_min
            and running >= fraction * ceiling
        )

    def _learn_prefill_rate(self, tokens: float, prefills: float, seconds: float) -> None:
        """Queued work drains at the endpoints' prefill throughput, which depends on the GPU
        and the model: the default (60,000 token-equivalents/s) is an 8B model on an H200;
        the test suite's CPU vLLM servers do ~4,300, so with the default the router believed
        their queues emptied at once and sent 67-83% of a shared-document workload to one
        of two servers (docs/benchmarks.md, live benchmark). Their own counters give it:
        the work of what they prefilled, in this cost model's units (each request's base
        cost, its computed tokens, and the attention term for a mean-sized cold prompt),
        over the time their requests spent prefilling."""
        cfg, cost = self.config, self.cost
        if not cfg.learn_prefill_rate or cost.drain_per_second <= 0 or prefills <= 0:
            return
        if seconds > prefills * PREFILL_SECONDS_MAX:
            return  # PREFILL_SECONDS_MAX: one such request would hold the rate at its floor
        mean = tokens / prefills
        work = tokens + prefills * (cost.base_tokens + cost.ctx_factor * mean * mean / 2)
        keep = 1.0 - 1.0 / PREFILL_RATE_WINDOWS
        self._rate_work = keep * self._rate_work + work
        self._rate_seconds = keep * self._rate_seconds + seconds
        self._rate_prefills = keep * self._rate_prefills + prefills
        if self._rate_prefills < PREFILL_RATE_MIN_PREFILLS or self._rate_seconds <= 0:
            return
        rate = min(max(self._rate_work / self._rate_seconds, 100.0), 1e9)
        self.cost = dataclasses.replace(cost, drain_per_second=rate)
        self.scheduler.cost = self.cost
        # Other routers' work and detached charges drain at the new rate from their own
        # start times: when nothing is left of them moves with it.
        self._unseen_work.rate_changed(rate)
        self._blocked_work.rate_changed(rate)
        self._detached.rate_changed(rate)
        self._peer_work.rate_changed(rate)

    @staticmethod
    def _arrivals(finished: float, grew: float) -> float:
        """Requests that reached an endpoint (or its batch) since it was last read: those it
        finished plus the growth of its queues (NaN: no earlier reading, finishes alone).
        vLLM counts a prefill when its request finishes, so while queues fill, what a router
        sent leads what finished by every request in them: one of several routers read
        itself alone (share 1), and a router alone measured nothing until requests
        finished."""
        return finished if np.isnan(grew) else max(0.0, finished + grew)

    def _learn_traffic_share(self, i: int, arrived: float) -> None:
        """This router's share of the requests the endpoints serve: what it sent them against
        what reached them (``_arrivals``), in sums decaying with time (TRAFFIC_SHARE_SECONDS):
        sums that decayed at every endpoint's reading held 32 / N seconds of arrivals at N
        endpoints read twice a second, under 16 below N / 2 requests a second, so a router
        of several at low traffic never knew it was one. The price: a router joining or
        leaving takes tens of seconds to show (share 1 -> 0.5 passes 0.9 in ~7 s, 0.55 in
        ~74 s). Under half, other router replicas (or clients)
        place the rest without this router's index, and a cold start that stays on the
        rendezvous pick is what lets their placements meet: the cold-start margin moves
        from cold_margin (alone) to shared_cold_margin (half or less), linearly, and the
        stickiness premium's floor from 0 to the full premium (this router's index then
        sees only part of what fills the caches; CostModel.premium). In the
        simulator, K=4 router replicas stayed within 0.02 of one router's hit ratio in 12 of
        18 cells with margin 1 against 6 with 0.5, while one router's tails are shorter
        with a small margin (0.5 then, cold_margin 0.1 since; docs/benchmarks.md)."""
        sent, self._sent[i] = float(self._sent[i]), 0
        now = self.clock()
        keep = math.exp(-max(0.0, now - self._share_decayed_at) / TRAFFIC_SHARE_SECONDS)
        self._share_decayed_at = max(self._share_decayed_at, now)
        self._share_sent = keep * self._share_sent + sent
        self._share_arrived = keep * self._share_arrived + arrived
        if self._share_arrived < TRAFFIC_SHARE_MIN_REQUESTS:
            return
        # Requests still on their way (or an endpoint without queue gauges): at most 1.
        self._traffic_share = min(1.0, self._share_sent / self._share_arrived)
        self._share_measured = True
        shared = min(1.0, 2.0 * (1.0 - self._traffic_share))
        alone = self._alone_cold_margin
        margin = alone + (self.config.shared_cold_margin - alone) * shared
        if margin != self.cost.cold_margin or shared != self.cost.stickiness_floor:
            self.cost = dataclasses.replace(self.cost, cold_margin=margin, stickiness_floor=shared)
            self.scheduler.cost = self.cost

    def own_queued_work(self) -> dict[str, float]:
        """This router's own charges per endpoint now (what it tells its peers): not other
        routers' work, which they count themselves."""
        now = self.clock()
        self._drain_all(now)
        own = self._own(np.arange(len(self._addresses)), now)
        return dict(zip(self._addresses, own.tolist(), strict=True))

    def _sum_reports(
        self,
        reports: dict[str, tuple[dict[str, float], float]],
        peer: str,
        figures: Mapping[str, float],
        now: float,
        drain_rate: float = 0.0,
    ) -> np.ndarray:
        """Keep ``peer``'s report in ``reports``, drop those older than PEER_FORGET_SECONDS,
        and sum them per endpoint, each drained at ``drain_rate`` since it came (0: kept)."""
        reports[peer] = (dict(figures), now)
        for stale in [p for p, (_, at) in reports.items() if now - at > PEER_FORGET_SECONDS]:
            del reports[stale]
        total = np.zeros(len(self._addresses))
        for report, at in reports.values():
            left = drain_rate * (now - at)
            for address, amount in report.items():
                i = self._position.get(address)
                if i is not None and math.isfinite(amount) and amount > 0:  # not a peer's junk
                    total[i] += max(0.0, amount - left) if drain_rate > 0 else amount
        return total

    def own_placed_work(self) -> dict[str, float]:
        """The prefill work of the cold starts this router placed on each endpoint lately
        (decaying; what it tells its peers, who balance new sessions by it)."""
        return dict(zip(self._addresses, self._placed.tolist(), strict=True))

    def peer_placed_work(self) -> dict[str, float]:
        """The peers' placed cold-start work per endpoint that counts now (0 when none is
        fresh), summed over the peers."""
        fresh = self.clock() <= self._peer_placed_until
        totals = self._peer_placed_total.tolist() if fresh else [0.0] * len(self._addresses)
        return dict(zip(self._addresses, totals, strict=True))

    def observe_peer_placed(self, peer: str, placed: Mapping[str, float]) -> None:
        """Another router replica's placed cold-start work per endpoint (its
        ``own_placed_work``). While such reports are fresh and this router shares placements,
        its cold starts balance over the sum of all the replicas' placed work (``_placed_view``).
        A peer not heard from for PEER_FORGET_SECONDS is dropped."""
        if peer == self.instance:
            return
        now = self.clock()
        self._peer_placed_total = self._sum_reports(self._peer_placed, peer, placed, now)
        self._peer_placed_until = now + PEER_FORGET_SECONDS

    def observe_peer_work(self, peer: str, work: Mapping[str, float]) -> None:
        """Another router replica's own queued work per endpoint, as it reports it now. Each
        report drains at the prefill throughput from its arrival; the sum over peers counts
        as queued work (in place of the estimate from waiting counts, where larger). A peer
        not heard from for PEER_FORGET_SECONDS is dropped (its work has drained by then
        anyway, unless the throughput is tiny)."""
        if peer == self.instance:
            return
        now = self.clock()
        rate = self.cost.drain_per_second
        total = self._sum_reports(self._peer_reports, peer, work, now, rate)
        self._peer_work.set_all(total, now, rate)

    def peers(self) -> list[str]:
        """The peers whose queued work counts (heard from within PEER_FORGET_SECONDS)."""
        return self._peers_heard(self.clock())

    def _peers_heard(self, now: float) -> list[str]:
        return [p for p, (_, at) in self._peer_reports.items() if now - at <= PEER_FORGET_SECONDS]

    @property
    def traffic_share(self) -> float:
        """This router's share of the requests its endpoints serve (1 until measured)."""
        return self._traffic_share

    @property
    def traffic_share_measured(self) -> bool:
        """Whether ``traffic_share`` is a measurement yet (enough arrivals in its sums)."""
        return self._share_measured

    @property
    def cold_margin(self) -> float:
        """The cold-start margin in use (``_learn_traffic_share``), before what recurring
        keys add to it (CostModel.recurring_margin)."""
        return self.cost.cold_margin

    @property
    def key_recurrence(self) -> float:
        """The share of this router's recent requests whose placement key it had seen
        before (recurrence.py)."""
        return self.scheduler.recurrence.rate

    @property
    def prefill_rate(self) -> float:
        """The prefill throughput queued work drains at (token-equivalents per second)."""
        return self.cost.drain_per_second

    @property
    def endpoints(self) -> list[str]:
        return list(self._addresses)

    def is_member(self, address: str) -> bool:
        return address in self._position

    def set_health(self, address: str, healthy: bool) -> bool:
        """The probes' verdict: an unhealthy endpoint is not picked. Its index is emptied (a
        restarted server comes back with an empty cache) unless its metrics tell restarts
        (a process start time, or counters that would start over): an endpoint that only
        missed probes (a stall, an overloaded API server, a network blip) then keeps what
        it holds, rather than every prefix it held being prefilled again elsewhere once it
        is back. Healthy again, such an endpoint is picked only once its metrics have been
        read (``observe_signals``, after the service told any restart they show:
        ``restarted``), so that no request goes there for a prefix a restarted server no
        longer holds. Returns True when the caller should read its metrics at once."""
        i = self._position.get(address)
        if i is None:
            return False
        if healthy:
            self._probe_passed_at[i] = self.clock()
        if not healthy and self._returning[i]:
            # Failed again before its metrics were read: out, as it was (a reading that
            # came now must not return it).
            self._returning[i] = False
            return False
        if bool(self._healthy[i]) == healthy or self._returning[i]:
            return False  # (returning: read at once already asked)
        kept = not healthy and bool(self._tells_restarts[i])
        if healthy and self._tells_restarts[i]:
            self._returning[i] = True
            log.warning("endpoint %s answers its probes again; reading its metrics", address)
            return True
        self._healthy[i] = healthy
        if not healthy and not kept:
            # A restarted server comes back with an empty cache: forget what it held.
            self._forget(address)
        log.warning(
            "endpoint %s is now %s%s",
            address,
            "healthy" if healthy else "unhealthy",
            "; its index is kept (its metrics tell a restart)" if kept else "",
        )
        return False

    def probe_passed_since(self, address: str, when: float) -> bool:
        """Whether a probe of the endpoint passed after ``when`` (router clock): a failure
        Envoy reports late (a retried request's answer comes after its whole generation)
        is then over."""
        i = self._position.get(address)
        return i is not None and bool(self._probe_passed_at[i] > when)

    def _returned(self, i: int, read: bool) -> None:
        """A returning endpoint's metrics reading came (``read``; any restart it showed was
        told before), or failed: then nothing tells whether it restarted, and what it held
        is forgotten, as for an endpoint whose metrics tell no restarts."""
        self._returning[i] = False
        self._healthy[i] = True
        address = self._addresses[i]
        if not read:
            self._forget(address)
        log.warning(
            "endpoint %s is now healthy%s",
            address,
            "" if read else "; its metrics unread, its index is emptied",
        )

    def observe_models(self, address: str, models: frozenset[str] | None) -> None:
        """The endpoint's model list as read (None: unreadable; it is then sent any model).
        An unreadable list of a not-ready member changes nothing (a pod still loading its
        model answers none; read as "any model", it would join every pool when ready,
        until the next round): its list is read when it is ready."""
        i = self._position.get(address)
        if i is not None and models is None and self._held[i]:
            return
        if i is not None and self.models.observe(i, models):
            log.info("endpoint %s: models %s", address, sorted(models or ()) or "any")

    def lists_model(self, address: str, model: str) -> bool:
        """Whether the endpoint's models as known name ``model``."""
        i = self._position.get(address)
        return i is not None and bool(model) and model in (self.models.served(i) or ())

    def served_models(self) -> dict[str, frozenset[str] | None]:
        """Each endpoint's models as known (None: not known; it may be sent any)."""
        return {a: self.models.served(i) for i, a in enumerate(self._addresses)}

    def restarted(self, address: str) -> None:
        """The endpoint's server restarted (its metrics' start time changed, or their
        counters went down), maybe between two health probes: its cache is empty, so is
        what the index says it holds."""
        if address in self._position:
            self._forget(address)
            log.warning("endpoint %s restarted; forgetting what it held", address)

    def healthy_endpoints(self) -> list[str]:
        """The endpoints that may be picked: healthy by their probes (and, back from missed
        probes, read since) and ready."""
        usable = (self._healthy & ~self._held).tolist()
        return [a for a, ok in zip(self._addresses, usable, strict=True) if ok]

    def in_flight(self) -> dict[str, int]:
        return dict(zip(self._addresses, self._in_flight.tolist(), strict=True))

    def queued_work(self) -> dict[str, float]:
        """Estimated prefill work queued per endpoint now (token-equivalents), as the
        scheduler sees it: this router's charges (``_own``) plus other routers'
        (``_others``)."""
        now = self.clock()
        self._drain_all(now)
        every = np.arange(len(self._addresses))
        queued = self._own(every, now) + self._others(every, now)[0]
        return dict(zip(self._addresses, queued.tolist(), strict=True))

    def index_stats(self) -> IndexStats:
        return self.index.stats()

    # -- queued work ----------------------------------------------------------------------
    def _unseen(
        self, positions: np.ndarray, now: float
    ) -> tuple[np.ndarray | float, np.ndarray | float]:
        """Queued work other routers sent, as of now: the excess over the endpoints' median,
        and apart the rest of each endpoint's (up to the median), which the first leaves
        out. An endpoint that reports more requests
        waiting than this router has in flight there holds at least that many from someone
        else: each is priced as this router's typical prefill, and the sum drains at the
        prefill throughput from the scrape on. Several uncoordinated router replicas each
        see only their own charges; without this, another router's 191k-token Mooncake
        prompt held a simulated endpoint for 40 s while the others kept sending it
        requests (K=4 p99 up to 8x K=1's, docs/benchmarks.md). With one router (and no
        client bypassing it) nothing waits beyond its own in-flight requests: zero, unless
        the endpoint waits for KV memory (``_memory_bound``) while another has room: when
        every cache is full a move only trades places and loses the prefix (two CPU vLLM
        servers with 160-block caches, item 15)."""
        rate = self.cost.drain_per_second
        left = self._unseen_work.left(positions, now, rate)
        blocked = self._blocked_work.left(positions, now, rate)  # 0.0 while none is left
        if isinstance(blocked, np.ndarray) and not self._no_room[positions].all():
            left = left + blocked
        hidden: np.ndarray | float = 0.0
        if isinstance(left, np.ndarray) and left.any():
            # Only the excess over the endpoints' median: a queue every endpoint has does not
            # say where to send, and in an overloaded pool counting it in full had each router
            # move different sessions off their prefixes (GAIE 4 x 100k, K=4: hit ratio 0.33
            # -> 0.17 in full, 0.22 above the median). It does say that every endpoint is
            # busy: the scheduler's backlog rules read it (EndpointTable.backlog).
            median = float(np.median(left))
            hidden = np.minimum(left, median)
            left = left - hidden
        return left, hidden

    def _own(self, positions: np.ndarray, now: float) -> np.ndarray:
        """This router's charges (after ``_drain_all``), detached ones included."""
        return self._work[positions] + self._detached_now(positions, now)

    def _others(
        self, positions: np.ndarray, now: float
    ) -> tuple[np.ndarray | float, np.ndarray | float]:
        """Other routers' queued work: what peers report (times routing.peer_work_weight), or
        the waiting-count estimate where that is larger (it also sees clients that bypass
        the routers); and, apart, the part of that estimate left out (``_unseen``).
        The weight damps a herd: every router reads the same second-old
        figures and would move sessions off the same busy replica at once; on the
        simulator's Mooncake cells, weight 0.5 against 1 kept most of the shorter tails
        (K=4 p99 8 x 200k 7.5 -> 8.1 s; 30.1 s without peers) for about half the hit-ratio
        cost (0.158 -> 0.165; 0.171 without), and did no worse on GAIE or chat
        (docs/benchmarks.md)."""
        unseen, hidden = self._unseen(positions, now)
        if not self._peer_reports or not self._peers_heard(now):
            return unseen, hidden  # no peers, or every one silent (dropped at the next report)
        peers = self.config.peer_work_weight * self._peer_work.left(
            positions, now, self.cost.drain_per_second
        )
        others = np.maximum(unseen, peers)
        # What is left out: the rest of the larger of the two whole estimates.
        return others, np.maximum(0.0, np.maximum(unseen + hidden, peers) - others)

    def _drain_all(self, now: float) -> None:
        rate = self.cost.drain_per_second
        if rate > 0:
            elapsed = np.maximum(0.0, now - self._work_at)
            np.maximum(0.0, self._work - rate * elapsed, out=self._work)
        self._work[self._in_flight == 0] = 0.0
        self._work_at.fill(now)

    def _drain(self, i: int, now: float) -> float:
        """``_drain_all`` for one endpoint (the same arithmetic)."""
        rate = self.cost.drain_per_second
        work = float(self._work[i])
        if rate > 0 and work > 0:
            work = max(0.0, work - rate * max(0.0, now - float(self._work_at[i])))
        if self._in_flight[i] == 0:
            work = 0.0
        self._work[i], self._work_at[i] = work, now
        return work

    def _charge(self, i: int, decision: Decision, now: float) -> None:
        decision.charged_generation = int(self._generation[i])
        decision.work_released = False
        decision.queued_before = self._drain(i, now)
        decision.charged_at = now
        self._work[i] += decision.work
        self._charges += 1
        step = 1.0 / min(self._charges, TYPICAL_WORK_REQUESTS)
        self._typical_work += (decision.work - self._typical_work) * step
        self._in_flight[i] += decision.engine_requests

    def _release_work(self, i: int, decision: Decision, now: float) -> float:
        """Take back what is left of the request's charge (FIFO: work queued before it
        drains first); returns how much that was."""
        if decision.work_released:
            return 0.0
        decision.work_released = True
        self._drain(i, now)
        drained = self.cost.drain_per_second * max(0.0, now - decision.charged_at)
        left = min(decision.work, max(0.0, decision.work + decision.queued_before - drained))
        self._work[i] = max(0.0, float(self._work[i]) - left)
        return left

    def _detached_now(self, positions: np.ndarray, now: float) -> np.ndarray | float:
        """Charges of requests no longer counted in flight whose prefill may not be over
        (``finish(prefill_over=False)``), drained at the prefill throughput."""
        return self._detached.left(positions, now, self.cost.drain_per_second)

    def _uncharge(self, i: int, decision: Decision, now: float, prefill_over: bool) -> None:
        left = self._release_work(i, decision, now)
        if not prefill_over and left > 0:
            rest = float(np.sum(self._detached_now(np.array([i]), now)))
            self._detached.set(i, rest + left, now, self.cost.drain_per_second)
        self._in_flight[i] = max(0, int(self._in_flight[i]) - decision.engine_requests)
        if self._in_flight[i] == 0:
            self._work[i] = 0.0

    # -- decisions ----------------------------------------------------------------------
    def route(
        self,
        request: LLMRequest,
        allowed: frozenset[str] | None = None,
        *,
        defer_record: bool = False,
    ) -> Decision:
        """Decide and count the request in flight. ``allowed`` is the proxy's subset hint.
        ``defer_record``: the index learns the placement only at ``record(decision)``."""
        cfg = self.config
        root = root_hash(request.model, request.cache_salt)
        hashes = block_hashes(request.prompt, root, cfg.block_size_bytes, cfg.max_blocks)
        key = placement_key(
            request, hashes, root, cfg.block_size_bytes, cfg.cold_start_key, cfg.cold_start_blocks
        )
        now = self.clock()
        self._drain_all(now)
        usable = self._healthy & ~self._held
        # (NotRoutable: no endpoint serves it)
        serving = self.models.eligible(request.model, usable, now)
        if serving is not None:
            usable = usable & serving
        pool = usable  # what any router replica would place this model's requests on
        if allowed is not None:  # O(size of the hint), not O(endpoints)
            hinted = np.zeros(len(self._addresses), dtype=bool)
            hinted[[i for a in allowed if (i := self._position.get(a)) is not None]] = True
            usable = usable & hinted
        positions = np.flatnonzero(usable)
        placed, placed_choices = self._placed_view(positions, now)
        others, backlog = self._others(positions, now)
        table = EndpointTable(
            addresses=self._addresses,
            rows=positions,
            load=np.fmax(self._in_flight[positions], self._reported_load[positions]),
            work=self._own(positions, now) + others,
            matched=self.index.match_positions(hashes, positions),
            weight=self._weight[positions],
            address_hash=self._address_hash[positions],
            saturated=self._saturated[positions],
            fill=self.index.fill_positions(positions) if self.cost.stickiness_fill else None,
            placed=placed,
            placed_choices=placed_choices,
            backlog=backlog,
        )
        # No endpoint holds more of a session than its whole cache: one holding that much
        # holds it (else a prompt longer than every cache would be a new session each time
        # and leave its replica whenever that one reports its cache full).
        session = min(
            self._largest_capacity,
            session_blocks(
                request, hashes, cfg.block_size_bytes, cfg.cold_start_key, cfg.cold_start_blocks
            ),
        )
        decision = self.scheduler.pick(
            table,
            len(hashes),
            key,
            session,
            prompt_tokens=len(request.prompt) / cfg.bytes_per_token,
            block_tokens=cfg.block_size_bytes / cfg.bytes_per_token,
            hashes=hashes,
            group_key=(
                preamble := group_key(
                    request,
                    hashes,
                    cfg.block_size_bytes,
                    cfg.cold_start_key,
                    cfg.shared_prefix_fraction,
                )
            ),
            turnless=not keyed_by_turns(request, cfg.cold_start_key),
            index_shared=self._index_shared(),
        )
        decision.home_keys = tuple({key, preamble, decision.placement_key} - {0})
        decision.home_pool = pool
        decision.hashes = hashes
        decision.engine_requests = request.engine_requests
        if decision.endpoint is not None:
            chosen = self._position[decision.endpoint]
            self._charge(chosen, decision, now)  # (first: it names the incarnation recorded at)
            decision.unrecorded = True
            if not defer_record:
                self.record(decision)
            self._sent[chosen] += decision.engine_requests  # (what the server counts)
            if decision.cold_start and cfg.balance_cold_starts:
                self._placed *= 1.0 - 1.0 / BALANCE_COLD_STARTS
                self._placed[chosen] += decision.work
        return decision

    def record(self, decision: Decision) -> None:
        """Enter a routed request's blocks in the index as held where it was sent (where
        Envoy says it went, once that is known: ``served``), and in the placement log its
        peers read; once per destination, a no-op after that. The server
        calls it once its answer is on the way to Envoy (``route(defer_record=True)``): the
        index update, about a quarter of a decision (~0.1 ms for a 32 KiB prompt, ~0.5 ms
        for 512 KiB; ``bench core``'s answer columns), is then not part of the time Envoy
        waits. The queued-work charge stays in ``route``: concurrent decisions must see it."""
        if not decision.unrecorded:
            return
        decision.unrecorded = False
        address = decision.served or decision.endpoint
        i = self._charged_position(decision)
        # An endpoint removed meanwhile holds nothing here, nor one found dead meanwhile
        # (set_health emptied its index: a restarted server comes back with an empty cache),
        # nor one not ready whose index was emptied so (_holds_what_it_is_sent).
        if i is not None and self._holds_what_it_is_sent(i):
            self._update(i, True, decision.hashes, self._age_off_pick(i, decision))
            self._log_placement(address, decision.hashes)

    def _index_shared(self) -> bool:
        """Whether the index has been told of more than this router's own placements
        (KV-cache events, peers' placements) within PEER_FORGET_SECONDS: the others' copies
        and the evictions are then in it, so it ages no copy (_age_off_pick) and recurring
        keys widen no cold-start margin (Scheduler.pick)."""
        return self.clock() <= self._index_shared_until

    def _age_off_pick(self, i: int, decision: Decision) -> int:
        """How long ago (index stamps) a placement on endpoint ``i`` counts as touched: 0,
        unless this router is one of several without a shared view (its traffic share under
        balance_min_share) and ``i`` is not the rendezvous pick of any key the request could
        be placed by, among the endpoints ready to serve its model (before the proxy's
        subset hint: the pick other routers' cold starts make). Such a copy (a move off a
        busy pick) is refreshed by this router alone: the others' requests go to the pick,
        and their new blocks, which this index never sees, turn the endpoint's cache over
        1 / share times as fast as this router's own. Entered as if (1 - share) x the cache
        had turned over since, the copy leaves the index about when it leaves the server,
        and a later request goes back to the pick instead of to a prefix gone (simulated
        K=4, docs/benchmarks.md). Not while KV-cache events (evictions told) or peers'
        placements (the others' copies seen) come in."""
        share = self._traffic_share
        aging = self.config.off_pick_aging
        if not aging or not self._share_measured or share >= self.config.balance_min_share:
            return 0
        if self._index_shared():
            return 0  # the events' evictions, or the peers' placements, keep the index
        if decision.home_pool is None or len(decision.home_pool) != len(self._addresses):
            return 0  # (the endpoint set changed since it was routed)
        pool = np.flatnonzero(decision.home_pool)
        if not len(pool):
            return 0
        hashes = self._address_hash[pool]
        for key in decision.home_keys:
            if pool[int(np.argmax(rendezvous_scores(key, hashes)))] == i:
                return 0
        turned_over = aging * (1.0 - share) * self._capacity_blocks[i]
        return int(turned_over * self.index.stamps_per_new_block(i))

    def _holds_what_it_is_sent(self, i: int) -> bool:
        """Whether a placement there (this router's deferred record, a peer's, which may
        come seconds late) is taken: not on an endpoint out for failed probes, nor on one
        not ready whose metrics tell no restarts (its index was emptied: it may be
        restarting); one whose metrics tell restarts has them emptied at the restart."""
        return bool(self._healthy[i]) and (not self._held[i] or bool(self._tells_restarts[i]))

    def _placed_view(self, positions: np.ndarray, now: float) -> tuple[np.ndarray | None, int]:
        """The placed work cold starts balance by, and among how many of a key's first
        rendezvous picks (0: all; Scheduler._balance), or None: no balance.

        A router known to place (nearly) all the traffic balances its own placements over
        every endpoint. Router replicas that share placements with peers balance the sum of
        everyone's, between the key's two first picks and only past a margin: their views
        differ by the last second's placements, and this keeps them agreeing where a new
        session's requests reach several of them at once (docs/benchmarks.md item 20).
        Other router replicas must make the same rendezvous pick for a conversation's turns
        to meet, and a balance, which depends on what each of them placed, would part them."""
        if not self.config.balance_cold_starts:
            return None, 0
        if self.placements is not None and now <= self._peer_placed_until:
            placed = self._placed[positions] + self._peer_placed_total[positions]
            return placed, SHARED_BALANCE_CHOICES
        if self._share_measured and self._traffic_share >= self.config.balance_min_share:
            return self._placed[positions], 0
        return None, 0

    def finish(self, decision: Decision, prefill_over: bool = True) -> None:
        """The request is no longer in flight. ``prefill_over=False``: it ended for the
        router before it did on the endpoint, without proof that the prefill is over (Envoy
        closes a full-duplex processing stream at a stream's response headers, which come
        before its prefill): what is left of its charge keeps draining."""
        i = self._charged_position(decision)
        if i is not None:
            self._uncharge(i, decision, self.clock(), prefill_over)

    def prefill_done(self, decision: Decision) -> None:
        """The endpoint's prefill for this request is certainly over: its response headers
        came and the response is not a stream (they come after the whole generation), or
        is an error. What is left of the work charge is taken back now; the request stays
        in flight until ``finish``. A stream's headers come before its prefill (the server
        does not call this for them), so its charge drains on the router's clock; a
        release there made every streamed request look like no queued work at all (in the
        simulator, Mooncake p99 up to 7x longer; docs/benchmarks.md)."""
        i = self._charged_position(decision)
        if i is not None:
            self._release_work(i, decision, self.clock())

    def _charged_position(self, decision: Decision) -> int | None:
        """The endpoint the request is charged to, if it is still the one it was charged to:
        removed, it holds nothing; removed and added again (a flapping readiness probe, a
        reused pod IP), it is another endpoint, whose own requests a late finish of the old
        one's would otherwise take off the count (a busy replica then read idle)."""
        if decision.rule == RULE_NO_ENDPOINT or decision.endpoint is None:
            return None
        i = self._position.get(decision.served or decision.endpoint)
        if i is None or self._generation[i] != decision.charged_generation:
            return None
        return i

    def served(self, decision: Decision, served_address: str) -> bool:
        """Envoy reports where the request really went; move the load and learn the blocks.

        Returns True when the report differed from the decision and was applied.
        """
        current = decision.served or decision.endpoint
        i = self._position.get(served_address)
        if served_address == current or i is None:
            return False
        self.finish(decision)
        decision.served = served_address
        self._charge(i, decision, self.clock())
        decision.unrecorded = True  # held where Envoy sent it (a pending record goes there)
        self.record(decision)
        return True

    # -- the endpoints' own cache reports -------------------------------------------------
    def observe_cache_events(
        self,
        address: str,
        events: Sequence[tuple[bool | None, np.ndarray]],
        replayed: bool = False,
    ) -> set[bool | None]:
        """What an endpoint reports it stored and evicted (vLLM's KV-cache events), in
        order, each (stored, block hashes of this router's), or (None, ...): it cleared its
        whole cache. The index then holds what the endpoint holds, whoever placed it, where
        its own record of its placements is a guess that other router replicas'
        placements and the endpoint's evictions leave behind (the K=4 gap,
        docs/benchmarks.md). Its own placements are still recorded at the decision: an
        endpoint reports a prefix only once its prefill computed it. A run of events of
        one kind is applied as one index update.

        A router known to place (nearly) all the traffic (its measured share at least
        balance_min_share) ignores stores and evictions, and returns False: it recorded
        every placement at its decision, and in the simulator's two overloaded cells
        reading them cost a router alone up to 0.07 of hit ratio and 40% of p99, while
        elsewhere they changed it by under 0.005 (docs/benchmarks.md, "KV-cache events").
        Until it has measured its share (TRAFFIC_SHARE_MIN_REQUESTS arrivals in the
        endpoints' counts: in the simulator's Mooncake 16 x 200k cell a router alone took
        91 s while the share's sums decayed at every reading, 5 s since they decay with time)
        it reads the stores, which tell it of other routers' placements, and skips the
        evictions, which cost a router alone: they cut its record of where a prefix lives
        short and send the prefix's next requests elsewhere (that cell, one router, before
        the sums decayed with time: 0.331 of hit ratio without events, 0.317 with, 0.331 with
        this; docs/benchmarks.md) — for at
        most UNMEASURED_EVICTIONS_SKIP_SECONDS after its first events, as at low traffic the
        share may stay unmeasured. Events ``replayed`` from the endpoint's buffer (asked
        for at a late start or after lost messages) are its history in order, not news of
        other routers' placements: their evictions are applied before the share is measured
        too (a router alone still ignores them), or a replay would enter every block the
        endpoint stored and has since evicted (a lone router restarted on the simulator's
        GAIE shape lost 0.083 of the next window's hit ratio with the whole buffer
        replayed, 0.048 with its evictions applied; docs/benchmarks.md, "A replay's
        evictions applied"). A cleared cache empties the endpoint's index either way.
        Returns the kinds applied (True: stores, False: evictions, None: a clear)."""
        i = self._position.get(address)
        applied: set[bool | None] = set()
        if i is None:
            return applied
        now = self.clock()
        if self._events_first_read is None:
            self._events_first_read = now
        alone = self._share_measured and self._traffic_share >= self.config.balance_min_share
        skip_evictions = (
            not replayed
            and not self._share_measured
            and now - self._events_first_read < UNMEASURED_EVICTIONS_SKIP_SECONDS
        )
        for stored, run in itertools.groupby(events, key=lambda event: event[0]):
            if stored is None:
                self._forget(address)
                applied.add(None)
                continue
            chains = [hashes for _, hashes in run if len(hashes)]
            if alone or not chains or (skip_evictions and not stored):
                continue
            applied.add(stored)
            self._index_shared_until = now + PEER_FORGET_SECONDS
            if stored:
                self._record_newest_first(i, chains[::-1])  # the newest event's blocks newest
            else:
                blocks = np.concatenate(chains).astype(np.uint64, copy=False)
                self._update(i, False, blocks)
        return applied

    # -- placements shared with peers -----------------------------------------------------
    def _log_placement(self, address: str, hashes: np.ndarray) -> None:
        if self.placements is not None:
            self.placements.add(Placement(self.instance, address, hashes))

    def observe_peer_placements(self, placements: Sequence[Placement]) -> int:
        """Other router replicas' placements, oldest first: each endpoint now probably holds
        those blocks, as if this router had sent the request there (this router's own, which
        sibling workers' shared log returns too, are skipped). Returns how many were
        recorded. One index update per endpoint for the whole batch (newest placement's
        blocks newest, each block once, at most the endpoint's capacity): one update per
        placement cost ~85 us, which at a thousand placements a second held the event loop
        for most of 0.1 s at every read. None on an endpoint this router finds dead: the
        peers' placements come a second or more late, some made before they noticed, and
        a restarted server comes back with an empty cache."""
        by_position: dict[int, list[np.ndarray]] = {}
        recorded = 0
        for placement in reversed(placements):  # newest first
            i = self._position.get(placement.endpoint)
            if i is None or not self._holds_what_it_is_sent(i):
                continue
            if placement.router != self.instance and len(placement.hashes):
                by_position.setdefault(i, []).append(placement.hashes[: self.config.max_blocks])
                recorded += 1
        for i, chains in by_position.items():
            self._record_newest_first(i, chains)
        if recorded:
            self._index_shared_until = self.clock() + PEER_FORGET_SECONDS
        return recorded

    def _record_newest_first(self, i: int, chains: Sequence[np.ndarray]) -> None:
        """Several chains held at endpoint ``i``, newest first, as one index update: each
        block once, where it first appears (record_position makes block 0 the newest), at
        most the endpoint's capacity: more would only evict the batch's own newer blocks."""
        hashes = np.concatenate(chains).astype(np.uint64, copy=False)
        _, first = np.unique(hashes, return_index=True)
        newest = np.sort(first)[: self._capacity_blocks[i]]
        self._update(i, True, hashes[newest])

    # -- warm start (warm_start.py) ----------------------------------------------------------
    def index_regions(self) -> tuple[int, dict[str, RegionCopy]]:
        """The index clock and a copy of every endpoint's region, for a router starting."""
        regions = {address: self.index.export_region(address) for address in self._addresses}
        return self.index.clock, {a: r for a, r in regions.items() if r is not None}

    def handover_refusal(self, address: str, copy: RegionCopy) -> str | None:
        """Why a region another router's index held cannot go in here now, or None: "not a
        member", "not ready" (out for failed probes, or not ready with its index emptied),
        "size not read yet" (its KV size is provisional until its first reading) — all of
        which may pass — or "another KV capacity", which will not."""
        i = self._position.get(address)
        if i is None:
            return "not a member"
        if not self._holds_what_it_is_sent(i):
            return "not ready"
        if address in self._unsized:
            return "size not read yet"
        if self._capacity_blocks[i] != copy.capacity:
            return "another KV capacity"
        return None

    # -- index updates ----------------------------------------------------------------------
    def _update(self, i: int, stored: bool, hashes: np.ndarray, age: int = 0) -> None:
        """Blocks endpoint ``i`` now holds (``stored``) or evicted, journalled while its
        index region has its provisional size (Journal)."""
        if stored:
            self.index.record_position(i, hashes, age)
        else:
            self.index.remove_position(i, hashes)
        if self._unsized:
            journal = self._unsized.get(self._addresses[i])
            if journal is not None:
                journal.add(stored, hashes)

    def _forget(self, address: str) -> None:
        """The endpoint holds nothing (any more): neither does its index, nor its journal."""
        self.index.forget(address)
        journal = self._unsized.get(address)
        if journal is not None:
            journal.clear()
