"""`prefix-router bench core`: the routing core alone, per body size and endpoint count.

One decision = parse + canonicalise + hash + index lookup + schedule + index update (and the
finish that releases its in-flight count) — exactly what the servicer runs per request,
without gRPC. Bodies are chat requests of multi-turn conversations (so the index has real
matches), warmed up before timing. Prints a table; --json writes it.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from .bench import add_routing_argument
from .config import EndpointConfig, RoutingConfig, routing_overrides
from .prompt import parse_request
from .router import Router

KIB = 1024


def chat_bodies(
    size: int, count: int, conversations: int, seed: int = 1, history: int = 1
) -> list[bytes]:
    """`count` chat bodies of about `size` bytes from `conversations` conversations: each
    conversation repeats its own document (80 % of the body, so later requests match it
    in the index) followed by a new question. With ``history`` > 1 the document is that
    many messages, user and assistant in turn (a long conversation or agent loop)."""
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(2000)]

    def text(length: int) -> str:
        out = " ".join(rng.choices(words, k=length // 5 + 1))
        return out[:length]

    system = "You are a helpful assistant. " * 4
    documents = [
        [
            {"role": ("user", "assistant")[k % 2], "content": text(int(size * 0.8) // history)}
            for k in range(history)
        ]
        for _ in range(conversations)
    ]
    bodies = []
    for i in range(count):
        messages = [
            {"role": "system", "content": system},
            *documents[i % conversations],
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": text(max(16, size - int(size * 0.8) - 200))},
        ]
        bodies.append(orjson.dumps({"model": "m", "messages": messages}))
    return bodies


def _endpoints(count: int, capacity_tokens: int | None = None) -> list[EndpointConfig]:
    return [
        EndpointConfig(address=f"10.{i // 250}.{i % 250}.1:8000", capacity_tokens=capacity_tokens)
        for i in range(count)
    ]


def _warmed(
    size: int,
    endpoints: int,
    requests: int,
    routing: RoutingConfig | None = None,
    history: int = 1,
) -> tuple[Router, list[bytes]]:
    """A router whose index the first ``requests`` of 2 x ``requests`` bodies filled, and
    all the bodies (the second half is the one to time)."""
    router = Router(routing or RoutingConfig(), _endpoints(endpoints))
    bodies = chat_bodies(size, requests * 2, conversations=max(4, endpoints), history=history)
    for body in bodies[:requests]:
        router.finish(router.route(parse_request("chat", body)))
    return router, bodies


def measure(
    size: int,
    endpoints: int,
    requests: int,
    routing: RoutingConfig | None = None,
    history: int = 1,
) -> dict[str, Any]:
    router, bodies = _warmed(size, endpoints, requests, routing, history)
    timings, answers, blocks = [], [], []
    gc.collect()
    perf = time.perf_counter_ns
    for body in bodies[requests:]:
        started = perf()
        decision = router.route(parse_request("chat", body), defer_record=True)
        answered = perf()  # what the server answers Envoy with; it records after (Router.record)
        router.record(decision)
        router.finish(decision)
        timings.append((perf() - started) / 1000)
        answers.append((answered - started) / 1000)
        blocks.append(decision.total_blocks)
    timings.sort()
    answers.sort()
    return {
        "body_bytes": size,
        "endpoints": endpoints,
        "messages": history + 3,
        "requests": len(timings),
        "mean_body_bytes": round(statistics.fmean(len(b) for b in bodies)),
        "mean_blocks_hashed": round(statistics.fmean(blocks)),
        "p50_us": round(statistics.median(timings), 1),
        "p99_us": round(timings[int(0.99 * (len(timings) - 1))], 1),
        "mean_us": round(statistics.fmean(timings), 1),
        "answer_p50_us": round(statistics.median(answers), 1),
        "answer_p99_us": round(answers[int(0.99 * (len(answers) - 1))], 1),
        "index_bytes": router.index_stats().approx_bytes,
    }


# Stages of a decision, by the function that implements each (for --profile).
STAGES = {
    "parse + canonicalise": "parse_request",
    "block hashing": "block_hashes",
    "index match": "match_positions",
    "scheduler": "pick",
    "index update": "_record",
    "queued-work drain": "_drain_all",
    "finish": "finish",
}


def profile(size: int, endpoints: int, requests: int, history: int = 1) -> dict[str, float]:
    """Share of each stage in ``requests`` decisions (cProfile, cumulative time)."""
    import cProfile
    import pstats

    router, bodies = _warmed(size, endpoints, requests, history=history)
    profiler = cProfile.Profile()
    profiler.enable()
    for body in bodies[requests:]:
        router.finish(router.route(parse_request("chat", body)))
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    cumulative: dict[str, float] = {}
    for (_, _, function), (_, _, _, cum, _) in stats.items():
        cumulative[function] = cumulative.get(function, 0.0) + cum
    total = cumulative.get("route", 0.0) + cumulative["parse_request"] + cumulative["finish"]
    shares = {stage: cumulative.get(function, 0.0) / total for stage, function in STAGES.items()}
    shares["other"] = max(0.0, 1.0 - sum(shares.values()))
    return shares


def rss_bytes() -> int:
    """This process's resident set size (Linux /proc)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def index_memory(endpoints: int, blocks: int, seed: int = 1) -> dict[str, Any]:
    """The index of ``endpoints`` endpoints x ``blocks`` blocks each, filled with distinct
    blocks (through the router's own ``record``): its own report against the RSS growth."""
    rss_before = rss_bytes()
    config = RoutingConfig(block_size_bytes=64, bytes_per_token=4.0)
    router = Router(config, _endpoints(endpoints, capacity_tokens=blocks * 16))
    rng = np.random.default_rng(seed)
    started = time.perf_counter()
    for position in range(endpoints):
        # Twice the capacity in 1,024-block requests: buckets fill unevenly (LRU per
        # bucket), so the first pass leaves ~20 % of the slots empty.
        for _ in range(-(-2 * blocks // 1024)):
            router.index.record_position(position, rng.integers(1, 2**63, 1024, dtype=np.uint64))
    stats = router.index_stats()
    return {
        "endpoints": endpoints,
        "blocks_per_endpoint": blocks,
        "entries": stats.entries,
        "reported_bytes": stats.approx_bytes,
        "rss_growth_bytes": rss_bytes() - rss_before,
        "fill_seconds": round(time.perf_counter() - started, 1),
    }


def _decision_us(router: Router, bodies: list[bytes]) -> float:
    perf = time.perf_counter_ns
    started = perf()
    for body in bodies:
        router.finish(router.route(parse_request("chat", body)))
    return (perf() - started) / 1000 / len(bodies)


def peer_placements(endpoints: int, requests: int, rounds: int = 5) -> dict[str, Any]:
    """What sharing placements with peer routers (config ``peers``) costs this router: the
    mean decision with and without keeping the placement log (alternating rounds, 32 KiB
    bodies), and recording a second's worth of a peer's placements into the index in the
    reader's slices (the event loop is blocked for one slice at a time)."""
    from .peers import placement_slices
    from .placements import Placement, PlacementLog

    plain, logged = [], []
    for _ in range(rounds):
        for keep, out in ((False, plain), (True, logged)):
            router, bodies = _warmed(32 * KIB, endpoints, requests)
            router.placements = PlacementLog() if keep else None
            gc.collect()
            out.append(_decision_us(router, bodies[requests:]))
    rng = np.random.default_rng(1)
    recording = []
    for count, blocks in ((1000, 20), (100, 373)):
        router = Router(RoutingConfig(), _endpoints(endpoints))
        addresses = router.endpoints
        totals, longest = [], []
        for _ in range(rounds):
            placements = [
                Placement(
                    "peer",
                    addresses[i % endpoints],
                    rng.integers(1, 2**63, blocks, dtype=np.uint64),
                )
                for i in range(count)
            ]
            slices = []
            for piece in placement_slices(placements):
                started = time.perf_counter()
                router.observe_peer_placements(piece)
                slices.append(time.perf_counter() - started)
            totals.append(1000 * sum(slices))
            longest.append(1000 * max(slices))
        recording.append(
            {
                "placements": count,
                "blocks_each": blocks,
                "total_ms": [round(t, 2) for t in totals],
                "longest_slice_ms": [round(t, 2) for t in longest],
            }
        )
    return {
        "endpoints": endpoints,
        "decision_us_without_log": [round(t, 1) for t in plain],
        "decision_us_with_log": [round(t, 1) for t in logged],
        "recording": recording,
    }


def metrics_parse(page: Path, rounds: int = 5, repeat: int = 50) -> dict[str, Any]:
    """The event-loop time one scrape of ``page`` (an endpoint's /metrics text) costs:
    parse_metrics as it is (only the samples it reads are parsed) against handing the whole
    page to prometheus_client's parser, as it did before; alternating rounds, ms per page."""
    from prometheus_client.parser import text_string_to_metric_families

    from .signals import parse_metrics

    text = page.read_text()

    def whole() -> None:
        for family in text_string_to_metric_families(text):
            for _ in family.samples:
                pass

    timings: dict[str, list[float]] = {"filtered_ms": [], "whole_page_ms": []}
    for _ in range(rounds):
        for name, parse in (("filtered_ms", lambda: parse_metrics(text)), ("whole_page_ms", whole)):
            started = time.perf_counter()
            for _ in range(repeat):
                parse()
            timings[name].append(round(1000 * (time.perf_counter() - started) / repeat, 3))
    return {"page": str(page), "lines": len(text.splitlines()), "bytes": len(text), **timings}


def full_collections_ms(rounds: int) -> list[float]:
    """How long each of ``rounds`` full garbage collections takes, in ms."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - start) * 1000)
    return times


def _rounded(times: list[float]) -> list[float]:
    return [round(t, 2) for t in times]


def collector_pause(rounds: int = 5) -> dict[str, Any]:
    """A full garbage collection in a started router service (built as ``serve`` builds it,
    gRPC on a loopback port, two endpoints), before and after serve.freeze_start_up_heap:
    what a decision waits when the collector's oldest generation comes due."""
    import asyncio

    from .config import load_config
    from .serve import RouterService, freeze_start_up_heap

    async def measure() -> dict[str, Any]:
        config = load_config(
            None, {"server.listen": "127.0.0.1:0", "endpoints": "127.0.0.1:9,127.0.0.1:10"}
        )
        service = RouterService(config, None, serve_admin=False)
        await service.start()
        try:
            before = _rounded(full_collections_ms(rounds))
            tracked = len(gc.get_objects())
            frozen = freeze_start_up_heap()
            after = _rounded(full_collections_ms(rounds))
            tracked_after = len(gc.get_objects())
        finally:
            gc.unfreeze()
            await service.stop(grace=0.1, notice=0)
        return {
            "tracked_objects": tracked,
            "frozen_objects": frozen,
            "tracked_after_freeze": tracked_after,
            "full_collection_ms": before,
            "full_collection_frozen_ms": after,
        }

    return asyncio.run(measure())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="2,32,1024", help="body sizes in KiB")
    parser.add_argument("--endpoints", default="4,64,512", help="endpoint counts")
    parser.add_argument("--requests", type=int, default=2000, help="timed decisions per cell")
    parser.add_argument("--short", action="store_true", help="CI mode: few requests")
    parser.add_argument(
        "--history",
        type=int,
        default=1,
        help="messages the conversation's shared part is split into (a long conversation)",
    )
    add_routing_argument(
        parser,
        help_text="a routing setting for the timed router (repeatable), e.g. max_blocks=1024",
    )
    parser.add_argument(
        "--index-memory",
        metavar="ENDPOINTS,BLOCKS",
        help="also fill an index of ENDPOINTS x BLOCKS blocks and report its memory "
        "(e.g. 64,100000)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also print each stage's share of the decision (cProfile) for the largest cell",
    )
    parser.add_argument(
        "--peer-placements",
        action="store_true",
        help="also measure what sharing placements with peer routers costs (decision with "
        "and without the log; recording a peer's placements, per reader slice)",
    )
    parser.add_argument(
        "--metrics-page",
        metavar="FILE",
        type=Path,
        help="also time parsing this /metrics page (filtered, and whole as before), e.g. "
        "tests/data/vllm-0.32.0-metrics.txt",
    )
    parser.add_argument(
        "--collector",
        action="store_true",
        help="also time a full garbage collection in a started router service, before and "
        "after its start-up heap is frozen (as serve does)",
    )
    parser.add_argument("--json", metavar="FILE")


def run(args: argparse.Namespace) -> int:
    sizes = [int(s) * KIB for s in args.sizes.split(",")]
    counts = [int(c) for c in args.endpoints.split(",")]
    requests = 50 if args.short else args.requests
    overrides = routing_overrides(args.routing)
    routing = RoutingConfig(**overrides)
    rows = []
    print(
        f"{'body':>8} {'endpoints':>9} {'p50 us':>9} {'p99 us':>9} {'mean us':>9}"
        f" {'answer p50':>10} {'answer p99':>10}"
    )
    for size in sizes:
        for count in counts:
            # 1 MiB bodies: fewer requests, the cell would otherwise take minutes.
            n = max(20, requests // 10) if size >= 512 * KIB else requests
            row = measure(size, count, n, routing, args.history)
            rows.append(row)
            print(
                f"{size // KIB:>6}Ki {count:>9} {row['p50_us']:>9.1f} {row['p99_us']:>9.1f} "
                f"{row['mean_us']:>9.1f} {row['answer_p50_us']:>10.1f} {row['answer_p99_us']:>10.1f}",
                flush=True,
            )
    doc: dict[str, Any] = {"command": "prefix-router bench core " + " ".join(sys.argv[3:])}
    doc["routing_overrides"] = overrides
    doc["rows"] = rows
    if args.profile:
        size, count = max(sizes), max(counts)
        shares = profile(size, count, max(20, requests // 4), args.history)
        doc["profile"] = {"body_bytes": size, "endpoints": count, "shares": shares}
        print(f"profile, {size // KIB} KiB x {count} endpoints (cProfile, share of a decision):")
        for stage, share in shares.items():
            print(f"  {stage:<22} {100 * share:5.1f} %")
    if args.index_memory:
        endpoints, blocks = (int(v) for v in args.index_memory.split(","))
        memory = index_memory(endpoints, blocks)
        doc["index_memory"] = memory
        print(
            f"index, {endpoints} endpoints x {blocks:,} blocks: {memory['entries']:,} entries, "
            f"reported {memory['reported_bytes'] / 2**20:.1f} MiB, "
            f"RSS growth {memory['rss_growth_bytes'] / 2**20:.1f} MiB "
            f"(filled in {memory['fill_seconds']} s)"
        )
    if args.peer_placements:
        count = max(counts) if max(counts) <= 64 else 64
        shared = peer_placements(count, max(50, requests // 4))
        doc["peer_placements"] = shared
        print(f"peer placements, {count} endpoints (five alternating rounds):")
        print(f"  decision, 32 KiB, no log   us: {shared['decision_us_without_log']}")
        print(f"  decision, 32 KiB, with log us: {shared['decision_us_with_log']}")
        for row in shared["recording"]:
            print(
                f"  recording {row['placements']} placements x {row['blocks_each']} blocks: "
                f"total ms {row['total_ms']}, longest slice ms {row['longest_slice_ms']}"
            )
    if args.metrics_page:
        parsed = metrics_parse(args.metrics_page)
        doc["metrics_parse"] = parsed
        print(f"/metrics page {parsed['page']} ({parsed['lines']} lines, five alternating rounds):")
        print(f"  parse_metrics (read samples only) ms: {parsed['filtered_ms']}")
        print(f"  whole page, prometheus_client     ms: {parsed['whole_page_ms']}")
    if args.collector:
        pause = collector_pause()
        doc["collector"] = pause
        print(
            f"full garbage collection in a started router service, "
            f"{pause['tracked_objects']:,} objects tracked:"
        )
        print(f"  as started           ms: {pause['full_collection_ms']}")
        print(
            f"  start-up heap frozen ms: {pause['full_collection_frozen_ms']} "
            f"({pause['frozen_objects']:,} frozen, {pause['tracked_after_freeze']:,} left)"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2))
    return 0
