"""`prefix-router bench latency`: what the router adds to one request's latency.

Three Envoys in front of the same instant-answer stand-in replicas: one with the ext_proc
filter and the router, one with the same filter and a no-op Python processor
(extproc.noop_processor: the floor of any Python grpc.aio ext_proc service; BUFFERED only),
one plain round robin. One keep-alive connection each, requests alternate between them
(A, B, C, A, B, C, ...) so machine noise hits all alike; the figures are differences of the
medians. Sequential, bounded by --requests.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from .stack import LOOPBACK, Stack, router_args_for

INSTANT_REPLICA = [
    "--base-ttft-ms",
    "0",
    "--prefill-ms-per-token",
    "0",
    "--decode-ms-per-token",
    "0",
    "--output-tokens",
    "1",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=2000, help="per configuration")
    parser.add_argument("--body-bytes", type=int, default=2048, help="chat body size")
    parser.add_argument(
        "--body-mode", choices=["buffered", "full_duplex_streamed"], default="buffered"
    )
    parser.add_argument(
        "--mode", choices=["override-host", "original-dst"], default="override-host"
    )
    parser.add_argument("--json", metavar="FILE")


def _body(size: int, i: int) -> bytes:
    # Distinct conversations with a shared system prompt, padded to about `size` bytes.
    system = "You are a helpful assistant. " * 8
    question = f"Question {i % 64}: " + "x" * max(0, size - len(system) - 120)
    return json.dumps(
        {
            "model": "demo-model",
            "max_tokens": 1,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ],
        }
    ).encode()


def _timed_post(conn: http.client.HTTPConnection, body: bytes) -> float:
    started = time.perf_counter()
    conn.request(
        "POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"}
    )
    response = conn.getresponse()
    response.read()
    elapsed = time.perf_counter() - started
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}")
    return elapsed * 1000


def _stats(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": round(statistics.median(ordered), 3),
        "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))], 3),
        "p99_ms": round(ordered[int(0.99 * (len(ordered) - 1))], 3),
        "mean_ms": round(statistics.fmean(ordered), 3),
    }


def run(args: argparse.Namespace) -> int:
    results: dict[str, Any] = {}
    with Stack() as stack:
        replicas = stack.start_replicas(2, INSTANT_REPLICA)
        router, _ = stack.start_router(
            replicas, body_mode=args.body_mode, extra_args=router_args_for(args.mode)
        )
        processors = {"with_router": router}
        if args.body_mode == "buffered":
            processors["with_noop"], _ = stack.start_noop_processor()
        ports = {}
        for label, processor in processors.items():
            ports[label], _ = stack.start_proxy(
                args.mode, replicas, processor, args.body_mode, name=f"envoy-{label}"
            )
        ports["envoy_only"], _ = stack.start_proxy(
            "round-robin", replicas, None, args.body_mode, name="envoy-envoy_only"
        )
        conns = {k: http.client.HTTPConnection(LOOPBACK, p, timeout=10) for k, p in ports.items()}
        samples: dict[str, list[float]] = {k: [] for k in conns}
        for i in range(50):  # warm-up: connections, Envoy and the router's code paths
            for conn in conns.values():
                _timed_post(conn, _body(args.body_bytes, i))
        for i in range(args.requests):
            for label, conn in conns.items():
                samples[label].append(_timed_post(conn, _body(args.body_bytes, i)))
        for conn in conns.values():
            conn.close()
    for label, values in samples.items():
        results[label] = _stats(values)
    added = round(results["with_router"]["p50_ms"] - results["envoy_only"]["p50_ms"], 3)
    results["added_p50_ms"] = added
    if "with_noop" in results:
        floor = round(results["with_noop"]["p50_ms"] - results["envoy_only"]["p50_ms"], 3)
        results["noop_added_p50_ms"] = floor
    results["params"] = {
        "requests": args.requests,
        "body_bytes": args.body_bytes,
        "body_mode": args.body_mode,
        "mode": args.mode,
        "command": "prefix-router bench latency " + " ".join(sys.argv[3:]),
    }
    print(f"{'':14}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'mean ms':>9}")
    for label in ("envoy_only", "with_noop", "with_router"):
        if label not in results:
            continue
        r = results[label]
        print(
            f"{label:14}{r['p50_ms']:9.3f}{r['p90_ms']:9.3f}{r['p99_ms']:9.3f}{r['mean_ms']:9.3f}"
        )
    print(f"router adds {added:.3f} ms at p50 ({args.requests} requests each, alternating)")
    if "noop_added_p50_ms" in results:
        print(
            f"a no-op Python ext_proc processor adds {results['noop_added_p50_ms']:.3f} ms at p50"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0
