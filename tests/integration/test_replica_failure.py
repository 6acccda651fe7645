"""A replica that is down when the router picks it: the request still succeeds."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc import envoyconf
from extproc.stack import Stack

from ..waiting import wait_until
from .conftest import Response, RoutedStack, chat_body, start_routed_stack
from .test_observability import samples, total

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
        # The router has seen the failure (probes every 0.2 s; its gauges refresh each second).
        admin = stack.router_admin_ports["router"]
        down = wait_until(
            lambda: total(samples(admin), "prefix_router_endpoint_healthy") == len(members) - 1, 10
        )
        assert down, "the router never marked the dead replica down"
        for turn in range(5):
            history += ["An answer.", f"next question {turn}"]
            response = routed.send(chat_body(*history))
            assert response.status == 200, response.body[:300]
            assert response.replica != home.replica


def _first_turn_after_its_home_died(
    stack: Stack, mode: str, retried: bool = False
) -> tuple[RoutedStack, str, list[str], Response]:
    """Three replicas, the router's probes too slow to matter (30 s): a conversation's home
    dies after its first turn. Returns the stack, the home's name, the conversation and the
    answer to its next turn: lost without retries, served elsewhere with the generated
    configs' retry policy (``retried``)."""
    members = stack.start_replicas(3, FAST)
    routed = start_routed_stack(
        stack,
        mode,
        "buffered",
        members,
        ["--set", "health.interval_seconds=30"],
        **({} if retried else {"retries": 0}),
    )
    history = ["Tell me about the dead replica. " * 30]
    home = routed.send(chat_body(*history))
    assert home.status == 200
    stack.stop(next(p for p in stack.processes if p.name == home.replica))
    history += ["An answer.", "first question after the death"]
    first = routed.send(chat_body(*history))
    if retried:
        assert first.status == 200 and first.replica != home.replica  # a retry saved it
    else:
        assert first.status == 503
    return routed, home.replica, history, first


def _served_elsewhere(routed: RoutedStack, home: str, history: list[str]) -> list[Response]:
    responses = []
    for turn in range(5):
        history += ["An answer.", f"next question {turn}"]
        responses.append(routed.send(chat_body(*history)))
        assert responses[-1].status == 200, responses[-1].body[:300]
        assert responses[-1].replica != home
    return responses


def test_original_dst_stops_picking_a_dead_replica_after_envoys_first_failure():
    """Envoy's local reply for the unreachable upstream carries its response flags, and the
    router takes the endpoint out at once. (With retries, the default, that request is
    retried elsewhere instead.)"""
    with Stack() as stack:
        routed, home, history, first = _first_turn_after_its_home_died(stack, "original-dst")
        assert "UF" in first.headers["x-prefix-router-upstream-failure"]  # says why
        _served_elsewhere(routed, home, history)


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


ISTIO_FILTER = Path(__file__).resolve().parents[2] / "deploy" / "istio" / "envoyfilter.yaml"


def _as_istio_gateway(config: dict[str, Any]) -> dict[str, Any]:
    """A generated override-host config as an Istio gateway's Envoy has it: its own
    connection manager, so neither the served-endpoint header nor the upstream-failure
    marker, with deploy/istio's ext_proc filter (to the test's router cluster)."""
    patches = yaml.safe_load(ISTIO_FILTER.read_text())["spec"]["configPatches"]
    (ext_proc,) = [p["patch"]["value"] for p in patches if p["applyTo"] == "HTTP_FILTER"]
    ext_proc = copy.deepcopy(ext_proc)
    ext_proc["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] = (
        envoyconf.ROUTER_CLUSTER
    )
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    manager = manager["typed_config"]
    del manager["local_reply_config"]
    virtual_host = manager["route_config"]["virtual_hosts"][0]
    del virtual_host["response_headers_to_add"], virtual_host["response_headers_to_remove"]
    filters = manager["http_filters"]
    (position,) = [i for i, f in enumerate(filters) if f["name"] == ext_proc["name"]]
    filters[position] = ext_proc
    return config


@pytest.fixture
def istio_gateway(monkeypatch: pytest.MonkeyPatch) -> None:
    """The proxies this test starts are shaped as an Istio gateway (_as_istio_gateway)."""
    render = envoyconf.render
    monkeypatch.setattr(envoyconf, "render", lambda options: _as_istio_gateway(render(options)))


@pytest.mark.usefixtures("istio_gateway")
def test_under_istio_a_dead_replica_is_out_after_envoys_first_failure():
    """deploy/istio's EnvoyFilter on a gateway that adds neither header: Envoy's response
    attributes (the endpoint that answered, its response flags) tell the router that it
    refused the connection, and the router stops picking it at once (probes every 30 s, no
    retries). Without them the conversation kept going to the dead replica."""
    with Stack() as stack:
        routed, home, history, first = _first_turn_after_its_home_died(stack, "override-host")
        assert "x-prefix-router-upstream-failure" not in first.headers  # Istio's shape
        served = _served_elsewhere(routed, home, history)
        assert not any("x-gateway-destination-endpoint-served" in r.headers for r in served)


def _decisions_by_endpoint(admin_port: int, requests: int) -> dict[str, float]:
    """Decisions per endpoint once the router has recorded ``requests`` of them (a decision
    is counted when Envoy closes the request's processing stream, after the client's
    answer)."""
    deadline = time.monotonic() + 10
    while True:
        metrics = samples(admin_port)
        by_endpoint: dict[str, float] = {}
        for (name, labels), value in metrics.items():
            if name == "prefix_router_endpoint_decisions_total":
                endpoint = dict(labels)["endpoint"]
                by_endpoint[endpoint] = by_endpoint.get(endpoint, 0.0) + value
        if sum(by_endpoint.values()) >= requests or time.monotonic() > deadline:
            assert sum(by_endpoint.values()) == requests, by_endpoint
            return by_endpoint
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("mode", "gateway"),
    [("override-host", "generated"), ("original-dst", "generated"), ("override-host", "istio")],
)
def test_a_pick_a_retry_saved_from_is_out_after_its_first_failure(request, mode, gateway):
    """Retries on (the generated configs' retry policy, also under the Istio-shaped
    config; Istio's own default retries a refused connection too): the first turn after a
    conversation's home died is retried on another replica and served. Envoy's attempt
    count (2) and the endpoint that answered tell the router its pick failed that attempt,
    and it stops picking it at once (probes every 30 s). Before, every later turn went to
    the dead home first, saved by a retry, until the probes found it dead."""
    if gateway == "istio":
        request.getfixturevalue("istio_gateway")
    with Stack() as stack:
        routed, home, history, _ = _first_turn_after_its_home_died(stack, mode, retried=True)
        admin = stack.router_admin_ports["router"]
        home_address = next(a for a, n in routed.names.items() if n == home)
        before = _decisions_by_endpoint(admin, 2)
        assert before[home_address] == 2  # the router picked the dead home for it
        _served_elsewhere(routed, home, history)
        after = _decisions_by_endpoint(admin, 7)
        assert after[home_address] == 2, after  # never picked again
