"""A replica dies and comes back, with the router's default health probes (1 s, 2 failures).

Dead: the router stops picking it within seconds and drops its index entries
(Router.set_health(False) -> index.forget); requests keep succeeding: both designs retry a
dead pick on another replica (original-dst through Envoy's composite cluster).
Back: it is used again. tests/integration/test_replica_failure.py covers the first half with
health checks off or fast; this is the whole cycle with the defaults.
"""

from __future__ import annotations

import signal
import time

import pytest

from extproc.stack import Stack

from .conftest import FAST, chat, report, router_samples, start_rig, total

pytestmark = [pytest.mark.envoy]


def _gauge(rig, name: str, endpoint: str) -> float:
    return total(router_samples(rig.router_admin), name, endpoint=endpoint)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["override-host", "original-dst"])
def test_dead_replica_is_avoided_forgotten_and_used_again_when_back(mode):
    with Stack() as stack:
        members = stack.start_replicas(3, FAST)
        names = {f"replica-{i + 1}": a for i, a in enumerate(members)}
        rig = start_rig(stack, mode, "buffered", members)
        homes: dict[int, str] = {}
        for c in range(12):
            response = rig.send(chat(c, 0))
            assert response.status == 200
            homes[c] = response.replica
        victim = max(set(homes.values()), key=list(homes.values()).count)
        address = names[victim]
        time.sleep(1.2)  # gauges refresh every second
        assert _gauge(rig, "prefix_router_index_entries", address) > 0

        proc = stack.process(victim)
        proc.signal(signal.SIGKILL)
        proc.process.wait(5)
        killed = time.monotonic()
        statuses: list[tuple[float, int]] = []
        detected = None
        turn = 1
        while time.monotonic() - killed < 15:
            for c in homes:  # the victim's conversations keep coming
                statuses.append((time.monotonic() - killed, rig.send(chat(c, turn)).status))
            turn += 1
            if _gauge(rig, "prefix_router_endpoint_healthy", address) == 0:
                detected = time.monotonic() - killed
                break
        assert detected is not None, "the router never marked the dead replica unhealthy"
        time.sleep(1.2)
        entries_after = _gauge(rig, "prefix_router_index_entries", address)
        assert entries_after == 0  # forgotten
        after = [rig.send(chat(c, turn)) for c in homes]
        assert all(r.status == 200 for r in after)
        assert victim not in {r.replica for r in after}
        failed = [(round(t, 2), s) for t, s in statuses if s != 200]
        assert failed == []  # Envoy retried every dead pick on a live member

        port = int(address.rsplit(":", 1)[1])
        stack.respawn(proc, port)
        back = time.monotonic()
        used_again = None
        c = 100
        while time.monotonic() - back < 20:
            # New sessions with their own system prompt: placed by rendezvous hashing over
            # the healthy endpoints (a prefix shared with earlier sessions would attract
            # them to where it is cached instead, by design).
            response = rig.send(chat(c, 0, system=f"Persona {c}. " * 12))
            assert response.status == 200
            if response.replica == victim:
                used_again = time.monotonic() - back
                break
            c += 1
            time.sleep(0.05)
        report(
            "replica_death_and_return",
            mode=mode,
            requests_while_detecting=len(statuses),
            failed_while_detecting=len(failed),
            unhealthy_after_s=round(detected, 2),
            index_entries_after=entries_after,
            used_again_after_s=round(used_again, 2) if used_again is not None else None,
            new_conversations_until_used=c - 99,
        )
        assert used_again is not None, "the replica was never used again"
