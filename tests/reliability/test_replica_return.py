"""A replica dies and comes back, with the router's default health probes (1 s, 2 failures).

Dead: the router stops picking it within seconds; requests keep succeeding: both designs
retry a dead pick on another replica (original-dst through Envoy's composite cluster). Its
index entries are kept while its metrics tell restarts, and dropped at the first scrape the
restarted server answers: a new process start time (vLLM's one API server exports it), or
without one (vLLM with several API servers) counters that started over; it is picked again
only after that scrape, so conversations that paused while it was out (their prefix known
only there) do not go to the restarted, empty server first. With no metrics read its
entries are dropped when it is found dead (Router.set_health). A replica that only stalls
keeps them. Back: it is used again. tests/integration/test_replica_failure.py covers the
first half with health checks off or fast; this is the whole cycle with the defaults.
"""

from __future__ import annotations

import signal
import time

import pytest

from extproc.stack import Stack

from .conftest import (
    FAST,
    chat,
    report,
    router_samples,
    settled,
    start_rig,
    total,
    wait_until,
)

pytestmark = [pytest.mark.envoy]


def _gauge(rig, name: str, endpoint: str) -> float:
    return total(router_samples(rig.router_admin), name, endpoint=endpoint)


def _start_conversations(stack: Stack, rig) -> tuple[dict[int, str], str, str, float]:
    """12 conversations' first turns: (their homes, the replica most are at, its address,
    its index entries once the gauges refreshed)."""
    names = {f"replica-{i + 1}": a for i, a in enumerate(stack.replicas)}
    homes: dict[int, str] = {}
    for c in range(12):
        response = rig.send(chat(c, 0))
        assert response.status == 200
        homes[c] = response.replica
    victim = max(set(homes.values()), key=list(homes.values()).count)
    address = names[victim]
    held = settled(lambda: _gauge(rig, "prefix_router_index_entries", address))
    assert held > 0
    return homes, victim, address, held


# What tells the router a replica restarted: its metrics' start time, their counters alone
# (the replicas export no start time), or nothing (the router reads no metrics).
REPLICA_ARGS = {"start time": FAST, "counters": [*FAST, "--no-start-time"], "none": FAST}
ROUTER_ARGS = {"start time": [], "counters": [], "none": ["--set", "signals.enabled=false"]}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "told_by"),
    [
        ("override-host", "start time"),
        ("original-dst", "start time"),
        ("override-host", "counters"),
        ("override-host", "none"),
    ],
)
def test_dead_replica_is_avoided_forgotten_and_used_again_when_back(mode, told_by):
    with Stack() as stack:
        members = stack.start_replicas(3, REPLICA_ARGS[told_by])
        rig = start_rig(stack, mode, "buffered", members, ROUTER_ARGS[told_by])
        homes, victim, address, _ = _start_conversations(stack, rig)
        # Two of its conversations pause while it is out: only its index says where their
        # prefix is, so they come back to it unless the router knows it restarted.
        idle = [c for c, home in homes.items() if home == victim][:2]
        active = [c for c in homes if c not in idle]
        proc = stack.process(victim)
        proc.signal(signal.SIGKILL)
        proc.process.wait(5)
        killed = time.monotonic()
        statuses: list[tuple[float, int]] = []
        detected = None
        turn = 1
        while time.monotonic() - killed < 15:
            for c in active:  # the victim's other conversations keep coming
                statuses.append((time.monotonic() - killed, rig.send(chat(c, turn)).status))
            turn += 1
            if _gauge(rig, "prefix_router_endpoint_healthy", address) == 0:
                detected = time.monotonic() - killed
                break
        assert detected is not None, "the router never marked the dead replica unhealthy"
        time.sleep(1.2)
        entries_after = _gauge(rig, "prefix_router_index_entries", address)
        if told_by != "none":
            assert entries_after > 0  # kept: a restart is told by the metrics
        else:
            assert entries_after == 0  # forgotten: nothing would tell a restart
        after = [rig.send(chat(c, turn)) for c in active]
        assert all(r.status == 200 for r in after)
        assert victim not in {r.replica for r in after}
        failed = [(round(t, 2), s) for t, s in statuses if s != 200]
        assert failed == []  # Envoy retried every dead pick on a live member

        port = int(address.rsplit(":", 1)[1])
        stack.respawn(proc, port)
        back = time.monotonic()
        restarts = "prefix_router_endpoint_restarts_total"
        used_again = until_used = None
        told_before = []  # for each request the restarted replica served: restart told?
        c = 100
        while time.monotonic() - back < 20:
            # The paused conversations' next turns, and new sessions with their own system
            # prompt: placed by rendezvous hashing over the healthy endpoints (a prefix
            # shared with earlier sessions would attract them to where it is cached
            # instead, by design).
            for request in [*(chat(i, 1) for i in idle), chat(c, 0, system=f"Persona {c}. " * 12)]:
                response = rig.send(request)
                assert response.status == 200
                if response.replica == victim:
                    told_before.append(_gauge(rig, restarts, address) == 1)
            if told_before and used_again is None:
                used_again = time.monotonic() - back
                until_used = c - 99
            if used_again is not None and time.monotonic() - back > used_again + 1:
                break
            c += 1
            time.sleep(0.05)
        told = _gauge(rig, restarts, address)
        report(
            "replica_death_and_return",
            mode=mode,
            restart_told_by=told_by,
            requests_while_detecting=len(statuses),
            failed_while_detecting=len(failed),
            unhealthy_after_s=round(detected, 2),
            index_entries_after=entries_after,
            restarts_told=told,
            used_again_after_s=round(used_again, 2) if used_again is not None else None,
            new_conversations_until_used=until_used if used_again is not None else None,
            served_there_in_the_next_second=len(told_before),
            served_there_before_the_restart_was_told=told_before.count(False),
        )
        assert used_again is not None, "the replica was never used again"
        # Picked again only once its metrics were read: never before its restart was told.
        assert told == (0 if told_by == "none" else 1)
        if told_by != "none":
            assert all(told_before), told_before


@pytest.mark.slow
@pytest.mark.parametrize("told_by", ["start time", "counters"])
def test_a_stalled_replica_keeps_its_index_and_its_conversations(told_by):
    """SIGSTOP'd past two probes, then resumed: marked unhealthy and back, and as its start
    time did not change (or its counters did not start over), what it held was kept; its
    conversations come back to it."""
    with Stack() as stack:
        members = stack.start_replicas(3, REPLICA_ARGS[told_by])
        rig = start_rig(stack, "override-host", "buffered", members)
        homes, victim, address, held = _start_conversations(stack, rig)
        proc = stack.process(victim)
        proc.signal(signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            healthy = "prefix_router_endpoint_healthy"
            assert wait_until(lambda: _gauge(rig, healthy, address) == 0, 10)
            detected = time.monotonic() - stopped
        finally:
            proc.signal(signal.SIGCONT)
        assert wait_until(lambda: _gauge(rig, healthy, address) == 1, 10)
        time.sleep(1.2)
        kept = _gauge(rig, "prefix_router_index_entries", address)
        assert kept == held
        assert _gauge(rig, "prefix_router_endpoint_restarts_total", address) == 0
        mine = [c for c, home in homes.items() if home == victim]
        back = [rig.send(chat(c, 1)) for c in mine]
        assert all(r.status == 200 for r in back)
        returned = sum(r.replica == victim for r in back)
        report(
            "replica_stall",
            restart_told_by=told_by,
            unhealthy_after_s=round(detected, 2),
            index_entries_before=held,
            index_entries_after=kept,
            conversations=len(mine),
            back_on_it=returned,
        )
        assert returned == len(mine)
