"""Real model servers for the end-to-end tests: two vLLM CPU servers with a tiny local model.

The fixture prepares what is missing through ``extproc.lab`` (the vLLM environment under
~/.cache/prefix-router, ~100 s and ~3.5 GB once; the tiny model, a few seconds once), starts
one server per core on 127.0.0.1 and stops them after this directory's tests (module scope:
they must not idle through the rest of the suite). It never skips: if vLLM
cannot be installed or started here, the tests error with the install or server log.

``E2E_VLLM_ENDPOINTS=ip:port,ip:port`` runs the tests against servers that are
already up (e.g. from ``prefix-router lab up``) instead of starting new ones.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from extproc import bench_live, lab

REPLICAS = 2


@pytest.fixture(scope="module")
def vllm_endpoints(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    given = os.environ.get("E2E_VLLM_ENDPOINTS", "").strip()
    if given:
        endpoints = [e.strip() for e in given.split(",") if e.strip()]
        bench_live.warm_up(endpoints, lab.SERVED_MODEL_NAME)
        yield endpoints
        return
    log_dir = tmp_path_factory.mktemp("vllm-logs")
    with lab.vllm_servers(REPLICAS, log_dir) as servers:
        endpoints = [s.address for s in servers]
        # The first request after start-up is several times slower than the next ones.
        bench_live.warm_up(endpoints, lab.SERVED_MODEL_NAME)
        yield endpoints
