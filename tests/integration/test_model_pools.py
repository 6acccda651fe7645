"""Several model pools behind one Envoy cluster and one router: a request reaches only the
replicas serving its model, read from their /v1/models (real Envoy, router process and
stand-in replicas; extproc/model_pools.py)."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from extproc.stack import LOOPBACK, Stack

from .conftest import start_routed_stack

pytestmark = [pytest.mark.envoy]

FAST = ["--prefill-ms-per-token", "0.0001", "--decode-ms-per-token", "0.1"]


def _chat(model: str, text: str) -> bytes:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    return json.dumps(body).encode()


def _models_known(admin_port: int) -> set[tuple[str, str]]:
    url = f"http://{LOOPBACK}:{admin_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    known = set()
    for line in text.splitlines():
        if line.startswith("prefix_router_endpoint_model{") and line.endswith(" 1.0"):
            labels = dict(
                part.split("=", 1)
                for part in line[line.index("{") + 1 : line.index("}")].split(",")
            )
            known.add((labels["endpoint"].strip('"'), labels["model"].strip('"')))
    return known


@pytest.mark.parametrize(
    ("mode", "body_mode"),
    [("override-host", "buffered"), ("original-dst", "full_duplex_streamed")],
)
def test_each_models_requests_reach_only_its_pool(mode, body_mode):
    with Stack() as stack:
        pool_a = stack.start_replicas(2, [*FAST, "--model", "pool-a"])
        pool_b = stack.start_replicas(1, [*FAST, "--model", "pool-b"])
        members = pool_a + pool_b
        routed = start_routed_stack(stack, mode, body_mode, members)
        admin = stack.router_admin_ports["router"]
        expected = {(a, "pool-a") for a in pool_a} | {(b, "pool-b") for b in pool_b}
        deadline = time.monotonic() + 10
        while _models_known(admin) != expected:  # gauges refresh every second
            assert time.monotonic() < deadline, _models_known(admin)
            time.sleep(0.2)
        served: dict[str, set[str]] = {"pool-a": set(), "pool-b": set()}
        for k in range(12):
            for model in served:
                response = routed.send(_chat(model, f"question {k} for {model} " * 20))
                assert response.status == 200, (model, response.body[:200])
                served[model].add(response.replica)
        assert served["pool-b"] == {"replica-3"}
        assert served["pool-a"] <= {"replica-1", "replica-2"} and served["pool-a"]
        unknown = routed.send(_chat("no-such-model", "anyone? " * 20))
        assert unknown.status == 404
        assert "does not exist" in json.loads(unknown.body)["error"]["message"]


def test_without_the_model_lists_requests_land_in_the_wrong_pool():
    """The same pools with the lists not read (models.enabled=false): requests go by prefix
    and load alone, and a pool-b request on a pool-a replica gets its 404."""
    with Stack() as stack:
        pool_a = stack.start_replicas(2, [*FAST, "--model", "pool-a"])
        pool_b = stack.start_replicas(1, [*FAST, "--model", "pool-b"])
        routed = start_routed_stack(
            stack, "override-host", "buffered", pool_a + pool_b, ["--set", "models.enabled=false"]
        )
        statuses = [
            routed.send(_chat("pool-b", f"question {k} for pool-b " * 20)).status for k in range(12)
        ]
        assert 404 in statuses and 200 in statuses
