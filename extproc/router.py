"""The routing core's one entry point: request → hashes → index → scheduler → decision.

No gRPC or Envoy here: the ext_proc server and the simulator drive this same object.
A request is in flight on its endpoint from ``route`` until ``finish``; the server calls
``finish`` when Envoy's processing stream for that request ends. Besides the count, each
endpoint carries the estimated prefill work of what was sent to it (scheduler.CostModel),
drained at the configured throughput and taken back at ``finish``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .config import EndpointConfig, RoutingConfig
from .hashing import block_hashes, placement_key, root_hash, session_blocks
from .index import IndexStats, PrefixIndex
from .prompt import LLMRequest
from .scheduler import (
    RULE_NO_ENDPOINT,
    CostModel,
    Decision,
    EndpointView,
    Scheduler,
    address_hash,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EndpointState:
    address: str
    weight: float
    capacity_blocks: int
    address_hash: int
    in_flight: int = 0
    healthy: bool = True
    # Estimated prefill work queued here (token-equivalents) as of ``work_at`` (clock time).
    work: float = 0.0
    work_at: float = 0.0
    # From the endpoint's own /metrics (signals.py); None/False when unknown or unreachable.
    reported_load: float | None = None
    saturated: bool = False
    # capacity_tokens came from the config, so a scraped KV size must not override it.
    capacity_configured: bool = False


class Router:
    def __init__(
        self,
        config: RoutingConfig,
        endpoints: Sequence[EndpointConfig] = (),
        cost: CostModel | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.cost = cost or CostModel.from_config(config)
        self.clock = clock
        self.scheduler = Scheduler(config, self.cost)
        self.index = PrefixIndex()
        self._endpoints: dict[str, EndpointState] = {}
        self.set_endpoints(endpoints)

    # -- endpoint set -------------------------------------------------------------------
    def capacity_blocks(self, capacity_tokens: int | None) -> int:
        tokens = capacity_tokens or self.config.default_capacity_tokens
        return max(1, int(tokens * self.config.bytes_per_token) // self.config.block_size_bytes)

    def set_endpoints(self, endpoints: Sequence[EndpointConfig]) -> None:
        """Replace the endpoint set; keeps load and index of endpoints that stay."""
        fresh: dict[str, EndpointState] = {}
        for e in endpoints:
            state = self._endpoints.get(e.address)
            capacity = self.capacity_blocks(e.capacity_tokens)
            if state is None:
                state = EndpointState(e.address, e.weight, capacity, address_hash(e.address))
            elif e.capacity_tokens is not None or state.capacity_configured:
                state.capacity_blocks = capacity  # else keep a size learned from the endpoint
            state.weight = e.weight
            state.capacity_configured = e.capacity_tokens is not None
            fresh[e.address] = state
        self._endpoints = fresh
        self.index.set_endpoints({a: s.capacity_blocks for a, s in fresh.items()})

    def observe_signals(
        self,
        address: str,
        up: bool,
        running: float | None = None,
        waiting: float | None = None,
        kv_usage: float | None = None,
        kv_capacity_tokens: int | None = None,
    ) -> None:
        """What the endpoint itself reports. Its running + waiting requests count as its load
        when they exceed this router's own in-flight count (other routers' traffic, or
        requests queued in the server); a KV cache nearly full of running requests takes no
        new ones while another endpoint can; the KV size sizes the index when the config did
        not. ``up=False`` (scrape failed) falls back to in-flight counts only."""
        state = self._endpoints.get(address)
        if state is None:
            return
        if not up:
            state.reported_load, state.saturated = None, False
            return
        known = [v for v in (running, waiting) if v is not None]
        state.reported_load = sum(known) if known else None
        state.saturated = kv_usage is not None and kv_usage >= self.config.kv_saturated_fraction
        if kv_capacity_tokens and not state.capacity_configured:
            blocks = self.capacity_blocks(kv_capacity_tokens)
            if blocks != state.capacity_blocks:
                state.capacity_blocks = blocks
                self.index.set_endpoints({a: e.capacity_blocks for a, e in self._endpoints.items()})

    @property
    def endpoints(self) -> list[str]:
        return list(self._endpoints)

    def is_member(self, address: str) -> bool:
        return address in self._endpoints

    def set_health(self, address: str, healthy: bool) -> None:
        state = self._endpoints.get(address)
        if state is None or state.healthy == healthy:
            return
        state.healthy = healthy
        if not healthy:
            # A restarted server comes back with an empty cache: forget what it held.
            self.index.forget(address)
        log.warning("endpoint %s is now %s", address, "healthy" if healthy else "unhealthy")

    def healthy_endpoints(self) -> list[str]:
        return [a for a, s in self._endpoints.items() if s.healthy]

    def in_flight(self) -> dict[str, int]:
        return {a: s.in_flight for a, s in self._endpoints.items()}

    def queued_work(self) -> dict[str, float]:
        """Estimated prefill work queued per endpoint now (token-equivalents)."""
        now = self.clock()
        return {a: self._drain(s, now) for a, s in self._endpoints.items()}

    def index_stats(self) -> IndexStats:
        return self.index.stats()

    def _drain(self, state: EndpointState, now: float) -> float:
        rate = self.cost.drain_per_second
        if rate > 0 and state.work > 0:
            state.work = max(0.0, state.work - rate * max(0.0, now - state.work_at))
        if state.in_flight == 0:
            state.work = 0.0
        state.work_at = now
        return state.work

    def _charge(self, state: EndpointState, decision: Decision, now: float) -> None:
        decision.work_released = False
        decision.queued_before = self._drain(state, now)
        decision.charged_at = now
        state.work += decision.work
        state.in_flight += 1

    def _release_work(self, state: EndpointState, decision: Decision, now: float) -> None:
        """Take back what is left of the request's charge (FIFO: work queued before it
        drains first)."""
        if decision.work_released:
            return
        decision.work_released = True
        self._drain(state, now)
        drained = self.cost.drain_per_second * max(0.0, now - decision.charged_at)
        left = min(decision.work, max(0.0, decision.work + decision.queued_before - drained))
        state.work = max(0.0, state.work - left)

    def _uncharge(self, state: EndpointState, decision: Decision, now: float) -> None:
        self._release_work(state, decision, now)
        if state.in_flight > 0:
            state.in_flight -= 1
        if state.in_flight == 0:
            state.work = 0.0

    # -- decisions ----------------------------------------------------------------------
    def route(self, request: LLMRequest, allowed: frozenset[str] | None = None) -> Decision:
        """Decide and count the request in flight. ``allowed`` is the proxy's subset hint."""
        cfg = self.config
        root = root_hash(request.model, request.cache_salt)
        hashes = block_hashes(request.prompt, root, cfg.block_size_bytes, cfg.max_blocks)
        key = placement_key(
            request, hashes, root, cfg.block_size_bytes, cfg.cold_start_key, cfg.cold_start_blocks
        )
        now = self.clock()
        views = [
            EndpointView(
                s.address,
                float(
                    s.in_flight if s.reported_load is None else max(s.in_flight, s.reported_load)
                ),
                s.weight,
                s.address_hash,
                self._drain(s, now),
                s.saturated,
            )
            for s in self._endpoints.values()
            if s.healthy and (allowed is None or s.address in allowed)
        ]
        matches = self.index.match(hashes, (v.address for v in views))
        session = session_blocks(
            request, hashes, cfg.block_size_bytes, cfg.cold_start_key, cfg.cold_start_blocks
        )
        decision = self.scheduler.pick(
            views,
            matches,
            len(hashes),
            key,
            session,
            prompt_tokens=len(request.prompt) / cfg.bytes_per_token,
            block_tokens=cfg.block_size_bytes / cfg.bytes_per_token,
        )
        decision.hashes = hashes
        if decision.endpoint is not None:
            self.index.record(decision.endpoint, hashes)
            self._charge(self._endpoints[decision.endpoint], decision, now)
        return decision

    def finish(self, decision: Decision) -> None:
        if decision.rule == RULE_NO_ENDPOINT or decision.endpoint is None:
            return
        state = self._endpoints.get(decision.served or decision.endpoint)
        if state is not None:
            self._uncharge(state, decision, self.clock())

    def prefill_done(self, decision: Decision) -> None:
        """The endpoint has answered (its first byte reached Envoy): the request's prefill is
        over, so what is left of its work charge is taken back now. It stays in flight, as a
        decoding sequence, until ``finish``. Envoy waits for the router's answer to the
        response headers before the client sees them, so a client that sends its next turn
        after this answer always finds the charge released."""
        if decision.rule == RULE_NO_ENDPOINT or decision.endpoint is None:
            return
        state = self._endpoints.get(decision.served or decision.endpoint)
        if state is not None:
            self._release_work(state, decision, self.clock())

    def served(self, decision: Decision, served_address: str) -> bool:
        """Envoy reports where the request really went; move the load and learn the blocks.

        Returns True when the report differed from the decision and was applied.
        """
        current = decision.served or decision.endpoint
        if served_address == current or served_address not in self._endpoints:
            return False
        self.finish(decision)
        decision.served = served_address
        self._charge(self._endpoints[served_address], decision, self.clock())
        self.index.record(served_address, decision.hashes)
        return True
