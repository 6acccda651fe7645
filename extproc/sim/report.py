"""Per-policy metrics from a run, the stdout table, the JSON document and the PNG."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .engine import RunResult


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values (0 for none)."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(q / 100.0 * len(sorted_values)))
    return float(sorted_values[rank - 1])


def summarize(result: RunResult, ideal_hit_ratio: float) -> dict[str, Any]:
    records = result.records
    prompt = sum(r.input_tokens for r in result.requests)
    hits = sum(r.hit_tokens for r in records)
    ttft = sorted(r.ttft_ms for r in records)
    served = [r.requests for r in result.replicas]
    mean_served = sum(served) / len(served) if served else 0.0
    hit_ratio = hits / prompt if prompt else 0.0
    summary: dict[str, Any] = {
        "hit_ratio": round(hit_ratio, 4),
        "fraction_of_ideal": round(hit_ratio / ideal_hit_ratio, 4) if ideal_hit_ratio else 0.0,
        "ttft_p50_ms": round(percentile(ttft, 50), 1),
        "ttft_p90_ms": round(percentile(ttft, 90), 1),
        "ttft_p99_ms": round(percentile(ttft, 99), 1),
        "queue_mean_ms": round(sum(r.queue_ms for r in records) / max(1, len(records)), 1),
        "load_max_requests": max(served, default=0),
        "load_mean_requests": round(mean_served, 1),
        "load_max_over_mean": round(max(served) / mean_served, 3) if mean_served else 0.0,
        "peak_in_flight": max((r.peak_in_flight for r in result.replicas), default=0),
        "prefill_gpu_s": round(sum(r.prefill_ms for r in result.replicas) / 1000.0, 2),
        "requests": len(records),
        "simulated_s": round(result.sim_seconds, 1),
    }
    if result.params.kv_pool == "preempt":
        # How often vLLM's allocation ran out of blocks, and the prefill it cost again.
        summary["preemptions"] = sum(r.preemptions for r in result.replicas)
        summary["recomputed_tokens"] = sum(r.recomputed_tokens for r in result.replicas)
    if result.rules:
        summary["rules"] = dict(sorted(result.rules.items()))
    if result.router_phases:
        summary["phases"] = phase_summaries(result)
    if result.audit:
        summary["audit"] = {
            rule: {
                "decisions": a.decisions,
                "off_best_holder": a.off_best_holder,
                "hit_ratio_lost": round(a.tokens_lost / prompt, 4) if prompt else 0.0,
            }
            for rule, a in sorted(result.audit.items())
        }
    return summary


def phase_summaries(result: RunResult, with_tokens: bool = False) -> list[dict[str, Any]]:
    """Per stretch between router changes (by arrival): what a scale or a restart costs is
    in the requests that arrive after it, while fresh routers' indexes fill. ``with_tokens``
    adds the hit and prompt tokens, to merge stretches."""
    starts = [at for at, _ in result.router_phases]
    ends = [*starts[1:], math.inf]
    phases = []
    for (start, routers), end in zip(result.router_phases, ends, strict=True):
        picked = [i for i, r in enumerate(result.requests) if start <= r.arrival_s < end]
        prompt = sum(result.requests[i].input_tokens for i in picked)
        hits = sum(result.records[i].hit_tokens for i in picked)
        ttft = sorted(result.records[i].ttft_ms for i in picked)
        phase: dict[str, Any] = {
            "from_s": start,
            "to_s": None if math.isinf(end) else end,
            "router_replicas": routers,
            "requests": len(picked),
            # None for a stretch no request arrived in (not a hit ratio of 0)
            "hit_ratio": round(hits / prompt, 4) if prompt else None,
            "ttft_p50_ms": round(percentile(ttft, 50), 1) if ttft else None,
            "ttft_p99_ms": round(percentile(ttft, 99), 1) if ttft else None,
        }
        if with_tokens:
            phase["hit_tokens"], phase["prompt_tokens"] = hits, prompt
        phases.append(phase)
    return phases


def phases_table(results: dict[str, dict[str, Any]]) -> str:
    """Per policy, each stretch between router changes (requests by arrival)."""
    lines = ["by stretch between router changes (requests by arrival time):"]
    lines.append(
        f"{'policy':18}{'from s':>8}{'to s':>8}{'K':>4}{'requests':>10}{'hit':>8}"
        f"{'p50 ms':>9}{'p99 ms':>9}"
    )
    for name, summary in results.items():
        for phase in summary.get("phases", []):
            end = "end" if phase["to_s"] is None else f"{phase['to_s']:g}"
            if phase["requests"]:
                figures = (
                    f"{phase['hit_ratio']:>8.3f}{phase['ttft_p50_ms']:>9.0f}"
                    f"{phase['ttft_p99_ms']:>9.0f}"
                )
            else:
                figures = f"{'-':>8}{'-':>9}{'-':>9}"
            lines.append(
                f"{name:18}{phase['from_s']:>8g}{end:>8}{phase['router_replicas']:>4}"
                f"{phase['requests']:>10}{figures}"
            )
    return "\n".join(lines)


def audit_table(results: dict[str, dict[str, Any]]) -> str:
    """Per policy and rule: decisions, those off the replica holding most of the prompt, and
    the hit ratio they left behind (measured when the request was routed)."""
    lines = ["decisions against the replicas' true caches (when routed):"]
    lines.append(f"{'policy':18}{'rule':18}{'decisions':>10}{'off best':>10}{'hit lost':>10}")
    for name, summary in results.items():
        for rule, a in summary.get("audit", {}).items():
            label = "" if rule == name else rule
            lines.append(
                f"{name:18}{label:18}{a['decisions']:>10}{a['off_best_holder']:>10}"
                f"{a['hit_ratio_lost']:>10.4f}"
            )
    return "\n".join(lines)


COLUMNS = [
    ("policy", "{}", 18),
    ("hit_ratio", "{:.3f}", 9),
    ("fraction_of_ideal", "{:.3f}", 8),
    ("ttft_p50_ms", "{:.0f}", 8),
    ("ttft_p90_ms", "{:.0f}", 8),
    ("ttft_p99_ms", "{:.0f}", 8),
    ("queue_mean_ms", "{:.0f}", 8),
    ("load_max_over_mean", "{:.2f}", 8),
    ("prefill_gpu_s", "{:.1f}", 9),
]
HEADERS = [
    "policy",
    "hit",
    "of ideal",
    "p50 ms",
    "p90 ms",
    "p99 ms",
    "queue",
    "max/mean",
    "prefill s",
]


def table(policies: dict[str, dict[str, Any]], markdown: bool = False) -> str:
    """Aligned text (or a markdown table) with one row per policy."""
    rows = [
        [fmt.format(name if key == "policy" else stats[key]) for key, fmt, _ in COLUMNS]
        for name, stats in policies.items()
    ]
    if markdown:
        lines = ["| " + " | ".join(HEADERS) + " |", "|---" + "|---:" * (len(HEADERS) - 1) + "|"]
        lines += ["| " + " | ".join(row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [w for _, _, w in COLUMNS]

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    return "\n".join([line(HEADERS), *(line(r) for r in rows)])


def sweep_table(sweep: dict[str, dict[Any, float]], markdown: bool = False) -> str:
    """Hit ratio against router replicas K, one row per policy (aligned text or markdown).
    Keys may be ints or, read back from JSON, strings."""
    by_policy = {name: {int(k): v for k, v in by_k.items()} for name, by_k in sweep.items()}
    ks = sorted({k for by_k in by_policy.values() for k in by_k})
    if markdown:
        lines = ["| policy |" + "".join(f" K={k} |" for k in ks), "|---|" + "---:|" * len(ks)]
        for name, by_k in by_policy.items():
            cells = "".join(f" {by_k[k]:.3f} |" if k in by_k else " |" for k in ks)
            lines.append(f"| {name} |{cells}")
        return "\n".join(lines)
    lines = ["policy".ljust(18) + "".join(f"K={k}".rjust(8) for k in ks)]
    for name, by_k in by_policy.items():
        lines.append(
            name.ljust(18) + "".join(f"{by_k[k]:8.3f}" if k in by_k else " " * 8 for k in ks)
        )
    return "\n".join(lines)


# The sweep line of ours with peers (bench simulate --sweep-peers).
PEERS_LINE = "ours, peers"


def plot(
    path: str,
    title: str,
    policies: dict[str, dict[str, Any]],
    ideal_hit_ratio: float,
    sweep: dict[str, dict[int, float]] | None = None,
) -> None:
    """Hit ratio and TTFT p99 per policy; hit ratio vs router replicas K when swept."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 3 if sweep else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.2))
    names = list(policies)
    colors = [
        "tab:red" if n == "ours" else "tab:gray" if n == "oracle" else "tab:blue" for n in names
    ]
    ax = axes[0]
    ax.bar(names, [policies[n]["hit_ratio"] for n in names], color=colors)
    ax.axhline(ideal_hit_ratio, color="black", linestyle="--", linewidth=1, label="ideal")
    ax.set_ylabel("token cache-hit ratio")
    ax.set_title("hit ratio")
    ax.legend(loc="upper right")
    ax = axes[1]
    ax.bar(names, [max(1.0, policies[n]["ttft_p99_ms"]) for n in names], color=colors)
    ax.set_yscale("log")
    ax.set_ylabel("ms (log)")
    ax.set_title("TTFT p99")
    for ax in axes[:2]:
        ax.tick_params(axis="x", rotation=60, labelsize=8)
    if sweep:
        ax = axes[2]
        for name, by_k in sweep.items():
            ks = sorted(by_k)
            # Every colour but red, which is ours (the cycle may hold hex strings or tuples).
            others = [
                c
                for c in plt.rcParams["axes.prop_cycle"].by_key()["color"]
                if matplotlib.colors.to_hex(c) != matplotlib.colors.to_hex("tab:red")
            ]
            if name == "ours":
                style: dict[str, Any] = {"color": "tab:red", "linewidth": 2.5}
            elif name == PEERS_LINE:
                style = {"color": "darkred", "linestyle": "--", "marker": "s"}
            else:
                style = {"color": others[list(sweep).index(name) % len(others)]}
            ax.plot(ks, [by_k[k] for k in ks], **{"marker": "o", "label": name, **style})
        ax.axhline(ideal_hit_ratio, color="black", linestyle="--", linewidth=1, label="ideal")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("router replicas K")
        ax.set_ylabel("token cache-hit ratio")
        ax.set_title("hit ratio vs router replicas")
        ax.legend(fontsize=7, ncol=2)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
