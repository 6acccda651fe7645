"""What router replicas restarting or scaling cost: the same run with and without the change.

A fresh router starts with an empty index and an unmeasured traffic share, so for a while
it sends returning prefixes where it would place them new. Each scenario runs the workload
with its router change (engine.RouterChange) and without it, at the router count it starts
with and at the one it ends with, over several seeds, and compares the hit ratio of the
requests arriving in each stretch: before the change, the window after it, the rest.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .engine import RouterChange, SimParams, simulate
from .report import percentile, phase_summaries
from .workloads import Workload

# How long a rolled router's successor routes beside it (a pod's readiness to its
# predecessor's removal from the gateway's endpoints; a few seconds, assumed).
SURGE_OVERLAP_S = 5.0


@dataclass(frozen=True)
class Scenario:
    name: str
    routers: int
    peers: bool
    # (seconds after the change's time, what) -> the changes of the run
    steps: tuple[tuple[float, RouterChange], ...]

    @property
    def routers_after(self) -> int:
        count = self.routers
        for _, change in self.steps:
            if change.replicas is not None:
                count = change.replicas
        return count


def scenarios(window_s: float) -> list[Scenario]:
    """A deployment's router changes: a lone router restarted (an upgrade, a crash), or
    rolled as a Deployment does (its successor routing SURGE_OVERLAP_S beside it first); a
    high-availability pair rolled one after the other (the second a quarter of the window
    after the first), without and with ``peers``, each old one gone as its successor
    starts, and with ``peers`` as the shipped Deployment rolls (maxSurge 1: the successor
    routes SURGE_OVERLAP_S beside it first); a scale-out 2 -> 4 and a scale-in 4 -> 2."""
    restart = RouterChange(0.0, restart=True)
    surge = RouterChange(0.0, restart=True, overlap_s=SURGE_OVERLAP_S)
    second = window_s / 4
    return [
        Scenario("restart, one router", 1, False, ((0.0, restart),)),
        Scenario(f"rolling, {SURGE_OVERLAP_S:g} s overlap, one router", 1, False, ((0.0, surge),)),
        Scenario("rolling restart, two routers", 2, False, ((0.0, restart), (second, restart))),
        Scenario(
            "rolling restart, two routers, peers", 2, True, ((0.0, restart), (second, restart))
        ),
        Scenario(
            f"rolling, {SURGE_OVERLAP_S:g} s overlap, peers",
            2,
            True,
            ((0.0, surge), (second, surge)),
        ),
        Scenario("scale out 2 -> 4", 2, False, ((0.0, RouterChange(0.0, replicas=4)),)),
        Scenario("scale in 4 -> 2", 4, False, ((0.0, RouterChange(0.0, replicas=2)),)),
    ]


def _changes(
    scenario: Scenario | None, routers: int, at_s: float, window_s: float
) -> tuple[RouterChange, ...]:
    """The run's changes: the scenario's at ``at_s``, else boundaries only (the count it
    has), and always a boundary at the window's end, so every run reports three stretches."""
    if scenario is None:
        return (
            RouterChange(at_s, replicas=routers),
            RouterChange(at_s + window_s, replicas=routers),
        )
    steps = [dataclasses.replace(c, at_s=at_s + after) for after, c in scenario.steps]
    return (*steps, RouterChange(at_s + window_s, replicas=scenario.routers_after))


def _stretches(phases: list[dict[str, Any]], at_s: float, window_s: float) -> list[float | None]:
    """Hit ratio of the requests before ``at_s``, in the window after it, and after that,
    from the run's stretches (a rolling restart's second step splits the window: merged);
    None where no request arrived."""
    out: list[float | None] = []
    for start, end in ((0.0, at_s), (at_s, at_s + window_s), (at_s + window_s, float("inf"))):
        chosen = [p for p in phases if start <= p["from_s"] < end]
        prompt = sum(p["prompt_tokens"] for p in chosen)
        out.append(sum(p["hit_tokens"] for p in chosen) / prompt if prompt else None)
    return out


def _mean(values: list[float | None]) -> float | None:
    """The mean of the seeds that had requests there (None if none had)."""
    present = [v for v in values if v is not None]
    return round(statistics.fmean(present), 4) if present else None


def run_scenarios(
    workload_for_seed: Callable[[int], Workload],
    base: SimParams,
    seeds: Sequence[int],
    at_s: float,
    window_s: float,
    progress: Callable[[], None] | None = None,
) -> list[dict[str, Any]]:
    """Each scenario's mean hit ratio per stretch and overall, and p99, over ``seeds``:
    changed, static at the count it starts with, static at the one it ends with."""
    rows = []
    cache: dict[tuple[int, bool, int], dict[str, Any]] = {}

    def one(scenario: Scenario | None, routers: int, peers: bool, seed: int) -> dict[str, Any]:
        key = (routers, peers, seed)
        if scenario is None and key in cache:
            return cache[key]
        params = dataclasses.replace(
            base,
            router_replicas=routers,
            seed=seed,
            share_queues=peers,
            share_placements=peers,
            router_changes=_changes(scenario, routers, at_s, window_s),
        )
        result = simulate(workload_for_seed(seed), "ours", params)
        phases = phase_summaries(result, with_tokens=True)
        hits = sum(p["hit_tokens"] for p in phases)
        prompt = sum(p["prompt_tokens"] for p in phases)
        ttft = sorted(r.ttft_ms for r in result.records)
        figures = {
            "stretches": _stretches(phases, at_s, window_s),
            "hit_ratio": hits / prompt if prompt else 0.0,
            "ttft_p99_ms": percentile(ttft, 99),
        }
        if scenario is None:
            cache[key] = figures
        if progress is not None:
            progress()
        return figures

    for scenario in scenarios(window_s):
        runs: dict[str, list[dict[str, Any]]] = {"changed": [], "before": [], "after": []}
        for seed in seeds:
            runs["changed"].append(one(scenario, scenario.routers, scenario.peers, seed))
            runs["before"].append(one(None, scenario.routers, scenario.peers, seed))
            runs["after"].append(one(None, scenario.routers_after, scenario.peers, seed))
        row: dict[str, Any] = {
            "scenario": scenario.name,
            "routers": scenario.routers,
            "routers_after": scenario.routers_after,
            "peers": scenario.peers,
        }
        for label, figures in runs.items():
            row[label] = {
                "stretches": [_mean([f["stretches"][i] for f in figures]) for i in range(3)],
                "hit_ratio": round(statistics.fmean(f["hit_ratio"] for f in figures), 4),
                "ttft_p99_ms": round(statistics.fmean(f["ttft_p99_ms"] for f in figures), 1),
                "per_seed_hit_ratio": [round(f["hit_ratio"], 4) for f in figures],
            }
        rows.append(row)
    return rows


def runs_needed(seeds: int) -> int:
    """Simulations run_scenarios makes (static runs shared between scenarios)."""
    static = {(s.routers, s.peers) for s in scenarios(1.0)}
    static |= {(s.routers_after, s.peers) for s in scenarios(1.0)}
    return seeds * (len(scenarios(1.0)) + len(static))


def table(rows: list[dict[str, Any]], at_s: float, window_s: float) -> str:
    """Per scenario: hit ratio per stretch and overall, changed against static."""
    w_end = at_s + window_s
    head = (
        f"{'scenario':38}{'run':>12}{f'0-{at_s:g} s':>12}{f'{at_s:g}-{w_end:g} s':>14}"
        f"{f'{w_end:g} s-end':>12}{'whole':>9}{'p99 ms':>10}"
    )
    lines = [head]
    for row in rows:
        labels = [("changed", "changed")]
        labels.append(("before", f"static K={row['routers']}"))
        if row["routers_after"] != row["routers"]:
            labels.append(("after", f"static K={row['routers_after']}"))
        for i, (key, label) in enumerate(labels):
            figures = row[key]
            s = ["-" if v is None else f"{v:.4f}" for v in figures["stretches"]]
            lines.append(
                f"{row['scenario'] if i == 0 else '':38}{label:>12}{s[0]:>12}{s[1]:>14}"
                f"{s[2]:>12}{figures['hit_ratio']:>9.4f}{figures['ttft_p99_ms']:>10.0f}"
            )
    return "\n".join(lines)
