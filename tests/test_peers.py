"""Peer router replicas' queued work: the exported gauge, parsed back, and the config."""

from __future__ import annotations

import aiohttp
import pytest
import yaml
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from extproc.admin import start_admin
from extproc.config import (
    Config,
    ConfigError,
    EndpointConfig,
    PeersConfig,
    RoutingConfig,
    load_config,
)
from extproc.metrics import RouterMetrics
from extproc.peers import PeerReader, parse_peer_figures, parse_peer_work
from extproc.prompt import parse_request
from extproc.router import Router
from extproc.serve import siblings_as_peers
from extproc.stack import free_port

ENDPOINTS = [EndpointConfig(address=f"10.0.0.{i}:8000") for i in range(1, 4)]


def test_the_exported_gauge_reads_back_as_each_routers_own_work():
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    router = Router(RoutingConfig(), ENDPOINTS, clock=lambda: 0.0)
    body = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"long " * 4000 + b'"}]}'
    decision = router.route(parse_request("chat", body))
    router.observe_peer_work("another", {ENDPOINTS[1].address: 7.0})  # not re-exported
    metrics.refresh(router)
    work = parse_peer_work(generate_latest(registry).decode())
    assert work == {router.instance: router.own_queued_work()}
    assert decision.work > 0
    assert work[router.instance][decision.endpoint] == pytest.approx(decision.work)
    assert sum(work[router.instance].values()) == pytest.approx(decision.work)
    # And the cold starts' placed work, which peers that share placements balance by.
    router.observe_peer_placed("another", {ENDPOINTS[1].address: 7.0})  # not re-exported
    metrics.refresh(router)
    page = generate_latest(registry).decode()
    placed = parse_peer_figures(page).placed
    assert decision.cold_start and placed == {router.instance: router.own_placed_work()}
    assert placed[router.instance][decision.endpoint] == pytest.approx(decision.work)
    # What the peers report is exported apart, per endpoint (it is what the balance adds).
    line = f'prefix_router_peer_placed_work{{endpoint="{ENDPOINTS[1].address}"}} 7.0'
    assert line in page


def test_peers_config_is_validated_with_the_field_named(tmp_path):
    config = Config.model_validate({"peers": {"addresses": "10.0.0.5:9003, router-1.ns:9003"}})
    assert config.peers.addresses == ("10.0.0.5:9003", "router-1.ns:9003")
    assert config.peers.enabled and not Config().peers.enabled
    assert Config.model_validate({"peers": {"dns_name": "r.ns", "dns_port": 9003}}).peers.enabled
    for bad, field in [
        ({"addresses": ["10.0.0.5"]}, "peers.addresses"),
        ({"addresses": ["10.0.0.5:99999"]}, "peers.addresses"),
        ({"dns_name": "r.ns"}, "dns_port"),
        ({"dns_name": "r ns", "dns_port": 9003}, "dns_name"),
        ({"interval_seconds": 0}, "peers.interval_seconds"),
    ]:
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump({"peers": bad}))
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config(path)


def test_a_removed_endpoint_is_no_longer_exported_to_peers():
    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    router = Router(RoutingConfig(), ENDPOINTS, clock=lambda: 0.0)
    metrics.refresh(router)
    assert set(parse_peer_work(generate_latest(registry).decode())[router.instance]) == {
        e.address for e in ENDPOINTS
    }
    router.set_endpoints(ENDPOINTS[:2])
    metrics.refresh(router)
    figures = parse_peer_figures(generate_latest(registry).decode())
    assert set(figures.work[router.instance]) == {e.address for e in ENDPOINTS[:2]}
    assert set(figures.placed[router.instance]) == {e.address for e in ENDPOINTS[:2]}


async def test_the_reader_counts_answering_peers_and_skips_broken_or_dead_ones():
    """One peer answers with its work, one serves garbage, one a 500, one is not there: the
    first is counted, the rest are skipped without an exception."""
    good = "\n".join(
        [
            "# TYPE prefix_router_own_queued_work gauge",
            'prefix_router_own_queued_work{router="r1",endpoint="10.0.0.1:8000"} 5000.0',
            'prefix_router_own_queued_work{router="r1",endpoint="10.0.0.2:8000"} 0.0',
            'prefix_router_own_queued_work{router="me",endpoint="10.0.0.1:8000"} 9.0',
            "# TYPE prefix_router_own_placed_work gauge",
            'prefix_router_own_placed_work{router="r1",endpoint="10.0.0.1:8000"} 300.0',
        ]
    )
    pages = {"good": (200, good), "garbage": (200, "{not prometheus"), "error": (500, "")}

    async def handler(request: web.Request) -> web.Response:
        status, text = pages[request.match_info["name"]]
        return web.Response(status=status, text=text)

    app = web.Application()
    app.router.add_get("/{name}/metrics", handler)
    runner, port = await start_admin(app, "127.0.0.1:0")
    heard: list[tuple[str, dict[str, float]]] = []
    config = PeersConfig(addresses=(f"127.0.0.1:{free_port()}",), timeout_seconds=1.0)
    placed: list[tuple[str, dict[str, float]]] = []
    reader = PeerReader(
        config,
        lambda router, work: heard.append((router, work)),
        on_placed=lambda router, work: placed.append((router, work)),
    )
    # The path prefix stands in for three peers on one test server (and one dead address).
    reader._addresses_now = [f"127.0.0.1:{port}/{name}" for name in pages]
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as session:
            results = [await reader.poll(session, a) for a in reader._addresses_now]
            results.append(await reader.poll(session, config.addresses[0]))
        for address, result in zip([*reader._addresses_now, "dead"], results, strict=True):
            reader.record(address, result)
    finally:
        await runner.cleanup()
    assert [r.work for r in results[1:]] == [None, None, None]
    assert all(r.placements is None for r in results)  # not asked for
    assert sorted(heard) == [
        ("me", {"10.0.0.1:8000": 9.0}),
        ("r1", {"10.0.0.1:8000": 5000.0, "10.0.0.2:8000": 0.0}),
    ]
    assert placed == [("r1", {"10.0.0.1:8000": 300.0})]
    # The router skips its own figures (its instance name), which the reader passes on.
    router = Router(RoutingConfig(), ENDPOINTS, clock=lambda: 0.0)
    router.instance = "me"
    for name, work in heard:
        router.observe_peer_work(name, work)
    assert router.peers() == ["r1"]


def test_worker_processes_are_each_others_peers_unless_peers_is_set():
    def peers_of(data: dict) -> tuple[tuple[str, ...], str | None]:
        config = siblings_as_peers(Config.model_validate(data))
        return config.peers.addresses, config.peers.dns_name

    workers = {"workers": 2, "admin_listen": "0.0.0.0:9003"}
    assert peers_of({"server": workers}) == (("127.0.0.1:9003",), None)
    assert peers_of({"server": {**workers, "admin_listen": "[::]:9003"}}) == (("[::1]:9003",), None)
    assert peers_of({"server": {**workers, "admin_listen": "10.1.2.3:9003"}}) == (
        ("10.1.2.3:9003",),
        None,
    )
    # One process, no admin port, an ephemeral one, or peers already set: unchanged.
    assert peers_of({"server": {**workers, "workers": 1}}) == ((), None)
    assert peers_of({"server": {**workers, "admin_listen": ""}}) == ((), None)
    assert peers_of({"server": {**workers, "admin_listen": "127.0.0.1:0"}}) == ((), None)
    dns = {"dns_name": "prefix-router-peers", "dns_port": 9003}
    assert peers_of({"server": workers, "peers": dns}) == ((), "prefix-router-peers")
