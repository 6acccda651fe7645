"""The multi-worker /metrics page (metrics.exposition) while workers start."""

from __future__ import annotations

import subprocess
import sys

from prometheus_client.parser import text_string_to_metric_families

from extproc.metrics import MULTIPROC_ENV, exposition

WRITE_A_WORKER_COUNTER = """
from prometheus_client import CollectorRegistry, Counter
Counter("worker_requests", "requests", registry=CollectorRegistry()).inc(3)
"""


def test_a_value_file_still_being_created_does_not_fail_the_page(tmp_path, monkeypatch):
    """A worker creates its value file before it sizes it; the supervisor's page read in
    between used to fail whole with a 500. It now leaves that empty file out and still
    serves the other workers' values."""
    env = {MULTIPROC_ENV: str(tmp_path)}
    subprocess.run([sys.executable, "-c", WRITE_A_WORKER_COUNTER], env=env, check=True)
    (tmp_path / "counter_99999.db").touch()  # a starting worker's file, not yet sized
    monkeypatch.setenv(MULTIPROC_ENV, str(tmp_path))

    body, _ = exposition()

    values = {
        s.name: s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }
    assert values["worker_requests_total"] == 3.0


def test_a_removed_endpoints_series_go_with_it():
    """A deleted pod kept showing healthy=1, its in-flight count and the rest for as long as
    the router ran; with pod churn the series piled up. Its series now go when the router
    drops it, the remaining endpoints' stay."""
    from prometheus_client import CollectorRegistry, generate_latest

    from extproc.config import EndpointConfig, RoutingConfig
    from extproc.metrics import RouterMetrics
    from extproc.prompt import parse_request
    from extproc.router import Router
    from extproc.signals import EndpointSignals

    registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    endpoints = [EndpointConfig(address=f"10.0.0.{i}:8000") for i in (1, 2)]
    router = Router(RoutingConfig(), endpoints, clock=lambda: 0.0)
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hello there"}]}'
    for _ in range(4):
        router.route(parse_request("chat", body), allowed=frozenset({"10.0.0.2:8000"}))
    for address in router.endpoints:
        metrics.record_signals(address, EndpointSignals(up=True, waiting=1, kv_usage=0.5))
        metrics.cache_events.labels(address, "stored_blocks").inc(3)
        metrics.endpoint_decisions.labels(address).inc()
        metrics.endpoint_restarts.labels(address).inc()

    def endpoints_in_page() -> dict[str, set[str]]:
        seen: dict[str, set[str]] = {}
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            for sample in family.samples:
                if "endpoint" in sample.labels and "router" not in sample.labels:
                    seen.setdefault(sample.labels["endpoint"], set()).add(sample.name)
        return seen

    metrics.refresh(router)
    before = endpoints_in_page()
    assert "prefix_router_endpoint_healthy" in before["10.0.0.2:8000"]
    assert "prefix_router_endpoint_restarts_total" in before["10.0.0.2:8000"]
    assert before["10.0.0.2:8000"] == before["10.0.0.1:8000"]
    router.set_endpoints(endpoints[:1])
    metrics.refresh(router)
    after = endpoints_in_page()
    assert set(after) == {"10.0.0.1:8000"} and after["10.0.0.1:8000"] == before["10.0.0.1:8000"]
