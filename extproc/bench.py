"""`prefix-router bench`: benchmarks. `simulate` replays a workload through routing policies
on simulated replicas (extproc.sim) and compares cache-hit ratio, TTFT and load.

Example: prefix-router bench simulate --trace ../shared/workloads/mooncake/synthetic_trace.jsonl
         --replicas 8 --policies all --json out.json --plot out.png --sweep-k 1,2,4,8
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from .config import RoutingConfig, routing_overrides
from .sim import grid as sim_grid
from .sim.engine import RouterChange, SimParams, parse_router_changes, simulate
from .sim.grid import CAPACITIES
from .sim.policies import ALL_POLICIES, BOUNDS, WARM_STARTS, ideal_hit_ratio
from .sim.replica import DEFAULT_KV_POOL, KV_POOLS, CostModel
from .sim.report import (
    PEERS_LINE,
    audit_table,
    phases_table,
    plot,
    summarize,
    sweep_table,
    table,
)
from .sim.workloads import PRESETS, Workload, load_mooncake

# Benchmarks in their own modules: name -> (module, help).
OTHER_BENCHMARKS = {
    "latency": ("extproc.latency", "what the router adds to one request through Envoy"),
    "core": ("extproc.bench_core", "the routing core alone, per body size and endpoints"),
    "events": ("extproc.bench_events", "translating vLLM's KV-cache events, per prompt size"),
    "share": (
        "extproc.bench_share",
        "a router's traffic share: a router joining, low traffic, a lull, a burst, noise",
    ),
    "warm-start": (
        "extproc.bench_warm",
        "handing a router's index over: snapshot, encode, decode and adopt, per index size",
    ),
    "overhead": ("extproc.bench_overhead", "throughput and latency through Envoy, with wrk"),
    "live": (
        "extproc.bench_live",
        "real vLLM servers: Envoy round robin, this router, sglang-router, vllm-router",
    ),
}

# Workload overrides: CLI flag → generator keyword (None = keep the preset's value).
_WORKLOAD_FLAGS = {
    "groups": int,
    "prompts": int,
    "system_tokens": int,
    "question_tokens": int,
    "output_tokens": int,
    "rate": float,
    "requests": int,
    "sessions": int,
    "turns": int,
    "think_s": float,
    "system_prompts": int,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    for name, (module_name, help_text) in OTHER_BENCHMARKS.items():
        importlib.import_module(module_name).add_arguments(sub.add_parser(name, help=help_text))
    sim = sub.add_parser("simulate", help="replay a workload through routing policies")
    source = sim.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", help="Mooncake JSONL trace (timestamp, hash_ids, ...)")
    source.add_argument("--workload", choices=sorted(PRESETS), help="generated workload")
    for flag, kind in _WORKLOAD_FLAGS.items():
        sim.add_argument("--" + flag.replace("_", "-"), type=kind, help="workload parameter")
    sim.add_argument("--limit", type=int, help="use only the first N trace lines")
    sim.add_argument("--replicas", type=int, default=8, help="model-server replicas")
    sim.add_argument(
        "--capacity-tokens", type=int, default=500_000, help="KV cache per replica (tokens)"
    )
    sim.add_argument(
        "--router-replicas", type=int, default=1, help="K independent router instances"
    )
    sim.add_argument(
        "--router-changes",
        metavar="TIME:WHAT,...",
        help="the router replicas change during the run, at simulated seconds TIME: "
        "'restart' replaces the oldest with a fresh one (empty index: a rolling restart's "
        "step), 'restart+S' lets the fresh one join S seconds before the oldest leaves (a "
        "surge pod), a count scales to it (fresh ones join, the newest leave; the current "
        "count: a boundary only); e.g. 300:restart,330:restart. Adds a table by stretch "
        "between changes",
    )
    sim.add_argument("--speedup", type=float, default=1.0, help="trace time compression")
    sim.add_argument(
        "--seed",
        type=int,
        default=0,
        help="draws a generated workload; for a trace, which the seed does not change, names "
        "the replicas (the addresses ours and consistent hashing hash; 0: the names before Dec 7)",
    )
    sim.add_argument(
        "--policies", default="all", help=f"comma list or 'all': {','.join(ALL_POLICIES)}"
    )
    _add_cost_argument(sim)
    add_routing_argument(sim)
    sim.add_argument("--json", dest="json_out", help="write results as JSON here")
    sim.add_argument("--plot", help="write a PNG here (matplotlib)")
    sim.add_argument(
        "--sweep-k", help="also run router replicas K in this comma list (e.g. 1,2,4,8)"
    )
    _add_share_queues_argument(sim)
    _add_kv_pool_argument(sim)
    _add_server_blocks_argument(sim)
    _add_cache_outputs_argument(sim)
    _add_kv_events_argument(sim)
    _add_kv_events_replay_argument(sim)
    _add_warm_start_argument(sim)
    sim.add_argument(
        "--sweep-peers",
        action="store_true",
        help="with --sweep-k: also sweep ours with peers (router replicas reading each "
        "other's queued work and placements), as the line 'ours, peers'",
    )
    sim.add_argument(
        "--audit",
        action="store_true",
        help="check every decision against the replicas' true caches: per rule, how many "
        "missed a replica holding more of the prompt and the hit ratio that cost",
    )
    sim.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_grid_arguments(sub.add_parser("grid", help="simulator grid: ours vs best peer per cell"))
    add_churn_arguments(
        sub.add_parser(
            "churn", help="simulator: what restarting or scaling ours' router replicas costs"
        )
    )


def add_churn_arguments(churn: argparse.ArgumentParser) -> None:
    source = churn.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", help="Mooncake JSONL trace (timestamp, hash_ids, ...)")
    source.add_argument("--workload", choices=sorted(PRESETS), help="generated workload")
    churn.add_argument("--replicas", type=int, default=8, help="model-server replicas")
    churn.add_argument(
        "--capacity-tokens", type=int, default=1_000_000, help="KV cache per replica (tokens)"
    )
    churn.add_argument(
        "--seeds",
        type=int,
        default=5,
        help="seeds 0..N-1 (a new draw of a generated workload, new replica names for a trace)",
    )
    churn.add_argument(
        "--at", type=float, help="when the change happens, simulated s (default: 30%% of the run)"
    )
    churn.add_argument(
        "--window",
        type=float,
        help="the stretch after the change reported apart, s (default: 15%% of the run)",
    )
    _add_cost_argument(churn)
    add_routing_argument(churn)
    _add_kv_pool_argument(churn)
    _add_cache_outputs_argument(churn)
    _add_kv_events_argument(churn)
    _add_kv_events_replay_argument(churn)
    _add_warm_start_argument(churn)
    churn.add_argument("--json", dest="json_out", help="write results as JSON here")
    churn.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_server_blocks_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--server-blocks",
        action="store_true",
        help="ours hashes prompts in its configured blocks (64 bytes), as a server does, not "
        "one block per trace id (Mooncake: 512 tokens): more blocks per prompt, and its index "
        "then errs as a server's does",
    )


def _add_cache_outputs_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cache-outputs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a finished request's reply stays in its replica's cache, as vLLM v1 caches "
        "every full block it computes, so a chat's next turn (which carries the reply) can "
        "hit it there (chat workloads). The default with one KV pool since Dec 4; "
        "--no-cache-outputs is the prompt-only model of the earlier figures (and the only "
        "one --kv-pool split has)",
    )


def _add_kv_events_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-events",
        type=float,
        metavar="DELAY_MS",
        help="ours' router replicas read the replicas' KV-cache events (vLLM's BlockStored "
        "/ BlockRemoved), each DELAY_MS after it happened: what a router subscribed to them "
        "would know (the server's cache_events section; a prompt's blocks are announced when "
        "its prefill ends); needs one KV pool",
    )


def _add_kv_events_replay_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-events-replay",
        type=int,
        default=0,
        metavar="MESSAGES",
        help="with --kv-events: a router replica started during the run (--router-changes, "
        "bench churn) first reads each replica's last MESSAGES event messages, as the server "
        "asks vLLM's replay_endpoint (cache_events.replay; vLLM keeps 10000); 0: none",
    )


def _add_warm_start_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--warm-start",
        choices=WARM_STARTS,
        default="none",
        help="what a router replica of ours started during the run (--router-changes, bench "
        "churn) is handed, as the server's warm_start section does: 'file', at a restart in "
        "place, the index its predecessor wrote at its stop; 'peer', the index of the oldest "
        "router still routing (a surge's predecessor, a pair's other); 'none' (default)",
    )


def add_grid_arguments(grid: argparse.ArgumentParser) -> None:
    grid.add_argument("--trace", help="Mooncake JSONL trace, for the mooncake workload")
    grid.add_argument(
        "--workloads",
        default=",".join(sim_grid.DEFAULT_WORKLOADS),
        help=f"comma list of {', '.join(CAPACITIES)} (each at its tight and loose KV size); "
        "'tuned' = the three the scheduler was tuned on (the default), 'held-out' = the "
        "published shapes it was not",
    )
    grid.add_argument("--replicas", default="4,8,16", help="comma list of replica counts")
    grid.add_argument("--router-replicas", default="1,4", help="comma list of K for ours")
    grid.add_argument("--policies", default="all", help="comma list or 'all'")
    grid.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="run every cell with seeds 0..N-1 (a new draw of each generated workload, new "
        "replica names for a trace) and compare the means",
    )
    _add_cost_argument(grid)
    add_routing_argument(grid)
    _add_share_queues_argument(grid)
    _add_kv_pool_argument(grid)
    _add_server_blocks_argument(grid)
    _add_cache_outputs_argument(grid)
    _add_kv_events_argument(grid)
    grid.add_argument(
        "--peers-from",
        help="reuse the peers' results from this grid JSON: simulate ours only, or ours and "
        "the peers --policies names (their figures replace the file's)",
    )
    grid.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    grid.add_argument("--json", dest="json_out", help="write results as JSON here")


def _add_cost_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cost",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a cost-model constant (repeatable): "
        + ", ".join(f.name for f in dataclasses.fields(CostModel))
        + " (prefill_batch_tokens=0: one prefill at a time, the model before Dec 6)",
    )


def _add_kv_pool_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-pool",
        choices=KV_POOLS,
        default=DEFAULT_KV_POOL,
        help="replica memory: 'preempt' is vLLM's one block pool (running requests' blocks, "
        "shared prefixes once, and the prefix cache in --capacity-tokens) with its allocation: "
        "output blocks taken as generated, the newest running request preempted and "
        "recomputed later when none is free; 'shared' is that pool with each output reserved "
        "at admission (the figures of items 24-25); 'split' is the model before item 24 (a "
        "prefix cache and a running budget, each --capacity-tokens)",
    )


def _add_share_queues_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--share-queues",
        action="store_true",
        help="ours' K router replicas read each other's queued work every second "
        "(the server's peers config)",
    )
    parser.add_argument(
        "--share-placements",
        action="store_true",
        help="ours' K router replicas read each other's placements every second into their "
        "indexes (the server's peers config)",
    )


def add_routing_argument(
    parser: argparse.ArgumentParser,
    help_text: str = "override a routing setting for ours (repeatable), e.g. stickiness=2",
) -> None:
    """``--routing KEY=VALUE`` (checked later by config.routing_overrides)."""
    parser.add_argument(
        "--routing", action="append", default=[], metavar="KEY=VALUE", help=help_text
    )


def _cost_model(pairs: list[str]) -> CostModel:
    fields = {f.name: f.type for f in dataclasses.fields(CostModel)}
    updates: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in fields:
            raise SystemExit(f"--cost {pair!r}: expected KEY=VALUE with KEY in {sorted(fields)}")
        try:
            number = int(value) if fields[key] in (int, "int") else float(value)
        except ValueError:
            number = -1
        if number < 0:
            raise SystemExit(f"--cost {pair!r}: {key} must be a number, 0 or more")
        updates[key] = number
    return dataclasses.replace(CostModel(), **updates)


def _workload(args: argparse.Namespace) -> Workload:
    if args.trace:
        return load_mooncake(args.trace, speedup=args.speedup, limit=args.limit)
    preset = PRESETS[args.workload]
    overrides = {k: v for k in _WORKLOAD_FLAGS if (v := getattr(args, k)) is not None}
    bad = sorted(set(overrides) - preset.takes)
    if bad:
        raise SystemExit(f"--workload {args.workload} does not take {', '.join(bad)}")
    workload = preset(seed=args.seed, **overrides)
    if args.speedup != 1.0:
        scaled = [
            dataclasses.replace(r, arrival_s=r.arrival_s / args.speedup) for r in workload.requests
        ]
        workload = Workload(workload.name, scaled, {**workload.params, "speedup": args.speedup})
    return workload


def _policy_names(spec: str) -> list[str]:
    names = ALL_POLICIES if spec.strip() == "all" else [p.strip() for p in spec.split(",") if p]
    unknown = [n for n in names if n not in ALL_POLICIES]
    if unknown:
        raise SystemExit(f"unknown policies {unknown}; choose from {', '.join(ALL_POLICIES)}")
    return list(names)


def run(args: argparse.Namespace) -> int:
    if args.bench in OTHER_BENCHMARKS:
        return importlib.import_module(OTHER_BENCHMARKS[args.bench][0]).run(args)
    if args.cache_outputs is None:
        args.cache_outputs = args.kv_pool != "split"
    if args.cache_outputs and args.kv_pool == "split":
        raise SystemExit("--cache-outputs needs one KV pool: --kv-pool preempt or shared")
    if args.kv_events is not None and (args.kv_events < 0 or args.kv_pool == "split"):
        raise SystemExit(
            f"--kv-events {args.kv_events}: needs a delay >= 0 ms and one KV pool "
            "(--kv-pool preempt or shared)"
        )
    replay = getattr(args, "kv_events_replay", 0)
    if replay < 0 or (replay and args.kv_events is None):
        raise SystemExit(
            f"--kv-events-replay {replay}: a count of messages (at least 0), with --kv-events"
        )
    if args.bench == "grid":
        return grid_command(args)
    if args.bench == "churn":
        return churn_command(args)
    return simulate_command(args)


def churn_command(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .sim import churn

    started = time.perf_counter()
    if args.json_out and not Path(args.json_out).parent.is_dir():
        raise SystemExit(f"--json {args.json_out}: no such directory")
    if args.seeds < 1:
        raise SystemExit(f"--seeds {args.seeds}: at least 1")
    name = "mooncake" if args.trace else args.workload

    def workload_for_seed(seed: int) -> Workload:
        return sim_grid.workload_for(name, args.trace, seed)

    first = workload_for_seed(0)
    seeds = list(range(args.seeds))
    # The shortest draw: every seed must have requests after the window.
    span = min(
        max((r.arrival_s for r in workload_for_seed(seed).requests), default=0.0) for seed in seeds
    )
    at_s = args.at if args.at is not None else round(0.3 * span, 1)
    window_s = args.window if args.window is not None else round(0.15 * span, 1)
    if not (at_s > 0 and window_s > 0 and at_s + window_s < span):
        raise SystemExit(
            f"--at {at_s:g} / --window {window_s:g} (defaults: 30 % and 15 % of the run): the "
            f"change and its window must end inside every seed's arrivals (0-{span:g} s)"
        )
    cost = _cost_model(args.cost)
    routing = routing_overrides(args.routing)
    base = _sim_params(args, cost, routing)
    bar = tqdm(
        total=churn.runs_needed(args.seeds),
        unit="run",
        disable=True if args.no_progress else None,
        file=sys.stderr,
    )
    rows = churn.run_scenarios(workload_for_seed, base, seeds, at_s, window_s, bar.update)
    bar.close()
    wall = time.perf_counter() - started
    print(
        f"workload {first.name}: {len(first.requests)} requests over {span:g} s; "
        f"{args.replicas} replicas x {args.capacity_tokens:,} KV tokens; ours; seeds 0-"
        f"{seeds[-1]} (means); change at {at_s:g} s, window {window_s:g} s"
        + (f"; routing overrides {routing}" if routing else "")
        + _kv_events_note(args.kv_events)
        + (
            f"; a router started late reads each replica's last {args.kv_events_replay} "
            "event messages first"
            if args.kv_events_replay
            else ""
        )
        + (
            f"; a router started late is handed an index ({args.warm_start})"
            if args.warm_start != "none"
            else ""
        )
    )
    print(churn.table(rows, at_s, window_s))
    print(f"\n{wall:.1f} s wall")
    if args.json_out:
        doc = {
            "scenarios": rows,
            "workload": first.name,
            "replicas": args.replicas,
            "capacity_tokens": args.capacity_tokens,
            "at_s": at_s,
            "window_s": window_s,
            "seeds": seeds,
            "routing_overrides": routing,
            "kv_pool": args.kv_pool,
            "cache_outputs": args.cache_outputs,
            "kv_events_ms": args.kv_events,
            "kv_events_replay": args.kv_events_replay,
            "warm_start": args.warm_start,
            "cost_model": cost.as_dict(),
            "wall_seconds": round(wall, 2),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        Path(args.json_out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


def _int_list(flag: str, text: str) -> list[int]:
    try:
        return sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise SystemExit(f"{flag} {text!r}: expected a comma list of integers") from None


def grid_command(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    started = time.perf_counter()
    if args.json_out and not Path(args.json_out).parent.is_dir():
        raise SystemExit(f"--json {args.json_out}: no such directory")
    workloads = [
        name
        for w in args.workloads.split(",")
        if w.strip()
        for name in sim_grid.WORKLOAD_GROUPS.get(w.strip(), (w.strip(),))
    ]
    unknown = [w for w in workloads if w not in CAPACITIES]
    if unknown:
        raise SystemExit(f"--workloads: unknown {unknown}; choose from {', '.join(CAPACITIES)}")
    replicas = _int_list("--replicas", args.replicas)
    if args.seeds < 1:
        raise SystemExit(f"--seeds {args.seeds}: must be at least 1")
    seeds = tuple(range(args.seeds))
    ks = sorted({1, *_int_list("--router-replicas", args.router_replicas)})
    routing = routing_overrides(args.routing)
    cost = _cost_model(args.cost)
    names = _policy_names(args.policies)
    peers: dict[sim_grid.Cell, dict[str, dict[str, Any]]] = {}
    if args.peers_from:
        peers = sim_grid.load_peers(args.peers_from, seeds, args.kv_pool, args.cache_outputs, cost)
        rerun = [] if args.policies.strip() == "all" else [n for n in names if n != sim_grid.OURS]
        names = [sim_grid.OURS, *rerun]
    todo = sim_grid.cells(workloads, replicas, ks)
    runs = sum(1 for c in todo for p in names if p == sim_grid.OURS or c.router_replicas == 1)
    bar = tqdm(total=runs * len(seeds), unit="run", file=sys.stderr, disable=None)
    results = sim_grid.run_grid(
        todo,
        names,
        args.trace,
        routing,
        args.jobs,
        lambda *_: bar.update(len(seeds)),
        share_queues=args.share_queues,
        share_placements=args.share_placements,
        seeds=seeds,
        kv_pool=args.kv_pool,
        server_blocks=args.server_blocks,
        cache_outputs=args.cache_outputs,
        kv_events_ms=args.kv_events,
        cost=cost,
    )
    bar.close()
    for cell, by_policy in peers.items():
        if cell in results:
            # Ours first, then the peers in the file's order, as a run of every policy lists
            # them (the docs' tables follow this order); re-run peers take their new figures.
            fresh = results[cell]
            results[cell] = {sim_grid.OURS: fresh[sim_grid.OURS], **by_policy, **fresh}
    rows = sim_grid.verdicts(results)
    shared = "".join(
        f"; router replicas share {what}"
        for what, on in (("queued work", args.share_queues), ("placements", args.share_placements))
        if on
    )
    over = f", seeds 0-{seeds[-1]} (means)" if len(seeds) > 1 else ""
    print(
        f"routing overrides: {routing or 'none'}{shared}; {runs * len(seeds)} runs{over}, "
        f"{args.jobs} worker processes; KV pool {args.kv_pool}"
        + ("; ours in its configured blocks (--server-blocks)" if args.server_blocks else "")
        + ("; replies cached" if args.cache_outputs else "; prompts only (--no-cache-outputs)")
        + _kv_events_note(args.kv_events)
    )
    print("cost model: " + ", ".join(f"{k}={v}" for k, v in cost.as_dict().items()))
    print(sim_grid.markdown(rows))
    print(sim_grid.summary_line(rows))
    wall = time.perf_counter() - started
    print(f"{wall:.1f} s wall")
    if args.json_out:
        doc = {
            "cells": sim_grid.to_json(results),
            "routing_overrides": routing,
            "share_queues": args.share_queues,
            "share_placements": args.share_placements,
            "kv_pool": args.kv_pool,
            "server_blocks": args.server_blocks,
            "cache_outputs": args.cache_outputs,
            "kv_events_ms": args.kv_events,
            "cost_model": cost.as_dict(),
            "seeds": list(seeds),
            "summary": sim_grid.summary_line(rows),
            "wall_seconds": round(wall, 2),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        Path(args.json_out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0


def _kv_events_note(delay_ms: float | None) -> str:
    if delay_ms is None:
        return ""
    return f"; ours reads the replicas' KV-cache events {delay_ms:g} ms late (--kv-events)"


def _peer_sweep_runs(args: argparse.Namespace, names: list[str], ks: list[int]) -> list[int]:
    """The K values ours runs again with peers for --sweep-peers (every swept K above 1)."""
    if not args.sweep_peers:
        return []
    if not ks or "ours" not in names:
        raise SystemExit("--sweep-peers needs --sweep-k and ours among --policies")
    if args.share_queues or args.share_placements:
        raise SystemExit(
            "--sweep-peers puts ours with peers beside ours without; "
            "drop --share-queues/--share-placements"
        )
    return [k for k in ks if k != 1]


def _sim_params(args: argparse.Namespace, cost: CostModel, routing: dict[str, Any]) -> SimParams:
    """What `simulate` and `churn` set alike from their flags."""
    return SimParams(
        replicas=args.replicas,
        capacity_tokens=args.capacity_tokens,
        cost=cost,
        routing=RoutingConfig(**routing),
        kv_pool=args.kv_pool,
        cache_outputs=args.cache_outputs,
        kv_events_ms=args.kv_events,
        kv_events_replay=args.kv_events_replay,
        warm_start=args.warm_start,
    )


def _router_changes(args: argparse.Namespace) -> tuple[RouterChange, ...]:
    if not args.router_changes:
        return ()
    if args.sweep_k:
        raise SystemExit("--router-changes sets the router replicas over time: drop --sweep-k")
    try:
        return parse_router_changes(args.router_changes)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None


def simulate_command(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    started = time.perf_counter()
    workload = _workload(args)
    names = _policy_names(args.policies)
    cost = _cost_model(args.cost)
    routing = routing_overrides(args.routing)
    changes = _router_changes(args)
    if args.kv_events_replay and not changes:
        raise SystemExit(
            "--kv-events-replay matters only to a router that starts during the run: "
            "add --router-changes"
        )
    if args.warm_start != "none" and not changes:
        raise SystemExit(
            f"--warm-start {args.warm_start} matters only to a router that starts during the "
            "run: add --router-changes"
        )
    params = dataclasses.replace(
        _sim_params(args, cost, routing),
        router_replicas=args.router_replicas,
        seed=args.seed,
        audit=args.audit,
        share_queues=args.share_queues,
        share_placements=args.share_placements,
        server_blocks=args.server_blocks,
        router_changes=changes,
    )
    ks = _int_list("--sweep-k", args.sweep_k) if args.sweep_k else []
    swept = [n for n in names if n not in BOUNDS]
    extra_runs = [(n, k) for k in ks if k != args.router_replicas for n in swept]
    peer_runs = _peer_sweep_runs(args, names, ks)
    requests = workload.requests
    prompt_tokens = sum(r.input_tokens for r in requests)
    ideal = ideal_hit_ratio(requests, cost.kv_block_tokens, args.cache_outputs)

    bar = tqdm(
        total=len(requests) * (len(names) + len(extra_runs) + len(peer_runs)),
        unit="req",
        disable=True if args.no_progress else None,
        file=sys.stderr,
    )
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        bar.set_description(name)
        results[name] = summarize(simulate(workload, name, params, bar.update), ideal)
    sweep: dict[str, dict[int, float]] = {}
    if ks:
        for name in swept:
            sweep[name] = {args.router_replicas: results[name]["hit_ratio"]}
        # (line in the sweep, policy, K, parameters)
        runs = [(name, name, k, params) for name, k in extra_runs]
        if peer_runs:
            # One router replica has no peers: its K=1 point is ours' own run.
            sweep[PEERS_LINE] = {1: sweep["ours"][1]} if 1 in ks else {}
            peers = dataclasses.replace(params, share_queues=True, share_placements=True)
            runs += [(PEERS_LINE, "ours", k, peers) for k in peer_runs]
        for line, policy, k, base in runs:
            bar.set_description(f"{line} K={k}")
            run_params = dataclasses.replace(base, router_replicas=k)
            summary = summarize(simulate(workload, policy, run_params, bar.update), ideal)
            sweep[line][k] = summary["hit_ratio"]
    bar.close()

    doc: dict[str, Any] = {
        "policies": results,
        "ideal_hit_ratio": round(ideal, 4),
        "params": {
            "workload": workload.name,
            **workload.params,
            "requests": len(requests),
            "prompt_tokens": prompt_tokens,
            "replicas": args.replicas,
            "capacity_tokens": args.capacity_tokens,
            "router_replicas": args.router_replicas,
            "seed": args.seed,
            "cost_model": cost.as_dict(),
            "routing_overrides": routing,
            "share_queues": args.share_queues,
            "share_placements": args.share_placements,
            "kv_pool": args.kv_pool,
            "server_blocks": args.server_blocks,
            "cache_outputs": args.cache_outputs,
            "kv_events_ms": args.kv_events,
            "kv_events_replay": args.kv_events_replay,
            "router_changes": args.router_changes,
            "warm_start": args.warm_start,
        },
        "wall_seconds": round(time.perf_counter() - started, 2),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    if sweep:
        doc["sweep_k"] = {
            n: {str(k): v for k, v in sorted(by_k.items())} for n, by_k in sweep.items()
        }

    print(
        f"workload {workload.name}: {len(requests)} requests, {prompt_tokens:,} prompt tokens; "
        f"{args.replicas} replicas x {args.capacity_tokens:,} KV tokens; "
        f"router replicas K={args.router_replicas}; seed {args.seed}; KV pool {args.kv_pool}"
        + ("; ours in its configured blocks (--server-blocks)" if args.server_blocks else "")
        + ("; replies cached" if args.cache_outputs else "; prompts only (--no-cache-outputs)")
        + _kv_events_note(args.kv_events)
        + (f"; router changes {args.router_changes}" if changes else "")
        + (
            f"; a router started late is handed an index ({args.warm_start})"
            if changes and args.warm_start != "none"
            else ""
        )
    )
    print("cost model: " + ", ".join(f"{k}={v}" for k, v in cost.as_dict().items()))
    if routing:
        print("routing overrides for ours: " + ", ".join(f"{k}={v}" for k, v in routing.items()))
    print(f"ideal hit ratio (one infinite cache): {ideal:.3f}\n")
    print(table(results))
    if sweep:
        print("\nhit ratio vs router replicas K:")
        print(sweep_table(sweep))
    if changes:
        print("\n" + phases_table(results))
    if args.audit:
        print("\n" + audit_table(results))
    print(f"\n{doc['wall_seconds']:.1f} s wall")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(doc, indent=2) + "\n")
    if args.plot:
        title = (
            f"{workload.name}: {args.replicas} replicas x {args.capacity_tokens:,} tokens, "
            f"K={args.router_replicas}"
        )
        plot(args.plot, title, results, ideal, sweep or None)
    return 0
