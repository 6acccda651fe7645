"""`prefix-router bench warm-start`: what handing a router's index over costs (warm_start.py).

For each index size (endpoints x KV tokens each, at the default block size), a router's
index is filled full, then timed: taking the snapshot (a copy of every region: on the
router's event loop, every ``warm_start.interval_seconds`` with a file and once per
starting peer), encoding it (in a thread), its size, decoding it (in a thread) and taking it
into a fresh router's index (on the event loop, one region per endpoint reading). Best of
``--repeat`` runs each; the machine's noise goes into the spread, not the figure.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from . import warm_start
from .config import EndpointConfig, RoutingConfig
from .placements import hash_scheme
from .router import Router


def _filled_router(endpoints: int, capacity_tokens: int, seed: int = 0) -> Router:
    config = RoutingConfig()
    addresses = [f"10.0.{i // 250}.{i % 250 + 1}:8000" for i in range(endpoints)]
    router = Router(
        config,
        [EndpointConfig(address=a, capacity_tokens=capacity_tokens) for a in addresses],
        learns_capacity=False,
    )
    rng = np.random.default_rng(seed)
    blocks = router.capacity_blocks(capacity_tokens)
    for i in range(endpoints):
        for _ in range(max(1, 2 * blocks // 1024)):  # twice over: every bucket full
            router.index.record_position(i, rng.integers(1, 2**63, 1024, dtype=np.uint64))
    return router


def _best(repeat: int, call: Callable[[], Any]) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeat):
        started = time.perf_counter()
        out = call()
        best = min(best, time.perf_counter() - started)
    return best, out


def measure(endpoints: int, capacity_tokens: int, repeat: int) -> dict[str, Any]:
    scheme = hash_scheme(RoutingConfig().block_size_bytes)
    old = _filled_router(endpoints, capacity_tokens)
    take_s, snapshot = _best(repeat, lambda: warm_start.take(old, scheme, {}))
    encode_s, data = _best(repeat, lambda: warm_start.encode(snapshot))
    decode_s, decoded = _best(repeat, lambda: warm_start.decode(data))

    def adopt() -> tuple[float, int]:
        fresh = Router(
            RoutingConfig(),
            [EndpointConfig(address=a, capacity_tokens=capacity_tokens) for a in decoded.regions],
            learns_capacity=False,
        )
        started = time.perf_counter()
        handover = warm_start.Handover(decoded, "bench", fresh, reads_metrics=False)
        return time.perf_counter() - started, sum(handover.applied.values())

    adopt_s = min(adopt()[0] for _ in range(repeat))
    _, taken = adopt()
    return {
        "endpoints": endpoints,
        "capacity_tokens": capacity_tokens,
        "index_entries": old.index_stats().entries,
        "taken_entries": taken,
        "snapshot_bytes": len(data),
        "take_ms": round(take_s * 1000, 2),
        "encode_ms": round(encode_s * 1000, 2),
        "decode_ms": round(decode_s * 1000, 2),
        "adopt_ms": round(adopt_s * 1000, 2),
        "adopt_ms_per_endpoint": round(adopt_s * 1000 / endpoints, 3),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sizes",
        default="8x1000000,16x500000,64x100000,64x1000000",
        help="comma list of ENDPOINTSxKV_TOKENS (each endpoint's KV cache, tokens)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="best of this many runs each")
    parser.add_argument("--json", dest="json_out", help="write the results here")


def run(args: argparse.Namespace) -> int:
    rows = []
    for size in args.sizes.split(","):
        endpoints, _, tokens = size.strip().partition("x")
        rows.append(measure(int(endpoints), int(tokens), max(1, args.repeat)))
    print(
        "| endpoints × KV tokens | index entries | snapshot MB | take ms | encode ms "
        "| decode ms | adopt ms (per endpoint) |\n|---|---:|---:|---:|---:|---:|---:|"
    )
    for r in rows:
        print(
            f"| {r['endpoints']} × {r['capacity_tokens']:,} | {r['index_entries']:,} "
            f"| {r['snapshot_bytes'] / 2**20:.1f} | {r['take_ms']:.1f} | {r['encode_ms']:.1f} "
            f"| {r['decode_ms']:.1f} | {r['adopt_ms']:.1f} ({r['adopt_ms_per_endpoint']:.2f}) |"
        )
    if args.json_out:
        Path(args.json_out).write_text(
            json.dumps({"command": "prefix-router bench warm-start", "rows": rows}, indent=2) + "\n"
        )
    return 0
