"""Bounded memory: N distinct prompts through the routing core (Router.route / finish).

    .venv/bin/python tests/reliability/memory_soak.py --prompts 1000000

Every prompt is new (a distinct conversation with a shared system prompt, as in a chat
service), so without a bound the index would grow without end. The index is budgeted by
``capacity_tokens`` per endpoint; the run prints, at checkpoints, the index entries against
that capacity, ``index_stats().approx_bytes``, the process RSS, and the decision latency
percentiles of the requests since the previous checkpoint (start vs end: no drift).
tests/reliability/test_memory.py runs a smaller N and asserts the bounds.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from extproc.bench_core import rss_bytes
from extproc.config import EndpointConfig, RoutingConfig
from extproc.prompt import LLMRequest
from extproc.router import Router

SYSTEM = b"\x01system\x02You are a helpful assistant. Answer precisely and briefly.\x03" * 2


def request(i: int) -> LLMRequest:
    """A distinct ~600-byte prompt: shared system prompt, unique first user turn."""
    user = b"\x01user\x02" + (b"conversation %d asks about topic %d. " % (i, i * 7919)) * 8
    prompt = SYSTEM + user + b"\x03"
    return LLMRequest("chat", "demo-model", "", prompt, len(prompt), False)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Checkpoint:
    prompts: int
    entries: int
    capacity: int
    approx_bytes: int
    rss: int
    p50_us: float
    p99_us: float
    seconds: float

    def row(self) -> str:
        return (
            f"{self.prompts:>10,} {self.entries:>10,} {self.capacity:>10,} "
            f"{self.approx_bytes / 2**20:>10.1f} {self.rss / 2**20:>8.1f} "
            f"{self.p50_us:>8.1f} {self.p99_us:>8.1f} {self.seconds:>8.1f}"
        )


HEADER = (
    f"{'prompts':>10} {'entries':>10} {'capacity':>10} {'index MiB':>10} {'RSS MiB':>8} "
    f"{'p50 us':>8} {'p99 us':>8} {'time s':>8}"
)


def soak(
    prompts: int,
    endpoints: int = 8,
    capacity_tokens: int = 500_000,
    checkpoints: int = 10,
    in_flight: int = 64,
    out=sys.stdout,
) -> list[Checkpoint]:
    config = RoutingConfig()
    router = Router(
        config,
        [
            EndpointConfig(address=f"10.0.0.{i + 1}:8000", capacity_tokens=capacity_tokens)
            for i in range(endpoints)
        ],
    )
    every = max(1, prompts // checkpoints)
    window: list[float] = []
    pending = []
    results: list[Checkpoint] = []
    started = time.perf_counter()
    gc.collect()
    if out:
        print(HEADER, file=out)
    clock = time.perf_counter
    for i in range(prompts):
        req = request(i)
        t0 = clock()
        decision = router.route(req)
        window.append(clock() - t0)
        pending.append(decision)
        if len(pending) >= in_flight:  # keep a realistic number in flight
            router.finish(pending.pop(0))
        if (i + 1) % every == 0 or i + 1 == prompts:
            stats = router.index_stats()
            point = Checkpoint(
                i + 1,
                stats.entries,
                stats.capacity,
                stats.approx_bytes,
                rss_bytes(),
                percentile(window, 0.5) * 1e6,
                percentile(window, 0.99) * 1e6,
                time.perf_counter() - started,
            )
            results.append(point)
            window = []
            if out:
                print(point.row(), file=out, flush=True)
    for decision in pending:
        router.finish(decision)
    assert all(n == 0 for n in router.in_flight().values())
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=1_000_000)
    parser.add_argument("--endpoints", type=int, default=8)
    parser.add_argument("--capacity-tokens", type=int, default=500_000)
    parser.add_argument("--checkpoints", type=int, default=10)
    parser.add_argument("--json", help="also write the checkpoints to this file")
    args = parser.parse_args(argv)
    results = soak(args.prompts, args.endpoints, args.capacity_tokens, args.checkpoints)
    first, last = results[0], results[-1]
    print(
        f"\nindex within capacity: {last.entries <= last.capacity}; "
        f"RSS growth after the first checkpoint: {(last.rss - first.rss) / 2**20:+.1f} MiB; "
        f"p50 first/last window: {first.p50_us:.1f}/{last.p50_us:.1f} us"
    )
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
