"""Reading a running router's gauges from its admin port (shared by the test packages)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from extproc.stack import LOOPBACK


def models_known(admin_port: int) -> set[tuple[str, str]]:
    """(endpoint, model) for every model the router has read in an endpoint's list
    (``prefix_router_endpoint_model``, refreshed every second)."""
    url = f"http://{LOOPBACK}:{admin_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.labels["endpoint"], sample.labels["model"])
        for family in text_string_to_metric_families(text)
        if family.name == "prefix_router_endpoint_model"
        for sample in family.samples
        if sample.value == 1.0
    }
