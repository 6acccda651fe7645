"""A replica that is down when the router picks it: the request still succeeds."""

from __future__ import annotations

import time

import pytest

from extproc.stack import Stack

from .conftest import chat_body, start_routed_stack

pytestmark = [pytest.mark.envoy]
FAST = ["--prefill-ms-per-token", "0.0001", "--decode-ms-per-token", "0.1"]


@pytest.mark.parametrize("body_mode", ["buffered", "full_duplex_streamed"])
@pytest.mark.parametrize("mode", ["override-host", "original-dst"])
def test_envoy_retries_a_dead_pick_on_another_replica(mode, body_mode):
    """Router health checks off: the router still picks the dead home; Envoy must recover
    (override-host: the fallback policy; original-dst: the composite cluster's retry)."""
    with Stack() as stack:
        members = stack.start_replicas(3, FAST)
        routed = start_routed_stack(
            stack, mode, body_mode, members, ["--set", "health.enabled=false"]
        )
        history = ["Tell me about the dead replica. " * 30]
        home = routed.send(chat_body(*history))
        assert home.status == 200
        dead = next(p for p in stack.processes if p.name == home.replica)
        stack.stop(dead)
        for turn in range(5):
            history += ["An answer.", f"next question {turn}"]
            response = routed.send(chat_body(*history))
            assert response.status == 200, response.body[:300]
            assert response.replica != home.replica


@pytest.mark.parametrize("body_mode", ["buffered", "full_duplex_streamed"])
def test_original_dst_router_stops_picking_a_dead_replica(body_mode):
    """With its probes on, the router stops picking the dead replica (no retry needed)."""
    with Stack() as stack:
        members = stack.start_replicas(3, FAST)
        routed = start_routed_stack(
            stack,
            "original-dst",
            body_mode,
            members,
            ["--set", "health.interval_seconds=0.2", "--set", "health.unhealthy_threshold=1"],
        )
        history = ["Tell me about the dead replica. " * 30]
        home = routed.send(chat_body(*history))
        assert home.status == 200
        dead = next(p for p in stack.processes if p.name == home.replica)
        stack.stop(dead)
        time.sleep(1.0)  # > interval x threshold: the router has seen the failure
        for turn in range(5):
            history += ["An answer.", f"next question {turn}"]
            response = routed.send(chat_body(*history))
            assert response.status == 200, response.body[:300]
            assert response.replica != home.replica


def test_original_dst_stops_picking_a_dead_replica_after_envoys_first_failure():
    """Probes too slow to matter (30 s) and no retries: Envoy's local reply for the
    unreachable upstream carries its response flags, and the router takes the endpoint out
    at once. (With retries, the default, that request is retried elsewhere instead.)"""
    with Stack() as stack:
        members = stack.start_replicas(3, FAST)
        routed = start_routed_stack(
            stack,
            "original-dst",
            "buffered",
            members,
            ["--set", "health.interval_seconds=30"],
            retries=0,
        )
        history = ["Tell me about the dead replica. " * 30]
        home = routed.send(chat_body(*history))
        assert home.status == 200
        dead = next(p for p in stack.processes if p.name == home.replica)
        stack.stop(dead)
        history += ["An answer.", "first question after the death"]
        first = routed.send(chat_body(*history))
        # No retry configured: this one is lost, and says why.
        assert first.status == 503
        assert "UF" in first.headers["x-prefix-router-upstream-failure"]
        for turn in range(5):
            history += ["An answer.", f"next question {turn}"]
            response = routed.send(chat_body(*history))
            assert response.status == 200, response.body[:300]
            assert response.replica != home.replica


@pytest.mark.parametrize("mode", ["override-host", "original-dst"])
def test_a_replica_cannot_mark_itself_failed_with_envoys_header(mode):
    """Every replica's responses carry the header Envoy puts on its own reply for an
    unreachable upstream (a replica behind a proxy of its own might): Envoy removes it, so
    the router keeps a conversation on its replica and the client never sees it."""
    forged = ["--response-header", "x-prefix-router-upstream-failure: UF"]
    with Stack() as stack:
        members = stack.start_replicas(3, [*FAST, *forged])
        routed = start_routed_stack(
            stack, mode, "buffered", members, ["--set", "health.interval_seconds=30"]
        )
        history = ["Tell me about forged headers. " * 30]
        served = []
        for turn in range(5):
            response = routed.send(chat_body(*history))
            assert response.status == 200, response.body[:300]
            assert "x-prefix-router-upstream-failure" not in response.headers
            served.append(response.replica)
            history += ["An answer.", f"next question {turn}"]
        assert len(set(served)) == 1, served
