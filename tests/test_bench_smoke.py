"""The benchmarks run (short modes) and write what they claim; no timing is asserted."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from extproc.cli import main

METRICS_PAGE = Path(__file__).parent / "data" / "vllm-0.32.0-metrics.txt"


def test_bench_share_tells_how_soon_a_router_joining_or_leaving_shows(tmp_path):
    out = tmp_path / "share.json"
    args = ["bench", "share", "--rates", "10,0.25", "--quiet-gaps", "2,4", "--json", str(out)]
    assert main(args) == 0
    doc = json.loads(out.read_text())
    busy, quiet = doc["joining"]
    # One 32-s window: the share past 0.55 in about 2.3 time constants, from 0.5 requests
    # a second up.
    assert busy["below_0_9_s"] < 15.0 and 50.0 < busy["below_0_55_s"] < 90.0
    assert quiet["below_0_9_s"] is None and quiet["below_0_55_s"] is None  # never measured
    # A router left alone reads past 0.55 within seconds and as alone (0.9) after about 1.6
    # time constants; one that never measured its share reports no crossing.
    busy, quiet = doc["leaving"]
    assert 2.0 < busy["over_0_55_s"] < 10.0 and 35.0 < busy["over_0_9_s"] < 70.0
    assert quiet["over_0_9_s"] is None and quiet["over_0_55_s"] is None
    measured = [row["first_measured_s"] for row in doc["quiet"]]
    assert measured[0] is not None and measured[1] is None  # 16 in 32 s, not 8
    # Through a silence the share keeps its last reading; fresh arrivals replace it.
    lull = doc["after_a_lull"]
    assert lull["silent_900s"] == pytest.approx(lull["at_stop"]) and lull["at_stop"] < 0.7
    assert lull["resumed_5s"] < 0.55
    assert doc["through_a_burst"]["highest_after"] < 0.9  # a batch does not read as alone
    half, most = doc["random_split"]
    assert half["lowest"] > 0.35 and half["highest"] < 0.65 and most["highest"] < 0.9
    assert set(doc) == {
        "command",
        "joining",
        "leaving",
        "quiet",
        "after_a_lull",
        "through_a_burst",
        "random_split",
    }


def test_bench_warm_start_times_a_full_index_handed_over(tmp_path):
    out = tmp_path / "warm.json"
    assert (
        main(["bench", "warm-start", "--sizes", "4x20000", "--repeat", "1", "--json", str(out)])
        == 0
    )
    (row,) = json.loads(out.read_text())["rows"]
    # Filled full, and every entry taken by the fresh router (the same capacities).
    assert row["index_entries"] == row["taken_entries"] > 0.9 * 4 * 20000 * 4 // 64
    assert row["snapshot_bytes"] > 12 * row["index_entries"]
    assert all(row[k] > 0 for k in ("take_ms", "encode_ms", "decode_ms", "adopt_ms"))


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
                "--index-memory",
                "4,2000",
                "--profile",
                "--peer-placements",
                "--metrics-page",
                str(METRICS_PAGE),
                "--collector",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    doc = json.loads(out.read_text())
    collector = doc["collector"]
    assert collector["frozen_objects"] >= 1000 and len(collector["full_collection_ms"]) == 5
    assert collector["tracked_after_freeze"] < collector["tracked_objects"] // 10
    parsed = doc["metrics_parse"]
    assert (
        parsed["lines"] == 614 and len(parsed["filtered_ms"]) == len(parsed["whole_page_ms"]) == 5
    )
    shared = doc["peer_placements"]
    assert len(shared["decision_us_without_log"]) == len(shared["decision_us_with_log"]) == 5
    for row in shared["recording"]:
        assert 0 < max(row["longest_slice_ms"]) <= max(row["total_ms"])
    shares = doc["profile"]["shares"]
    assert abs(sum(shares.values()) - 1.0) < 1e-6 and shares["block hashing"] > 0
    memory = doc["index_memory"]
    assert memory["reported_bytes"] == 4 * 2000 * 12  # 4 endpoints x 2,000 slots x 12 bytes
    assert 0.9 * 4 * 2000 <= memory["entries"] <= 4 * 2000
    rows = doc["rows"]
    assert [(r["body_bytes"], r["endpoints"]) for r in rows] == [
        (2048, 4),
        (2048, 64),
        (32768, 4),
        (32768, 64),
    ]
    for row in rows:
        assert 0 < row["p50_us"] <= row["p99_us"]
        # The answer is part of each timed decision (the index update and finish follow it).
        assert 0 < row["answer_p50_us"] <= row["p50_us"] and row["answer_p99_us"] <= row["p99_us"]
        assert 0.8 * row["body_bytes"] < row["mean_body_bytes"] < 1.3 * row["body_bytes"]


@pytest.mark.envoy
def test_bench_latency_short(tmp_path):
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--requests", "30", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    for label in ("envoy_only", "with_noop", "with_router"):
        assert 0 < result[label]["p50_ms"] <= result[label]["p99_ms"]
    assert result["added_p50_ms"] == pytest.approx(
        result["with_router"]["p50_ms"] - result["envoy_only"]["p50_ms"], abs=1e-3
    )
    assert result["noop_added_p50_ms"] == pytest.approx(
        result["with_noop"]["p50_ms"] - result["envoy_only"]["p50_ms"], abs=1e-3
    )


@pytest.mark.envoy
def test_bench_overhead_short(tmp_path):
    """Needs wrk (Debian); the benchmark installs it with apt-get when run as root.
    The peers (sglang-router, vllm-router) are left out: they install into their own venvs."""
    out = tmp_path / "overhead.json"
    argv = ["bench", "overhead", "--sizes", "2", "--connections", "1,4", "--duration", "1"]
    configs = "direct,noop,buffered_w1"
    assert main([*argv, "--configs", configs, "--json", str(out)]) == 0
    document = json.loads(out.read_text())
    rows = document["rows"]
    assert {(r["config"], r["connections"]) for r in rows} == {
        (config, conns)
        for config in ("envoy_direct", "noop_buffered", "buffered_w1")
        for conns in (1, 4)
    }
    for row in rows:
        assert row["requests"] > 0 and row["errors"] == 0
        assert (row["router_cpu_s_per_1k"] > 0) == (row["config"] != "envoy_direct")
        assert row["envoy_cpu_s_per_1k"] > 0
        if row["config"] != "envoy_direct":
            # Envoy really asked the processor (no fail-open) for about every request.
            assert row["failed_open"] == 0
            assert row["ext_proc_streams"] >= row["requests"]
    for name in ("envoy_direct", "noop_buffered", "buffered_w1"):
        assert json.loads(document["checks"][name]["reply"])["object"] == "chat.completion"


@pytest.mark.envoy
def test_bench_overhead_beside_busy_loops(tmp_path):
    """--cpu-hogs measures each cell again beside as many busy loops as the machine has
    cores: the machine is busy throughout, and the loops are gone afterwards."""
    out = tmp_path / "hogs.json"
    hogs = min(os.cpu_count() or 1, 64)
    argv = ["bench", "overhead", "--sizes", "2", "--connections", "4", "--duration", "1"]
    argv += ["--configs", "buffered_w1", "--cpu-hogs", f"0,{hogs}", "--json", str(out)]
    assert main(argv) == 0  # (requests let through unrouted beside the loops are no fault)
    rows = json.loads(out.read_text())["rows"]
    assert [r["cpu_hogs"] for r in rows] == [0, hogs]
    assert all(r["requests"] > 0 and r["errors"] == 0 for r in rows)
    assert rows[1]["machine_busy_pct"] >= 90
    left = subprocess.run(["pgrep", "-f", "while time.monotonic"], capture_output=True)
    assert left.stdout == b""
    with pytest.raises(SystemExit, match="cpu-hogs"):
        main([*argv[:-2], "--cpu-hogs", "two"])


def test_a_cpu_limit_throttles_its_processes():
    """extproc/cpu_limit.py, which ``bench overhead --router-cpu-limits`` puts the router in:
    a busy loop under 0.1 core gets about a tenth of a core, and is let go at close."""
    from extproc.bench_overhead import _cpu_seconds
    from extproc.cpu_limit import CpuLimit

    _skip_without_cgroups()
    limit = CpuLimit("prefix-router-test")
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        limit.set(0.1)
        limit.add([loop.pid])
        start = _cpu_seconds([loop.pid])
        time.sleep(2.0)
        used = _cpu_seconds([loop.pid]) - start
        periods, seconds = limit.throttled()
        assert used < 0.5, used  # unlimited: ~2 s on an idle core
        assert periods >= 5 and seconds > 0.5
        limit.set(None)
        start = _cpu_seconds([loop.pid])
        time.sleep(1.0)
        assert _cpu_seconds([loop.pid]) - start > 0.3  # the limit lifted (a shared machine)
    finally:
        limit.close()
        loop.kill()
        loop.wait()
    assert not limit.path.exists()


@pytest.mark.envoy
def test_bench_overhead_under_a_router_cpu_limit(tmp_path):
    _skip_without_cgroups()
    out = tmp_path / "limit.json"
    argv = ["bench", "overhead", "--sizes", "2", "--connections", "8", "--duration", "1.5"]
    argv += ["--configs", "buffered_w1", "--router-cpu-limits", "none,0.1", "--json", str(out)]
    assert main(argv) == 0
    free, limited = json.loads(out.read_text())["rows"]
    assert (free["router_cpu_limit"], limited["router_cpu_limit"]) == (None, 0.1)
    assert free["throttled_periods"] == 0 < limited["throttled_periods"]
    assert limited["req_per_s"] < free["req_per_s"] / 2  # ~0.1 core against ~1
    assert not _cgroups("prefix-router-bench-*")
    with pytest.raises(SystemExit, match="router-cpu-limits"):
        main([*argv[:-2], "--router-cpu-limits", "0"])


@pytest.mark.envoy
def test_bench_overhead_sigterm_lets_a_limited_router_go(tmp_path):
    """SIGTERM mid-cell: the cgroup is removed and every process the run started stopped
    (before, a router was left throttled at 0.1 core in a leftover cgroup)."""
    _skip_without_cgroups()
    argv = [sys.executable, "-m", "extproc.cli", "bench", "overhead", "--configs", "buffered_w1"]
    argv += ["--sizes", "2", "--connections", "4", "--duration", "20"]
    bench = subprocess.Popen([*argv, "--router-cpu-limits", "0.1"], cwd=tmp_path)
    pattern = f"prefix-router-bench-buffered_w1-{bench.pid}"
    try:
        deadline = time.monotonic() + 60
        started: list[int] = []
        while not started:  # (the cgroup is made before the router's processes move in)
            assert bench.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
            for group in _cgroups(pattern):
                with contextlib.suppress(OSError):
                    started = [int(pid) for pid in (group / "cgroup.procs").read_text().split()]
        time.sleep(1.0)  # mid-cell
        bench.terminate()
        assert bench.wait(30) == 128 + 15
    finally:
        if bench.poll() is None:  # (a failure above: still let it clean up, then kill)
            bench.terminate()
            try:
                bench.wait(30)
            except subprocess.TimeoutExpired:
                bench.kill()
    assert not _cgroups(pattern)
    alive = [pid for pid in started if Path(f"/proc/{pid}").exists()]
    assert not alive, alive


def _skip_without_cgroups() -> None:
    """The CPU-limit tests need a writable cgroup hierarchy (root); skip, saying why."""
    from extproc.cpu_limit import CpuLimit, CpuLimitUnavailable

    try:
        CpuLimit("prefix-router-probe").close()
    except CpuLimitUnavailable as exc:
        pytest.skip(str(exc))


def _cgroups(pattern: str) -> list[Path]:
    """The cgroups named ``pattern`` under either hierarchy CpuLimit uses."""
    from extproc.cpu_limit import V1_ROOT, V2_ROOT

    return [group for root in (V2_ROOT, V1_ROOT) for group in root.glob(pattern)]


def test_bench_core_routing_overrides_reach_the_timed_router(tmp_path):
    """--routing max_blocks=1024 hashes a 128 KiB body's first 1,024 blocks (the default
    window, 8,192, hashes all ~2,000 of them): how the window's cost is measured."""
    hashed = {}
    for name, extra in (("default", []), ("narrow", ["--routing", "max_blocks=1024"])):
        out = tmp_path / f"{name}.json"
        args = ["bench", "core", "--short", "--sizes", "128", "--endpoints", "4"]
        assert main([*args, *extra, "--json", str(out)]) == 0
        doc = json.loads(out.read_text())
        hashed[name] = doc["rows"][0]["mean_blocks_hashed"]
        assert doc["routing_overrides"] == ({"max_blocks": 1024} if extra else {})
    assert hashed["narrow"] == 1024 < 1900 < hashed["default"] <= 2048
    with pytest.raises(SystemExit, match="max_blocks"):
        main(["bench", "core", "--short", "--routing", "max_blocks=0"])


def test_bench_core_history_makes_long_conversations(tmp_path):
    from extproc.bench_core import chat_bodies
    from extproc.prompt import parse_request

    out = tmp_path / "history.json"
    args = ["bench", "core", "--short", "--sizes", "8", "--endpoints", "4", "--history", "50"]
    assert main([*args, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["rows"][0]["messages"] == 53
    long, short = (chat_bodies(8192, 8, 4, history=h) for h in (50, 1))
    assert [len(json.loads(b)["messages"]) for b in (long[0], short[0])] == [53, 4]
    # A conversation's history repeats, so later requests find it in the index.
    prompts = [parse_request("chat", b).prompt for b in long]
    shared = len(prompts[0]) - len(json.loads(long[0])["messages"][-1]["content"]) - 10
    assert prompts[0][:shared] == prompts[4][:shared] != prompts[1][:shared]


def test_bench_overhead_config_selection():
    from extproc.bench_overhead import select_configs

    assert [c.name for c in select_configs("all")][-2:] == ["sglang", "vllm_router"]
    assert [c.name for c in select_configs("vllm_router,direct,duplex")] == [
        "envoy_direct",
        "full_duplex_w1",
        "full_duplex_w2",
        "vllm_router",
    ]
    with pytest.raises(SystemExit, match="unknown config"):
        select_configs("direct,nginx")


def test_peer_command_lines():
    """The peers' command lines (no install): cache_aware, loopback only, every worker."""
    from pathlib import Path

    from extproc import bench_live

    python = Path("/cache/peers/x/bin/python")
    servers = ["127.0.0.1:8001", "127.0.0.1:8002"]
    sglang = bench_live.sglang_router_command(python, servers, 9000, 9001)
    assert sglang[:3] == [str(python), "-m", "sglang_router.launch_router"]
    vllm = bench_live.vllm_router_command(python, servers, 9000, 9001)
    assert vllm[0] == "/cache/peers/x/bin/vllm-router"
    for args in (sglang, vllm):
        assert args[args.index("--worker-urls") + 1 : args.index("--worker-urls") + 3] == [
            "http://127.0.0.1:8001",
            "http://127.0.0.1:8002",
        ]
        assert args[args.index("--policy") + 1] == "cache_aware"
        assert args[args.index("--host") + 1] == "127.0.0.1"
        assert args[args.index("--prometheus-host") + 1] == "127.0.0.1"
        assert args[args.index("--port") + 1] == "9000"
        assert args[args.index("--prometheus-port") + 1] == "9001"
        assert "0.0.0.0" not in args
    assert "--tokenizer-path" not in sglang
    with_tokenizer = bench_live.sglang_router_command(python, servers, 1, 2, Path("/m"))
    assert with_tokenizer[with_tokenizer.index("--tokenizer-path") + 1] == "/m"


@pytest.mark.envoy
def test_instant_upstreams_answer_what_the_peers_call(tmp_path):
    """/health, vLLM's render endpoint (token ids, for vllm-router) and the chat call."""
    import subprocess
    import time
    import urllib.request

    import yaml

    from extproc.bench_overhead import UPSTREAM_BODY, instant_upstreams
    from extproc.stack import envoy_binary, port_open

    bootstrap, addresses = instant_upstreams(1)
    config = tmp_path / "upstreams.yaml"
    config.write_text(yaml.safe_dump(bootstrap))
    envoy = subprocess.Popen(
        [envoy_binary(), "-c", str(config), "--disable-hot-restart", "-l", "warning"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        port = int(addresses[0].rsplit(":", 1)[1])
        deadline = time.monotonic() + 30
        while not port_open(port):
            assert envoy.poll() is None and time.monotonic() < deadline, "upstream Envoy died"
            time.sleep(0.05)
        base = f"http://{addresses[0]}"

        def post(path: str, body: bytes) -> tuple[int, bytes]:
            request = urllib.request.Request(
                base + path, data=body, headers={"content-type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.status, response.read()

        with urllib.request.urlopen(base + "/health", timeout=5) as response:
            assert response.status == 200
        body = b'{"messages":[{"role":"user","content":"conversation 7 ' + b"x" * 4000 + b'"}]}'
        status, reply = post("/v1/chat/completions/render", body)
        tokens = json.loads(reply)["token_ids"]
        assert status == 200 and len(tokens) == len(body) // 4
        assert tokens[12] == 20007 and tokens[:12] == [9001] * 12
        assert post("/v1/chat/completions", body) == (200, UPSTREAM_BODY.encode())
    finally:
        envoy.terminate()
        envoy.wait(10)
