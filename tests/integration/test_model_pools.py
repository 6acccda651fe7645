"""Several model pools behind one Envoy cluster and one router: a request reaches only the
replicas serving its model, read from their /v1/models (real Envoy, router process and
stand-in replicas; extproc/model_pools.py)."""

from __future__ import annotations

import json
import time

import pytest

from extproc.stack import Stack

from ..replica_calls import post
from ..router_gauges import models_known
from ..waiting import wait_until
from .conftest import start_routed_stack

pytestmark = [pytest.mark.envoy]

FAST = ["--prefill-ms-per-token", "0.0001", "--decode-ms-per-token", "0.1"]


def _chat(model: str, text: str) -> bytes:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    return json.dumps(body).encode()


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
        # (gauges refresh every second)
        assert wait_until(lambda: models_known(admin) == expected, 10, 0.2), models_known(admin)
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


@pytest.mark.parametrize(
    ("mode", "body_mode"),
    [("override-host", "buffered"), ("original-dst", "full_duplex_streamed")],
)
def test_an_adapter_loaded_at_run_time_is_routed_to_its_server_from_its_first_request(
    mode: str, body_mode: str
):
    """LoRA adapters loaded on one replica each (vLLM's /v1/load_lora_adapter): an
    adapter's first request names a model no list read names, so the router reads every
    list again and the request waits for that read (models.unknown_wait_seconds). With the
    lists' rounds 60 s apart, only that read can teach it where the adapter is: every
    request, the first included, must reach the replica that loaded it (before, the first
    ones went by their prefix to any replica, the others answering 404)."""
    with Stack() as stack:
        members = stack.start_replicas(3, [*FAST, "--model", "base"])
        routed = start_routed_stack(
            stack,
            mode,
            body_mode,
            members,
            # (the longest wait the configs allow: a busy shared machine answers slowly)
            ["--set", "models.interval_seconds=60", "--set", "models.unknown_wait_seconds=0.9"],
        )
        admin = stack.router_admin_ports["router"]
        # every list read once
        assert wait_until(lambda: len(models_known(admin)) >= 3, 10, 0.2), models_known(admin)
        for k, member in enumerate(members):
            if k:
                time.sleep(1.1)  # (another name had the lists read within a second)
            name = f"sql-lora-{k}"
            load = {"lora_name": name, "lora_path": f"/adapters/{k}"}
            assert post(member, "/v1/load_lora_adapter", load, timeout=5) == 200
            statuses = []
            for j in range(4):
                response = routed.send(_chat(name, f"question {k} {j} " * 20))
                statuses.append((response.status, response.replica))
            assert statuses == [(200, f"replica-{k + 1}")] * 4, (name, statuses)
        adapters = {(m, f"sql-lora-{k}") for k, m in enumerate(members)}
        # (gauges: every second)
        assert wait_until(lambda: adapters <= models_known(admin), 5, 0.2), models_known(admin)


def test_an_adapter_unloaded_from_one_server_goes_to_the_other_after_one_404():
    """An adapter both stand-in replicas serve is unloaded from one (vLLM's
    /v1/unload_lora_adapter); the lists' rounds are 60 s apart. The first request routed
    there gets its 404, which has the router read that replica's list again at once (only
    that read can drop the adapter within the test): the requests after it go to the
    replica that still serves the adapter (before, some went on to the 404 until the next
    round)."""
    with Stack() as stack:
        members = stack.start_replicas(2, [*FAST, "--model", "base"])
        for member in members:
            load = {"lora_name": "x", "lora_path": "/x"}
            assert post(member, "/v1/load_lora_adapter", load, timeout=5) == 200
        routed = start_routed_stack(
            stack,
            "override-host",
            "buffered",
            members,
            ["--set", "models.interval_seconds=60"],
        )
        admin = stack.router_admin_ports["router"]
        # both lists read, each naming base and x
        assert wait_until(lambda: len(models_known(admin)) >= 4, 10, 0.2), models_known(admin)
        assert post(members[0], "/v1/unload_lora_adapter", {"lora_name": "x"}, timeout=5) == 200
        before = []
        while (404, "replica-1") not in before:
            assert len(before) < 40, before
            response = routed.send(_chat("x", f"before {len(before)} " * 20))
            before.append((response.status, response.replica))
        unloaded = (members[0], "x")
        # (gauges: every second)
        assert wait_until(lambda: unloaded not in models_known(admin), 5), models_known(admin)
        after = []
        for k in range(12):
            response = routed.send(_chat("x", f"after {k} " * 20))
            after.append((response.status, response.replica))
        assert after == [(200, "replica-2")] * 12, (before, after)
