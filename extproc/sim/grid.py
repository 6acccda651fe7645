"""The simulator grid: workloads x replicas x tight/loose KV x router replicas K, every cell a
plain `simulate` run, spread over worker processes.

It answers the question issue #3 asks of our scheduler — in each cell, is ours' hit ratio the
highest of the non-oracle policies and its TTFT p99 the lowest, and how much does K=4 lose
against K=1 — with one command, so a tuning change can be judged on all cells at once.
Peers do not depend on our routing configuration: ``--peers-from`` reuses their figures from
an earlier grid JSON, so a tuning run only re-simulates ours.

With several seeds (``--seeds N``) every cell runs once per seed — a generated workload is
drawn anew from each seed, a trace's replicas get new names (the addresses ours' rendezvous
order and the hash ring hash: on a trace, before Dec 7, ours at K=1 and consistent hashing
ran the same run five times; SGLang, which names no replica, still does), the simulator's
own randomness (K router replicas, the random policy) follows it — and the verdicts compare
means: a p99 a few milliseconds apart on one
draw of the workload can swap places on the next (docs/benchmarks.md, the grid section).
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import RoutingConfig
from .engine import SimParams, simulate
from .policies import ALL_POLICIES, BOUNDS, ideal_hit_ratio
from .replica import DEFAULT_KV_POOL, CostModel
from .report import summarize
from .workloads import PRESETS, Workload, load_mooncake

# Tight (evicts) and loose KV capacity per replica, in tokens, per workload.
CAPACITIES: dict[str, tuple[int, int]] = {
    "mooncake": (200_000, 1_000_000),
    "gaie-high-cache": (100_000, 400_000),
    "gaie-high-cache-chat": (100_000, 400_000),
    "multi-turn-chat": (50_000, 400_000),
    # Held out: published shapes the scheduler was not tuned on. Tight is where the KV
    # memory the running requests hold (long outputs) starts to queue requests.
    "sglang-shared-prefix": (50_000, 400_000),
    "gaie-low-cache": (100_000, 400_000),
    "llmd-precise-prefix": (600_000, 1_000_000),
    "llmd-tiered-prefix": (400_000, 1_000_000),
    "gaie-long-questions": (600_000, 1_000_000),
    "gaie-multi-chat": (1_000_000, 4_000_000),
    # Small shapes for tests and quick looks.
    "small-shared-prefix": (5_000, 40_000),
    "small-multi-turn": (5_000, 40_000),
}
# The grid of docs/benchmarks.md, and the held-out grid (`--workloads held-out`).
DEFAULT_WORKLOADS = ("mooncake", "gaie-high-cache", "multi-turn-chat")
HELD_OUT_WORKLOADS = (
    "sglang-shared-prefix",
    "gaie-low-cache",
    "llmd-precise-prefix",
    "llmd-tiered-prefix",
    "gaie-long-questions",
    "gaie-multi-chat",
)
# Names `--workloads` takes for a whole set.
WORKLOAD_GROUPS = {"tuned": DEFAULT_WORKLOADS, "held-out": HELD_OUT_WORKLOADS}
OURS = "ours"


@dataclass(frozen=True, slots=True)
class Cell:
    workload: str
    replicas: int
    capacity_tokens: int
    router_replicas: int = 1

    @property
    def name(self) -> str:
        return f"{self.workload} {self.replicas}x{self.capacity_tokens} K={self.router_replicas}"


def cells(workloads: Sequence[str], replicas: Sequence[int], ks: Sequence[int]) -> list[Cell]:
    return [
        Cell(w, n, c, k) for w in workloads for n in replicas for c in CAPACITIES[w] for k in ks
    ]


@functools.cache
def workload_for(name: str, trace: str | None, seed: int = 0) -> Workload:
    """A trace is what it is whatever the seed (which renames its replicas instead:
    engine.simulate): read once for every seed; a generated workload is drawn from it."""
    if name == "mooncake":
        if not trace:
            raise SystemExit("the mooncake workload needs --trace (the Mooncake JSONL file)")
        return _trace(trace)
    return PRESETS[name](seed=seed)


@functools.cache
def _trace(path: str) -> Workload:
    return load_mooncake(path)


@functools.cache
def _ideal(
    name: str, trace: str | None, block_tokens: int, seed: int = 0, cache_outputs: bool = True
) -> float:
    return ideal_hit_ratio(workload_for(name, trace, seed).requests, block_tokens, cache_outputs)


DEFAULT_COST = CostModel()


def run_one(
    cell: Cell,
    policy: str,
    trace: str | None,
    routing: dict[str, Any],
    share_queues: bool = False,
    share_placements: bool = False,
    seed: int = 0,
    kv_pool: str = DEFAULT_KV_POOL,
    server_blocks: bool = False,
    cache_outputs: bool = True,
    kv_events_ms: float | None = None,
    cost: CostModel = DEFAULT_COST,
) -> tuple[Cell, str, dict[str, Any]]:
    """One simulation (runs in a worker process; everything it takes is picklable)."""
    params = SimParams(
        replicas=cell.replicas,
        capacity_tokens=cell.capacity_tokens,
        router_replicas=cell.router_replicas,
        cost=cost,
        routing=RoutingConfig(**routing),
        share_queues=share_queues,
        share_placements=share_placements,
        seed=seed,
        kv_pool=kv_pool,
        server_blocks=server_blocks,
        cache_outputs=cache_outputs,
        kv_events_ms=kv_events_ms,
    )
    workload = workload_for(cell.workload, trace, seed)
    result = simulate(workload, policy, params)
    ideal = _ideal(cell.workload, trace, cost.kv_block_tokens, seed, cache_outputs)
    return cell, policy, summarize(result, ideal)


# Per-seed figures kept beside the means, to show how far one draw strays.
SPREAD_KEYS = ("hit_ratio", "ttft_p99_ms")


def combine_seeds(by_seed: Sequence[dict[str, Any]], seeds: Sequence[int]) -> dict[str, Any]:
    """One policy's summaries over several seeds: numbers averaged (a p99 here is the mean of
    the per-seed p99s), and so are ours' decisions per rule; the per-seed hit ratio and p99
    kept under ``per_seed``."""
    if len(by_seed) == 1:
        return by_seed[0]
    first = by_seed[0]
    out: dict[str, Any] = {
        key: round(sum(s[key] for s in by_seed) / len(by_seed), 4)
        for key, value in first.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool)
    }
    rules = sorted({rule for s in by_seed for rule in s.get("rules", {})})
    if rules:
        out["rules"] = {
            rule: sum(s.get("rules", {}).get(rule, 0) for s in by_seed) / len(by_seed)
            for rule in rules
        }
    out["seeds"] = list(seeds)
    out["per_seed"] = {key: [s[key] for s in by_seed] for key in SPREAD_KEYS}
    return out


def run_grid(
    grid: Iterable[Cell],
    policies: Sequence[str],
    trace: str | None,
    routing: dict[str, Any],
    jobs: int,
    done: Callable[[Cell, str, dict[str, Any]], None] | None = None,
    share_queues: bool = False,
    share_placements: bool = False,
    seeds: Sequence[int] = (0,),
    kv_pool: str = DEFAULT_KV_POOL,
    server_blocks: bool = False,
    cache_outputs: bool = True,
    kv_events_ms: float | None = None,
    cost: CostModel = DEFAULT_COST,
) -> dict[Cell, dict[str, dict[str, Any]]]:
    """Peers and bounds run at K=1 only (their K sweep is `simulate --sweep-k`'s job).
    ``done`` is called once per (cell, policy), when all its seeds have run."""
    work = [
        (cell, policy, seed)
        for cell in grid
        for policy in policies
        if policy == OURS or cell.router_replicas == 1
        for seed in seeds
    ]
    # Longest first (Mooncake's big prompts, then the 8k-request GAIE runs) keeps workers busy.
    work.sort(
        key=lambda item: (item[0].workload != "gaie-high-cache", item[0].workload != "mooncake")
    )
    runs: dict[tuple[Cell, str], dict[int, dict[str, Any]]] = {}
    out: dict[Cell, dict[str, dict[str, Any]]] = {}
    with ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = [
            (
                seed,
                pool.submit(
                    run_one,
                    c,
                    p,
                    trace,
                    routing,
                    share_queues,
                    share_placements,
                    seed,
                    kv_pool,
                    server_blocks,
                    cache_outputs,
                    kv_events_ms,
                    cost,
                ),
            )
            for c, p, seed in work
        ]
        for seed, future in futures:
            cell, policy, summary = future.result()
            per_seed = runs.setdefault((cell, policy), {})
            per_seed[seed] = summary
            if len(per_seed) < len(seeds):
                continue
            combined = combine_seeds([per_seed[s] for s in seeds], seeds)
            out.setdefault(cell, {})[policy] = combined
            if done is not None:
                done(cell, policy, combined)
    return out


def to_json(results: dict[Cell, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    return [
        {
            "workload": c.workload,
            "replicas": c.replicas,
            "capacity_tokens": c.capacity_tokens,
            "router_replicas": c.router_replicas,
            "policies": policies,
        }
        for c, policies in results.items()
    ]


def from_json(rows: list[dict[str, Any]]) -> dict[Cell, dict[str, dict[str, Any]]]:
    return {
        Cell(r["workload"], r["replicas"], r["capacity_tokens"], r["router_replicas"]): r[
            "policies"
        ]
        for r in rows
    }


def grid_cost_model(doc: dict[str, Any]) -> dict[str, Any]:
    """The cost model a grid file ran: grids written before Dec 6 record none, and ran the
    default constants of then, one prefill at a time."""
    recorded = doc.get("cost_model")
    if recorded is not None:
        return dict(recorded)
    return CostModel(prefill_batch_tokens=0).as_dict()


def load_peers(
    path: str | os.PathLike[str],
    seeds: Sequence[int] = (0,),
    kv_pool: str = DEFAULT_KV_POOL,
    cache_outputs: bool = True,
    cost: CostModel = DEFAULT_COST,
) -> dict[Cell, dict[str, dict[str, Any]]]:
    """The peers' figures from an earlier grid, which must have run the same seeds, memory
    and cost model: means over other draws of the workloads, or on other replicas, are not
    comparable."""
    doc = json.loads(Path(path).read_text())
    theirs_cost = grid_cost_model(doc)
    differ = sorted(k for k, v in cost.as_dict().items() if theirs_cost.get(k) != v)
    if differ:
        said = ", ".join(f"{k}={theirs_cost.get(k)}" for k in differ)
        raise SystemExit(
            f"--peers-from {path}: its grid ran the cost model with {said}, this one with "
            + ", ".join(f"{k}={getattr(cost, k)}" for k in differ)
            + " (use the same --cost)"
        )
    # Grids written before item 24 have no "kv_pool": they ran the split model.
    theirs = doc.get("kv_pool", "split")
    if theirs != kv_pool:
        raise SystemExit(
            f"--peers-from {path}: its grid ran --kv-pool {theirs}, this one runs {kv_pool} "
            f"(use the same --kv-pool)"
        )
    if bool(doc.get("cache_outputs", False)) != cache_outputs:
        raise SystemExit(
            f"--peers-from {path}: its grid ran with cache_outputs "
            f"{bool(doc.get('cache_outputs', False))}, this one with {cache_outputs} "
            f"(use the same --cache-outputs)"
        )
    if list(doc.get("seeds", [0])) != list(seeds):
        raise SystemExit(
            f"--peers-from {path}: its grid ran seeds {doc.get('seeds', [0])}, "
            f"this one runs {list(seeds)} (use the same --seeds)"
        )
    rows = from_json(doc["cells"])
    return {
        cell: {p: s for p, s in policies.items() if p != OURS}
        for cell, policies in rows.items()
        if cell.router_replicas == 1
    }


# Two-sided 95 % critical values of Student's t by degrees of freedom (seeds - 1).
_T95 = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
    9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120,
    17: 2.110, 18: 2.101, 19: 2.093, 20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064,
    25: 2.060, 26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045, 30: 2.042, 40: 2.021, 60: 2.000,
    120: 1.980,
}  # fmt: skip


def _t95(df: int) -> float:
    """The critical value for ``df`` degrees of freedom: the table's, or that of the next
    smaller tabled df (a little stricter), or the normal's past 120."""
    if df in _T95:
        return _T95[df]
    if df > 120:
        return 1.96
    return _T95[max(k for k in _T95 if k < df)]


def better_beyond_noise(ours: dict[str, Any], peer: dict[str, Any], key: str, higher: bool) -> bool:
    """Whether ``peer`` beats ours on ``key`` by more than the seeds' noise: a t-test (95 %,
    two-sided) on the per-seed differences. For a generated workload both ran the same draw
    of it, so the test is paired; for a trace each seed names the replicas anew, which moves
    ours and consistent hashing independently of the peer, so it is a one-sample test of the
    differences. A lead a fraction of the draws' spread is not shown beyond noise (which is
    not to say it is noise: a peer ahead in every draw but one may miss the bar); a lead the
    same in every draw counts however small. Per peer: comparing several, an equal peer
    shows as better about once in 40. With fewer than two seeds: False."""
    mine = ours.get("per_seed", {}).get(key)
    theirs = peer.get("per_seed", {}).get(key)
    if not mine or not theirs or len(mine) != len(theirs) or len(mine) < 2:
        return False
    diffs = [(t - m) if higher else (m - t) for m, t in zip(mine, theirs, strict=True)]
    n = len(diffs)
    mean = sum(diffs) / n
    if mean <= 1e-12:
        return False
    spread = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    if spread == 0.0:
        return True  # better by the same margin in every draw
    return mean / (spread / math.sqrt(n)) > _t95(n - 1)


@dataclass(frozen=True, slots=True)
class Verdict:
    """Ours against the best non-oracle peer in one (workload, replicas, capacity) cell."""

    cell: Cell
    hit: float
    p99: float
    best_hit: tuple[str, float, float]  # peer, its hit ratio, its p99
    best_p99: tuple[str, float, float]  # peer, its p99, its hit ratio
    hit_k: dict[int, float]
    # Peers at least as good on both and better on one (hit ratio, p99).
    dominated_by: tuple[str, ...] = ()
    # Peers better on hit ratio, and on p99, beyond the seeds' noise (better_beyond_noise);
    # None: a single seed, nothing to test.
    clearly_better_hit: tuple[str, ...] | None = None
    clearly_better_p99: tuple[str, ...] | None = None

    @property
    def wins_hit(self) -> bool:
        return self.hit >= self.best_hit[1]

    @property
    def wins_p99(self) -> bool:
        return self.p99 <= self.best_p99[1]


def verdicts(results: dict[Cell, dict[str, dict[str, Any]]]) -> list[Verdict]:
    base = [c for c in results if c.router_replicas == 1 and OURS in results[c]]
    out = []
    for cell in base:
        policies = results[cell]
        peers = {
            p: s for p, s in policies.items() if p != OURS and p not in BOUNDS and p in ALL_POLICIES
        }
        if not peers:
            continue
        ours = policies[OURS]
        hit_peer = max(peers, key=lambda p: (peers[p]["hit_ratio"], -peers[p]["ttft_p99_ms"]))
        p99_peer = min(peers, key=lambda p: (peers[p]["ttft_p99_ms"], -peers[p]["hit_ratio"]))
        hit_k = {
            c.router_replicas: results[c][OURS]["hit_ratio"]
            for c in results
            if OURS in results[c]
            and (c.workload, c.replicas, c.capacity_tokens)
            == (cell.workload, cell.replicas, cell.capacity_tokens)
        }
        hit, p99 = ours["hit_ratio"], ours["ttft_p99_ms"]
        dominated_by = tuple(
            p
            for p, s in peers.items()
            if s["hit_ratio"] >= hit
            and s["ttft_p99_ms"] <= p99
            and (s["hit_ratio"] > hit or s["ttft_p99_ms"] < p99)
        )
        seeded = len(ours.get("per_seed", {}).get("hit_ratio", ())) >= 2
        clearly_hit = clearly_p99 = None
        if seeded:
            clearly_hit = tuple(
                p for p, s in peers.items() if better_beyond_noise(ours, s, "hit_ratio", True)
            )
            clearly_p99 = tuple(
                p for p, s in peers.items() if better_beyond_noise(ours, s, "ttft_p99_ms", False)
            )
        out.append(
            Verdict(
                cell,
                hit,
                p99,
                (hit_peer, peers[hit_peer]["hit_ratio"], peers[hit_peer]["ttft_p99_ms"]),
                (p99_peer, peers[p99_peer]["ttft_p99_ms"], peers[p99_peer]["hit_ratio"]),
                hit_k,
                dominated_by,
                clearly_hit,
                clearly_p99,
            )
        )
    return out


def markdown(rows: Sequence[Verdict]) -> str:
    """The docs/benchmarks.md grid table; bold = ours at least as good as every peer. With
    several seeds, the peers better than ours beyond the seeds' noise (better_beyond_noise)."""
    ks = sorted({k for v in rows for k in v.hit_k if k != 1})
    tested = any(v.clearly_better_hit is not None for v in rows)
    head = (
        "| workload | replicas × KV tokens | ours hit | ours p99 ms | best peer hit (who, its p99)"
        " | best peer p99 (who, its hit) | peers better on both |"
        + (" better beyond noise: hit; p99 |" if tested else "")
        + "".join(f" ours K={k} hit (vs K=1) |" for k in ks)
    )
    lines = [head, "|" + "---|" * (7 + tested + len(ks))]
    for v in rows:
        hit = f"**{v.hit:.3f}**" if v.wins_hit else f"{v.hit:.3f}"
        p99 = f"**{v.p99:.0f}**" if v.wins_p99 else f"{v.p99:.0f}"
        by_k = "".join(
            f" {v.hit_k[k]:.3f} ({v.hit_k[k] - v.hit:+.3f}) |" if k in v.hit_k else " |" for k in ks
        )
        noise = ""
        if tested:
            noise = (
                f" {', '.join(v.clearly_better_hit or ()) or '—'};"
                f" {', '.join(v.clearly_better_p99 or ()) or '—'} |"
            )
        lines.append(
            f"| {v.cell.workload} | {v.cell.replicas} × {v.cell.capacity_tokens:,} | {hit} | {p99} "
            f"| {v.best_hit[1]:.3f} ({v.best_hit[0]}, {v.best_hit[2]:.0f}) "
            f"| {v.best_p99[1]:.0f} ({v.best_p99[0]}, {v.best_p99[2]:.3f}) "
            f"| {', '.join(v.dominated_by) or '—'} |{noise}{by_k}"
        )
    return "\n".join(lines)


def summary_line(rows: Sequence[Verdict]) -> str:
    hit = sum(v.wins_hit for v in rows)
    p99 = sum(v.wins_p99 for v in rows)
    both = sum(v.wins_hit and v.wins_p99 for v in rows)
    free = sum(not v.dominated_by for v in rows)
    text = (
        f"ours best hit ratio in {hit}/{len(rows)} cells, best p99 in {p99}, both in {both}; "
        f"no peer better on both in {free}"
    )
    for k in sorted({k for v in rows for k in v.hit_k if k != 1}):
        close = sum(1 for v in rows if k in v.hit_k and v.hit_k[k] >= v.hit - 0.02)
        text += f"; K={k} within 0.02 of K=1 in {close}"
    tested = [v for v in rows if v.clearly_better_hit is not None]
    if tested:
        hit_ok = sum(not v.clearly_better_hit for v in tested)
        p99_ok = sum(not v.clearly_better_p99 for v in tested)
        both_ok = sum(not v.clearly_better_hit and not v.clearly_better_p99 for v in tested)
        text += (
            f". Beyond the seeds' noise (a t-test, 95 %), no peer has a better hit ratio in "
            f"{hit_ok}/{len(tested)} cells, a shorter p99 in {p99_ok}, either in {both_ok}"
        )
    return text
