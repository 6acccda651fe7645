"""The benchmarks run (short modes) and write what they claim; no timing is asserted."""

from __future__ import annotations

import json

import pytest

from extproc.cli import main


def test_bench_core_short(tmp_path):
    out = tmp_path / "core.json"
    assert (
        main(
            [
                "bench",
                "core",
                "--short",
                "--sizes",
                "2,32",
                "--endpoints",
                "4,64",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert [(r["body_bytes"], r["endpoints"]) for r in rows] == [
        (2048, 4),
        (2048, 64),
        (32768, 4),
        (32768, 64),
    ]
    for row in rows:
        assert 0 < row["p50_us"] <= row["p99_us"]
        assert 0.8 * row["body_bytes"] < row["mean_body_bytes"] < 1.3 * row["body_bytes"]


@pytest.mark.envoy
def test_bench_latency_short(tmp_path):
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--requests", "30", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for label in ("envoy_only", "with_router"):
        assert 0 < result[label]["p50_ms"] <= result[label]["p99_ms"]
    assert result["added_p50_ms"] == pytest.approx(
        result["with_router"]["p50_ms"] - result["envoy_only"]["p50_ms"], abs=1e-3
    )


@pytest.mark.envoy
def test_bench_overhead_short(tmp_path):
    """Needs wrk (Debian); the benchmark installs it with apt-get when run as root."""
    out = tmp_path / "overhead.json"
    argv = ["bench", "overhead", "--sizes", "2", "--connections", "1,4", "--duration", "1"]
    assert main([*argv, "--configs", "envoy_direct,buffered_w1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(r["config"], r["connections"]) for r in rows} == {
        ("envoy_direct", 1),
        ("envoy_direct", 4),
        ("buffered_w1", 1),
        ("buffered_w1", 4),
    }
    for row in rows:
        assert row["requests"] > 0 and row["errors"] == 0
        assert (row["router_cpu_s_per_1k"] > 0) == (row["config"] != "envoy_direct")
