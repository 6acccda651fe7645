"""`prefix-router bench share`: how soon a router's traffic share shows a change.

A router reads its share of the traffic from the endpoints' metrics (Router._learn_traffic_share)
and widens its cold-start margin as the share falls, so that router replicas without shared
state agree on where new conversations go. This drives the router itself, its clock by hand,
with endpoints that report at once what reached them, read every ``--scrape-seconds`` as the
server reads them: a second router joins at a steady rate (taking every other request), and
the table says how many seconds pass before this router's share reads under 0.9 (where a
router alone stops balancing its cold starts) and under 0.55 (near a half), and after the
second router leaves again, before it reads over 0.55 and 0.9; then, at low
traffic, whether and when a router sent a quarter of the requests measures its share;
then what it reads through a lull, after a burst through it, and with requests split at
random (the cases a simulator whose routers start together at a steady rate cannot show).
Prints the tables; --json writes them.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import statistics
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import orjson

from .config import EndpointConfig, RoutingConfig
from .prompt import parse_request
from .router import Router

SYSTEM = "You are a meticulous assistant that answers with care. " * 20
# Arrivals come this long after their nominal times, so that none falls exactly on a round
# of readings (every 0.5 s): which round counted it would hang on rounding.
ARRIVAL_PHASE_SECONDS = 0.001
# How long the low-traffic table's routers run.
QUIET_SECONDS = 1800.0


class HandClock:
    """The router's clock, moved by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def replay(
    arrivals: Iterable[tuple[float, bool]],
    endpoints: int,
    scrape_seconds: float,
    seconds: float,
) -> Iterator[tuple[float, Router]]:
    """Requests reach ``endpoints`` endpoints in turn at the times given, those marked True
    sent by this router (the others by other routers or clients); each endpoint is read
    every ``scrape_seconds`` for ``seconds`` and reports finishing at once what reached it.
    Yields (time, the router) after each round of readings."""
    clock = HandClock()
    addresses = [EndpointConfig(address=f"10.1.0.{i}:8000") for i in range(endpoints)]
    router = Router(RoutingConfig(), addresses, clock=clock)
    arrived = [0.0] * endpoints
    counters = [(0.0, 0.0, 0.0)] * endpoints
    pending = iter(arrivals)
    upcoming = next(pending, None)
    n = 0
    while clock.now < seconds:
        while upcoming is not None and upcoming[0] <= clock.now:
            i = n % endpoints
            if upcoming[1]:
                only = frozenset({addresses[i].address})
                router.finish(router.route(_request(f"quiet {n} " * 30), allowed=only))
            arrived[i] += 1.0
            upcoming, n = next(pending, None), n + 1
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


def share_over_time(
    endpoints: int,
    scrape_seconds: float,
    every: Callable[[int], int],
    request_seconds: float = 1.0,
    seconds: float = 40.0,
) -> Iterator[tuple[float, Router]]:
    """``replay`` of one request each ``request_seconds``, this router sending the n-th
    when n is a multiple of ``every(n)``."""
    arrivals = _steady(0.0, seconds, 1.0 / request_seconds, lambda n: n % every(n) == 0)
    return replay(arrivals, endpoints, scrape_seconds, seconds)


def _steady(
    start: float, end: float, rate: float, ours: Callable[[int], bool]
) -> Iterator[tuple[float, bool]]:
    """Arrivals at ``rate`` from ``start`` to ``end``, the n-th this router's if ``ours(n)``."""
    n = 0
    while start + n / rate < end:
        yield start + n / rate + ARRIVAL_PHASE_SECONDS, ours(n)
        n += 1


def after_a_lull(
    rate: float = 20.0, endpoints: int = 8, scrape_seconds: float = 0.5
) -> dict[str, float]:
    """This router alone for 600 s, a second router taking every other request for 40 s,
    then silence for 900 s, then both again: the share when the traffic stopped, through
    the silence, and 1 and 5 s after it resumed (a router back at "alone", >= 0.9, after
    a lull would route the first requests as if alone)."""
    arrivals = [
        *_steady(0.0, 600.0, rate, lambda n: True),
        *_steady(600.0, 640.0, rate, lambda n: n % 2 == 0),
        *_steady(1540.0, 1600.0, rate, lambda n: n % 2 == 0),
    ]
    marks = {"at_stop": 640.0, "silent_60s": 700.0, "silent_300s": 940.0}
    marks |= {"silent_900s": 1539.5, "resumed_1s": 1541.0, "resumed_5s": 1545.0}
    read = {}
    for now, router in replay(arrivals, endpoints, scrape_seconds, 1546.0):
        for name, at in marks.items():
            if name not in read and now >= at:
                read[name] = router.traffic_share
    return read


def through_a_burst(
    rate: float = 2.0, burst: int = 80, endpoints: int = 8, scrape_seconds: float = 0.5
) -> dict[str, float]:
    """Two routers alternating at ``rate`` for 120 s, then ``burst`` requests in one second
    through this one (a client's batch), then alternating again: the share before it and
    the highest it reads from the burst's start until 5 s after it (at 0.9 or more it
    takes itself for alone)."""
    arrivals = [
        *_steady(0.0, 120.0, rate, lambda n: n % 2 == 0),
        *_steady(120.0, 121.0, float(burst), lambda n: True),
        *_steady(121.0, 130.0, rate, lambda n: n % 2 == 0),
    ]
    before, highest = 0.0, 0.0
    for now, router in replay(arrivals, endpoints, scrape_seconds, 126.0):
        if now < 120.0:
            before = router.traffic_share
        else:
            highest = max(highest, router.traffic_share)
    return {"before": before, "highest_after": highest}


def random_split(
    share: float,
    rate: float = 10.0,
    endpoints: int = 8,
    scrape_seconds: float = 0.5,
    seed: int = 1,
) -> dict[str, float]:
    """Each request this router's with probability ``share`` (clients spread at random),
    at ``rate`` for 600 s: the spread of its readings after the first 60 s, and how often
    they cross ``balance_min_share`` a minute."""
    rng = random.Random(seed)
    arrivals = list(_steady(0.0, 600.0, rate, lambda n: rng.random() < share))
    threshold = RoutingConfig().balance_min_share
    readings: list[float] = []
    for now, router in replay(arrivals, endpoints, scrape_seconds, 600.0):
        if now >= 60.0:
            readings.append(router.traffic_share)
    above = [r >= threshold for r in readings]
    crossings = sum(a != b for a, b in itertools.pairwise(above))
    return {
        "true_share": share,
        "lowest": min(readings),
        "highest": max(readings),
        "standard_deviation": statistics.pstdev(readings),
        "crossings_per_minute": crossings / ((len(readings) * scrape_seconds) / 60.0),
    }


def _request(text: str) -> Any:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]
    return parse_request("chat", orjson.dumps({"model": "m", "messages": messages}))


def seconds_until_share_crosses(
    rate: float,
    thresholds: tuple[float, ...] = (0.9, 0.55),
    endpoints: int = 8,
    scrape_seconds: float = 0.5,
    leaving: bool = False,
) -> dict[float, float]:
    """Seconds after a second router joined (taking every other request, after this one
    had them all for 60 s plus 300 requests' time) until this one's share reads under each
    threshold; or, ``leaving``, after the second router left (this one had every other
    request as long) until it reads at or over each; inf where not within 1,200 requests'
    time and 600 s."""
    request_seconds = 1.0 / rate
    changed_at = 300 * request_seconds + 60.0
    changed_request = 300 + 60.0 * rate
    before, after = (2, 1) if leaving else (1, 2)
    took = dict.fromkeys(thresholds, math.inf)
    for now, router in share_over_time(
        endpoints,
        scrape_seconds,
        lambda n: before if n < changed_request else after,
        request_seconds,
        changed_at + 1200 * request_seconds + 600.0,
    ):
        if now > changed_at and router.traffic_share_measured:
            share = router.traffic_share
            for threshold in thresholds:
                crossed = share >= threshold if leaving else share < threshold
                if math.isinf(took[threshold]) and crossed:
                    took[threshold] = now - changed_at
            if not any(math.isinf(t) for t in took.values()):
                break
    return took


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
    joining, leaving = [], []
    for rate in (float(r) for r in args.rates.split(",")):
        for rows, left in ((joining, False), (leaving, True)):
            took = seconds_until_share_crosses(
                rate, (0.9, 0.55), args.endpoints, args.scrape_seconds, leaving=left
            )
            row: dict[str, float | None] = {"requests_per_second": rate}
            for threshold in (0.9, 0.55):
                label = f"{'over' if left else 'below'}_{str(threshold).replace('.', '_')}_s"
                row[label] = None if math.isinf(took[threshold]) else took[threshold]  # None: never
            rows.append(row)
    print(
        f"A second router joins (every other request from then on), or leaves (this router "
        f"had every other request): seconds until this router's share reads under / over "
        f"0.9 and 0.55 ({args.endpoints} endpoints read every {args.scrape_seconds} s; "
        f"never: not within 600 s, or the share not measured)"
    )
    print(
        "| requests a second | joins: under 0.9 s | under 0.55 s | leaves: over 0.55 s "
        "| over 0.9 s |\n|---:|---:|---:|---:|---:|"
    )
    for joined, left in zip(joining, leaving, strict=True):
        cells = [
            "never" if row[k] is None else f"{row[k]:.1f}"
            for row, k in (
                (joined, "below_0_9_s"),
                (joined, "below_0_55_s"),
                (left, "over_0_55_s"),
                (left, "over_0_9_s"),
            )
        ]
        print(f"| {joined['requests_per_second']:g} | " + " | ".join(cells) + " |")
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
    lull = after_a_lull(endpoints=args.endpoints, scrape_seconds=args.scrape_seconds)
    print(
        "\nAfter a lull (alone 600 s at 20 requests a second, shared 40 s, silent 900 s, "
        "shared again): the share read"
    )
    print("| " + " | ".join(lull) + " |\n|" + "---:|" * len(lull))
    print("| " + " | ".join(f"{v:.3f}" for v in lull.values()) + " |")
    rate, size = 2.0, 80
    burst = through_a_burst(rate, size, args.endpoints, args.scrape_seconds)
    print(
        f"\nA burst (two routers at {rate:g} requests a second, then {size} in one second "
        f"through this one): share before {burst['before']:.3f}, highest from its start "
        f"until 5 s after {burst['highest_after']:.3f}"
    )
    spread = [
        random_split(share, endpoints=args.endpoints, scrape_seconds=args.scrape_seconds)
        for share in (0.5, 0.85)
    ]
    print(
        "\nRequests split at random, 10 a second for 600 s (readings after the first 60 s; "
        "crossings of balance_min_share a minute)"
    )
    print("| true share | lowest | highest | SD | crossings a minute |\n|---:|---:|---:|---:|---:|")
    for row in spread:
        print(
            f"| {row['true_share']:g} | {row['lowest']:.3f} | {row['highest']:.3f} | "
            f"{row['standard_deviation']:.3f} | {row['crossings_per_minute']:.1f} |"
        )
    if args.json_out:
        command = "prefix-router bench share " + " ".join(sys.argv[3:])
        document = {
            "command": command,
            "joining": joining,
            "leaving": leaving,
            "quiet": quiet,
            "after_a_lull": lull,
            "through_a_burst": burst,
            "random_split": spread,
        }
        Path(args.json_out).write_text(json.dumps(document, indent=2) + "\n")
    return 0
