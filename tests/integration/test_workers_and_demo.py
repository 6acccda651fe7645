"""Several router processes on one port, and the demo end to end."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from extproc.stack import Stack

from .conftest import chat_body, start_routed_stack

pytestmark = [pytest.mark.envoy]
FAST = ["--prefill-ms-per-token", "0.0001", "--decode-ms-per-token", "0.1"]


def test_two_workers_share_the_port_and_agree(tmp_path):
    with Stack(workdir=tmp_path) as stack:
        members = stack.start_replicas(4, FAST)
        routed = start_routed_stack(stack, "override-host", "buffered", members, ["--workers", "2"])
        deadline = time.monotonic() + 20
        pids: set[str] = set()
        while len(pids) < 2 and time.monotonic() < deadline:
            pids = set(re.findall(r"pid (\d+) serving", (tmp_path / "router.log").read_text()))
            time.sleep(0.1)
        assert len(pids) == 2
        for conversation in range(6):
            history = [f"Conversation {conversation} about workers. " * 20]
            seen = set()
            for turn in range(4):
                response = routed.send(chat_body(*history))
                assert response.status == 200
                seen.add(response.replica)
                history += ["An answer.", f"question {turn}"]
            assert len(seen) == 1  # whichever worker got each turn, they agreed
        routed.router.stop()
        assert not routed.router.alive()
        log = (tmp_path / "router.log").read_text()
        assert log.count("draining") == 2  # SIGTERM reached both workers


@pytest.mark.slow
def test_demo_runs_and_prefix_routing_beats_round_robin(tmp_path):
    out = tmp_path / "demo.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "extproc.cli",
            "demo",
            # 13 conversations on 4 replicas: round robin cannot line a conversation's turns
            # up on one replica by accident (with 12, turn t of conversation c would go to
            # replica (12t + c) mod 4 = c mod 4 whenever requests leave in order).
            "--conversations",
            "13",
            "--turns",
            "3",
            "--repeats",
            "3",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "cache hit ratio" in result.stdout and "median of 3 runs" in result.stdout
    runs = json.loads(out.read_text())["runs"]
    for run in runs.values():
        assert run["errors"] == 0 and run["requests"] == 39
        assert run["errors_all_runs"] == 0 and run["requests_all_runs"] == 3 * 39
        assert len(run["hit_ratio_runs"]) == 3
        assert run["hit_ratio"] == sorted(run["hit_ratio_runs"])[1]  # the median run's
        assert set(run) >= {
            "requests",
            "errors",
            "hit_ratio",
            "ttft_p50_ms",
            "ttft_p99_ms",
            "replica_share",
        }
    assert runs["prefix"]["hit_ratio"] > runs["round_robin"]["hit_ratio"] + 0.1
