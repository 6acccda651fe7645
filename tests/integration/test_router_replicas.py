"""Router replicas without shared state, each behind its own real Envoy.

Each router measures its share of the traffic from the replicas' own prefill counters (the
fake replica exports vLLM's) and, under a half, widens its cold-start margin so that its
placements of new conversations agree with the other routers' (Router._learn_traffic_share).
"""

from __future__ import annotations

import time

from extproc.stack import Stack, router_args_for

from .conftest import chat_body, request
from .test_observability import samples

FAST = ["--prefill-ms-per-token", "0.0001", "--decode-ms-per-token", "0.1"]
ROUTER_ARGS = ["--set", "signals.interval_seconds=0.2", "--set", "health.enabled=false"]
REQUESTS = 48


def _share_and_margin(admin_port: int) -> tuple[float, float]:
    metrics = samples(admin_port)
    share = [v for (name, _), v in metrics.items() if name == "prefix_router_traffic_share"]
    margin = [v for (name, _), v in metrics.items() if name == "prefix_router_cold_margin"]
    assert len(share) == 1 and len(margin) == 1, metrics
    return share[0], margin[0]


def _settled(admin_ports: list[int], done) -> list[tuple[float, float]]:
    """The routers' (share, margin) once ``done`` holds for all (scrapes and the gauge refresh
    come a moment after the last request), or the last reading."""
    deadline = time.monotonic() + 15
    while True:
        readings = [_share_and_margin(port) for port in admin_ports]
        if all(done(*r) for r in readings) or time.monotonic() > deadline:
            return readings
        time.sleep(0.2)


def _start(stack: Stack, names: list[str], replicas: list[str]) -> tuple[list[int], list[int]]:
    envoy_ports, admin_ports = [], []
    for name in names:
        address, _ = stack.start_router(
            replicas, name=name, extra_args=[*ROUTER_ARGS, *router_args_for("override-host")]
        )
        port, _ = stack.start_proxy("override-host", replicas, address, name=f"envoy-{name}")
        envoy_ports.append(port)
        admin_ports.append(stack.router_admin_ports[name])
    return envoy_ports, admin_ports


def _send(envoy_ports: list[int]) -> None:
    for i in range(REQUESTS):
        response = request(envoy_ports[i % len(envoy_ports)], chat_body(f"conversation {i}"))
        assert response.status == 200, response.body


def test_one_router_sees_all_the_traffic_and_keeps_its_cold_margin(tmp_path):
    with Stack(workdir=tmp_path) as stack:
        replicas = stack.start_replicas(2, FAST)
        envoy_ports, admin_ports = _start(stack, ["router"], replicas)
        assert _share_and_margin(admin_ports[0]) == (1.0, 0.5)  # before any traffic
        _send(envoy_ports)
        # Measured, not the start value: the share falls below 1 only if what the replicas
        # report finishing exceeds what this router sent them.
        ((share, margin),) = _settled(admin_ports, lambda s, m: s > 0.9)
        assert share > 0.9 and margin < 0.55, (share, margin)


def test_two_routers_each_see_half_the_traffic_and_widen_their_cold_margin(tmp_path):
    with Stack(workdir=tmp_path) as stack:
        replicas = stack.start_replicas(2, FAST)
        envoy_ports, admin_ports = _start(stack, ["router-a", "router-b"], replicas)
        _send(envoy_ports)
        readings = _settled(admin_ports, lambda s, m: s < 0.65 and m > 0.85)
        for share, margin in readings:
            # shared_cold_margin (1.0) from a half of the traffic down; 0.5 alone.
            assert 0.35 < share < 0.65 and margin > 0.85, readings
