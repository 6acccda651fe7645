"""Several router processes on one port, and the demo end to end."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from extproc.stack import ManagedProcess, Stack

from .conftest import chat_body, request, start_routed_stack

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


def _worker_pids(supervisor: int) -> list[int]:
    """The supervisor's worker processes (not multiprocessing's resource tracker)."""
    out = subprocess.run(["pgrep", "-P", str(supervisor)], capture_output=True, text=True)
    pids = []
    for pid in map(int, out.stdout.split()):
        with contextlib.suppress(OSError):
            if "resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_text():
                pids.append(pid)
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in state


def _keep_sending(routed, stop: threading.Event, statuses: list[int], i: int) -> None:
    n = 0
    while not stop.is_set():
        n += 1
        statuses.append(routed.send(chat_body(f"load {i} {n} " * 40)).status)


def test_workers_drain_and_exit_on_sigterm_under_load(tmp_path):
    """SIGTERM while Envoy keeps sending: the workers drain and exit and so does the
    supervisor. Each worker used to wait at exit for its queue to the supervisor to flush,
    while the supervisor, no longer reading it, waited for the worker: it hung until
    SIGKILL (every pod stop under load took the whole termination grace period)."""
    with Stack(workdir=tmp_path) as stack:
        members = stack.start_replicas(2, FAST)
        routed = start_routed_stack(stack, "override-host", "buffered", members, ["--workers", "2"])
        stop, statuses = threading.Event(), []
        senders = [
            threading.Thread(target=_keep_sending, args=(routed, stop, statuses, i), daemon=True)
            for i in range(8)
        ]
        for sender in senders:
            sender.start()
        time.sleep(2)
        routed.router.signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(3)  # traffic goes on through the drain
        stop.set()
        for sender in senders:
            sender.join(30)
        assert routed.router.process is not None
        routed.router.process.wait(20)  # (the drain's grace is 10 s)
        assert time.monotonic() - signalled < 20
        assert statuses and set(statuses) == {200}, collections.Counter(statuses)


def test_workers_whose_supervisor_is_killed_drain_and_exit(tmp_path):
    """The supervisor killed (SIGKILL, OOM): its workers used to keep serving the port as
    orphans that nothing would stop (SIGTERM then hung them). They watch their parent and
    drain as on SIGTERM; requests meanwhile are served (failed open once they stop)."""
    with Stack(workdir=tmp_path) as stack:
        members = stack.start_replicas(2, FAST)
        routed = start_routed_stack(stack, "override-host", "buffered", members, ["--workers", "2"])
        assert routed.router.process is not None
        supervisor = routed.router.process.pid
        deadline = time.monotonic() + 20
        workers: list[int] = []
        while len(workers) < 2 and time.monotonic() < deadline:
            workers = _worker_pids(supervisor)
            time.sleep(0.1)
        assert len(workers) == 2
        assert routed.send(chat_body("before " * 40)).status == 200
        routed.router.signal(signal.SIGKILL)
        deadline = time.monotonic() + 20
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            assert routed.send(chat_body("meanwhile " * 40)).status == 200
            time.sleep(0.1)
        assert not any(_alive(w) for w in workers)
        assert routed.send(chat_body("after " * 40)).status == 200  # failed open


def test_a_worker_killed_halfway_through_a_message_stops_nothing_else(tmp_path):
    """A worker killed while it writes the supervisor a placement batch larger than the
    pipe (12 prompts of 100 KB: ~150 KiB of hashes): with one queue shared by all workers,
    the supervisor then waited for the rest of that message for good (no restarts, no
    records from the other workers, SIGTERM hung). The supervisor is stopped for 1.5 s only
    to hold the worker in the middle of its message."""
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    with Stack(workdir=tmp_path) as stack:
        members = stack.start_replicas(2, FAST)
        address, router = stack.start_router(
            members, workers=2, env={"PROMETHEUS_MULTIPROC_DIR": str(metrics)}, ready=True
        )
        port, _ = stack.start_proxy("override-host", members, address)
        assert router.process is not None
        supervisor = router.process.pid
        admin = stack.router_admin_ports["router"]
        workers = _worker_pids(supervisor)
        assert len(workers) == 2
        assert request(port, chat_body("warm up")).status == 200

        busy = max(workers, key=lambda pid: _requests_of(metrics, pid))  # (Envoy: one conn.)
        os.kill(supervisor, signal.SIGSTOP)
        try:
            for i in range(12):
                long_prompt = f"long prompt {i} " + "lorem ipsum dolor sit amet " * 4000
                assert request(port, chat_body(long_prompt)).status == 200
            time.sleep(1.5)  # the worker's batch of the second: more than the pipe holds
            os.kill(busy, signal.SIGKILL)
        finally:
            os.kill(supervisor, signal.SIGCONT)
        deadline = time.monotonic() + 20
        while len([w for w in _worker_pids(supervisor) if w != busy]) < 2:
            assert time.monotonic() < deadline, "the killed worker was not replaced"
            time.sleep(0.1)
        for i in range(20):
            assert request(port, chat_body(f"later {i} " * 30)).status == 200
        time.sleep(1.0)
        assert _newest_decision_age(admin) < 2.0
        assert _worker_restarts(admin) == {"exited": 1.0, "hung": 0.0}
        router.signal(signal.SIGTERM)
        router.process.wait(15)


def test_a_hung_worker_is_killed_and_replaced(tmp_path):
    """A worker is stopped (a hung event loop). The kernel keeps handing it a share of the
    new connections, and requests on Envoy's connections to it wait for the message timeout
    (1 s) and go on unrouted; it stayed so for good. After server.worker_hang_seconds (5
    here) without a heartbeat the supervisor kills it, a new worker takes its place, and the
    requests are routed again. Every request is served throughout (BUFFERED: a stream that
    fails is continued without the router)."""
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    hang = 5.0
    with Stack(workdir=tmp_path) as stack:
        members, address, router, supervisor, workers = _two_workers(
            stack, 2, hang, {"PROMETHEUS_MULTIPROC_DIR": str(metrics)}
        )
        port, _ = stack.start_proxy("override-host", members, address)
        admin = stack.router_admin_ports["router"]
        for i in range(4):
            assert request(port, chat_body(f"warm up {i}")).status == 200
        busy = max(workers, key=lambda pid: _requests_of(metrics, pid))
        os.kill(busy, signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            waits = []
            while _alive(busy) or len([w for w in _worker_pids(supervisor) if _alive(w)]) < 2:
                assert time.monotonic() - stopped < hang + 8, "the hung worker was not replaced"
                sent = time.monotonic()
                response = request(
                    port, chat_body(f"while it hangs {len(waits)} " * 20), timeout=10
                )
                waits.append(round(time.monotonic() - sent, 1))
                assert response.status == 200
                time.sleep(0.05)
            assert max(waits) < 3, waits
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(busy, signal.SIGCONT)
        assert (tmp_path / "router.log").read_text().count("silent for") == 1  # (that one)
        assert _worker_restarts(admin) == {"exited": 0.0, "hung": 1.0}
        # Envoy's health check of the router may have met the stopped worker: requests fail
        # open until it passes again on a connection to a live one.
        replaced = time.monotonic()
        routed = 0
        while routed < 5:
            assert time.monotonic() - replaced < 15, "requests were not routed again"
            sent = time.time()
            assert request(port, chat_body(f"later {routed} " * 30), timeout=10).status == 200
            time.sleep(0.5)  # (the worker hands its decisions to the supervisor)
            routed += _newest_decision_age(admin) <= time.time() - sent
        print(
            f"{len(waits)} requests while hung, longest {max(waits)} s; "
            f"5 routed {time.monotonic() - replaced:.1f} s after the replacement"
        )
        router.signal(signal.SIGTERM)
        router.process.wait(15)


def test_a_worker_busy_with_long_requests_is_not_killed(tmp_path):
    """14 requests of 17 MiB (500,000 short chat messages: ~0.5 s each to parse and route)
    at once on one connection keep one worker's event loop busy for ~7 s, past
    server.worker_hang_seconds (5): its heartbeat moves after every message it handles, so
    it is not taken for hung. Beaten only once a second by a task of the loop, it was killed
    and every stream failed UNAVAILABLE."""
    import asyncio

    import grpc
    import orjson
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as epg

    messages = [{"role": "user", "content": f"m{i}"} for i in range(500_000)]
    body = orjson.dumps({"model": "m", "messages": messages})
    path = [(":path", b"/v1/chat/completions"), (":method", b"POST")]
    headers = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v) for k, v in path]
            )
        )
    )
    request_body = ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))

    async def send_all(address: str, count: int) -> list[str]:
        limit = 2 * len(body)
        options = [("grpc.max_send_message_length", limit)]
        async with grpc.aio.insecure_channel(address, options=options) as channel:
            stub = epg.ExternalProcessorStub(channel)

            async def one() -> str:
                async def messages():
                    yield headers
                    yield request_body

                try:
                    answers = [a.WhichOneof("response") async for a in stub.Process(messages())]
                except grpc.aio.AioRpcError as exc:
                    return exc.code().name
                return ",".join(answers)

            return await asyncio.gather(*(one() for _ in range(count)))

    with Stack(workdir=tmp_path) as stack:
        _, address, *_ = _two_workers(stack, 1, 5.0)
        started = time.monotonic()
        answers = asyncio.run(send_all(address, 14))
        busy = time.monotonic() - started
        assert answers == ["request_headers,request_body"] * 14, answers
        print(f"14 requests of {len(body) / 2**20:.1f} MiB answered in {busy:.1f} s")
        assert "silent for" not in (tmp_path / "router.log").read_text()


@pytest.mark.parametrize("stopped", ["supervisor", "everyone"])
def test_a_pause_kills_no_worker(tmp_path, stopped):
    """The supervisor alone (a starved process) or with its workers (a paused container,
    the cgroup freezer) stopped for longer than server.worker_hang_seconds: no worker is
    killed for it. The supervisor times silence on its own clock and counts it afresh after
    a gap in its own loop; timed by the pipe's reports, a paused supervisor killed healthy
    workers, and timed by the workers' own stamps, a thawed group killed every worker."""
    hang = 5.0
    with Stack(workdir=tmp_path) as stack:
        _, _, _, supervisor, workers = _two_workers(stack, 1, hang)
        time.sleep(1.5)  # (each has beaten)
        paused = [supervisor] + (workers if stopped == "everyone" else [])
        for pid in paused:
            os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(hang + 3)
        finally:
            for pid in paused:
                os.kill(pid, signal.SIGCONT)
        time.sleep(2.0)
        assert "silent for" not in (tmp_path / "router.log").read_text()
        assert sorted(_worker_pids(supervisor)) == sorted(workers)


def _two_workers(
    stack: Stack, replicas: int, hang: float, env: dict[str, str] | None = None
) -> tuple[list[str], str, ManagedProcess, int, list[int]]:
    """Stand-ins and a router of two workers with server.worker_hang_seconds ``hang``:
    (the stand-ins, the router's address, its process, the supervisor's pid, the workers')."""
    members = stack.start_replicas(replicas, FAST)
    address, router = stack.start_router(
        members,
        workers=2,
        extra_args=["--set", f"server.worker_hang_seconds={hang}"],
        env=env,
        ready=True,
    )
    assert router.process is not None
    workers = _worker_pids(router.process.pid)
    assert len(workers) == 2
    return members, address, router, router.process.pid, workers


def _requests_of(metrics: Path, pid: int) -> float:
    """Requests a worker counted, from its file in the multiprocess metrics directory."""
    from prometheus_client.mmap_dict import MmapedDict

    path = metrics / f"counter_{pid}.db"
    if not path.exists():
        return 0.0
    return sum(
        value
        for key, value, *_ in MmapedDict.read_all_values_from_file(str(path))
        if '"prefix_router_requests_total"' in key
    )


def _worker_restarts(admin_port: int) -> dict[str, float]:
    """prefix_router_worker_restarts_total by reason, from the supervisor's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/metrics", timeout=5) as page:
        text = page.read().decode()
    found = re.findall(r'^prefix_router_worker_restarts_total\{reason="(\w+)"\} (\S+)$', text, re.M)
    return {reason: float(value) for reason, value in found}


def _newest_decision_age(admin_port: int) -> float:
    with urllib.request.urlopen(
        f"http://127.0.0.1:{admin_port}/debug/decisions?limit=1", timeout=5
    ) as response:
        (record,) = json.loads(response.read())["decisions"]
    return time.time() - record["time"]


STALE_GAUGE = """
from prometheus_client import CollectorRegistry, Gauge
Gauge("prefix_router_peers", "x", registry=CollectorRegistry(), multiprocess_mode="liveall").set(3)
"""


def test_an_operators_metrics_directory_is_emptied_at_start(tmp_path):
    """With PROMETHEUS_MULTIPROC_DIR set by the operator (kept across runs), what an earlier
    run left there was exported for good, and read by the workers as their peers' figures;
    the supervisor empties it at start, as prometheus_client asks."""
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    env = {"PROMETHEUS_MULTIPROC_DIR": str(metrics)}
    subprocess.run([sys.executable, "-c", STALE_GAUGE], env={**os.environ, **env}, check=True)
    (stale,) = metrics.glob("gauge_liveall_*.db")
    with Stack(workdir=tmp_path) as stack:
        members = stack.start_replicas(1, FAST)
        stack.start_router(members, workers=2, env=env, ready=True)
        admin = stack.router_admin_ports["router"]
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=5) as page:
            text = page.read().decode()
    assert not stale.exists()
    stale_pid = stale.stem.rsplit("_", 1)[1]
    assert f'pid="{stale_pid}"' not in text and "prefix_router_peers{" in text


def test_envoy_opens_more_connections_to_the_router_under_concurrency(tmp_path):
    """SO_REUSEPORT spreads connections over the workers, not streams, and Envoy sent every
    ext_proc stream over one HTTP/2 connection per worker thread: behind an Envoy with one
    thread, one of three workers got all 600 requests. The generated config lets a
    connection carry ROUTER_STREAMS_PER_CONNECTION streams, so concurrent requests open more
    connections for the kernel to spread (which worker each lands on is its hash's choice)."""
    from concurrent.futures import ThreadPoolExecutor

    from extproc.envoyconf import ROUTER_CLUSTER

    with Stack(workdir=tmp_path) as stack:
        members = stack.start_replicas(2, FAST)
        address, _ = stack.start_router(members, workers=3, ready=True)
        port, _ = stack.start_proxy("override-host", members, address, name="envoy")
        with ThreadPoolExecutor(32) as pool:
            bodies = [chat_body(f"spread {i} " * 40) for i in range(600)]
            statuses = list(pool.map(lambda body: request(port, body).status, bodies))
        admin = stack.envoy_admin_ports["envoy"]
        url = f"http://127.0.0.1:{admin}/stats?filter=^cluster.{ROUTER_CLUSTER}.upstream_cx_total$"
        with urllib.request.urlopen(url, timeout=5) as page:
            connections = int(page.read().decode().split(":")[1])
    assert set(statuses) == {200}
    assert connections >= 3, connections  # (one for the health check, before: 2 in all)


def test_the_supervisors_readiness_is_what_its_workers_know(tmp_path):
    """With discovery only the workers know whether a ready endpoint exists: the
    supervisor's /readyz (what an HTTP readiness probe reads; the shipped Deployment probes
    the workers' gRPC readiness) said ready regardless."""

    with Stack(workdir=tmp_path) as stack:
        (member,) = stack.start_replicas(1, FAST)
        port = member.rsplit(":", 1)[1]

        def start(name: str, dns_name: str, ready: bool) -> int:
            discovery = ["discovery.kind=dns", f"discovery.dns_name={dns_name}"]
            discovery += [f"discovery.dns_port={port}", "discovery.interval_seconds=0.5"]
            args = [a for setting in discovery for a in ("--set", setting)]
            stack.start_router([], workers=2, extra_args=args, name=name, ready=ready)
            return stack.router_admin_ports[name]

        nowhere = start("nowhere", "nothing-here.invalid", ready=False)
        deadline = time.monotonic() + 20
        log = tmp_path / "nowhere.log"
        while len(re.findall(r"pid \d+ serving", log.read_text())) < 2:
            assert time.monotonic() < deadline, "the workers did not start"
            time.sleep(0.1)
        statuses = []
        for _ in range(6):  # two discovery rounds and two of the workers' reports
            time.sleep(0.5)
            statuses.append(_readyz(nowhere))
        assert set(statuses) == {503}, statuses
        found = start("found", "localhost", ready=True)  # (wait_ready: 200 within its timeout)
        assert _readyz(found) == 200


def test_the_supervisor_is_not_ready_while_every_worker_is_silent(tmp_path):
    """Workers report their readiness every second: when every one is stopped (a hung
    event loop), the supervisor's /readyz turns 503 within WORKER_SILENT_SECONDS, and ready
    again once they answer (it said ready throughout)."""
    from extproc.serve import WORKER_SILENT_SECONDS

    with Stack(workdir=tmp_path) as stack:
        members = stack.start_replicas(1, FAST)
        stack.start_router(members, workers=2, ready=True)
        admin = stack.router_admin_ports["router"]
        deadline = time.monotonic() + 20
        pids: set[str] = set()
        while len(pids) < 2:
            assert time.monotonic() < deadline, "the workers did not start"
            pids = set(re.findall(r"pid (\d+) serving", (tmp_path / "router.log").read_text()))
            time.sleep(0.1)
        for pid in pids:
            os.kill(int(pid), signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            while _readyz(admin) == 200:
                assert time.monotonic() - stopped < WORKER_SILENT_SECONDS + 5
                time.sleep(0.5)
            assert time.monotonic() - stopped >= WORKER_SILENT_SECONDS - 1.5
        finally:
            for pid in pids:
                os.kill(int(pid), signal.SIGCONT)
        resumed = time.monotonic()
        while _readyz(admin) != 200:
            assert time.monotonic() - resumed < 5
            time.sleep(0.2)


def _readyz(admin: int) -> int:
    """The router's /readyz status (its supervisor's, with workers)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/readyz", timeout=5) as page:
            return page.status
    except urllib.error.HTTPError as exc:
        return exc.code
