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
