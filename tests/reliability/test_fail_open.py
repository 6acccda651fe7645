"""Fail-open under load: the router killed (SIGKILL) or hung (SIGSTOP) mid-run.

BUFFERED (the default) must lose nothing in both Envoy designs: 2,000 requests at 32
concurrent, zero failures, and routing resumes once the router is back. FULL_DUPLEX_STREAMED
cannot fail open once a body is handed to the stream; the last two tests measure that limit
(docs/reliability.md quotes their figures).
"""

from __future__ import annotations

import signal
import time

import pytest

from extproc.envoyconf import ROUTER_CLUSTER
from extproc.stack import Stack

from .conftest import (
    Probe,
    chat,
    envoy_stats,
    report,
    routed_count,
    run_load,
    start_rig,
    wait_until,
)

pytestmark = [pytest.mark.envoy]
MODES = ["override-host", "original-dst"]
TOTAL, CONCURRENCY = 2000, 32


def _ext_proc(rig, name: str) -> int:
    return envoy_stats(rig.envoy_admin).get(f"http.llm.ext_proc.{name}", 0)


def _router_health_checks(rig) -> dict[str, int]:
    """Envoy's gRPC health checks of the router cluster so far, by result."""
    prefix = f"cluster.{ROUTER_CLUSTER}.health_check."
    stats = envoy_stats(rig.envoy_admin, prefix)
    return {k.removeprefix(prefix): v for k, v in stats.items() if k.startswith(prefix)}


def _routing_after_the_fault(rig, tag: str) -> tuple[Probe, dict]:
    """Probe that routing works once the load is over; one failed probe is tolerated.

    Envoy's health check of the router (0.5 s timeout, unhealthy threshold 1) takes the
    router out for an interval when one check is slow, which a loaded machine can cause
    after the fault. A CI run looked like that once (routed again 0.04 s after SIGCONT,
    then failed open to its end; cause not confirmed, docs/reliability.md): a transient,
    not a router that stays out. So a failed probe is reported with Envoy's health-check
    counters, routing must come back (``wait_routing``), and a second probe must pass."""
    probe = rig.routing_works(tag)
    if probe:
        return probe, {}
    retried = {"first_probe": repr(probe), "health_checks": _router_health_checks(rig)}
    retried["routed_again_s"] = rig.wait_routing()
    return rig.routing_works(f"{tag}, second probe"), retried


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_router_killed_and_restarted_under_load(replicas, mode):
    _, members = replicas
    with Stack() as stack:
        rig = start_rig(stack, mode, "buffered", members)
        assert rig.routing_works("before the kill")

        def kill():
            rig.router.signal(signal.SIGKILL)
            rig.router.process.wait(5)

        resumed = {}

        def restart():
            rig.restart_router()  # same port; waits for /readyz
            resumed["s"] = rig.wait_routing()  # probes, while the load goes on

        allowed_before = _ext_proc(rig, "failure_mode_allowed")
        run = run_load(
            rig.envoy_port,
            TOTAL,
            CONCURRENCY,
            events=[(TOTAL // 5, "kill", kill), (TOTAL // 5, "restart", restart)],
        )
        failed_open = _ext_proc(rig, "failure_mode_allowed") - allowed_before
        # The router counts a request when its stream ends, just after the response.
        wait_until(lambda: routed_count(rig.router_admin) > 0, 5)
        routed_after_restart = routed_count(rig.router_admin)
        figures = run.summary() | {
            "mode": mode,
            "down_s": round(run.events["restart:done"] - run.events["kill"], 2),
            "failed_open": failed_open,
            "routed_by_restarted_router": routed_after_restart,
            "routing_resumed_after_ready_s": resumed["s"] and round(resumed["s"], 2),
        }
        probe, figures["probe_retried"] = _routing_after_the_fault(rig, "after the restart")
        report("router_killed_under_load", **figures)
        assert run.failed == [], run.failed[:5]
        assert failed_open > 0  # the fault was real: Envoy continued without the router
        assert routed_after_restart > 0  # the tail of the run was routed again
        assert probe, figures["probe_retried"]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_router_hung_past_message_timeout_under_load(replicas, mode):
    _, members = replicas
    with Stack() as stack:
        rig = start_rig(stack, mode, "buffered", members)
        hang = 2.5  # > message_timeout (1 s)

        resumed = {}

        def stop():
            rig.router.signal(signal.SIGSTOP)
            time.sleep(hang)
            rig.router.signal(signal.SIGCONT)
            resumed["s"] = rig.wait_routing()

        timeouts_before = _ext_proc(rig, "message_timeouts")
        allowed_before = _ext_proc(rig, "failure_mode_allowed")
        routed_before = routed_count(rig.router_admin)
        checks_before = _router_health_checks(rig)
        run = run_load(rig.envoy_port, TOTAL, CONCURRENCY, events=[(TOTAL // 5, "hang", stop)])
        checks = _router_health_checks(rig)
        during = run.between("hang", "hang:done")
        figures = run.summary() | {
            "mode": mode,
            "hang_s": hang,
            "sent_during_hang": len(during),
            "max_ms_during_hang": run.latency_ms(during, 1.0),
            "message_timeouts": _ext_proc(rig, "message_timeouts") - timeouts_before,
            "failed_open": _ext_proc(rig, "failure_mode_allowed") - allowed_before,
            "routed": routed_count(rig.router_admin) - routed_before,
            "routing_resumed_after_sigcont_s": resumed["s"] and round(resumed["s"], 2),
            "router_health_checks": {
                k: v - checks_before.get(k, 0) for k, v in checks.items() if k != "healthy"
            },
        }
        probe, figures["probe_retried"] = _routing_after_the_fault(rig, "after SIGCONT")
        report("router_hung_under_load", **figures)
        assert run.failed == [], run.failed[:5]
        assert figures["message_timeouts"] > 0  # some requests waited for the hung router...
        assert run.latency_ms(q=1.0) < 10_000  # ...about message_timeout, then went on
        assert figures["routed"] > TOTAL // 5  # before the hang and after SIGCONT
        assert probe, figures["probe_retried"]


@pytest.mark.slow
def test_full_duplex_router_killed_mid_stream_is_a_bounded_loss(replicas):
    """Measured Envoy limit: in full duplex a request whose body was already handed to the
    router stream cannot fail open. The loss is bounded to the requests in flight when the
    router died plus those sent before Envoy's gRPC health check (0.5 s) saw it down."""
    _, members = replicas
    with Stack() as stack:
        rig = start_rig(stack, "override-host", "full_duplex_streamed", members)
        total = 1000

        def kill():
            rig.router.signal(signal.SIGKILL)
            rig.router.process.wait(5)

        def restart():
            time.sleep(1.5)  # Envoy's health check sees the router down meanwhile
            rig.restart_router()
            wait_until(rig.envoy_router_healthy, 10, 0.05)

        # Paced (open loop, 400/s): a closed loop would turn the instant 500s into a burst.
        run = run_load(
            rig.envoy_port,
            total,
            CONCURRENCY,
            events=[(total // 4, "kill", kill), (total // 4, "restart", restart)],
            rate=400,
        )
        killed_at = run.events["kill"]
        offsets = [r.started - killed_at for r in run.failed]
        window = 1.0  # health check interval 0.5 s, with room for a loaded machine
        late = [o for o in offsets if not -0.5 < o < window]
        figures = run.summary() | {
            "failed_first_s_after_kill": round(min(offsets, default=0), 3),
            "failed_last_s_after_kill": round(max(offsets, default=0), 3),
            "failed_outside_window": len(late),
            "sent_after_window": len([r for r in run.results if r.started > killed_at + window]),
        }
        probe, figures["probe_retried"] = _routing_after_the_fault(rig, "full duplex, restarted")
        report("full_duplex_router_killed", **figures)
        assert late == []  # only requests sent around the kill failed; never later ones
        assert all(r.status in (0, 500, 502, 503, 504) for r in run.failed)
        assert figures["sent_after_window"] > 0
        assert probe, figures["probe_retried"]


@pytest.mark.slow
def test_full_duplex_hung_router_holds_requests_until_stream_idle_timeout(replicas):
    """Measured Envoy limit: message_timeout does not apply in full duplex; a request that
    reached a hung router waits for stream_idle_timeout. Requests sent after the router's
    gRPC health check failed (0.5 s) skip it and succeed."""
    _, members = replicas
    idle = 4.0
    with Stack() as stack:
        rig = start_rig(
            stack, "override-host", "full_duplex_streamed", members, stream_idle_timeout=idle
        )
        from concurrent.futures import ThreadPoolExecutor

        def timed(i: int) -> tuple[int, float]:
            started = time.monotonic()
            status = rig.send(chat(5000 + i, 0)).status
            return status, time.monotonic() - started

        rig.router.signal(signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(8) as pool:
                stuck = list(pool.map(timed, range(8)))
            later = [timed(100 + i) for i in range(4)]  # the router is marked down by now
        finally:
            rig.router.signal(signal.SIGCONT)
        waited = [s for s in stuck if s[1] >= idle - 0.5]
        report(
            "full_duplex_router_hung",
            stream_idle_timeout_s=idle,
            stuck_statuses=sorted({s for s, _ in stuck}),
            stuck_waited=len(waited),
            stuck_max_s=round(max(t for _, t in stuck), 2),
            after_health_check_statuses=sorted({s for s, _ in later}),
            after_health_check_max_s=round(max(t for _, t in later), 2),
        )
        assert waited, stuck  # at least one request sat until stream_idle_timeout...
        assert all(t < idle + 10 for _, t in stuck)  # ...and no longer
        assert all(s == 200 for s, _ in later)  # once Envoy saw it down: fail open
        assert all(t < idle for _, t in later)
        assert wait_until(rig.envoy_router_healthy, 10)
        probe, retried = _routing_after_the_fault(rig, "full duplex after SIGCONT")
        assert probe, retried
