"""A real vLLM server with several API server processes, killed and started again behind
Envoy and the router (default health probes: 1 s, 2 failures).

vLLM with ``--api-server-count`` > 1 serves its metrics from a multiprocess registry, which
has no process collector: no ``process_start_time_seconds``. Its counters (summed over its
processes) start over when it restarts, which is what tells the router a restart there: so
while it is down the router keeps what its index says it held (a stall would have left the
cache as it was), and the first scrape the new server answers empties it. Before, such an
endpoint's index was emptied as soon as its probes failed, and a restart was never counted.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc import lab, signals
from extproc.stack import LOOPBACK, Stack, free_port

from ..waiting import settled
from .test_vllm import _chat, _get

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1200)]


def _router_gauge(admin_port: int, name: str, endpoint: str) -> float:
    families = text_string_to_metric_families(_get(f"http://{LOOPBACK}:{admin_port}/metrics"))
    return sum(
        s.value
        for family in families
        for s in family.samples
        if s.name == name and s.labels.get("endpoint") == endpoint
    )


def _wait_for(condition: Callable[[], bool], seconds: float, what: str) -> float:
    """Seconds until ``condition`` held (checked every 0.1 s); fails after ``seconds``."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < seconds, f"{what}: not within {seconds} s"
        time.sleep(0.1)
    return time.monotonic() - start


def test_a_restart_of_vllm_with_several_api_servers_is_told_by_its_counters(
    tmp_path: Path,
) -> None:
    python = lab.ensure_vllm_env(quiet=True)
    model_dir = lab.ensure_model(python, quiet=True)
    port = free_port()
    address = f"{LOOPBACK}:{port}"

    def start() -> lab.Server:
        server = lab.start_vllm(
            python, model_dir, "vllm-api2", lab.core_for(0), tmp_path, port=port, api_servers=2
        )
        lab.wait_healthy([server], quiet=True)
        return server

    server = start()
    try:
        page = _get(f"http://{address}/metrics")
        assert "process_start_time_seconds" not in page  # what this test is about
        with Stack() as stack:
            router, _ = stack.start_router(
                [address], extra_args=["--set", "signals.interval_seconds=0.5"], ready=True
            )
            envoy_port, _ = stack.start_proxy("override-host", [address], router)
            admin = stack.router_admin_ports["router"]

            def gauge(name: str) -> float:
                return _router_gauge(admin, name, address)

            for i in range(4):
                assert _chat(f"{LOOPBACK}:{envoy_port}", f"Question {i}: name a colour. " * 20)[
                    "choices"
                ]
            queries = signals.parse_metrics(_get(f"http://{address}/metrics")).queries
            assert queries, page  # counters the restart will start over
            _wait_for(lambda: gauge("prefix_router_index_entries") > 0, 10, "entries")
            # Once a scrape of the counters after the last request is in the refreshed gauges.
            held = settled(lambda: gauge("prefix_router_index_entries"))

            os.killpg(server.pid, signal.SIGKILL)  # API servers and engine core: a crash
            lab.stop_all([server])  # (reaped)
            down = _wait_for(lambda: gauge("prefix_router_endpoint_healthy") == 0, 15, "down")
            kept = settled(lambda: gauge("prefix_router_index_entries"))  # refreshed each second
            assert kept == held, (held, kept)  # kept: its counters will tell a restart

            server = start()
            told = _wait_for(
                lambda: gauge("prefix_router_endpoint_restarts_total") == 1, 15, "told"
            )
            _wait_for(lambda: gauge("prefix_router_index_entries") == 0, 3, "emptied")
            # (told by a scrape, maybe before its probes passed: healthy a probe round later)
            _wait_for(lambda: gauge("prefix_router_endpoint_healthy") == 1, 10, "healthy")
            assert _chat(f"{LOOPBACK}:{envoy_port}", "Question 9: name a colour. " * 20)["choices"]
            print(
                f"vLLM --api-server-count 2: {held:.0f} entries, unhealthy after {down:.1f} s, "
                f"kept while down ({kept:.0f}), restart told {told:.1f} s after it was healthy "
                "again, entries emptied"
            )
    finally:
        lab.stop_all([server])
