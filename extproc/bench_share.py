"""`prefix-router bench share`: how soon a router's traffic share shows a change.

A router reads its share of the traffic from the endpoints' metrics (Router._learn_traffic_share)
and widens its cold-start margin as the share falls, so that router replicas without shared
state agree on where new conversations go. This drives the router itself, its clock by hand,
with endpoints that report at once what reached them, read every ``--scrape-seconds`` as the
server reads them: a second router joins at a steady rate (taking every other request), and
the table says how many seconds pass before this router's share reads under 0.9 (where a
router alone stops balancing its cold starts) and under 0.55 (near a half); then, at rates too
low for that, whether a router sent a quarter of the requests measures its share at all.
Prints the tables; --json writes them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson

from .config import EndpointConfig, RoutingConfig
from .prompt import parse_request
from .router import Router

SYSTEM = "You are a meticulous assistant that answers with care. " * 20
# How long the low-traffic table's routers run.
QUIET_SECONDS = 1800.0


class HandClock:
    """The router's clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def share_over_time(
    endpoints: int,
    scrape_seconds: float,
    every: Callable[[float], int],
    request_seconds: float = 1.0,
    seconds: float = 40.0,
) -> Iterator[tuple[float, Router]]:
    """A router sent every ``every(t)``-th of the requests that reach ``endpoints``
    endpoints, one each ``request_seconds`` (others' requests arrive too), each endpoint
    read every ``scrape_seconds`` for ``seconds`` and reporting finishing at once what
    reached it; yields (time, the router) after each round of readings."""
    clock = HandClock()
    addresses = [EndpointConfig(address=f"10.1.0.{i}:8000") for i in range(endpoints)]
    router = Router(RoutingConfig(), addresses, clock=clock)
    arrived = [0.0] * endpoints
    counters = [(0.0, 0.0, 0.0)] * endpoints
    next_request, n = 0.0, 0
    while clock.now < seconds:
        while next_request <= clock.now:
            i = n % endpoints
            if n % every(next_request) == 0:
                only = frozenset({addresses[i].address})
                router.finish(router.route(_request(f"quiet {n} " * 30), allowed=only))
            arrived[i] += 1.0
            next_request, n = next_request + request_seconds, n + 1
        for i, e in enumerate(addresses):
            done = (1000.0 * arrived[i], arrived[i], 0.1 * arrived[i])
            window = tuple(b - a for a, b in zip(counters[i], done, strict=True))
            counters[i] = done
            router.observe_signals(
                e.address,
                up=True,
                running=0,
                waiting=0,
                prefill_window=window if window[1] else None,
                counts_finished=True,
            )
        yield clock.now, router
        clock.now += scrape_seconds


def _request(text: str) -> Any:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
    return parse_request("chat", orjson.dumps({"model": "m", "messages": messages}))


def seconds_until_share_below(
    rate: float, below: float, endpoints: int = 8, scrape_seconds: float = 0.5
) -> float:
    """Seconds after a second router joined (taking every other request, after this one
    had them all for 60 s plus 300 requests' time) until this one's share reads under
    ``below``; inf if not within 1,200 requests' time and 600 s."""
    request_seconds = 1.0 / rate
    joined_at = 300 * request_seconds + 60.0
    for now, router in share_over_time(
        endpoints,
        scrape_seconds,
        lambda t: 1 if t < joined_at else 2,
        request_seconds,
        joined_at + 1200 * request_seconds + 600.0,
    ):
        if now > joined_at and router.traffic_share < below:
            return now - joined_at
    return math.inf


def _quiet(gap: float, scrape_seconds: float) -> dict[str, Any]:
    """A router sent a quarter of one request every ``gap`` seconds over 16 endpoints:
    when it first measured its share, and the share at the end."""
    first = None
    for now, router in share_over_time(16, scrape_seconds, lambda _: 4, gap, QUIET_SECONDS):
        if first is None and router.traffic_share_measured:
            first = now
    return {
        "seconds_between_requests": gap,
        "first_measured_s": first,
        "share": router.traffic_share,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rates",
        default="20,10,6,4,3,2,1,0.75,0.5,0.25",
        help="requests a second in all (joining)",
    )
    parser.add_argument(
        "--quiet-gaps",
        default="1,2,3,4,8,16",
        help="seconds between requests for the low-traffic table (a quarter this router's)",
    )
    parser.add_argument("--endpoints", type=int, default=8, help="endpoints read (joining)")
    parser.add_argument(
        "--scrape-seconds", type=float, default=0.5, help="each endpoint read this often"
    )
    parser.add_argument("--json", dest="json_out", help="write the results here")


def run(args: argparse.Namespace) -> int:
    joining = []
    for rate in (float(r) for r in args.rates.split(",")):
        row = {"requests_per_second": rate}
        for label, below in (("below_0_9_s", 0.9), ("below_0_55_s", 0.55)):
            took = seconds_until_share_below(rate, below, args.endpoints, args.scrape_seconds)
            row[label] = None if math.isinf(took) else took  # None: never
        joining.append(row)
    print(
        f"A second router joins (every other request from then on): seconds until this "
        f"router's share reads under 0.9 / 0.55 ({args.endpoints} endpoints read every "
        f"{args.scrape_seconds} s)"
    )
    print("| requests a second | under 0.9 s | under 0.55 s |\n|---:|---:|---:|")
    for row in joining:
        cells = [
            "never" if row[k] is None else f"{row[k]:.1f}" for k in ("below_0_9_s", "below_0_55_s")
        ]
        print(f"| {row['requests_per_second']:g} | {cells[0]} | {cells[1]} |")
    quiet = [_quiet(float(gap), args.scrape_seconds) for gap in args.quiet_gaps.split(",")]
    print(
        f"\nLow traffic: a router sent a quarter of the requests over 16 endpoints for "
        f"{QUIET_SECONDS:.0f} s (it takes itself for alone, share 1, until measured)"
    )
    print("| one request every s | first measured at s | share at the end |\n|---:|---:|---:|")
    for row in quiet:
        first = row["first_measured_s"]
        when = "never" if first is None else f"{first:.0f}"
        print(f"| {row['seconds_between_requests']:g} | {when} | {row['share']:.3f} |")
    if args.json_out:
        command = "prefix-router bench share " + " ".join(sys.argv[3:])
        document = {"command": command, "joining": joining, "quiet": quiet}
        Path(args.json_out).write_text(json.dumps(document, indent=2) + "\n")
    return 0
