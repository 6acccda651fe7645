"""Requests routed before the router first read an endpoint's metrics.

The first scrape sizes an endpoint's index by the KV cache its server reports (unless
``capacity_tokens`` is configured), and a resized index region starts empty: what the router
placed before that scrape (a router just started, a pod just added, a server slow to answer
/metrics) was lost, and those conversations' next turns were routed as new ones. The
placements are journalled and replayed into the resized region now (``index.Journal``).
Real Envoy (override-host) and router process; stand-in replicas whose /metrics answers
503 for their first seconds and whose KV size (65,536 tokens) is not the router's
provisional one (500,000).
"""

from __future__ import annotations

import time

import pytest

from extproc.stack import Stack

from .conftest import FAST, chat, report, router_samples, start_rig, total, wait_until

pytestmark = [pytest.mark.envoy]

METRICS_AFTER_SECONDS = 8.0


def test_placements_made_before_the_first_scrape_are_kept():
    started = time.monotonic()
    with Stack() as stack:
        replicas = stack.start_replicas(
            3, [*FAST, "--metrics-after-seconds", str(METRICS_AFTER_SECONDS)]
        )
        rig = start_rig(stack, "override-host", "buffered", replicas)
        names = {f"replica-{i + 1}": a for i, a in enumerate(replicas)}

        def system(c: int) -> str:
            return f"Conversation {c} has a system prompt of its own. " * 12

        def gauge(name: str, address: str) -> float:
            return total(router_samples(rig.router_admin), name, endpoint=address)

        homes = {}
        for c in range(12):
            response = rig.send(chat(c, 0, system=system(c)))
            assert response.status == 200
            homes[c] = response.replica
        placed_after = time.monotonic() - started
        assert placed_after < METRICS_AFTER_SECONDS - 1, "too slow to place before the scrapes"
        up = "prefix_router_endpoint_metrics_up"
        assert all(gauge(up, a) == 0 for a in replicas)  # no scrape answered yet
        assert wait_until(lambda: all(gauge(up, a) == 1 for a in replicas), 20)
        time.sleep(1.2)  # the index gauges refresh every second
        held = {name: gauge("prefix_router_index_entries", names[name]) for name in names}
        matched = "prefix_router_matched_blocks_total"
        matched_before = total(router_samples(rig.router_admin), matched)
        for c, home in homes.items():
            response = rig.send(chat(c, 1, system=system(c)))
            assert response.status == 200 and response.replica == home
        matched_after = total(router_samples(rig.router_admin), matched)
        report(
            "first_scrape",
            placed_after_seconds=round(placed_after, 1),
            homes=sorted(set(homes.values())),
            index_entries=held,
            next_turns_matched_blocks=matched_after - matched_before,
        )
        assert all(held[home] > 0 for home in homes.values()), held
        assert matched_after - matched_before > 0
