"""The router behind a real Envoy, for both Envoy designs and both body modes."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from .conftest import chat_body

pytestmark = [pytest.mark.envoy]


def intruder_requests(intruder: str) -> float:
    text = urllib.request.urlopen(f"http://{intruder}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("vllm:prompt_tokens_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_same_prefix_goes_to_the_same_replica(routed):
    first = routed.send(chat_body("Explain B-trees. " * 40))
    assert first.status == 200, first.body
    seen = {first.replica}
    for turn in range(4):
        history = ["Explain B-trees. " * 40, "A B-tree is ...", f"follow-up {turn}"]
        response = routed.send(chat_body(*history))
        assert response.status == 200
        seen.add(response.replica)
    assert len(seen) == 1
    # Envoy reports the endpoint that served, and it is the one the router chose.
    assert routed.names[first.headers["x-gateway-destination-endpoint-served"]] == first.replica


def test_different_prefixes_spread(routed):
    replicas = {
        routed.send(
            chat_body(f"Topic {i}: " + "details " * 60, system=f"Persona {i}. " * 20)
        ).replica
        for i in range(16)
    }
    assert len(replicas) >= 3


@pytest.mark.parametrize(
    "headers",
    [
        [("x-gateway-destination-endpoint", "{intruder}")],
        [("X-Gateway-Destination-Endpoint", "{intruder}")],
        [
            ("x-gateway-destination-endpoint", "{intruder}"),
            ("x-gateway-destination-endpoint", "{intruder}"),
        ],
        [("x-gateway-destination-endpoint", "{intruder},{member}")],
        [("x-gateway-destination-endpoint", "[::1]:{intruder_port}")],
        [("x-gateway-destination-endpoint", "localhost:{intruder_port}")],
        [("x-gateway-destination-endpoint-served", "{intruder}")],
    ],
    ids=["plain", "case", "repeated", "list", "ipv6", "hostname", "served-header"],
)
def test_client_routing_header_is_never_honoured(routed, replica_stack, headers):
    _, members, intruder = replica_stack
    port = intruder.rsplit(":", 1)[1]
    values = {"intruder": intruder, "member": members[0], "intruder_port": port}
    sent = [(k, v.format(**values)) for k, v in headers]
    before = intruder_requests(intruder)
    for i in range(3):
        response = routed.send(chat_body(f"spoof attempt {i} " * 30), headers=sent)
        assert response.status == 200
        assert response.replica in routed.names.values()
    assert intruder_requests(intruder) == before


def test_non_json_body_passes_through_to_a_replica(routed):
    response = routed.send(b"this is not json {")
    # The replica, not Envoy or the router, answers: the body reached it unchanged.
    assert response.status == 400
    assert response.replica in routed.names.values()
    assert b"error" in response.body


def test_get_and_unknown_paths_pass_through(routed):
    models = routed.send(None, path="/v1/models", method="GET")
    assert models.status == 200 and b"demo-model" in models.body
    unknown = routed.send(b"{}", path="/v1/embeddings")
    assert unknown.replica in routed.names.values()


def test_eight_mib_body_is_routed(routed):
    document = "word " * (8 * 1024 * 1024 // 5)
    body = chat_body(document)
    assert len(body) >= 8 * 1024 * 1024
    replicas = set()
    for _ in range(3):
        response = routed.send(body, timeout=60)
        assert response.status == 200, response.body[:200]
        replicas.add(response.replica)
    assert len(replicas) == 1  # routed by prefix each time, not round robin


def test_router_down_requests_still_succeed_then_routing_resumes(routed):
    routed.stack.stop(routed.router)
    if routed.body_mode == "full_duplex_streamed":
        # Full duplex can only fail open before the body is handed to the stream: Envoy
        # must first see the router's gRPC health check fail (0.5 s interval).
        time.sleep(1.2)
    try:
        statuses = [
            routed.send(chat_body(f"while router is down {i} " * 20)).status for i in range(8)
        ]
        assert statuses == [200] * 8
    finally:
        routed.restart_router()
    # Envoy routes through the router again once its gRPC health check passes (~0.5-2 s).
    deadline = time.monotonic() + 8
    while True:
        seen = {routed.send(chat_body("after restart " * 40)).replica for _ in range(4)}
        if len(seen) == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(seen) == 1


def test_no_endpoint_is_a_clear_503(replica_stack):
    """Every endpoint of the subset hint is outside the pool: the router answers 503 itself."""
    from extproc.stack import Stack

    from .conftest import start_routed_stack

    _, members, _ = replica_stack
    with Stack() as stack:
        routed = start_routed_stack(
            stack, "override-host", "buffered", members, ["--set", "health.enabled=true"]
        )
        # Mark every endpoint unhealthy by pointing the router at a dead health path.
        stack.stop(routed.router)
        routed.router_args = [
            "--set",
            "health.path=/missing",
            "--set",
            "health.interval_seconds=0.1",
        ]
        routed.restart_router()
        # The router marks every endpoint unhealthy within ~0.2 s; Envoy sends to it again
        # once its gRPC health check passes after the restart (up to ~2 s).
        deadline = time.monotonic() + 10
        while True:
            response = routed.send(chat_body("nobody is healthy " * 20))
            if response.status == 503 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert response.status == 503
        assert json.loads(response.body)["error"]["type"] == "prefix_router"
