"""Bounded memory of the routing core: distinct prompts never grow the index past its
budget, RSS plateaus once the index is full, and decision latency does not drift.
The 1M-prompt figures in docs/reliability.md come from memory_soak.py (same code)."""

from __future__ import annotations

import pytest

from extproc.index import WAYS

from .memory_soak import soak


@pytest.mark.slow
def test_index_memory_and_latency_stay_bounded_over_many_distinct_prompts():
    # 8 endpoints x 100k tokens = 50k block entries: full after ~5k prompts, then 150k more.
    points = soak(150_000, endpoints=8, capacity_tokens=100_000, checkpoints=10, out=None)
    capacity = points[0].capacity
    assert capacity == 8 * (100_000 * 4 // 64)
    assert all(p.entries <= p.capacity == capacity for p in points)
    # Full, and stays there: one slot per block of capacity, in whole buckets.
    assert points[-1].entries == points[-2].entries == 8 * (100_000 * 4 // 64 // WAYS * WAYS)
    assert points[-1].approx_bytes == points[2].approx_bytes
    # RSS: no growth beyond noise once the index is full (allocator slack, counters).
    growth = points[-1].rss - points[2].rss
    assert growth < 16 * 2**20, f"RSS grew {growth / 2**20:.1f} MiB after the index filled"
    # Latency: the last window's median is not worse than the early ones (generous: the
    # machine is shared), i.e. no drift with the number of prompts seen.
    early = min(p.p50_us for p in points[1:4])
    assert points[-1].p50_us < 2.5 * early + 50, [round(p.p50_us, 1) for p in points]
