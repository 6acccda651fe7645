"""`prefix-router demo`: the product in one command, measured against round robin.

Starts N stand-in replicas, the router and a real Envoy on loopback; sends a multi-turn,
shared-system-prompt chat workload through Envoy with prefix routing, then the identical
workload through an Envoy that balances round robin; prints what the replicas' own
prefix-cache counters say each achieved. Caches are reset before each run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from .stack import LOOPBACK, Stack, router_args_for
from .workload import (
    ChatWorkload,
    aligned_table,
    reset_prefix_caches,
    run_chat_workload,
    scrape_prefix_counters,
    summarise,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument(
        "--mode", choices=["override-host", "original-dst"], default="override-host"
    )
    parser.add_argument(
        "--body-mode", choices=["buffered", "full_duplex_streamed"], default="buffered"
    )
    parser.add_argument("--workers", type=int, default=1, help="router processes")
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="runs per policy; the table shows the run with the median hit ratio, since "
        "round robin's depends on how concurrent turns happen to interleave",
    )
    parser.add_argument(
        "--replica-capacity-tokens",
        type=int,
        default=32768,
        help="each stand-in replica's KV cache (small enough that placement matters)",
    )
    parser.add_argument("--json", metavar="FILE", help="write the figures as JSON")
    parser.add_argument("--logs", metavar="DIR", help="keep process logs here")


def _run_workload(
    label: str, url: str, workload: ChatWorkload, replicas: list[str], repeats: int
) -> dict[str, Any]:
    """The workload `repeats` times from cold caches; the median run by hit ratio (the lower
    middle one for an even count), with every run's hit ratio and the errors of all runs."""

    async def once(bar: tqdm) -> dict[str, Any]:
        await reset_prefix_caches(replicas)
        before = await scrape_prefix_counters(replicas)
        result = await run_chat_workload(url, workload, on_request=lambda _r: bar.update())
        after = await scrape_prefix_counters(replicas)
        return summarise(result, before, after)

    async def go() -> list[dict[str, Any]]:
        total = workload.conversations * workload.turns * repeats
        with tqdm(total=total, desc=f"{label:>12}", unit="req", file=sys.stderr) as bar:
            return [await once(bar) for _ in range(repeats)]

    runs = asyncio.run(go())
    median = sorted(runs, key=lambda run: run["hit_ratio"])[(len(runs) - 1) // 2]
    return {
        **median,
        "hit_ratio_runs": [run["hit_ratio"] for run in runs],
        "errors_all_runs": sum(run["errors"] for run in runs),
        "requests_all_runs": sum(run["requests"] for run in runs),
    }


def _cell(run: dict[str, Any], key: str) -> str:
    if key == "hit_ratio_spread":
        ratios = run["hit_ratio_runs"]
        return f"{min(ratios):.4f}-{max(ratios):.4f}"
    return str(run[key])


def format_table(runs: dict[str, dict[str, Any]]) -> str:
    rows = [("", *runs)]
    for key, label in [
        ("requests_all_runs", "requests (all runs)"),
        ("errors_all_runs", "errors (all runs)"),
        ("hit_ratio", "cache hit ratio (replica counters)"),
        ("hit_ratio_spread", "  lowest-highest of all runs"),
        ("ttft_p50_ms", "TTFT p50 (ms)"),
        ("ttft_p99_ms", "TTFT p99 (ms)"),
        ("seconds", "wall time (s)"),
    ]:
        rows.append((label, *(_cell(run, key) for run in runs.values())))
    replicas = sorted({name for run in runs.values() for name in run["replica_share"]})
    for name in replicas:
        rows.append(
            (
                f"share {name}",
                *(f"{run['replica_share'].get(name, 0):.0%}" for run in runs.values()),
            )
        )
    return aligned_table(rows)


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        print(f"demo: --repeats must be at least 1, got {args.repeats}", file=sys.stderr)
        return 2
    # Ctrl-C and SIGTERM both unwind through Stack.__exit__, which stops every process.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    workload = ChatWorkload(
        conversations=args.conversations,
        turns=args.turns,
        concurrency=args.concurrency,
        seed=args.seed,
    )
    logs = Path(args.logs) if args.logs else None
    runs: dict[str, dict[str, Any]] = {}
    print(
        f"demo: {args.replicas} stand-in replicas, Envoy {args.mode} ({args.body_mode}), "
        f"{workload.conversations} conversations x {workload.turns} turns, "
        f"concurrency {workload.concurrency}",
        file=sys.stderr,
    )
    with Stack(workdir=logs) as stack:
        replicas = stack.start_replicas(
            args.replicas, ["--capacity-tokens", str(args.replica_capacity_tokens)]
        )
        router_address, router = stack.start_router(
            replicas,
            body_mode=args.body_mode,
            workers=args.workers,
            extra_args=router_args_for(args.mode),
        )
        for label, mode in (("prefix", args.mode), ("round_robin", "round-robin")):
            port, envoy = stack.start_proxy(
                mode, replicas, router_address, args.body_mode, name=f"envoy-{label}"
            )
            runs[label] = _run_workload(
                label, f"http://{LOOPBACK}:{port}", workload, replicas, args.repeats
            )
            stack.stop(envoy)
        stack.stop(router)
    print()
    print(format_table(runs))
    gain = runs["prefix"]["hit_ratio"] - runs["round_robin"]["hit_ratio"]
    print(
        f"\ncache hit ratio: prefix routing {runs['prefix']['hit_ratio']:.4f}, round robin "
        f"{runs['round_robin']['hit_ratio']:.4f} ({gain:+.4f}); median of {args.repeats} runs "
        "each, and the table's other rows are from those median runs"
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs}, indent=2) + "\n")
        print(f"wrote {args.json}")
    errors = sum(run["errors_all_runs"] for run in runs.values())
    return 1 if errors else 0
