"""`prefix-router bench live`: real vLLM servers, real routers, the servers' own cache counters.

The same workloads go, one run after another, through

* ``round_robin``       Envoy balancing round robin (no router),
* ``prefix_buffered``   Envoy + this router, ext_proc BUFFERED,
* ``prefix_duplex``     Envoy + this router, ext_proc FULL_DUPLEX_STREAMED,
* ``sglang``            PyPI ``sglang-router`` (Rust), ``--policy cache_aware``,
* ``vllm_router``       PyPI ``vllm-router`` (Rust), ``--policy cache_aware``,

all against the same N vLLM CPU servers (``extproc.lab``). Before every run the servers'
prefix caches are reset (``POST /reset_prefix_cache``) and each router starts fresh, so every
run begins cold. Reported per run: the hit ratio vLLM itself measured
(``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total``, deltas), client TTFT
p50/p99, end-to-end latency, throughput, errors, and CPU time per request of the routing
tier (the router's process tree, and Envoy where there is one) read from ``/proc``.

Workloads (both streaming, concurrent clients, bounded in requests and time):

* ``chat``: multi-turn conversations sharing a system prompt (``extproc.workload``); each
  turn carries the whole history including the server's real answers;
* ``groups``: G long shared prefixes (a document each) with Q short questions per group,
  single turn, interleaved across groups.

The peer routers are installed on first use into their own cached venvs
(``~/.cache/prefix-router/peers/...``); everything binds 127.0.0.1. The vLLM servers are
started with ``--enable-scale-out`` because vllm-router's cache-aware policy calls
``/v1/chat/completions/render`` on its workers (the flag only registers extra endpoints).

Example: prefix-router bench live --json out.json --plot out.png --markdown out.md
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import random
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from . import lab
from .config import routing_overrides
from .stack import LOOPBACK, ManagedProcess, Stack, free_port, wait_for_port
from .workload import (
    ChatWorkload,
    RequestRecord,
    RunResult,
    aligned_table,
    percentile,
    run_chat_workload,
)

RUNS = ("round_robin", "prefix_buffered", "prefix_duplex", "sglang", "vllm_router")
# Optional variants: our router placing new sessions by their first blocks, not the first turn;
# two router replicas behind one Envoy (its ext_proc cluster balances each request's stream
# over them), on their own, reading each other's queued work (config ``peers``), or each
# reading the servers' KV-cache events (config ``cache_events``; the servers then publish
# them, in every run of the benchmark).
EXTRA_RUNS = ("prefix_blocks", "prefix_k2", "prefix_k2_peers", "prefix_k2_events")
TWO_ROUTER_RUNS = ("prefix_k2", "prefix_k2_peers", "prefix_k2_events")
WORKLOADS = ("chat", "groups")
SGLANG_ROUTER = "sglang-router==0.3.2"
VLLM_ROUTER = "vllm-router==0.1.17"
_VOCABULARY = (
    "cache prefix token replica router envoy latency throughput model prompt batch decode "
    "prefill kernel memory tensor layer request stream header cluster metric queue policy "
    "schedule index block hash window context answer question system assistant user data"
)
_WORDS = _VOCABULARY.split()


# --------------------------------------------------------------------------- workloads
@dataclass(frozen=True)
class GroupWorkload:
    """G shared prefixes (a document each) x Q questions; one request per question."""

    groups: int = 6
    questions: int = 8
    concurrency: int = 4
    prefix_words: int = 1200  # ~1,500 tokens with the tiny model's tokenizer
    question_words: int = 40
    max_tokens: int = 16
    model: str = lab.SERVED_MODEL_NAME
    seed: int = 11


def group_requests(workload: GroupWorkload) -> list[tuple[int, bytes]]:
    rng = random.Random(workload.seed)
    docs = [
        f"Document {g}. " + " ".join(rng.choice(_WORDS) for _ in range(workload.prefix_words))
        for g in range(workload.groups)
    ]
    items = []
    for g in range(workload.groups):
        for q in range(workload.questions):
            question = f"Question {q}: " + " ".join(
                rng.choice(_WORDS) for _ in range(workload.question_words)
            )
            body = {
                "model": workload.model,
                "messages": [
                    {"role": "system", "content": docs[g]},
                    {"role": "user", "content": question},
                ],
                "stream": True,
                "max_tokens": workload.max_tokens,
            }
            items.append((g, orjson.dumps(body)))
    rng.shuffle(items)
    return items


async def _stream(session: aiohttp.ClientSession, url: str, body: bytes) -> tuple[int, float]:
    """POST one streaming request and read it to the end: (status, TTFT ms)."""
    started = time.perf_counter()
    ttft = 0.0
    async with session.post(url, data=body, headers={"content-type": "application/json"}) as r:
        if r.status != 200:
            await r.read()
            return r.status, 0.0
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            if line[5:].strip() == b"[DONE]":
                break
            if not ttft:
                ttft = (time.perf_counter() - started) * 1000
    return 200, ttft


async def run_group_workload(
    base_url: str,
    workload: GroupWorkload,
    on_request: Callable[[RequestRecord], None] | None = None,
    timeout_seconds: float = 300.0,
) -> RunResult:
    items = group_requests(workload)
    url = base_url.rstrip("/") + "/v1/chat/completions"
    result = RunResult()
    queue: asyncio.Queue[tuple[int, bytes]] = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)

    async def worker(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            group, body = queue.get_nowait()
            started = time.perf_counter()
            try:
                status, ttft = await _stream(session, url, body)
                error = "" if status == 200 else f"HTTP {status}"
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                status, ttft, error = 0, 0.0, type(exc).__name__
            record = RequestRecord(
                group, 0, status, ttft, (time.perf_counter() - started) * 1000, "", error
            )
            result.records.append(record)
            if on_request is not None:
                on_request(record)

    started = time.perf_counter()
    connector = aiohttp.TCPConnector(limit=workload.concurrency)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.wait_for(
            asyncio.gather(*(worker(session) for _ in range(workload.concurrency))),
            timeout_seconds,
        )
    result.seconds = time.perf_counter() - started
    return result


# --------------------------------------------------------------------------- measurement
def _http(method: str, url: str, timeout: float = 10.0) -> bytes:
    request = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return response.read()


def vllm_counters(address: str) -> dict[str, float]:
    """The prefix-cache counters (tokens) of one vLLM server, summed over label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {
        "vllm:prefix_cache_hits_total": "hits",
        "vllm:prefix_cache_queries_total": "queries",
        "vllm:prompt_tokens_total": "prompt_tokens",
        "vllm:generation_tokens_total": "generation_tokens",
        "vllm:request_success_total": "requests",
    }
    out = dict.fromkeys(wanted.values(), 0.0)
    text = _http("GET", f"http://{address}/metrics").decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                out[wanted[sample.name]] += sample.value
    return out


def _router_counts(
    admin_ports: Sequence[int], name: str, label: str, **only: str
) -> dict[str, float]:
    """Our routers' counter ``name`` summed by ``label`` (their admin /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for port in admin_ports:
        text = _http("GET", f"http://{LOOPBACK}:{port}/metrics").decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in only.items()):
                    key = sample.labels.get(label, "")
                    out[key] = out.get(key, 0.0) + sample.value
    return out


def routing_rules(admin_ports: Sequence[int]) -> dict[str, float]:
    """Requests our routers routed, by the rule that decided."""
    return _router_counts(admin_ports, "prefix_router_requests_total", "reason", outcome="routed")


def pass_through_reasons(admin_ports: Sequence[int]) -> dict[str, float]:
    """Requests our routers let through unrouted, by reason (no_body: the stream ended
    before the request's body reached the router)."""
    return _router_counts(
        admin_ports, "prefix_router_requests_total", "reason", outcome="pass_through"
    )


def envoy_ext_proc_counts(admin_port: int | None) -> dict[str, float]:
    """Envoy's ext_proc filter counters (streams started and closed, message timeouts,
    failure_mode_allowed: requests Envoy sent on without the router's answer)."""
    if admin_port is None:
        return {}
    text = _http("GET", f"http://{LOOPBACK}:{admin_port}/stats?filter=ext_proc").decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        name, sep, value = line.partition(": ")
        if sep and value.strip().isdigit():
            key = name.rsplit("ext_proc.", 1)[-1]
            out[key] = out.get(key, 0.0) + float(value)
    return out


def decision_outcomes(admin_ports: Sequence[int]) -> dict[str, float]:
    """Requests our routers saw, by outcome (routed, pass_through, no_endpoint, error)."""
    return _router_counts(admin_ports, "prefix_router_requests_total", "outcome")


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, int]:
    return {
        k: int(v - before.get(k, 0.0)) for k, v in sorted(after.items()) if v > before.get(k, 0.0)
    }


def cache_event_counts(admin_ports: Sequence[int]) -> dict[str, float]:
    """What our routers read of the servers' KV-cache events, by kind."""
    return _router_counts(admin_ports, "prefix_router_cache_events_total", "kind")


def reset_caches(addresses: Sequence[str]) -> None:
    """Empty every server's prefix cache; vLLM refuses while requests run, so retry."""
    for address in addresses:
        deadline = time.monotonic() + 30
        while True:
            try:
                _http("POST", f"http://{address}/reset_prefix_cache")
                break
            except (urllib.error.URLError, OSError) as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"reset_prefix_cache on {address} failed: {exc}") from exc
                time.sleep(0.5)


def _clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(root_pid: int) -> float:
    """User + system CPU of a process and all its descendants (living ones; /proc)."""
    children: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    tick = _clock_ticks()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            pid = int(entry.name)
            children.setdefault(int(fields[1]), []).append(pid)
            # utime, stime, cutime, cstime (reaped children count into the parent)
            cpu[pid] = sum(int(v) for v in fields[11:15]) / tick
    total, stack = 0.0, [root_pid]
    while stack:
        pid = stack.pop()
        total += cpu.get(pid, 0.0)
        stack.extend(children.get(pid, []))
    return total


@dataclass
class Target:
    """How one run reaches the servers, and whose CPU to charge to routing."""

    run: str
    url: str
    router_pid: int | None = None  # the router's process tree (ours or a peer)
    proxy_pid: int | None = None  # Envoy, where it is in the path
    admin_ports: tuple[int, ...] = ()  # our routers' admin ports (rule counts)
    proxy_admin_port: int | None = None  # that Envoy's admin port (its ext_proc counters)


def measured_run(
    target: Target,
    kind: str,
    chat: ChatWorkload,
    groups: GroupWorkload,
    servers: Sequence[str],
    timeout_seconds: float = 300.0,
    progress: bool = True,
    idle_seconds: float = 3.0,
) -> dict[str, Any]:
    """Reset caches, run one workload through ``target``, return the measured figures."""
    from tqdm import tqdm

    reset_caches(servers)
    pids = {name: pid for name, pid in (("router", target.router_pid), ("proxy", target.proxy_pid))}
    pids = {name: pid for name, pid in pids.items() if pid}
    # Idle baseline: health probes and /metrics scrapes cost CPU with no traffic at all.
    idle_start = {name: tree_cpu_seconds(pid) for name, pid in pids.items()}
    time.sleep(idle_seconds)
    idle_rate = {
        name: (tree_cpu_seconds(pid) - idle_start[name]) / idle_seconds
        for name, pid in pids.items()
    }
    before = {a: vllm_counters(a) for a in servers}
    rules_before = routing_rules(target.admin_ports)
    outcomes_before = decision_outcomes(target.admin_ports)
    passed_before = pass_through_reasons(target.admin_ports)
    envoy_before = envoy_ext_proc_counts(target.proxy_admin_port)
    events_before = cache_event_counts(target.admin_ports)
    cpu_before = {name: tree_cpu_seconds(pid) for name, pid in pids.items()}
    total = chat.conversations * chat.turns if kind == "chat" else groups.groups * groups.questions
    with tqdm(
        total=total,
        desc=f"{target.run:>15} {kind:6}",
        unit="req",
        file=sys.stderr,
        disable=None if progress else True,
    ) as bar:
        if kind == "chat":
            coro = run_chat_workload(target.url, chat, lambda _: bar.update(1), timeout_seconds)
        else:
            coro = run_group_workload(target.url, groups, lambda _: bar.update(1), timeout_seconds)
        result = asyncio.run(coro)
    cpu = {name: tree_cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()}
    time.sleep(1.0)  # let the servers publish the last requests' counters
    after = {a: vllm_counters(a) for a in servers}
    row = summarise(target.run, kind, result, before, after, cpu)
    # A request is counted when its ext_proc stream ends, which can trail its response.
    deadline = time.monotonic() + 5.0
    while True:
        outcomes = decision_outcomes(target.admin_ports)
        counted = sum(outcomes.values()) - sum(outcomes_before.values())
        if not target.admin_ports or counted >= row["requests"] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    # Every request's outcome (a request not routed went to the fallback); rules: the
    # routed ones' deciding rule.
    row["outcomes"] = _delta(outcomes, outcomes_before)
    row["pass_through"] = _delta(pass_through_reasons(target.admin_ports), passed_before)
    # What Envoy saw of the router: a request whose answer came too late went on without it.
    row["envoy_ext_proc"] = _delta(envoy_ext_proc_counts(target.proxy_admin_port), envoy_before)
    row["rules"] = _delta(routing_rules(target.admin_ports), rules_before)
    events = cache_event_counts(target.admin_ports)
    row["cache_events"] = _delta(events, events_before)
    n = max(1, row["requests"])
    net = {name: max(0.0, cpu[name] - idle_rate[name] * result.seconds) for name in pids}
    row["router_idle_cpu_ms_per_s"] = (
        round(idle_rate["router"] * 1000, 2) if "router" in idle_rate else None
    )
    row["router_net_cpu_ms_per_req"] = (
        round(net["router"] * 1000 / n, 3) if "router" in net else None
    )
    return row


def summarise(
    run: str,
    kind: str,
    result: RunResult,
    before: dict[str, dict[str, float]],
    after: dict[str, dict[str, float]],
    cpu: dict[str, float],
) -> dict[str, Any]:
    delta = {a: {k: after[a][k] - before[a][k] for k in after[a]} for a in after}
    hits = sum(d["hits"] for d in delta.values())
    queries = sum(d["queries"] for d in delta.values())
    ok = [r for r in result.records if not r.error]
    ttfts = [r.ttft_ms for r in ok]
    latencies = [r.latency_ms for r in ok]
    n = len(result.records)
    out: dict[str, Any] = {
        "run": run,
        "workload": kind,
        "requests": n,
        "errors": n - len(ok),
        "error_kinds": sorted({r.error for r in result.records if r.error}),
        "hit_ratio": round(hits / queries, 4) if queries else 0.0,
        "prompt_tokens": int(queries),
        "cached_tokens": int(hits),
        "ttft_p50_ms": round(percentile(ttfts, 50), 1),
        "ttft_p99_ms": round(percentile(ttfts, 99), 1),
        "latency_p50_ms": round(percentile(latencies, 50), 1),
        "latency_p99_ms": round(percentile(latencies, 99), 1),
        "seconds": round(result.seconds, 2),
        "throughput_rps": round(len(ok) / result.seconds, 3) if result.seconds else 0.0,
        "output_tokens_per_s": round(
            sum(d["generation_tokens"] for d in delta.values()) / result.seconds, 1
        )
        if result.seconds
        else 0.0,
        # Share of prompt tokens each server received (who carried the load).
        "server_share": {
            a: round(d["queries"] / queries, 3) if queries else 0.0 for a, d in delta.items()
        },
    }
    for name in ("router", "proxy"):
        seconds = cpu.get(name)
        out[f"{name}_cpu_ms_per_req"] = (
            round(seconds * 1000 / n, 3) if seconds is not None else None
        )
    routing = [cpu[k] for k in ("router", "proxy") if k in cpu]
    out["routing_cpu_ms_per_req"] = round(sum(routing) * 1000 / n, 3) if routing and n else None
    return out


# --------------------------------------------------------------------------- routers
def _wait_http(url: str, proc: ManagedProcess, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(urllib.error.URLError, OSError):
            _http("GET", url, timeout=2)
            return
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited at start-up:\n{proc.log_tail()}")
        time.sleep(0.3)
    raise TimeoutError(f"{proc.name}: {url} not answering after {timeout:.0f}s:\n{proc.log_tail()}")


def _spawn(stack: Stack, name: str, args: list[str]) -> ManagedProcess:
    assert stack.workdir is not None
    env = lab._clean_env()
    proc = ManagedProcess(name, args, stack.workdir / f"{name}.log", env).start()
    stack.processes.append(proc)
    return proc


def ensure_peer(requirement: str) -> Path:
    name = requirement.replace("==", "-")
    return lab.ensure_venv(f"peers/{name}", [requirement])


def _common_peer_args(servers: Sequence[str], port: int, metrics_port: int) -> list[str]:
    """What both Rust routers take alike: workers, cache_aware, loopback ports."""
    return [
        "--worker-urls",
        *(f"http://{a}" for a in servers),
        "--policy",
        "cache_aware",
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        "--prometheus-host",
        LOOPBACK,
        "--prometheus-port",
        str(metrics_port),
    ]


def sglang_router_command(
    python: Path,
    servers: Sequence[str],
    port: int,
    metrics_port: int,
    tokenizer_path: Path | None = None,
) -> list[str]:
    """sglang-router (cache_aware) in front of ``servers`` (``ip:port``), on loopback."""
    return [
        str(python),
        "-m",
        "sglang_router.launch_router",
        *_common_peer_args(servers, port, metrics_port),
        *(["--tokenizer-path", str(tokenizer_path)] if tokenizer_path is not None else []),
        "--log-level",
        "warn",
    ]


def vllm_router_command(
    python: Path, servers: Sequence[str], port: int, metrics_port: int
) -> list[str]:
    """vllm-router (cache_aware) in front of ``servers`` (``ip:port``), on loopback."""
    return [
        str(python.with_name("vllm-router")),
        *_common_peer_args(servers, port, metrics_port),
        "--log-level",
        "warning",
    ]


# run name -> (pip requirement, process name)
PEERS = {"sglang": (SGLANG_ROUTER, "sglang-router"), "vllm_router": (VLLM_ROUTER, "vllm-router")}


@dataclass
class Peer:
    """A running peer router: where it serves, where its Prometheus metrics are."""

    run: str
    proc: ManagedProcess
    port: int
    metrics_port: int

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"


def start_peer(
    stack: Stack, run: str, servers: Sequence[str], tokenizer_path: Path | None = None
) -> Peer:
    """Install (cached) and start peer ``run`` in front of ``servers``; wait for /health."""
    requirement, name = PEERS[run]
    python = ensure_peer(requirement)
    port, metrics_port = free_port(), free_port()
    if run == "sglang":
        args = sglang_router_command(python, servers, port, metrics_port, tokenizer_path)
    else:
        args = vllm_router_command(python, servers, port, metrics_port)
    proc = _spawn(stack, name, args)
    try:
        wait_for_port(port, proc, timeout=60)
        _wait_http(f"http://{LOOPBACK}:{port}/health", proc)
    except BaseException:
        stack.stop(proc)
        raise
    return Peer(run, proc, port, metrics_port)


def _envoy_in_front(
    stack: Stack,
    run: str,
    servers: Sequence[str],
    mode: str,
    router: str,
    body_mode: str = "buffered",
) -> tuple[str, ManagedProcess, int]:
    """A real Envoy on loopback in front of ``servers`` (``router``: one or a comma list of
    ext_proc addresses); returns its URL, its process and that process's pid."""
    port, envoy = stack.start_proxy(mode, servers, router, body_mode, name=f"envoy-{run}")
    assert envoy.process is not None
    return f"http://{LOOPBACK}:{port}", envoy, envoy.process.pid


@contextlib.contextmanager
def start_target(
    stack: Stack,
    run: str,
    servers: Sequence[str],
    model_dir: Path,
    router_args: Sequence[str] = (),
    events_args: Sequence[str] = (),
):
    """Start what ``run`` needs in front of the servers; yields a Target; stops it after.
    ``events_args``: a router's settings to read the servers' KV-cache events."""
    started: list[ManagedProcess] = []
    try:
        if run in TWO_ROUTER_RUNS:
            admin = [free_port(), free_port()]
            addresses = []
            for k in range(2):
                name = f"router-{run}-{k + 1}"
                stack.router_admin_ports[name] = admin[k]
                peers = ["--set", f"peers.addresses={LOOPBACK}:{admin[1 - k]}"]
                own = {"prefix_k2_peers": peers, "prefix_k2_events": list(events_args)}
                address, router = stack.start_router(
                    servers, extra_args=[*router_args, *own.get(run, [])], name=name
                )
                started.append(router)
                addresses.append(address)
            routers = ",".join(addresses)
            url, envoy, pid = _envoy_in_front(stack, run, servers, "override-host", routers)
            started.append(envoy)
            # Two router processes: no single process tree to charge CPU to.
            envoy_admin = stack.envoy_admin_ports[f"envoy-{run}"]
            yield Target(run, url, None, pid, tuple(admin), envoy_admin)
        elif run in ("round_robin", "prefix_buffered", "prefix_duplex", "prefix_blocks"):
            body_mode = "full_duplex_streamed" if run == "prefix_duplex" else "buffered"
            if run == "prefix_blocks":
                router_args = [*router_args, "--set", "routing.cold_start_key=blocks"]
            router_pid = None
            router_address = f"{LOOPBACK}:{free_port()}"  # unused by round robin
            if run != "round_robin":
                router_address, router = stack.start_router(
                    servers, body_mode=body_mode, extra_args=router_args, name=f"router-{run}"
                )
                started.append(router)
                router_pid = router.process.pid if router.process else None
            mode = "round-robin" if run == "round_robin" else "override-host"
            url, envoy, pid = _envoy_in_front(stack, run, servers, mode, router_address, body_mode)
            started.append(envoy)
            admin_ports = (
                () if run == "round_robin" else (stack.router_admin_ports[f"router-{run}"],)
            )
            envoy_admin = stack.envoy_admin_ports[f"envoy-{run}"]
            yield Target(run, url, router_pid, pid, admin_ports, envoy_admin)
        elif run in PEERS:
            peer = start_peer(stack, run, servers, model_dir if run == "sglang" else None)
            started.append(peer.proc)
            assert peer.proc.process is not None
            yield Target(run, peer.url, peer.proc.process.pid, None)
        else:
            raise ValueError(f"unknown run {run!r}; choose from {', '.join(RUNS + EXTRA_RUNS)}")
    finally:
        for proc in reversed(started):
            stack.stop(proc)


def routing_set_args(routing: dict[str, Any]) -> list[str]:
    """``--routing`` settings (validated) as the router's own ``--set routing.KEY=VALUE``
    arguments, each value as JSON, which the router reads back as YAML."""
    return [
        arg
        for key, value in routing.items()
        for arg in ("--set", f"routing.{key}={json.dumps(value)}")
    ]


def warm_up(servers: Sequence[str], model: str) -> None:
    """One small request per server: the first request after start-up is slow."""
    body = orjson.dumps(
        {"model": model, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 4}
    )
    for address in servers:
        request = urllib.request.Request(
            f"http://{address}/v1/chat/completions",
            data=body,
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            response.read()


def count_render_calls(log_paths: Sequence[str]) -> int:
    """POSTs to /v1/chat/completions/render in the servers' access logs (vllm-router)."""
    total = 0
    for path in log_paths:
        with contextlib.suppress(OSError):
            total += len(re.findall(r"POST /v1/chat/completions/render", Path(path).read_text()))
    return total


# --------------------------------------------------------------------------- report
_ROWS = (
    ("requests", "requests", "{}"),
    ("errors", "errors", "{}"),
    ("hit ratio (vLLM counters)", "hit_ratio", "{:.3f}"),
    ("TTFT p50 (ms)", "ttft_p50_ms", "{:.0f}"),
    ("TTFT p99 (ms)", "ttft_p99_ms", "{:.0f}"),
    ("latency p50 (ms)", "latency_p50_ms", "{:.0f}"),
    ("latency p99 (ms)", "latency_p99_ms", "{:.0f}"),
    ("throughput (req/s)", "throughput_rps", "{:.2f}"),
    ("wall time (s)", "seconds", "{:.1f}"),
    ("router CPU ms/req", "router_cpu_ms_per_req", "{:.2f}"),
    ("  same, net of idle", "router_net_cpu_ms_per_req", "{:.2f}"),
    ("Envoy CPU ms/req", "proxy_cpu_ms_per_req", "{:.2f}"),
    ("routing tier CPU ms/req", "routing_cpu_ms_per_req", "{:.2f}"),
)


def _cell(value: Any, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def table_rows(results: list[dict[str, Any]]) -> list[list[str]]:
    rows = [["", *(r["run"] for r in results)]]
    for label, key, fmt in _ROWS:
        rows.append([label, *(_cell(r.get(key), fmt) for r in results)])
    servers = sorted({a for r in results for a in r["server_share"]})
    for i, address in enumerate(servers):
        rows.append(
            [
                f"share server {i + 1}",
                *(f"{r['server_share'].get(address, 0):.0%}" for r in results),
            ]
        )
    return rows


def format_table(results: list[dict[str, Any]]) -> str:
    return aligned_table(table_rows(results))


def format_markdown(results: list[dict[str, Any]]) -> str:
    rows = table_rows(results)
    out = ["| " + " | ".join(rows[0]) + " |", "|---" + "|---:" * (len(rows[0]) - 1) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    return "\n".join(out)


def plot(path: str, doc: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = doc["results"]
    kinds = [k for k in WORKLOADS if any(r["workload"] == k for r in results)]
    runs = [r for r in RUNS + EXTRA_RUNS if any(x["run"] == r for x in results)]
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.2))
    panels = (
        ("vLLM prefix-cache hit ratio", "hit_ratio", None),
        ("client TTFT p50 (ms)", "ttft_p50_ms", "ttft_p99_ms"),
        ("end-to-end latency p50 (ms)", "latency_p50_ms", "latency_p99_ms"),
        ("routing-tier CPU per request (ms)", "routing_cpu_ms_per_req", None),
    )
    width = 0.8 / max(1, len(kinds))
    for ax, (title, key, high) in zip(axes, panels, strict=True):
        for k, kind in enumerate(kinds):
            xs, ys, tops = [], [], []
            for i, run in enumerate(runs):
                row = next((r for r in results if r["run"] == run and r["workload"] == kind), None)
                if row is None or row.get(key) is None:
                    continue
                xs.append(i + (k - (len(kinds) - 1) / 2) * width)
                ys.append(row[key])
                tops.append(row[high] if high else None)
            bars = ax.bar(xs, ys, width, label=kind)
            if high:
                ax.scatter(xs, tops, marker="_", s=120, color=bars.patches[0].get_facecolor())
        ax.set_title(title + (" (dash: p99)" if high else ""), fontsize=9)
        ax.set_xticks(range(len(runs)))
        ax.set_xticklabels(runs, rotation=30, ha="right", fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(doc.get("title", "live benchmark"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=2, help="vLLM servers (one per core)")
    parser.add_argument(
        "--runs",
        default=",".join(RUNS),
        help=f"comma list of {','.join(RUNS + EXTRA_RUNS)} (default: {','.join(RUNS)})",
    )
    parser.add_argument(
        "--workloads", default=",".join(WORKLOADS), help=f"comma list of {','.join(WORKLOADS)}"
    )
    c, g = ChatWorkload(), GroupWorkload()
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4, help="concurrent clients")
    parser.add_argument("--system-words", type=int, default=c.system_prompt_words)
    parser.add_argument("--first-words", type=int, default=c.first_message_words)
    parser.add_argument("--followup-words", type=int, default=c.followup_words)
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request")
    parser.add_argument("--groups", type=int, default=g.groups)
    parser.add_argument("--questions", type=int, default=g.questions, help="per group")
    parser.add_argument("--prefix-words", type=int, default=g.prefix_words)
    parser.add_argument("--kv-blocks", type=int, default=None, help="vLLM KV blocks per server")
    parser.add_argument(
        "--max-num-seqs",
        type=_slot_counts,
        default=[16],
        help="vLLM batch slots (max_num_seqs): one count for every server, or a comma list "
        "with one per server, e.g. 4,16",
    )
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--routing",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a routing setting of this project's routers (repeatable), e.g. "
        "stickiness=2; checked as the server checks --set routing.KEY=VALUE",
    )
    parser.add_argument("--run-timeout", type=float, default=300.0, help="limit per run (s)")
    parser.add_argument("--json", dest="json_out", help="write results as JSON here")
    parser.add_argument("--plot", help="write a PNG here")
    parser.add_argument("--markdown", help="write the tables as Markdown here")
    parser.add_argument("--logs", help="keep every process log in this directory")


def _slot_counts(spec: str) -> list[int]:
    try:
        counts = [int(part) for part in spec.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of integers: {spec!r}") from None
    if any(count < 1 for count in counts):
        raise argparse.ArgumentTypeError(f"batch slots must be at least 1: {spec!r}")
    return counts


def _split(spec: str, allowed: Sequence[str], what: str) -> list[str]:
    names = [s.strip() for s in spec.split(",") if s.strip()]
    bad = [n for n in names if n not in allowed]
    if bad:
        raise SystemExit(f"unknown {what} {bad}; choose from {', '.join(allowed)}")
    return names


def _commit() -> str:
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=lab.REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    return "unknown"


def run(args: argparse.Namespace) -> int:
    lab.sigterm_as_interrupt()  # Ctrl-C or SIGTERM: every server and router is stopped
    runs = _split(args.runs, RUNS + EXTRA_RUNS, "runs")
    kinds = _split(args.workloads, WORKLOADS, "workloads")
    routing = routing_overrides(args.routing)
    router_args = routing_set_args(routing)
    try:
        slots = lab.per_server(args.max_num_seqs, args.replicas, "--max-num-seqs")
    except ValueError as error:
        raise SystemExit(str(error)) from None
    chat = ChatWorkload(
        conversations=args.conversations,
        turns=args.turns,
        concurrency=args.concurrency,
        system_prompt_words=args.system_words,
        first_message_words=args.first_words,
        followup_words=args.followup_words,
        max_tokens=args.max_tokens,
        model=lab.SERVED_MODEL_NAME,
        seed=args.seed,
    )
    groups = GroupWorkload(
        groups=args.groups,
        questions=args.questions,
        concurrency=args.concurrency,
        prefix_words=args.prefix_words,
        max_tokens=args.max_tokens,
        seed=args.seed + 4,
    )
    # Prepare everything before any clock starts.
    python = lab.ensure_vllm_env()
    model_dir = lab.ensure_model(python)
    if "sglang" in runs:
        ensure_peer(SGLANG_ROUTER)
    if "vllm_router" in runs:
        ensure_peer(VLLM_ROUTER)
    logs = Path(args.logs) if args.logs else None
    started = time.monotonic()
    results: list[dict[str, Any]] = []
    with Stack(workdir=logs) as stack:
        assert stack.workdir is not None
        vllm_extra = ["--enable-scale-out"] if "vllm_router" in runs else []
        events_dir = stack.workdir / "kv-events" if "prefix_k2_events" in runs else None
        events_args = []
        if events_dir is not None:
            events_dir.mkdir(parents=True, exist_ok=True)
            events_args = lab.router_kv_events_args(events_dir, model_dir)
        # uvicorn access log on: it shows whether vllm-router called /render.
        with lab.vllm_servers(
            args.replicas,
            stack.workdir / "vllm",
            kv_blocks=args.kv_blocks,
            extra_args=vllm_extra,
            access_log=True,
            max_num_seqs=slots,
            kv_events_dir=events_dir,
        ) as servers:
            addresses = [s.address for s in servers]
            warm_up(addresses, lab.SERVED_MODEL_NAME)
            for kind in kinds:
                for name in runs:
                    renders_before = count_render_calls([s.log_path for s in servers])
                    with start_target(
                        stack, name, addresses, model_dir, router_args, events_args
                    ) as target:
                        row = measured_run(target, kind, chat, groups, addresses, args.run_timeout)
                    row["render_calls"] = (
                        count_render_calls([s.log_path for s in servers]) - renders_before
                    )
                    results.append(row)
                    print(
                        f"{name:>15} {kind:6}: hit {row['hit_ratio']:.3f}, "
                        f"TTFT p50 {row['ttft_p50_ms']:.0f} ms, errors {row['errors']}, "
                        f"rules {row['rules'] or '-'}",
                        file=sys.stderr,
                    )
    doc: dict[str, Any] = {
        "title": (
            f"{args.replicas} vLLM CPU servers (tiny Llama), {args.concurrency} clients, "
            f"streaming; hit ratio from vLLM's own counters"
        ),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": _commit(),
        "machine": f"{os.cpu_count()} cores, no GPU",
        "command": "prefix-router bench live " + " ".join(sys.argv[sys.argv.index("live") + 1 :])
        if "live" in sys.argv
        else " ".join(sys.argv),
        "vllm": lab.VLLM_VERSION,
        "peers": [SGLANG_ROUTER, VLLM_ROUTER],
        "chat_workload": asdict(chat),
        "group_workload": asdict(groups),
        "kv_blocks": args.kv_blocks,
        "routing": routing,
        "max_num_seqs": slots[0] if len(set(slots)) == 1 else slots,
        "wall_seconds": round(time.monotonic() - started, 1),
        "results": results,
    }
    for kind in kinds:
        rows = [r for r in results if r["workload"] == kind]
        print(f"\nworkload {kind}:")
        print(format_table(rows))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json_out}")
    if args.markdown:
        parts = [
            f"**{kind}**\n\n" + format_markdown([r for r in results if r["workload"] == kind])
            for kind in kinds
        ]
        Path(args.markdown).write_text("\n\n".join(parts) + "\n")
        print(f"wrote {args.markdown}")
    if args.plot:
        plot(args.plot, doc)
        print(f"wrote {args.plot}")
    return 1 if any(r["errors"] for r in results) else 0
