"""The routing core's one entry point: request → hashes → index → scheduler → decision.

No gRPC or Envoy here: the ext_proc server and the simulator drive this same object.
A request is in flight on its endpoint from ``route`` until ``finish``; the server calls
``finish`` when Envoy's processing stream for that request ends.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from .config import EndpointConfig, RoutingConfig
from .hashing import block_hashes, placement_key, root_hash, session_blocks
from .index import IndexStats, PrefixIndex
from .prompt import LLMRequest
from .scheduler import RULE_NO_ENDPOINT, Decision, EndpointView, Scheduler, address_hash

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EndpointState:
    address: str
    weight: float
    capacity_blocks: int
    address_hash: int
    in_flight: int = 0
    healthy: bool = True


class Router:
    def __init__(self, config: RoutingConfig, endpoints: Sequence[EndpointConfig] = ()) -> None:
        self.config = config
        self.scheduler = Scheduler(config)
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
            else:
                state.weight, state.capacity_blocks = e.weight, capacity
            fresh[e.address] = state
        self._endpoints = fresh
        self.index.set_endpoints({a: s.capacity_blocks for a, s in fresh.items()})

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

    def index_stats(self) -> IndexStats:
        return self.index.stats()

    # -- decisions ----------------------------------------------------------------------
    def route(self, request: LLMRequest, allowed: frozenset[str] | None = None) -> Decision:
        """Decide and count the request in flight. ``allowed`` is the proxy's subset hint."""
        cfg = self.config
        root = root_hash(request.model, request.cache_salt)
        hashes = block_hashes(request.prompt, root, cfg.block_size_bytes, cfg.max_blocks)
        key = placement_key(
            request, hashes, root, cfg.block_size_bytes, cfg.cold_start_key, cfg.cold_start_blocks
        )
        views = [
            EndpointView(s.address, float(s.in_flight), s.weight, s.address_hash)
            for s in self._endpoints.values()
            if s.healthy and (allowed is None or s.address in allowed)
        ]
        matches = self.index.match(hashes, (v.address for v in views))
        session = session_blocks(
            request, hashes, cfg.block_size_bytes, cfg.cold_start_key, cfg.cold_start_blocks
        )
        decision = self.scheduler.pick(views, matches, len(hashes), key, session)
        decision.hashes = hashes
        if decision.endpoint is not None:
            self.index.record(decision.endpoint, hashes)
            self._endpoints[decision.endpoint].in_flight += 1
        return decision

    def finish(self, decision: Decision) -> None:
        if decision.rule == RULE_NO_ENDPOINT or decision.endpoint is None:
            return
        state = self._endpoints.get(decision.served or decision.endpoint)
        if state is not None and state.in_flight > 0:
            state.in_flight -= 1

    def served(self, decision: Decision, served_address: str) -> bool:
        """Envoy reports where the request really went; move the load and learn the blocks.

        Returns True when the report differed from the decision and was applied.
        """
        current = decision.served or decision.endpoint
        if served_address == current or served_address not in self._endpoints:
            return False
        self.finish(decision)
        decision.served = served_address
        self._endpoints[served_address].in_flight += 1
        self.index.record(served_address, decision.hashes)
        return True
