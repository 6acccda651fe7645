"""Where a router with nothing queued sends a request: its rendezvous pick.

Tests that need "where another router replica would cold-start this" ask a new Router for
each request. One Router asked over and over charges its own picks as queued work, and with
the one-router cold-start margin (routing.cold_margin, 0.1) those charges alone move later
picks off the rendezvous order.
"""

from __future__ import annotations

from collections.abc import Sequence

from extproc.config import EndpointConfig, RoutingConfig
from extproc.prompt import parse_request
from extproc.router import Router


def rendezvous_pick(body: bytes, addresses: Sequence[str]) -> str | None:
    router = Router(RoutingConfig(), [EndpointConfig(address=a) for a in addresses])
    return router.route(parse_request("chat", body)).endpoint
