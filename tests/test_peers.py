"""Peer router replicas' queued work: the exported gauge, parsed back, and the config."""

from __future__ import annotations

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from extproc.config import Config, ConfigError, EndpointConfig, RoutingConfig, load_config
from extproc.metrics import RouterMetrics
from extproc.peers import parse_peer_work
from extproc.prompt import parse_request
from extproc.router import Router

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
    exported = parse_peer_work(generate_latest(registry).decode())[router.instance]
    assert set(exported) == {e.address for e in ENDPOINTS[:2]}
