"""Several router replicas, each behind its own real Envoy.

Without shared state, each router measures its share of the traffic from the replicas' own
prefill counters (the fake replica exports vLLM's) and, under a half, widens its cold-start
margin so that its placements of new conversations agree with the other routers'
(Router._learn_traffic_share). With ``peers`` set, each also counts the others' queued work
and reads their placements into its index.
"""

from __future__ import annotations

import http.client
import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc import bench_live
from extproc.config import RoutingConfig
from extproc.stack import LOOPBACK, Stack, free_port, router_args_for

from ..rendezvous import rendezvous_pick
from .conftest import chat_body, request
from .test_observability import get, samples

FAST = ["--prefill-ms-per-token", "0.0001", "--decode-ms-per-token", "0.1"]
ROUTER_ARGS = ["--set", "signals.interval_seconds=0.2", "--set", "health.enabled=false"]
REQUESTS = 48


def conversations_picking(x: str, y: str, count: int = 4) -> list[tuple[bytes, bytes]]:
    """(first turn, second turn) of ``count`` conversations whose second turn's rendezvous
    pick among (x, y) is ``y`` (shared with test_warm_start)."""
    found = []
    for i in range(200):
        first = f"conversation {i} about a subject of its own " * 40
        second = chat_body(first, "Sure.", "and then?")
        if rendezvous_pick(second, (x, y)) == y:
            found.append((chat_body(first), second))
        if len(found) == count:
            return found
    raise AssertionError("too few conversations with Y as their rendezvous pick")


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
        alone = RoutingConfig().cold_margin
        assert _share_and_margin(admin_ports[0]) == (1.0, alone)  # before any traffic
        _send(envoy_ports)
        # The share is measured from the same prefill windows, past the same 16-request
        # threshold, as the prefill rate: once the rate has moved off its start value the
        # share on show is a measurement, not the start value 1.
        rate = ("prefix_router_prefill_tokens_per_second", ())
        deadline = time.monotonic() + 15
        while samples(admin_ports[0]).get(rate, 60_000.0) == 60_000.0:
            assert time.monotonic() < deadline, "no prefill window reached the router"
            time.sleep(0.2)
        time.sleep(1.2)  # the gauges are refreshed every second
        ((share, margin),) = _settled(admin_ports, lambda s, m: s > 0.9)
        assert share > 0.9 and margin < alone + 0.1, (share, margin)


def test_two_routers_each_see_half_the_traffic_and_widen_their_cold_margin(tmp_path):
    with Stack(workdir=tmp_path) as stack:
        replicas = stack.start_replicas(2, FAST)
        envoy_ports, admin_ports = _start(stack, ["router-a", "router-b"], replicas)
        _send(envoy_ports)
        readings = _settled(admin_ports, lambda s, m: s < 0.65 and m > 0.85)
        for share, margin in readings:
            # shared_cold_margin (1.0) from a half of the traffic down; cold_margin alone.
            assert 0.35 < share < 0.65 and margin > 0.85, readings


@pytest.mark.slow
def test_two_routers_at_low_traffic_over_eight_replicas_each_see_half(tmp_path):
    """A router reads every replica every 0.5 s (the default), traffic or not. At 1.5
    requests a second over 8 replicas, sums that decayed at every reading held 4 s of
    arrivals, about 6, never the 16 a share needs: each router took itself for alone. Sums
    that decay with time (32 s) hold ~22 after 20 s."""
    with Stack(workdir=tmp_path) as stack:
        replicas = stack.start_replicas(8, FAST)
        names = ["router-a", "router-b"]
        envoy_ports, admin_ports = [], []
        for name in names:
            address, _ = stack.start_router(
                replicas,
                name=name,
                extra_args=[
                    *["--set", "health.enabled=false"],
                    *router_args_for("override-host"),
                ],
            )
            port, _ = stack.start_proxy("override-host", replicas, address, name=f"envoy-{name}")
            envoy_ports.append(port)
            admin_ports.append(stack.router_admin_ports[name])
        start = time.monotonic()
        for i in range(30):  # 1.5 a second for 20 s, alternating routers
            time.sleep(max(0.0, start + i / 1.5 - time.monotonic()))
            response = request(envoy_ports[i % 2], chat_body(f"quiet conversation {i}"))
            assert response.status == 200, response.body
        readings = _settled(admin_ports, lambda s, m: s < 0.65 and m > 0.85)
        for share, margin in readings:
            assert 0.35 < share < 0.65 and margin > 0.85, readings


def test_peers_count_each_others_queued_work(tmp_path):
    """Router A has a long stream waiting for its prefill on one replica; router B, told A's
    admin address (peers), sends new conversations elsewhere, even those whose rendezvous
    pick is that replica. Without peers B would not know (its own queue there is empty)."""
    with Stack(workdir=tmp_path) as stack:
        # ~9 s for A's ~15k-token prompt, ~0.1 s for B's: seconds to spare on a slow machine.
        slow_prefill = ["--prefill-ms-per-token", "0.6", "--decode-ms-per-token", "1"]
        replicas = stack.start_replicas(2, slow_prefill)
        args = [
            *ROUTER_ARGS,
            # A slow drain keeps A's charge for the whole test, whatever the machine.
            *["--set", "routing.prefill_tokens_per_second=50"],
            *["--set", "routing.learn_prefill_rate=false"],
            *["--set", "peers.interval_seconds=0.2"],
        ]
        envoy_ports = stack.start_peer_routers({"router-a": replicas, "router-b": replicas}, args)
        admin = stack.router_admin_ports
        conn = http.client.HTTPConnection(LOOPBACK, envoy_ports["router-a"], timeout=30)
        try:
            # ~15k tokens: A's charge (half of it counts at B) outweighs B's three requests.
            long_stream = chat_body("a long document to summarise " * 2000, stream=True)
            conn.request("POST", "/v1/chat/completions", long_stream, JSON)
            stream = conn.getresponse()  # headers now; the prefill takes ~9 s
            busy = _decided_endpoint(admin["router-a"])
            (idle,) = set(replicas) - {busy}
            # B hears of A's work (A's gauge refresh, then B's next read), well within 9 s.
            deadline = time.monotonic() + 10
            while _queued_work(admin["router-b"], busy) <= 0:
                assert time.monotonic() < deadline, "router B never counted A's work"
                time.sleep(0.05)
            bodies = []
            for i in range(40):
                # Nothing in common with A's stream or each other (not even a system prompt,
                # which B would know A's replica holds, from A's placements): cold starts.
                body = chat_body(f"new conversation {i} " * 5, system=f"Be brief, {i}. " * 20)
                if rendezvous_pick(body, replicas) == busy:
                    bodies.append(body)  # only those whose rendezvous pick is the busy replica
                if len(bodies) == 3:
                    break
            assert len(bodies) == 3
            # All at once, well inside A's prefill.
            with ThreadPoolExecutor(len(bodies)) as pool:
                responses = list(pool.map(lambda b: request(envoy_ports["router-b"], b), bodies))
            for response in responses:
                assert response.status == 200
                assert response.headers["x-gateway-destination-endpoint-served"] == idle
            assert b"data: [DONE]" in stream.read()
        finally:
            conn.close()


JSON = {"content-type": "application/json"}


def test_a_router_finds_the_conversations_another_router_placed(tmp_path):
    """Router A (which knows only replica X) starts conversations on X; router B, reading
    A's placements (peers), sends their second turns to X although its own rendezvous order
    puts them on Y, where it sends a conversation A never saw."""
    with Stack(workdir=tmp_path) as stack:
        x, y = stack.start_replicas(2, FAST)
        args = [*ROUTER_ARGS, "--set", "peers.interval_seconds=0.2"]
        envoy_ports = stack.start_peer_routers({"router-a": [x], "router-b": [x, y]}, args)
        admin = stack.router_admin_ports
        conversations = conversations_picking(x, y)
        *started, (_, unseen) = conversations
        for first, _ in started:
            response = request(envoy_ports["router-a"], first)
            assert response.status == 200
            assert response.headers["x-gateway-destination-endpoint-served"] == x
        read = ("prefix_router_peer_placements_total", ())
        deadline = time.monotonic() + 10
        while samples(admin["router-b"]).get(read, 0.0) < len(started):
            assert time.monotonic() < deadline, "router B never read A's placements"
            time.sleep(0.1)
        for _, second in started:
            response = request(envoy_ports["router-b"], second)
            assert response.status == 200
            assert response.headers["x-gateway-destination-endpoint-served"] == x
        response = request(envoy_ports["router-b"], unseen)
        assert response.headers["x-gateway-destination-endpoint-served"] == y


def _own_placed_work(admin_port: int, endpoint: str) -> float:
    metrics = samples(admin_port)
    return sum(
        v
        for (name, labels), v in metrics.items()
        if name == "prefix_router_own_placed_work" and dict(labels)["endpoint"] == endpoint
    )


def _peer_placed_work(admin_port: int, endpoint: str) -> float:
    metrics = samples(admin_port)
    return metrics.get(("prefix_router_peer_placed_work", (("endpoint", endpoint),)), 0.0)


def test_router_replicas_balance_new_conversations_over_each_others_placements(tmp_path):
    """Router A (which knows only replica X) starts four long conversations there; router B,
    reading A's placed cold-start work (peers), sends new conversations whose rendezvous pick
    is X to Y, which no router has placed anything on, once its own admin port shows it has
    A's figure (prefix_router_peer_placed_work). B has not measured its share of the traffic,
    so without its peers' figures it would keep the rendezvous pick, X."""
    with Stack(workdir=tmp_path) as stack:
        x, y = stack.start_replicas(2, FAST)
        args = [*ROUTER_ARGS, "--set", "peers.interval_seconds=0.2"]
        envoy_ports = stack.start_peer_routers({"router-a": [x], "router-b": [x, y]}, args)
        admin = stack.router_admin_ports
        for i in range(4):
            body = chat_body(f"a long conversation {i} of router A " * 200, system=f"A{i}.")
            response = request(envoy_ports["router-a"], body)
            assert response.status == 200
            assert response.headers["x-gateway-destination-endpoint-served"] == x
        # A exports its gauges once a second (serve._refresh_gauges): right after its last
        # request the figure may cover only its first placements, and B, reading that, sent
        # the third new conversation to X (in one of six runs of this file). Wait for A's
        # figure to cover all four (each decays by 1/512 per later cold start), then for B.
        placed_by_a = sum(d["decision"]["work"] for d in _decisions(admin["router-a"], 4))
        deadline = time.monotonic() + 20
        placed_at_a = 0.0
        while placed_at_a < 0.99 * placed_by_a:
            assert time.monotonic() < deadline, f"A exports {placed_at_a} of {placed_by_a}"
            time.sleep(0.1)
            placed_at_a = _own_placed_work(admin["router-a"], x)
        while _peer_placed_work(admin["router-b"], x) < placed_at_a:
            assert time.monotonic() < deadline, "router B never read A's placed work"
            time.sleep(0.1)
        bodies = []
        for i in range(40):
            body = chat_body(f"a short conversation {i} " * 5, system=f"Be brief, {i}.")
            if rendezvous_pick(body, (x, y)) == x:
                bodies.append(body)
            if len(bodies) == 3:
                break
        assert len(bodies) == 3
        for n, body in enumerate(bodies):
            response = request(envoy_ports["router-b"], body)
            assert response.status == 200
            served = response.headers["x-gateway-destination-endpoint-served"]
            if served != y:
                pytest.fail(f"request {n} went to X: {json.dumps(_decisions(admin['router-b']))}")


def _decisions(admin_port: int, count: int = 1) -> list[dict]:
    """The router's latest ``count`` decision records (/debug/decisions), each with its
    figures per endpoint. A record is logged when Envoy closes the request's processing
    stream, a moment after the client has its response."""
    deadline = time.monotonic() + 10
    while True:
        _, text = get(f"http://{LOOPBACK}:{admin_port}/debug/decisions?limit={count}")
        records = json.loads(text)["decisions"]
        if len(records) == count or time.monotonic() > deadline:
            assert len(records) == count, records
            return records
        time.sleep(0.05)


def _decided_endpoint(admin_port: int) -> str:
    url = f"http://{LOOPBACK}:{admin_port}/metrics"
    deadline = time.monotonic() + 10
    while True:
        _, text = get(url)
        for family in text_string_to_metric_families(text.decode()):
            for s in family.samples:
                if s.name == "prefix_router_endpoint_decisions_total" and s.value >= 1:
                    return s.labels["endpoint"]
        assert time.monotonic() < deadline, "router A made no decision"
        time.sleep(0.05)


def _queued_work(admin_port: int, endpoint: str) -> float:
    metrics = samples(admin_port)
    return metrics.get(("prefix_router_endpoint_queued_work", (("endpoint", endpoint),)), 0.0)


@pytest.mark.parametrize("peers", ["unset", "own admin port"])
def test_sibling_workers_read_each_others_work_through_their_shared_admin_port(tmp_path, peers):
    """--workers 2, with peers unset (the workers then read the pod's own admin port,
    serve.siblings_as_peers) or pointing there: each worker exports its work under its own
    ``router`` label, skips its own and counts its sibling's; and the supervisor's placement
    log, fed by both workers, gives each the other's placements."""
    with Stack(workdir=tmp_path) as stack:
        replicas = stack.start_replicas(2, FAST)
        admin = free_port()
        stack.router_admin_ports["router"] = admin
        args = [*ROUTER_ARGS, *router_args_for("override-host")]
        if peers == "own admin port":
            args += ["--set", f"peers.addresses={LOOPBACK}:{admin}"]
        address, _ = stack.start_router(replicas, workers=2, extra_args=args, ready=True)
        deadline = time.monotonic() + 15
        while True:
            metrics = samples(admin)
            peers = [v for (name, _), v in metrics.items() if name == "prefix_router_peers"]
            routers = {
                dict(labels)["router"]
                for (name, labels), _ in metrics.items()
                if name == "prefix_router_own_queued_work"
            }
            if peers == [1.0, 1.0] and len(routers) == 2:
                break
            assert time.monotonic() < deadline, (peers, routers)
            time.sleep(0.2)
        port, _ = stack.start_proxy("override-host", replicas, address)
        for i in range(12):  # Envoy spreads its connections over both workers
            assert request(port, chat_body(f"conversation {i}")).status == 200
        read = ("prefix_router_peer_placements_total", ())
        while samples(admin).get(read, 0.0) < 1:
            assert time.monotonic() < deadline + 15, "no worker read its sibling's placements"
            time.sleep(0.2)


def test_one_envoy_spreads_requests_over_two_router_replicas(tmp_path):
    """`bench live`'s two-router runs: one Envoy whose ext_proc cluster lists both routers
    balances each request's processing stream over them, so each router sees part of the
    traffic (and, with peers, hears the other)."""
    with Stack(workdir=tmp_path) as stack:
        replicas = stack.start_replicas(2, FAST)
        with bench_live.start_target(
            stack, "prefix_k2_peers", replicas, tmp_path, ROUTER_ARGS
        ) as target:
            port = int(target.url.rsplit(":", 1)[1])
            for i in range(20):
                assert request(port, chat_body(f"conversation {i}")).status == 200
            admins = [p for n, p in stack.router_admin_ports.items() if "prefix_k2" in n]
            assert len(admins) == 2
            deadline = time.monotonic() + 10
            while True:
                metrics = [samples(a) for a in admins]
                decided = [
                    sum(
                        v
                        for (n, _), v in m.items()
                        if n == "prefix_router_endpoint_decisions_total"
                    )
                    for m in metrics
                ]
                peers = [m.get(("prefix_router_peers", ())) for m in metrics]
                if sum(decided) == 20 and peers == [1.0, 1.0]:
                    break
                assert time.monotonic() < deadline, (decided, peers)
                time.sleep(0.2)
            assert min(decided) >= 5, decided  # round robin over the two: about 10 each
            # The live benchmark's rule counts: every request, summed over both routers.
            assert sorted(target.admin_ports) == sorted(admins)
            assert sum(bench_live.routing_rules(target.admin_ports).values()) == 20
            # What Envoy saw of the routers: 20 processing streams, none failed open.
            envoy = bench_live.envoy_ext_proc_counts(target.proxy_admin_port)
            assert envoy["streams_started"] == 20 and not envoy.get("failure_mode_allowed")
            assert bench_live.pass_through_reasons(target.admin_ports) == {}
