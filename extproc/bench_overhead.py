"""`prefix-router bench overhead`: the cost of being in the request path, side by side.

A real Envoy in front of upstreams that answer at once (a second Envoy whose listeners reply
with a fixed JSON body, so only the proxy path is measured), loaded by `wrk` (Debian package;
installed with apt-get when missing) in closed loop at fixed connections and duration, with
chat bodies of realistic sizes (distinct conversations, so the router hashes real prompts).
Configurations: Envoy direct (no ext_proc), Envoy + router BUFFERED and FULL_DUPLEX_STREAMED,
each with 1 and 2 router worker processes. Reports req/s, p50/p99/p99.9 latency, router
CPU-seconds per 1,000 requests and router RSS; table + JSON + PNG.
Everything binds 127.0.0.1; every run is bounded by --duration.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from . import envoyconf
from .stack import LOOPBACK, Stack, envoy_binary, free_port, wait_for_port

KIB = 1024
_WRK_SCRIPT = """
counter = 0
local body_size = %(size)d
local filler = string.rep("lorem ipsum dolor sit amet ", math.ceil(body_size / 27))
request = function()
  counter = counter + 1
  local conversation = counter %% 512
  local body = '{"model":"demo-model","max_tokens":1,"messages":[' ..
    '{"role":"system","content":"You are a helpful assistant."},' ..
    '{"role":"user","content":"conversation ' .. conversation .. ' ' ..
    string.sub(filler, 1, body_size - 160) .. '"}]}'
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


def instant_upstreams(count: int) -> tuple[dict[str, Any], list[str]]:
    """An Envoy bootstrap whose listeners answer every request with a small JSON body."""
    body = '{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"}}]}'
    listeners, addresses = [], []
    for i in range(count):
        port = free_port()
        addresses.append(f"{LOOPBACK}:{port}")
        listeners.append(
            {
                "name": f"upstream{i}",
                "address": {"socket_address": {"address": LOOPBACK, "port_value": port}},
                "filter_chains": [
                    {
                        "filters": [
                            {
                                "name": "envoy.filters.network.http_connection_manager",
                                "typed_config": {
                                    "@type": "type.googleapis.com/envoy.extensions.filters."
                                    "network.http_connection_manager.v3.HttpConnectionManager",
                                    "stat_prefix": f"upstream{i}",
                                    "route_config": {
                                        "virtual_hosts": [
                                            {
                                                "name": "all",
                                                "domains": ["*"],
                                                "routes": [
                                                    {
                                                        "match": {"prefix": "/"},
                                                        "direct_response": {
                                                            "status": 200,
                                                            "body": {"inline_string": body},
                                                        },
                                                    }
                                                ],
                                            }
                                        ]
                                    },
                                    "http_filters": [
                                        {
                                            "name": "envoy.filters.http.router",
                                            "typed_config": {
                                                "@type": "type.googleapis.com/envoy.extensions."
                                                "filters.http.router.v3.Router"
                                            },
                                        }
                                    ],
                                },
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


def run_wrk(wrk: str, port: int, size: int, connections: int, duration: float) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(_WRK_SCRIPT % {"size": size})
    try:
        out = subprocess.run(
            [
                wrk,
                "-t1",
                f"-c{connections}",
                f"-d{max(1, round(duration))}s",
                "--timeout",
                "5s",
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
    }


CONFIGS = [
    ("envoy_direct", None, 0),
    ("buffered_w1", "buffered", 1),
    ("buffered_w2", "buffered", 2),
    ("full_duplex_w1", "full_duplex_streamed", 1),
    ("full_duplex_w2", "full_duplex_streamed", 2),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="2,32,1024", help="body sizes in KiB")
    parser.add_argument("--connections", default="1,16,64")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per cell")
    parser.add_argument("--configs", default=",".join(c[0] for c in CONFIGS))
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--plot", metavar="FILE.png")


def run(args: argparse.Namespace) -> int:
    wrk = ensure_wrk()
    sizes = [int(s) * KIB for s in args.sizes.split(",")]
    connections = [int(c) for c in args.connections.split(",")]
    wanted = set(args.configs.split(","))
    rows: list[dict[str, Any]] = []
    header = f"{'config':<16}{'body':>7}{'conns':>6}{'req/s':>9}{'p50 ms':>8}{'p99 ms':>8}{'p99.9':>8}{'cpu s/1k':>9}{'rss MiB':>8}{'err':>5}"
    print(header)
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
        for name, body_mode, workers in CONFIGS:
            if name not in wanted:
                continue
            router_proc = None
            router_address = f"{LOOPBACK}:{free_port()}"
            if body_mode is not None:
                router_address, router_proc = stack.start_router(
                    upstreams,
                    body_mode=body_mode,
                    workers=workers,
                    extra_args=["--set", "health.enabled=false", "--set", "signals.enabled=false"],
                    name=f"router-{name}",
                )
            port = free_port()
            options = envoyconf.EnvoyOptions(
                mode="round-robin" if body_mode is None else "override-host",
                endpoints=upstreams,
                listen=f"{LOOPBACK}:{port}",
                admin=f"{LOOPBACK}:{free_port()}",
                router=router_address,
                body_mode=body_mode or "buffered",
                health_check_path="",
            )
            _, envoy = stack.start_envoy(options, name=f"envoy-{name}")
            run_wrk(wrk, port, 2 * KIB, 4, 1.0)  # warm-up
            for size in sizes:
                for conns in connections:
                    pids = _process_tree(router_proc.process.pid) if router_proc else []
                    cpu_before = _cpu_seconds(pids)
                    result = run_wrk(wrk, port, size, conns, args.duration)
                    cpu = _cpu_seconds(pids) - cpu_before
                    row = {
                        "config": name,
                        "body_bytes": size,
                        "connections": conns,
                        **result,
                        "router_cpu_s_per_1k": round(cpu / max(result["requests"], 1) * 1000, 3)
                        if router_proc
                        else 0.0,
                        "router_rss_mib": round(_rss_mib(pids), 1),
                    }
                    rows.append(row)
                    print(
                        f"{name:<16}{size // KIB:>5}Ki{conns:>6}{row['req_per_s']:>9.0f}"
                        f"{row['p50_ms']:>8.2f}{row['p99_ms']:>8.2f}{row['p999_ms']:>8.2f}"
                        f"{row['router_cpu_s_per_1k']:>9.3f}{row['router_rss_mib']:>8.0f}"
                        f"{row['errors']:>5}",
                        flush=True,
                    )
            stack.stop(envoy)
            if router_proc is not None:
                stack.stop(router_proc)
    document = {
        "command": "prefix-router bench overhead " + " ".join(sys.argv[3:]),
        "duration_s": args.duration,
        "rows": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
    if args.plot:
        plot(rows, args.plot)
    return 0


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["body_bytes"] for r in rows})
    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4), squeeze=False)
    for ax, size in zip(axes[0], sizes, strict=True):
        for config in dict.fromkeys(r["config"] for r in rows):
            points = [r for r in rows if r["config"] == config and r["body_bytes"] == size]
            ax.plot(
                [p["connections"] for p in points],
                [p["req_per_s"] for p in points],
                marker="o",
                label=config,
            )
        ax.set_title(f"{size // KIB} KiB bodies")
        ax.set_xlabel("connections")
        ax.set_ylabel("req/s")
        ax.set_xscale("log", base=2)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
