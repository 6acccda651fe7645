"""Ours alone in one simulator cell over several seeds, at several memory_wait weights.

Usage (from the repository root, with docs/tried-memory-wait/memory-wait.patch applied and
the experiment's MW_* variables set):
    python docs/tried-memory-wait/seeds.py WORKLOAD REPLICAS CAPACITY SEEDS WEIGHTS
e.g. `MW_MEDIAN=1 MW_AFF=0 python docs/tried-memory-wait/seeds.py multi-turn-chat 4 50000 0,1,2,3,4 1`.
The figures equal `prefix-router bench grid --policies ours --seeds 5` for that cell.
"""

from __future__ import annotations

import sys

import numpy as np

from extproc.config import RoutingConfig
from extproc.sim.engine import SimParams, simulate
from extproc.sim.report import summarize
from extproc.sim.workloads import PRESETS, load_mooncake

TRACE = "../shared/workloads/mooncake/synthetic_trace.jsonl"


def main(argv: list[str]) -> None:
    workload, replicas, capacity = argv[0], int(argv[1]), int(argv[2])
    seeds = [int(x) for x in argv[3].split(",")]
    for weight in [float(x) for x in argv[4].split(",")]:
        hits, tails = [], []
        for seed in seeds:
            requests = (
                load_mooncake(TRACE) if workload == "mooncake" else PRESETS[workload](seed=seed)
            )
            params = SimParams(
                replicas=replicas,
                capacity_tokens=capacity,
                seed=seed,
                routing=RoutingConfig(memory_wait=weight),
            )
            summary = summarize(simulate(requests, "ours", params), 1.0)
            hits.append(summary["hit_ratio"])
            tails.append(summary["ttft_p99_ms"])
        print(
            f"memory_wait={weight}: hit {np.mean(hits):.4f} p99 {np.mean(tails):.0f}  "
            f"per seed p99 {[round(t) for t in tails]} hit {[round(h, 4) for h in hits]}"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
