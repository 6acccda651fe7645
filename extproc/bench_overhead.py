"""`prefix-router bench overhead`: the cost of being in the request path, side by side.

Upstreams that answer at once (a second Envoy whose listeners reply with a fixed JSON body
as soon as the whole request arrived, so only the proxy path is measured), loaded by `wrk`
(Debian package; installed with apt-get when missing) in closed loop at fixed connections and
duration, with chat bodies of realistic sizes (512 distinct conversations behind one system
prompt, so routers see real prompts).

Configurations (``--configs``, comma list of names or of the groups in brackets):

* ``envoy_direct`` [direct]: Envoy round robin, no ext_proc;
* ``noop_buffered`` [noop]: Envoy + ``extproc.noop_processor``, a Python ``grpc.aio``
  ext_proc service that answers every message with the empty response of its kind, in the
  BUFFERED router's Envoy config (same filter, same processing modes): the floor any Python
  ext_proc service pays, so the gap to ``buffered_w1`` is the routing work;
* ``buffered_w1``/``buffered_w2`` [buffered], ``full_duplex_w1``/``full_duplex_w2`` [duplex]:
  Envoy + this router, ext_proc BUFFERED or FULL_DUPLEX_STREAMED, 1 or 2 worker processes;
* ``sglang``, ``vllm_router`` [peers]: the Rust routers of PyPI ``sglang-router`` and
  ``vllm-router`` (versions pinned in ``extproc.bench_live``) with ``--policy cache_aware``,
  in place of Envoy (they are the proxy), installed once into cached venvs and started by
  ``bench_live.start_peer``.

What the peers call on the upstreams, and what the instant upstreams answer:

* sglang-router 0.3.2: at start ``GET /health``, a gRPC ``HealthCheck`` POST for SGLang's and
  vLLM's gRPC services (to tell gRPC from HTTP workers; the plain 200 answer is not gRPC, so
  the workers count as HTTP), ``GET /server_info`` and ``GET /model_info`` (model discovery:
  the fixed JSON carries no model, the workers register as model "unknown", which serves any
  model and gets the default cache_aware policy; no tokenizer is loaded), then ``GET /health``
  periodically. Per request only the request itself: its cache-aware tree is built from the
  request text, no upstream call.
* vllm-router 0.1.17: ``GET /health`` at start and every 60 s; per request
  ``POST /v1/chat/completions/render`` on *every* worker (vLLM's render endpoint, served with
  ``--enable-scale-out``, returns the tokenised request as a ``GenerateRequest`` JSON with
  ``token_ids``), then the request. Without valid ``token_ids`` it routes without its prefix
  tree (its metric ``vllm_router_prefix_routing_decisions_total{outcome="missing_tokens"}``),
  so the upstreams answer render with a Lua filter: one token per 4 body bytes (about a BPE
  tokenizer's ratio on English), 12 tokens shared by all requests, one token for the
  conversation number, then a repeating 6-token filler (as the text's filler repeats), so its
  prefix tree sees the same structure as the text. The Lua filter is off on every other route.

Reported per cell: req/s, p50/p99/p99.9 latency (wrk), CPU-seconds per 1,000 requests and
RSS of the router's process tree (our router, the no-op processor, or the peer router, which
is also the proxy), CPU of the front Envoy (none for the peers) and their sum (the routing
tier), requests that Envoy let through without an ext_proc answer (``failure_mode_allow``),
the peers' own routing-decision counters (JSON), wrk's own CPU share (near 100 % = the client
was the bottleneck) and the machine's busy share. CPU is read from ``/proc/<pid>/stat`` (utime
+ stime of the living processes of the tree). req/s is shown in parentheses when fewer than 3
requests per connection finished in the cell (too short a cell for that load).
``--cpu-hogs 0,4`` measures each cell again beside that many busy loops (processes of the
same priority, each ending on its own a few seconds after the cell): what a router starved
of CPU by its neighbours costs, in latency and in requests Envoy lets through unrouted when
the router's answer takes longer than ``message_timeout`` (``f.open``).
``--router-cpu-limits none,0.25`` measures each cell again with the router's processes (or
the no-op processor's, or a peer router's) under that CPU limit in cores, a cgroup's CFS
quota as Kubernetes' ``limits.cpu`` sets it (extproc/cpu_limit.py; needs root), and reports
the periods it was throttled in (``thr.``).
Every configuration is first checked with one request whose reply body must be the upstream's.
All configurations run side by side and each cell is measured for each of them in turn, so a
background job on a shared machine slows them alike (idle configurations cost next to nothing).
Table + JSON + Markdown + PNG. Everything binds 127.0.0.1; every run is bounded by --duration.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from . import bench_live, envoyconf
from .cpu_limit import CpuLimit, CpuLimitUnavailable
from .stack import LOOPBACK, ManagedProcess, Stack, envoy_binary, free_port, wait_for_port

KIB = 1024
MIB = 1024 * KIB
# A request still unanswered after this counts as an error (wrk's timeout). Long enough for
# 64 connections queued behind a proxy that needs ~60 ms per 1 MiB request.
WRK_TIMEOUT_S = 15
_WRK_SCRIPT = """
counter = 0
local body_size = %(size)d
local filler = string.sub(
  string.rep("lorem ipsum dolor sit amet ", math.ceil(body_size / 27)), 1, body_size - 160)
request = function()
  counter = counter + 1
  local conversation = counter %% 512
  local body = '{"model":"demo-model","max_tokens":1,"messages":[' ..
    '{"role":"system","content":"You are a helpful assistant."},' ..
    '{"role":"user","content":"conversation ' .. conversation .. ' ' .. filler .. '"}]}'
  return wrk.format("POST", "/v1/chat/completions",
    {["Content-Type"] = "application/json"}, body)
end
done = function(summary, latency, requests)
  io.write(string.format(
    'WRK_JSON {"requests":%%d,"errors":%%d,"duration_us":%%d,' ..
    '"p50_us":%%d,"p99_us":%%d,"p999_us":%%d,"non2xx":%%d}\\n',
    summary.requests, summary.errors.connect + summary.errors.read + summary.errors.write +
    summary.errors.timeout, summary.duration, latency:percentile(50), latency:percentile(99),
    latency:percentile(99.9), summary.errors.status))
end
"""
UPSTREAM_BODY = (
    '{"id":"x","object":"chat.completion","choices":[{"index":0,'
    '"message":{"role":"assistant","content":"ok"}}]}'
)
RENDER_PATH = "/v1/chat/completions/render"
# vLLM's render answer (a GenerateRequest) for vllm-router's cache-aware policy; see above.
_RENDER_LUA = """
function envoy_on_request(handle)
  local body = handle:body()
  local size = 0
  local head = ""
  if body ~= nil then
    size = body:length()
    head = body:getBytes(0, math.min(size, 1024))
  end
  local conversation = tonumber(string.match(head, "conversation (%d+)")) or 0
  local count = math.max(16, math.floor(size / 4))
  local filler = string.rep("3001,3002,3003,3004,3005,3006,", math.floor((count - 14) / 6))
  local ids = string.rep("9001,", 12) .. tostring(20000 + conversation) .. "," ..
    filler .. string.rep("12345,", (count - 14) % 6) .. "2"
  handle:respond({[":status"] = "200", ["content-type"] = "application/json"},
    '{"request_id":"render","token_ids":[' .. ids .. '],' ..
    '"sampling_params":{"max_tokens":1},"model":"demo-model","stream":false}')
end
"""
_LUA = "envoy.filters.http.lua"
_LUA_TYPE = "type.googleapis.com/envoy.extensions.filters.http.lua.v3."


@dataclass(frozen=True)
class Config:
    name: str
    kind: str  # "direct" | "noop" | "router" | "peer"
    body_mode: str | None = None
    workers: int = 0


CONFIGS = [
    Config("envoy_direct", "direct"),
    Config("noop_buffered", "noop", "buffered", 1),
    Config("buffered_w1", "router", "buffered", 1),
    Config("buffered_w2", "router", "buffered", 2),
    Config("full_duplex_w1", "router", "full_duplex_streamed", 1),
    Config("full_duplex_w2", "router", "full_duplex_streamed", 2),
    Config("sglang", "peer"),
    Config("vllm_router", "peer"),
]
GROUPS = {
    "all": [c.name for c in CONFIGS],
    "direct": ["envoy_direct"],
    "noop": ["noop_buffered"],
    "buffered": ["buffered_w1", "buffered_w2"],
    "duplex": ["full_duplex_w1", "full_duplex_w2"],
    "router": ["buffered_w1", "buffered_w2", "full_duplex_w1", "full_duplex_w2"],
    "peers": ["sglang", "vllm_router"],
}


def select_configs(spec: str) -> list[Config]:
    """Configs named in ``spec`` (names or groups, comma list), in the canonical order."""
    wanted: set[str] = set()
    names = {c.name for c in CONFIGS}
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        if item in GROUPS:
            wanted.update(GROUPS[item])
        elif item in names:
            wanted.add(item)
        else:
            choices = ", ".join([*GROUPS, *names])
            raise SystemExit(f"bench overhead: unknown config {item!r}; choose from {choices}")
    return [c for c in CONFIGS if c.name in wanted]


def ensure_wrk() -> str:
    path = shutil.which("wrk")
    if path:
        return path
    if os.geteuid() == 0 and shutil.which("apt-get"):
        print("installing wrk (Debian package)...", file=sys.stderr)
        install = ["apt-get", "install", "-y", "-qq", "wrk"]
        if subprocess.run(install, capture_output=True).returncode != 0:
            subprocess.run(["apt-get", "update", "-qq"], check=True)  # fresh package lists
            subprocess.run(install, check=True, capture_output=True)
        path = shutil.which("wrk")
    if not path:
        raise SystemExit("bench overhead needs wrk: apt-get install wrk")
    return path


def _lua_off() -> dict[str, Any]:
    return {_LUA: {"@type": _LUA_TYPE + "LuaPerRoute", "disabled": True}}


def instant_upstreams(count: int) -> tuple[dict[str, Any], list[str]]:
    """An Envoy bootstrap whose listeners answer at once: ``/health`` 200, vLLM's render
    endpoint with token ids (Lua), everything else with a small chat-completion JSON."""
    listeners, addresses = [], []
    for i in range(count):
        port = free_port()
        addresses.append(f"{LOOPBACK}:{port}")
        routes = [
            {
                "match": {"path": "/health"},
                "direct_response": {"status": 200},
                "typed_per_filter_config": _lua_off(),
            },
            # The Lua filter answers it; the route only has to exist (and enable Lua).
            {"match": {"path": RENDER_PATH}, "direct_response": {"status": 500}},
            {
                "match": {"prefix": "/"},
                "direct_response": {"status": 200, "body": {"inline_string": UPSTREAM_BODY}},
                "typed_per_filter_config": _lua_off(),
            },
        ]
        manager = {
            "@type": "type.googleapis.com/envoy.extensions.filters."
            "network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": f"upstream{i}",
            "route_config": {
                "virtual_hosts": [
                    {
                        "name": "all",
                        "domains": ["*"],
                        "routes": routes,
                    }
                ]
            },
            "http_filters": [
                # Answer only once the whole request arrived, as a model server does. Without
                # it a direct_response goes out while a large body is still arriving, and
                # Envoy then resets the stream and closes the connection: every 32 KiB+
                # request would cost the proxy a new upstream connection. Its limit also
                # lets the Lua filter read 1 MiB+ bodies (413 above the 1 MiB default).
                {
                    "name": "envoy.filters.http.buffer",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http."
                        "buffer.v3.Buffer",
                        "max_request_bytes": 64 * MIB,
                    },
                },
                {
                    "name": _LUA,
                    "typed_config": {
                        "@type": _LUA_TYPE + "Lua",
                        "default_source_code": {"inline_string": _RENDER_LUA},
                    },
                },
                {
                    "name": "envoy.filters.http.router",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions."
                        "filters.http.router.v3.Router"
                    },
                },
            ],
        }
        listeners.append(
            {
                "name": f"upstream{i}",
                "address": {"socket_address": {"address": LOOPBACK, "port_value": port}},
                "filter_chains": [
                    {
                        "filters": [
                            {
                                "name": "envoy.filters.network.http_connection_manager",
                                "typed_config": manager,
                            }
                        ]
                    }
                ],
            }
        )
    admin = {"address": {"socket_address": {"address": LOOPBACK, "port_value": free_port()}}}
    return {"admin": admin, "static_resources": {"listeners": listeners}}, addresses


def _cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime + stime
        except (OSError, IndexError, ValueError):
            continue
    return total / os.sysconf("SC_CLK_TCK")


def _rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except (OSError, ValueError):
            continue
    return total / 1024


def _process_tree(pid: int) -> list[int]:
    pids, frontier = [pid], [pid]
    while frontier:
        parent = frontier.pop()
        try:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            continue
        for child in children:
            pids.append(int(child))
            frontier.append(int(child))
    return pids


def _machine_ticks() -> tuple[int, int, int]:
    """(busy, stolen, total) jiffies of all CPUs since boot (/proc/stat). Busy includes
    softirq time, where the kernel does most loopback TCP work; stolen is the hypervisor's."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    values += [0] * (8 - len(values))
    idle = values[3] + values[4]  # idle + iowait
    steal = values[7]
    total = sum(values[:8])  # guest time is already counted in user
    return total - idle - steal, steal, total


def run_wrk(wrk: str, port: int, size: int, connections: int, duration: float) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(_WRK_SCRIPT % {"size": size})
    usage_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        out = subprocess.run(
            [
                wrk,
                "-t1",
                f"-c{connections}",
                f"-d{max(1, round(duration))}s",
                "--timeout",
                f"{WRK_TIMEOUT_S}s",
                "-s",
                script.name,
                f"http://{LOOPBACK}:{port}",
            ],
            capture_output=True,
            text=True,
            timeout=duration + 30,
            check=True,
        ).stdout
    finally:
        os.unlink(script.name)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    wrk_cpu = (usage.ru_utime - usage_before.ru_utime) + (usage.ru_stime - usage_before.ru_stime)
    line = next(line for line in out.splitlines() if line.startswith("WRK_JSON "))
    data = json.loads(line.removeprefix("WRK_JSON "))
    seconds = data["duration_us"] / 1e6
    return {
        "requests": data["requests"],
        "errors": data["errors"] + data["non2xx"],
        "req_per_s": round(data["requests"] / seconds, 1),
        "p50_ms": data["p50_us"] / 1000,
        "p99_ms": data["p99_us"] / 1000,
        "p999_ms": data["p999_us"] / 1000,
        "wrk_cpu_pct": round(100 * wrk_cpu / seconds, 1),
    }


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def ext_proc_stats(admin_port: int) -> dict[str, int]:
    """Envoy's ext_proc filter counters (``http.<prefix>.ext_proc.<name>``), by name."""
    text = _get(f"http://{LOOPBACK}:{admin_port}/stats?filter=ext_proc")
    out: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        if ".ext_proc." in name and value.strip().isdigit():
            key = name.rsplit(".ext_proc.", 1)[1]
            out[key] = out.get(key, 0) + int(value)
    return out


def check_reply(port: int) -> str:
    """One chat request through the configuration: the reply must be the upstream's body."""
    body = json.dumps(
        {"model": "demo-model", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    ).encode()
    request = urllib.request.Request(
        f"http://{LOOPBACK}:{port}/v1/chat/completions",
        data=body,
        headers={"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            status, reply = response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        status, reply = exc.code, exc.read().decode(errors="replace")
    if status != 200 or json.loads(reply or "null") != json.loads(UPSTREAM_BODY):
        raise RuntimeError(f"port {port}: expected the upstream's reply, got {status} {reply!r}")
    return reply


def peer_decisions(metrics_port: int) -> dict[str, float]:
    """The peer's own routing counters: proof that its cache-aware policy ran."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    text = _get(f"http://{LOOPBACK}:{metrics_port}/metrics")
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm_router_prefix_routing_decisions_total":
                key = f"{sample.labels.get('policy')}:{sample.labels.get('outcome')}"
            elif sample.name == "smg_worker_selection_total":
                key = f"{sample.labels.get('policy')}:selected"
            else:
                continue
            out[key] = out.get(key, 0.0) + sample.value
    return out


@dataclass
class Running:
    """One configuration, started: where wrk sends, which processes to measure."""

    config: Config
    port: int
    router: ManagedProcess | None = None  # router / no-op processor / peer router
    envoy: ManagedProcess | None = None
    envoy_admin: int | None = None
    peer: Any = None  # bench_live.Peer
    processes: list[ManagedProcess] = field(default_factory=list)
    cpu_limit: CpuLimit | None = None  # the router's processes' cgroup (--router-cpu-limits)


def start_config(stack: Stack, config: Config, upstreams: list[str]) -> Running:
    if config.kind == "peer":
        peer = bench_live.start_peer(stack, config.name, upstreams)
        return Running(config, peer.port, router=peer.proc, peer=peer, processes=[peer.proc])
    router = None
    router_address = f"{LOOPBACK}:{free_port()}"  # unused by envoy_direct
    if config.kind == "router":
        assert config.body_mode is not None
        router_address, router = stack.start_router(
            upstreams,
            body_mode=config.body_mode,
            workers=config.workers,
            extra_args=["--set", "health.enabled=false", "--set", "signals.enabled=false"],
            name=f"router-{config.name}",
        )
    elif config.kind == "noop":
        router_address, router = stack.start_noop_processor(f"processor-{config.name}")
    port, admin = free_port(), free_port()
    options = envoyconf.EnvoyOptions(
        mode="round-robin" if config.kind == "direct" else "override-host",
        endpoints=upstreams,
        listen=f"{LOOPBACK}:{port}",
        admin=f"{LOOPBACK}:{admin}",
        router=router_address,
        body_mode=config.body_mode or "buffered",  # type: ignore[arg-type]
        health_check_path="",
    )
    _, envoy = stack.start_envoy(options, name=f"envoy-{config.name}")
    processes = [envoy] + ([router] if router else [])
    return Running(config, port, router, envoy, admin, processes=processes)


def _wait_ext_proc_healthy(running: Running, timeout: float = 10.0) -> None:
    """Envoy opens ext_proc streams only once its gRPC health check found the processor
    SERVING (fail open before that): wait until a request really opens a stream."""
    if running.envoy_admin is None or running.config.kind == "direct":
        return
    deadline = time.monotonic() + timeout
    while True:
        before = ext_proc_stats(running.envoy_admin).get("streams_started", 0)
        check_reply(running.port)
        if ext_proc_stats(running.envoy_admin).get("streams_started", 0) > before:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{running.config.name}: Envoy never opened an ext_proc stream")
        time.sleep(0.2)


# A busy loop that ends by itself (a run killed before it stops them leaves nothing behind).
_HOG = "import time, sys\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end: pass"


def start_cpu_hogs(count: int, seconds: float) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", _HOG, str(seconds)]) for _ in range(count)]


def stop_cpu_hogs(hogs: list[subprocess.Popen[bytes]]) -> None:
    for hog in hogs:
        hog.kill()
    for hog in hogs:
        hog.wait()


def measure_cell(
    wrk: str,
    running: Running,
    upstream_pid: int,
    size: int,
    conns: int,
    duration: float,
    cpu_hogs: int = 0,
    cpu_limit: float | None = None,
) -> dict[str, Any]:
    router_pids = _process_tree(running.router.process.pid) if running.router else []
    envoy_pids = [running.envoy.process.pid] if running.envoy else []
    assert all(p.process is not None for p in running.processes)
    ext_proc = running.envoy_admin is not None and running.config.kind in ("noop", "router")
    stats_before = ext_proc_stats(running.envoy_admin) if ext_proc else {}
    router_before, envoy_before = _cpu_seconds(router_pids), _cpu_seconds(envoy_pids)
    upstream_before = _cpu_seconds([upstream_pid])
    peer = running.peer
    decisions_before = peer_decisions(peer.metrics_port) if peer is not None else {}
    if running.cpu_limit is not None:
        running.cpu_limit.set(cpu_limit)
        throttled_before = running.cpu_limit.throttled()
    hogs = start_cpu_hogs(cpu_hogs, duration + 5.0)
    try:
        busy_before, steal_before, total_before = _machine_ticks()
        result = run_wrk(wrk, running.port, size, conns, duration)
        busy, steal, total = _machine_ticks()
    finally:
        stop_cpu_hogs(hogs)
    ticks = max(1, total - total_before)
    router_cpu = _cpu_seconds(router_pids) - router_before
    envoy_cpu = _cpu_seconds(envoy_pids) - envoy_before
    upstream_cpu = _cpu_seconds([upstream_pid]) - upstream_before
    n = max(result["requests"], 1)
    row: dict[str, Any] = {
        "config": running.config.name,
        # When (UTC): to match a noisy cell with what else ran on a shared machine.
        "at": datetime.datetime.now(datetime.UTC).strftime("%H:%M:%S"),
        "body_bytes": size,
        "connections": conns,
        "cpu_hogs": cpu_hogs,
        "router_cpu_limit": cpu_limit,
        **result,
        "router_cpu_s_per_1k": round(router_cpu / n * 1000, 3),
        "envoy_cpu_s_per_1k": round(envoy_cpu / n * 1000, 3) if envoy_pids else None,
        "tier_cpu_s_per_1k": round((router_cpu + envoy_cpu) / n * 1000, 3),
        "upstream_cpu_s_per_1k": round(upstream_cpu / n * 1000, 3),
        "router_rss_mib": round(_rss_mib(router_pids), 1),
        "envoy_rss_mib": round(_rss_mib(envoy_pids), 1) if envoy_pids else None,
        "machine_busy_pct": round(100 * (busy - busy_before) / ticks, 1),
        "machine_steal_pct": round(100 * (steal - steal_before) / ticks, 1),
    }
    if running.cpu_limit is not None:
        periods, seconds = running.cpu_limit.throttled()
        row["throttled_periods"] = periods - throttled_before[0]
        row["throttled_s"] = round(seconds - throttled_before[1], 3)
    if result["requests"] < 3 * conns:
        # Closed loop: each connection should finish a few requests for the figures to mean
        # anything; requests still in flight when wrk stops are not counted at all.
        row["few_requests"] = True
    if peer is not None:
        after = peer_decisions(peer.metrics_port)
        row["peer_decisions"] = {k: v - decisions_before.get(k, 0) for k, v in after.items()}
    if ext_proc:
        stats = ext_proc_stats(running.envoy_admin)
        delta = {k: v - stats_before.get(k, 0) for k, v in stats.items()}
        row["ext_proc_streams"] = delta.get("streams_started", 0)
        # Requests Envoy let through without the processor's answer (failure_mode_allow).
        row["failed_open"] = delta.get("failure_mode_allowed", 0)
        row["message_timeouts"] = delta.get("message_timeouts", 0)
    return row


_COLUMNS = (
    # header, width, key, format
    ("config", 15, "config", "{}"),
    ("body", 6, "body_bytes", None),
    ("conns", 6, "connections", "{}"),
    ("hogs", 5, "cpu_hogs", "{}"),
    ("limit", 6, "router_cpu_limit", "{:g}"),
    ("req/s", 8, "req_per_s", "{:.0f}"),
    ("p50 ms", 8, "p50_ms", "{:.2f}"),
    ("p99 ms", 8, "p99_ms", "{:.2f}"),
    ("p99.9", 8, "p999_ms", "{:.2f}"),
    ("cpu s/1k", 9, "router_cpu_s_per_1k", "{:.3f}"),
    ("envoy", 7, "envoy_cpu_s_per_1k", "{:.3f}"),
    ("tier", 9, "tier_cpu_s_per_1k", "{:.3f}"),
    ("rss MiB", 8, "router_rss_mib", "{:.0f}"),
    ("err", 5, "errors", "{}"),
    ("f.open", 7, "failed_open", "{}"),
    ("thr.", 6, "throttled_periods", "{}"),
    ("wrk %", 6, "wrk_cpu_pct", "{:.0f}"),
    ("busy %", 7, "machine_busy_pct", "{:.0f}"),
)


def _size(value: int) -> str:
    return f"{value // MIB}Mi" if value >= MIB and value % MIB == 0 else f"{value // KIB}Ki"


def _cell(row: dict[str, Any], key: str, fmt: str | None) -> str:
    value = row.get(key)
    if key == "body_bytes":
        return _size(value or 0)
    if key == "req_per_s" and row.get("few_requests"):
        return f"({value:.0f})"  # too few requests finished in the cell's duration
    if value is None or (key.startswith("router_") and row["config"] == "envoy_direct"):
        return "-"
    assert fmt is not None
    return fmt.format(value)


def format_row(row: dict[str, Any]) -> str:
    parts = []
    for i, (_, width, key, fmt) in enumerate(_COLUMNS):
        text = _cell(row, key, fmt)
        parts.append(f"{text:<{width}}" if i == 0 else f"{text:>{width}}")
    return "".join(parts)


def format_header() -> str:
    return "".join(
        f"{h:<{w}}" if i == 0 else f"{h:>{w}}" for i, (h, w, _, _) in enumerate(_COLUMNS)
    )


def format_markdown(rows: list[dict[str, Any]]) -> str:
    header = "| " + " | ".join(h for h, _, _, _ in _COLUMNS) + " |"
    rule = "|---" + "|---:" * (len(_COLUMNS) - 1) + "|"
    lines = [header, rule]
    for row in rows:
        lines.append("| " + " | ".join(_cell(row, k, f) for _, _, k, f in _COLUMNS) + " |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="2,32,1024", help="body sizes in KiB")
    parser.add_argument("--connections", default="1,16,64")
    parser.add_argument(
        "--extra-cells",
        default="",
        metavar="KIBxCONNS,...",
        help="cells measured after the sizes x connections grid, e.g. 1024x16",
    )
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per cell")
    parser.add_argument(
        "--cpu-hogs",
        default="0",
        metavar="N,...",
        help="measure every cell beside each of these counts of busy-loop processes "
        "(default 0: none)",
    )
    parser.add_argument(
        "--router-cpu-limits",
        default="none",
        metavar="CORES,...",
        help="measure every cell with the router's processes under each of these CPU limits "
        "(cores; 'none': no limit), a cgroup's CFS quota as Kubernetes' limits.cpu sets; "
        "needs root (default none)",
    )
    parser.add_argument(
        "--configs",
        default="all",
        help="comma list of configs ("
        + ", ".join(c.name for c in CONFIGS)
        + ") or groups ("
        + ", ".join(GROUPS)
        + "); default all",
    )
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--markdown", metavar="FILE.md")
    parser.add_argument("--plot", metavar="FILE.png")


def run(args: argparse.Namespace) -> int:
    """SIGTERM ends the run as Ctrl-C does: the processes it started are stopped, and a
    router it limited is let go (it was left throttled in a leftover cgroup)."""

    def exit_on_sigterm(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, exit_on_sigterm)
    try:
        return _run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> int:
    configs = select_configs(args.configs)
    wrk = ensure_wrk()
    cells = [
        (int(size) * KIB, int(conns))
        for size in args.sizes.split(",")
        for conns in args.connections.split(",")
    ]
    for cell in filter(None, args.extra_cells.split(",")):
        size, _, conns = cell.partition("x")
        cells.append((int(size) * KIB, int(conns)))
    try:
        hog_counts = [int(n) for n in args.cpu_hogs.split(",")]
    except ValueError:
        raise SystemExit(f"--cpu-hogs: not a comma list of counts: {args.cpu_hogs!r}") from None
    if any(n < 0 or n > 64 for n in hog_counts):
        raise SystemExit("--cpu-hogs: each count must be 0 to 64")
    try:
        cpu_limits = [None if v == "none" else float(v) for v in args.router_cpu_limits.split(",")]
    except ValueError:
        raise SystemExit(
            f"--router-cpu-limits: not a comma list of cores or 'none': {args.router_cpu_limits!r}"
        ) from None
    if any(v is not None and not 0.01 <= v <= 64 for v in cpu_limits):
        raise SystemExit("--router-cpu-limits: each limit must be 0.01 to 64 cores, or none")
    limited = any(v is not None for v in cpu_limits)
    for config in configs:  # install the peers (once, cached) before any clock starts
        if config.kind == "peer":
            bench_live.ensure_peer(bench_live.PEERS[config.name][0])
    started = time.monotonic()
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    checks: dict[str, dict[str, Any]] = {}
    print(format_header())
    with Stack() as stack:
        bootstrap, upstreams = instant_upstreams(2)
        assert stack.workdir is not None
        upstream_config = stack.workdir / "upstreams.yaml"
        upstream_config.write_text(yaml.safe_dump(bootstrap))
        upstream = stack._spawn(
            "upstreams",
            [
                envoy_binary(),
                "-c",
                str(upstream_config),
                "--disable-hot-restart",
                "--concurrency",
                "1",
                "-l",
                "warning",
            ],
        )
        for address in upstreams:
            wait_for_port(int(address.rsplit(":", 1)[1]), upstream)
        assert upstream.process is not None
        # Every configuration runs side by side (idle ones cost next to nothing) and each
        # cell is measured for all of them in turn: on a shared machine a background job
        # then slows every configuration alike instead of the ones that happened to be last.
        started_configs: list[Running] = []
        try:
            for config in configs:
                running = start_config(stack, config, upstreams)
                started_configs.append(running)
                if limited and running.router is not None:
                    try:
                        running.cpu_limit = CpuLimit(f"prefix-router-bench-{config.name}")
                    except CpuLimitUnavailable as exc:
                        raise SystemExit(f"--router-cpu-limits: {exc}") from None
                    assert running.router.process is not None
                    running.cpu_limit.add(_process_tree(running.router.process.pid))
                _wait_ext_proc_healthy(running)
                check = {"reply": check_reply(running.port)}
                run_wrk(wrk, running.port, 2 * KIB, 4, 1.0)  # warm-up
                if running.peer is not None:
                    check["decisions_after_warm_up"] = peer_decisions(running.peer.metrics_port)
                checks[config.name] = check
            for size, conns in cells:
                for hogs in hog_counts:
                    for cpu_limit in cpu_limits:
                        for running in started_configs:
                            row = measure_cell(
                                wrk,
                                running,
                                upstream.process.pid,
                                size,
                                conns,
                                args.duration,
                                hogs,
                                cpu_limit,
                            )
                            rows.append(row)
                            print(format_row(row), flush=True)
            for running in started_configs:
                if running.peer is not None:
                    checks[running.config.name]["decisions"] = peer_decisions(
                        running.peer.metrics_port
                    )
        finally:
            for running in reversed(started_configs):
                if running.cpu_limit is not None:
                    running.cpu_limit.close()
                for proc in running.processes:
                    stack.stop(proc)
    order = {c.name: i for i, c in enumerate(configs)}
    rows.sort(key=lambda r: order[r["config"]])  # stable: cells stay in measured order
    document = {
        "command": "prefix-router bench overhead " + " ".join(sys.argv[3:]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": bench_live._commit(),
        "machine": f"{os.cpu_count()} cores",
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "wall_seconds": round(time.monotonic() - started, 1),
        "duration_s": args.duration,
        "peers": [bench_live.SGLANG_ROUTER, bench_live.VLLM_ROUTER],
        "checks": checks,
        "rows": rows,
    }
    missing = {
        name: c["decisions"]
        for name, c in checks.items()
        if any(k.endswith(":missing_tokens") and v for k, v in c.get("decisions", {}).items())
    }
    if missing:
        print(f"warning: peer routed without its prefix tree: {missing}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(format_markdown(rows) + "\n")
    if args.plot:
        plot(rows, args.plot)
    # Beside busy loops or under a limit requests let through unrouted are what is
    # measured, not a fault.
    failed = [
        r
        for r in rows
        if r["errors"]
        or (r.get("failed_open") and not r["cpu_hogs"] and r["router_cpu_limit"] is None)
    ]
    return 1 if failed else 0


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # (The plot shows one setting of busy loops and limit: none of either, else the first's.)
    def setting(row: dict[str, Any]) -> tuple[int, float | None]:
        return row.get("cpu_hogs", 0), row.get("router_cpu_limit")

    shown = (0, None) if any(setting(r) == (0, None) for r in rows) else setting(rows[0])
    rows = [r for r in rows if setting(r) == shown]
    sizes = sorted({r["body_bytes"] for r in rows})
    fig, axes = plt.subplots(2, len(sizes), figsize=(5 * len(sizes), 7.5), squeeze=False)
    styles = {"direct": ("k", "-"), "noop": ("grey", ":"), "peer": (None, "--")}
    kinds = {c.name: c.kind for c in CONFIGS}
    panels = (("req_per_s", "req/s"), ("tier_cpu_s_per_1k", "routing-tier CPU s / 1k req"))
    for column, size in enumerate(sizes):
        for line, (key, label) in enumerate(panels):
            ax = axes[line][column]
            for config in dict.fromkeys(r["config"] for r in rows):
                points = [r for r in rows if r["config"] == config and r["body_bytes"] == size]
                color, style = styles.get(kinds.get(config, ""), (None, "-"))
                ax.plot(
                    [p["connections"] for p in points],
                    [p[key] for p in points],
                    marker="o",
                    color=color,
                    linestyle=style,
                    label=config,
                )
            ax.set_title(f"{_size(size)}B bodies", fontsize=10)
            ax.set_xlabel("connections")
            ax.set_ylabel(label)
            ax.set_xscale("log", base=2)
            if key != "req_per_s":
                ax.set_yscale("log")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
