"""`prefix-router bench grid`: cells, the ours-vs-best-peer verdicts, reuse of peer results."""

from __future__ import annotations

import json
import random

import pytest

from extproc.cli import main
from extproc.sim.grid import Cell, better_beyond_noise, markdown, summary_line, verdicts


def _summary(hit: float, p99: float) -> dict[str, float]:
    return {"hit_ratio": hit, "ttft_p99_ms": p99}


def test_verdict_compares_ours_with_the_best_non_oracle_peer() -> None:
    cell = Cell("w", 4, 1000)
    results = {
        cell: {
            "ours": _summary(0.80, 100.0),
            "sglang": _summary(0.81, 120.0),
            "round-robin": _summary(0.30, 90.0),
            "oracle": _summary(0.99, 10.0),  # a bound, never a peer
        },
        Cell("w", 4, 1000, 4): {"ours": _summary(0.78, 130.0)},
    }
    (verdict,) = verdicts(results)
    assert verdict.best_hit == ("sglang", 0.81, 120.0)
    assert verdict.best_p99 == ("round-robin", 90.0, 0.30)
    assert not verdict.wins_hit and not verdict.wins_p99
    assert verdict.dominated_by == ()  # each peer is worse on one of the two
    assert verdict.hit_k == {1: 0.80, 4: 0.78}
    results[cell]["gaie"] = _summary(0.80, 99.0)  # as good on hit, better on p99
    (verdict,) = verdicts(results)
    assert verdict.dominated_by == ("gaie",)
    results[cell]["ours"] = _summary(0.81, 90.0)  # ties count as wins
    (verdict,) = verdicts(results)
    assert verdict.wins_hit and verdict.wins_p99


def _seeded(hits: list[float], p99s: list[float]) -> dict:
    n = len(hits)
    return {
        "hit_ratio": sum(hits) / n,
        "ttft_p99_ms": sum(p99s) / n,
        "per_seed": {"hit_ratio": hits, "ttft_p99_ms": p99s},
    }


def test_a_peer_is_better_beyond_noise_only_past_its_seeds_spread() -> None:
    """A t-test on the per-seed differences (95 %): a lead the same in every draw counts,
    one a fraction of the draws' spread does not, and one seed is no evidence either way."""
    ours = _seeded([0.50, 0.52, 0.51, 0.53, 0.49], [100, 110, 105, 95, 120])
    steady = _seeded([0.51, 0.53, 0.52, 0.54, 0.50], [99, 109, 104, 94, 119])  # +0.01, -1 ms
    assert better_beyond_noise(ours, steady, "hit_ratio", higher=True)
    assert better_beyond_noise(ours, steady, "ttft_p99_ms", higher=False)
    assert not better_beyond_noise(steady, ours, "hit_ratio", higher=True)
    # Ahead on the mean by 0.002, but by -0.02 to +0.02 draw by draw: noise.
    noisy = _seeded([0.52, 0.50, 0.54, 0.51, 0.49], [130, 80, 100, 120, 90])
    assert noisy["hit_ratio"] > ours["hit_ratio"] and noisy["ttft_p99_ms"] < ours["ttft_p99_ms"]
    assert not better_beyond_noise(ours, noisy, "hit_ratio", higher=True)
    assert not better_beyond_noise(ours, noisy, "ttft_p99_ms", higher=False)
    # Mostly ahead with one draw behind: t = 2.57 over 5 seeds with the sample deviation,
    # under 2.776 (2.87 with the population's, which would wrongly pass).
    mostly = _seeded([0.51, 0.53, 0.52, 0.54, 0.486], [100, 110, 105, 95, 120])
    assert not better_beyond_noise(ours, mostly, "hit_ratio", higher=True)
    # Eleven seeds: t with 10 degrees of freedom needs 2.228, not the normal's 1.96 (t = 2.14).
    base = [0.5 + 0.01 * i for i in range(11)]
    ahead = [b + d for b, d in zip(base, [0.01] * 10 + [-0.025], strict=True)]
    assert not better_beyond_noise(
        _seeded(base, [100] * 11), _seeded(ahead, [100] * 11), "hit_ratio", higher=True
    )
    assert not better_beyond_noise(ours, ours, "hit_ratio", higher=True)  # a tie
    one = _seeded([0.50], [100])
    assert not better_beyond_noise(one, _seeded([0.90], [10]), "hit_ratio", higher=True)


def test_the_verdict_names_the_peers_better_beyond_noise() -> None:
    cell = Cell("w", 4, 1000)
    results = {
        cell: {
            "ours": _seeded([0.50, 0.52, 0.51], [100, 110, 105]),
            "sglang": _seeded([0.51, 0.53, 0.52], [140, 150, 145]),  # more hits, every draw
            "round-robin": _seeded([0.30, 0.31, 0.29], [90, 125, 95]),  # p99 lower on the mean
        }
    }
    (verdict,) = verdicts(results)
    assert verdict.clearly_better_hit == ("sglang",)
    assert verdict.clearly_better_p99 == ()  # round robin: 103 against 105, ± 15
    assert not verdict.wins_p99  # the strict verdict still counts it
    assert summary_line([verdict]).endswith(
        "Beyond the seeds' noise (a t-test, 95 %), no peer has a better hit ratio in 0/1 cells,"
        " a shorter p99 in 1, either in 0"
    )
    table = markdown([verdict]).splitlines()
    assert "better beyond noise: hit; p99" in table[0] and "| sglang; — |" in table[2]
    # One seed: nothing to test, and the table and summary say nothing of it.
    single = {
        cell: {p: _summary(s["hit_ratio"], s["ttft_p99_ms"]) for p, s in results[cell].items()}
    }
    (verdict,) = verdicts(single)
    assert verdict.clearly_better_hit is None and verdict.clearly_better_p99 is None
    assert "noise" not in summary_line([verdict]) and "noise" not in markdown([verdict])


def _grid(tmp_path, name: str, *extra: str) -> dict:
    out = tmp_path / name
    code = main(
        [
            "bench",
            "grid",
            "--workloads",
            "small-multi-turn",
            "--replicas",
            "4",
            "--router-replicas",
            "1,2",
            "--policies",
            "ours,round-robin,sglang,oracle",
            "--jobs",
            "2",
            "--json",
            str(out),
            *extra,
        ]
    )
    assert code == 0
    return json.loads(out.read_text())


def test_grid_runs_every_cell_and_reuses_peer_results(tmp_path, capsys) -> None:
    doc = _grid(tmp_path, "grid.json")
    cells = {(c["capacity_tokens"], c["router_replicas"]): c["policies"] for c in doc["cells"]}
    assert set(cells) == {(5_000, 1), (5_000, 2), (40_000, 1), (40_000, 2)}
    for (_, k), policies in cells.items():
        # Peers and bounds run once per cell, at K=1; ours at every K.
        expected = {"ours", "round-robin", "sglang", "oracle"} if k == 1 else {"ours"}
        assert set(policies) == expected
    out = capsys.readouterr().out
    assert "| small-multi-turn | 4 × 5,000 |" in out and "ours best hit ratio in" in out
    table = [line for line in out.splitlines() if line.startswith("|")]
    assert len({line.count("|") for line in table}) == 1  # every row has the header's columns

    again = _grid(
        tmp_path,
        "again.json",
        "--peers-from",
        str(tmp_path / "grid.json"),
        "--routing",
        "stickiness=0",
    )
    again_cells = {
        (c["capacity_tokens"], c["router_replicas"]): c["policies"] for c in again["cells"]
    }
    assert again["routing_overrides"] == {"stickiness": 0.0}
    for key, policies in cells.items():
        # Peers copied from the first run; ours simulated again with the override; listed
        # in the first run's order (ours first), which the docs' tables follow.
        assert list(again_cells[key]) == list(policies)
        for name in set(policies) - {"ours"}:
            assert again_cells[key][name] == policies[name]
    assert any(again_cells[k]["ours"] != cells[k]["ours"] for k in cells)


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        (["--routing", "stickyness=2"], "stickyness=2"),
        (["--routing", "stickiness=-1"], "stickiness"),
        (["--workloads", "nope"], "unknown ['nope']"),
        (["--replicas", "four"], "--replicas"),
        (["--json", "/nonexistent/dir/grid.json"], "no such directory"),
        (["--seeds", "0"], "--seeds 0"),
        (["--cost", "prefill_batch_tokens=-5"], "prefill_batch_tokens must be"),
        (["--cost", "prefill_batch_tokens=many"], "prefill_batch_tokens must be"),
        (["--cost", "prefill_batch=8"], "expected KEY=VALUE"),
    ],
)
def test_grid_rejects_bad_arguments_by_name(flag: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as error:
        main(["bench", "grid", "--workloads", "small-multi-turn", *flag])
    assert message in str(error.value)


def test_grid_with_seeds_averages_draws_it_also_runs_alone(tmp_path) -> None:
    """Each seed is a new draw of the workload; the cell's figures are the seeds' means, seed
    0's own figures are those of a grid run with one seed, and seed 1 is another draw."""
    doc = _grid(tmp_path, "two.json", "--seeds", "2", "--router-replicas", "1")
    assert doc["seeds"] == [0, 1]
    one = _grid(tmp_path, "one.json", "--router-replicas", "1")
    for row, alone in zip(doc["cells"], one["cells"], strict=True):
        for name, summary in row["policies"].items():
            hits = summary["per_seed"]["hit_ratio"]
            p99s = summary["per_seed"]["ttft_p99_ms"]
            assert summary["seeds"] == [0, 1]
            assert hits[0] == alone["policies"][name]["hit_ratio"]
            assert summary["hit_ratio"] == pytest.approx(sum(hits) / 2, abs=1e-4)
            assert summary["ttft_p99_ms"] == pytest.approx(sum(p99s) / 2, abs=1e-4)
        # Ours' decisions per rule: the mean over the seeds, every request counted once.
        rules = row["policies"]["ours"]["rules"]
        assert sum(rules.values()) == pytest.approx(row["policies"]["ours"]["requests"])
    # Round robin's hit ratio depends only on the workload: a second draw changes it.
    assert any(
        len(set(row["policies"]["round-robin"]["per_seed"]["hit_ratio"])) == 2
        for row in doc["cells"]
    )
    with pytest.raises(SystemExit) as error:
        _grid(tmp_path, "mixed.json", "--peers-from", str(tmp_path / "one.json"), "--seeds", "2")
    assert "same --seeds" in str(error.value)
    # Peers simulated on the other memory model (grids before item 24 have no kv_pool and
    # ran "split") are refused too.
    with pytest.raises(SystemExit) as error:
        _grid(
            tmp_path, "mixed.json", "--peers-from", str(tmp_path / "one.json"), "--kv-pool", "split"
        )
    assert "same --kv-pool" in str(error.value)
    assert one["kv_pool"] == "preempt"
    # And peers simulated with the other reply model (replies cached by default since Dec 4;
    # grids before ran prompts only).
    with pytest.raises(SystemExit) as error:
        _grid(
            tmp_path, "mixed.json", "--peers-from", str(tmp_path / "one.json"), "--no-cache-outputs"
        )
    assert "same --cache-outputs" in str(error.value)
    assert one["cache_outputs"] is True
    # And peers simulated with other cost constants: a file before Dec 6 records none and
    # ran one prefill at a time.
    assert one["cost_model"]["prefill_batch_tokens"] == 8192
    with pytest.raises(SystemExit) as error:
        _grid(
            tmp_path,
            "mixed.json",
            "--peers-from",
            str(tmp_path / "one.json"),
            "--cost",
            "prefill_batch_tokens=0",
        )
    assert "prefill_batch_tokens=8192" in str(error.value) and "same --cost" in str(error.value)
    old = json.loads((tmp_path / "one.json").read_text())
    del old["cost_model"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(SystemExit) as error:
        _grid(tmp_path, "mixed.json", "--peers-from", str(tmp_path / "old.json"))
    assert "prefill_batch_tokens=0" in str(error.value)
    before = _grid(
        tmp_path,
        "before.json",
        "--router-replicas",
        "1",
        "--peers-from",
        str(tmp_path / "old.json"),
        "--cost",
        "prefill_batch_tokens=0",
    )
    assert before["cost_model"]["prefill_batch_tokens"] == 0
    # The constants are run, not only recorded: SGLang (named, so re-simulated) queues
    # requests on its holders, and one prefill at a time lengthens its tail.
    tails = [[c["policies"]["sglang"]["ttft_p99_ms"] for c in g["cells"]] for g in (one, before)]
    assert all(a < b for a, b in zip(*tails, strict=True)), tails


def test_grid_server_blocks_runs_ours_as_simulate_does(tmp_path) -> None:
    """--server-blocks reaches every worker: the grid's Mooncake cell at the server's block
    size equals `simulate --server-blocks` on it, and differs from the trace-id blocks (here
    groups differ only past the first 16,384 tokens, all a window of 1,024 64-byte blocks
    hashes)."""
    rng = random.Random(4)
    rows = []
    for i in range(200):
        group = rng.randrange(40)
        ids = [*range(32), *range(1000 + group * 100, 1000 + group * 100 + 40), 100_000 + i]
        rows.append(
            {
                "timestamp": i * 50,
                "input_length": 512 * len(ids) - 400,
                "output_length": 8,
                "hash_ids": ids,
            }
        )
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def grid(*extra: str) -> dict:
        out = tmp_path / "grid.json"
        args = ["bench", "grid", "--workloads", "mooncake", "--trace", str(trace)]
        args += ["--replicas", "2", "--router-replicas", "1", "--policies", "ours"]
        args += ["--routing", "max_blocks=1024"]
        assert main([*args, "--jobs", "2", "--json", str(out), *extra]) == 0
        doc = json.loads(out.read_text())
        (cell,) = [c for c in doc["cells"] if c["capacity_tokens"] == 200_000]
        return {"server_blocks": doc["server_blocks"], **cell["policies"]["ours"]}

    def simulate(*extra: str) -> dict:
        out = tmp_path / "sim.json"
        args = ["bench", "simulate", "--trace", str(trace), "--replicas", "2"]
        args += ["--capacity-tokens", "200000", "--policies", "ours", "--no-progress"]
        args += ["--routing", "max_blocks=1024"]
        assert main([*args, "--json", str(out), *extra]) == 0
        return json.loads(out.read_text())["policies"]["ours"]

    coarse, fine = grid(), grid("--server-blocks")
    assert fine["server_blocks"] and not coarse["server_blocks"]
    for from_grid, alone in ((coarse, simulate()), (fine, simulate("--server-blocks"))):
        assert from_grid["hit_ratio"] == alone["hit_ratio"]
        assert from_grid["ttft_p99_ms"] == alone["ttft_p99_ms"]
    assert fine["hit_ratio"] < coarse["hit_ratio"] - 0.05


def test_grid_re_simulates_the_peers_named_and_copies_the_others(tmp_path) -> None:
    """``--peers-from FILE --policies ours,sglang``: sglang is simulated again (a peer whose
    model changed), the other peers come from the file."""
    first = _grid(tmp_path, "first.json", "--router-replicas", "1")
    for cell in first["cells"]:  # a file whose peers' figures were made otherwise
        for name in ("sglang", "round-robin"):
            cell["policies"][name] = {**cell["policies"][name], "hit_ratio": -1.0}
    (tmp_path / "doctored.json").write_text(json.dumps(first))
    peers = ["--peers-from", str(tmp_path / "doctored.json"), "--router-replicas", "1"]
    copied = _grid(tmp_path, "copied.json", *peers, "--policies", "ours")
    rerun = _grid(tmp_path, "rerun.json", *peers, "--policies", "ours,sglang")
    for cell in copied["cells"]:
        assert cell["policies"]["sglang"]["hit_ratio"] == -1.0
        assert cell["policies"]["round-robin"]["hit_ratio"] == -1.0
    for cell in rerun["cells"]:
        assert cell["policies"]["sglang"]["hit_ratio"] >= 0.0
        assert cell["policies"]["round-robin"]["hit_ratio"] == -1.0
    assert [list(c["policies"]) for c in rerun["cells"]] == [
        list(c["policies"]) for c in first["cells"]
    ]
