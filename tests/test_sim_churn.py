"""Router replicas that restart or scale during a simulated run (--router-changes, bench churn)."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from extproc.cli import main
from extproc.sim import churn
from extproc.sim.engine import RouterChange, SimParams, parse_router_changes, simulate
from extproc.sim.policies import CacheEventFeed, PolicyContext, RouterGroup, make_policy
from extproc.sim.replica import CostModel, Replica
from extproc.sim.report import phase_summaries, summarize
from extproc.sim.workloads import PRESETS, Workload


@pytest.fixture(scope="module")
def chat() -> Workload:
    return PRESETS["small-multi-turn"](seed=0)


def _group(routers: int, **sharing):
    ctx = PolicyContext(
        [Replica(i, 20_000, CostModel()) for i in range(4)], random.Random(0), 20_000, **sharing
    )
    return ctx, make_policy("ours", ctx, routers, 16)


def _decisions(instance) -> int:
    return sum(instance.rules.values())


def test_router_changes_parse_in_time_order_and_name_the_flag() -> None:
    assert parse_router_changes("60:restart, 90:4,90:2") == (
        RouterChange(60.0, restart=True),
        RouterChange(90.0, replicas=4),
        RouterChange(90.0, replicas=2),
    )
    assert parse_router_changes("5:restart+2.5") == (
        RouterChange(5.0, restart=True, overlap_s=2.5),
    )
    for bad in (
        "",
        "60",
        "x:restart",
        "-1:2",
        "60:0",
        "60:reboot",
        "90:2,60:restart",
        "inf:2",
        "60:restart+",
        "60:restart+-1",
        "60:restart+x",
    ):
        with pytest.raises(ValueError, match="--router-changes"):
            parse_router_changes(bad)


def test_a_restart_replaces_the_oldest_router_with_an_empty_one(chat: Workload) -> None:
    ctx, group = _group(2)
    for request in chat.requests[:40]:
        ctx.now = request.arrival_s
        group.route(request, ctx.now)
    old, kept = group.instances
    assert old.router.index.stats().entries and kept.router.index.stats().entries
    routed_before = _decisions(old)
    group.restart()
    fresh = group.instances[2]
    assert group.active == [1, 2] and fresh.router.index.stats().entries == 0
    assert not fresh.router.traffic_share_measured
    for request in chat.requests[40:80]:
        ctx.now = request.arrival_s
        group.route(request, ctx.now)
    assert _decisions(old) == routed_before  # retired: routes nothing more
    assert _decisions(fresh) > 0 and _decisions(kept) > 0


def test_scaling_adds_fresh_routers_and_retires_the_newest_first() -> None:
    _, group = _group(2, share_queues=True)
    group.resize(4)
    assert group.active == [0, 1, 2, 3]
    for instance in group.instances:  # peers: every active router reads the others
        assert set(instance.peers) == set(group.instances) - {instance}
    group.resize(2)
    assert group.active == [0, 1]
    assert group.instances[0].peers == [group.instances[1]]
    assert group.instances[2].peers == [] and group.instances[3].peers == []
    with pytest.raises(ValueError):
        group.resize(0)


def test_a_retired_router_no_longer_queues_cache_events() -> None:
    ctx = PolicyContext(
        [Replica(i, 20_000, CostModel()) for i in range(2)],
        random.Random(0),
        20_000,
        cache_events_delay=0.05,
    )
    group = make_policy("ours", ctx, 2, 16)
    feed = group.instances[0].cache_events
    assert isinstance(feed, CacheEventFeed) and len(feed.queues) == 2
    retired = group.instances[0].event_queue
    group.restart()
    assert len(feed.queues) == 2 and group.instances[0].event_queue is None
    assert all(q is not retired for q in feed.queues)
    assert any(q is group.instances[2].event_queue for q in feed.queues)


def test_boundaries_alone_change_nothing_and_stretches_cover_every_request(
    chat: Workload,
) -> None:
    base = SimParams(replicas=4, capacity_tokens=20_000, router_replicas=2, seed=1)
    plain = simulate(chat, "ours", base)
    marked = simulate(
        chat,
        "ours",
        dataclasses.replace(
            base, router_changes=(RouterChange(10.0, replicas=2), RouterChange(20.0, replicas=2))
        ),
    )
    assert [r.hit_tokens for r in marked.records] == [r.hit_tokens for r in plain.records]
    assert [r.ttft_ms for r in marked.records] == [r.ttft_ms for r in plain.records]
    phases = phase_summaries(marked, with_tokens=True)
    assert [(p["from_s"], p["router_replicas"]) for p in phases] == [(0, 2), (10, 2), (20, 2)]
    assert sum(p["requests"] for p in phases) == len(chat.requests)
    assert sum(p["hit_tokens"] for p in phases) == sum(r.hit_tokens for r in plain.records)
    assert not plain.router_phases and "phases" not in summarize(plain, 1.0)
    # The oracle is one instance that knows the truth: no changes, no stretches.
    oracle = simulate(chat, "oracle", marked.params)
    assert not oracle.router_phases


def test_a_lone_routers_restart_costs_hits_until_its_index_fills() -> None:
    """A fresh router does not know where its predecessor put the conversations: their next
    turns after the restart go where it would place them new, and pay their history again
    (0.024-0.08 of the window's hit ratio over these draws). Every request is still served."""
    for seed in (0, 1, 2):
        chat = PRESETS["small-multi-turn"](seed=seed)
        base = SimParams(replicas=4, capacity_tokens=20_000, seed=seed)
        marks = (RouterChange(8.0, replicas=1), RouterChange(14.0, replicas=1))
        static = simulate(chat, "ours", dataclasses.replace(base, router_changes=marks))
        restart = (RouterChange(8.0, restart=True), marks[1])
        changed = simulate(chat, "ours", dataclasses.replace(base, router_changes=restart))
        assert all(r.ttft_ms > 0 for r in changed.records)
        before, window, _ = phase_summaries(changed)
        static_before, static_window, _ = phase_summaries(static)
        assert before == static_before
        assert window["hit_ratio"] < static_window["hit_ratio"] - 0.01, seed


def test_churn_scenarios_compare_each_change_with_the_same_routers_unchanged(
    chat: Workload,
) -> None:
    base = SimParams(replicas=4, capacity_tokens=20_000)
    rows = churn.run_scenarios(lambda seed: chat, base, [0], 8.0, 6.0)
    assert [r["scenario"] for r in rows] == [s.name for s in churn.scenarios(6.0)]
    plain_k1 = summarize(simulate(chat, "ours", base), 1.0)["hit_ratio"]
    by_name = {r["scenario"]: r for r in rows}
    lone = by_name["restart, one router"]
    assert lone["before"]["hit_ratio"] == pytest.approx(plain_k1, abs=1e-4)
    assert lone["changed"]["stretches"][0] == lone["before"]["stretches"][0]
    assert lone["changed"]["stretches"][1] < lone["before"]["stretches"][1]
    scale_out = by_name["scale out 2 -> 4"]
    assert (scale_out["routers"], scale_out["routers_after"]) == (2, 4)
    assert scale_out["before"] == by_name["rolling restart, two routers"]["before"]
    assert scale_out["after"] == by_name["scale in 4 -> 2"]["before"]
    assert by_name["rolling restart, two routers, peers"]["peers"]


def test_cli_churn_and_simulate_router_changes(tmp_path, capsys) -> None:
    out = tmp_path / "churn.json"
    args = ["bench", "churn", "--workload", "small-multi-turn", "--replicas", "4"]
    args += ["--capacity-tokens", "20000", "--seeds", "1", "--no-progress"]
    assert main([*args, "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert len(doc["scenarios"]) == 7 and doc["seeds"] == [0]
    assert 0 < doc["at_s"] < 40 and doc["window_s"] > 0
    assert "restart, one router" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--at"):
        main([*args, "--at", "100000"])
    with pytest.raises(SystemExit, match="every seed's arrivals"):
        main([*args, "--at", "20", "--window", "15"])  # past the end of the run

    sim = ["bench", "simulate", "--workload", "small-multi-turn", "--replicas", "4"]
    sim += ["--policies", "ours", "--no-progress", "--router-replicas", "2"]
    out = tmp_path / "sim.json"
    assert main([*sim, "--router-changes", "8:restart,14:3", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    phases = doc["policies"]["ours"]["phases"]
    assert [(p["from_s"], p["router_replicas"]) for p in phases] == [(0, 2), (8, 2), (14, 3)]
    assert doc["params"]["router_changes"] == "8:restart,14:3"
    assert "by stretch between router changes" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--router-changes"):
        main([*sim, "--router-changes", "8:reboot"])
    with pytest.raises(SystemExit, match="--sweep-k"):
        main([*sim, "--router-changes", "8:restart", "--sweep-k", "1,2"])


def _fresh_router_after_events(chat: Workload, replay: int, evict: int = 0):
    """One router routes 20 requests and the replicas announce their blocks (and the
    eviction of the first ``evict`` requests' blocks); then it is restarted and its
    successor routes one request: (its queue before that, its index entries)."""
    ctx = PolicyContext(
        [Replica(i, 20_000, CostModel(), "preempt") for i in range(4)],
        random.Random(0),
        20_000,
        cache_events_delay=0.05,
        cache_events_replay=replay,
    )
    group = make_policy("ours", ctx, 1, 16)
    feed = group.instances[0].cache_events
    placed = []
    for request in chat.requests[:20]:
        ctx.now = request.arrival_s
        replica, _ = group.route(request, ctx.now)
        feed._publish(replica, [(True, chunk, request.chunk_tokens) for chunk in request.ids])
        placed.append((replica, request))
    for replica, request in placed[:evict]:
        feed._publish(replica, [(False, chunk, request.chunk_tokens) for chunk in request.ids])
    group.restart()
    fresh = group.instances[-1]
    queued = [message[0] for message in fresh.event_queue]
    assert queued == sorted(queued)  # in time order across the replicas
    ctx.now += 1.0
    group.route(chat.requests[20], ctx.now)
    return len(queued), fresh.router.index.stats().entries


def test_a_router_started_late_replays_what_the_replicas_still_buffer(chat: Workload) -> None:
    """With KV-cache events and replay (vLLM's replay_endpoint), a restarted router reads
    the replicas' buffered messages first, so its index starts with what they hold; the
    buffer keeps only the last N messages of each replica."""
    none, alone = _fresh_router_after_events(chat, 0)
    two, some = _fresh_router_after_events(chat, 2)
    every, full = _fresh_router_after_events(chat, 10_000)
    assert none == 0 and 0 < two <= 2 * 4 and every == 20
    assert alone > 0  # the request it routed itself
    assert full > some > alone


def test_a_replay_applies_the_evictions_it_carries(chat: Workload) -> None:
    """The replayed messages are each replica's history in order, so the successor applies
    their evictions too, though a router yet to measure its traffic share skips live ones
    (Router.observe_cache_events): its index holds fewer entries than when the same
    blocks were stored and never evicted."""
    _, kept = _fresh_router_after_events(chat, 10_000)
    queued, after_evictions = _fresh_router_after_events(chat, 10_000, evict=5)
    assert queued == 25 and after_evictions < kept


def test_replayed_events_take_most_of_a_lone_routers_restart_cost_away() -> None:
    for seed in (0, 1, 2):
        chat = PRESETS["small-multi-turn"](seed=seed)
        base = SimParams(replicas=4, capacity_tokens=20_000, seed=seed, kv_events_ms=50.0)
        changes = (RouterChange(8.0, restart=True), RouterChange(14.0, replicas=1))
        window = {}
        for replay in (0, 10_000):
            params = dataclasses.replace(base, router_changes=changes, kv_events_replay=replay)
            window[replay] = phase_summaries(simulate(chat, "ours", params))[1]["hit_ratio"]
        assert window[10_000] > window[0] + 0.02, seed


def test_cli_kv_events_replay_needs_kv_events(tmp_path) -> None:
    sim = ["bench", "simulate", "--workload", "small-multi-turn", "--replicas", "4"]
    sim += ["--policies", "ours", "--no-progress", "--router-changes", "8:restart"]
    with pytest.raises(SystemExit, match="--kv-events-replay"):
        main([*sim, "--kv-events-replay", "100"])
    with pytest.raises(SystemExit, match="--kv-events-replay"):
        main([*sim, "--kv-events", "50", "--kv-events-replay", "-1"])
    without_changes = [a for a in sim if a not in ("--router-changes", "8:restart")]
    with pytest.raises(SystemExit, match="add --router-changes"):
        main([*without_changes, "--kv-events", "50", "--kv-events-replay", "100"])
    out = tmp_path / "sim.json"
    assert main([*sim, "--kv-events", "50", "--kv-events-replay", "100", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["params"]["kv_events_replay"] == 100


def test_a_surge_restart_routes_beside_the_old_router_then_retires_it(chat: Workload) -> None:
    """restart+S: the fresh router joins at once and the oldest leaves S seconds later (a
    rollout with maxSurge 1); every request is served, and only the overlap has three."""
    base = SimParams(replicas=4, capacity_tokens=20_000, router_replicas=2, seed=1)
    changes = parse_router_changes("8:restart+3,14:2")
    result = simulate(chat, "ours", dataclasses.replace(base, router_changes=changes))
    assert all(r.ttft_ms > 0 for r in result.records)
    assert result.router_phases == [(0.0, 2), (8.0, 3), (11.0, 2), (14.0, 2)]
    # Two overlaps that overlap: each retires its own predecessor.
    changes = parse_router_changes("8:restart+4,10:restart+4")
    result = simulate(chat, "ours", dataclasses.replace(base, router_changes=changes))
    assert result.router_phases == [(0.0, 2), (8.0, 3), (10.0, 4), (12.0, 3), (14.0, 2)]
    _, group = _group(2)
    group.join()
    assert group.active == [0, 1, 2]
    group.leave(0)
    assert group.active == [1, 2]
    group.leave(1)
    group.leave(2)  # never the last one
    assert group.active == [2]


def test_a_change_after_the_last_request_does_not_lengthen_the_run(chat: Workload) -> None:
    base = SimParams(replicas=4, capacity_tokens=20_000, router_replicas=2, seed=1)
    plain = simulate(chat, "ours", base)
    late = simulate(
        chat, "ours", dataclasses.replace(base, router_changes=(RouterChange(1000.0, 2),))
    )
    assert late.sim_seconds == plain.sim_seconds < 1000
    phases = phase_summaries(late)
    assert phases[-1]["requests"] == 0 and phases[-1]["hit_ratio"] is None


def test_a_request_arriving_at_a_changes_instant_goes_to_the_routers_after_it(
    chat: Workload, monkeypatch
) -> None:
    at = chat.requests[30].arrival_s
    routed_by: dict[int, int] = {}
    route = RouterGroup.route

    def noting(self, request, now):
        replica, handle = route(self, request, now)
        routed_by[request.rid] = handle[0]
        return replica, handle

    monkeypatch.setattr(RouterGroup, "route", noting)
    base = SimParams(replicas=4, capacity_tokens=20_000, seed=1)
    result = simulate(
        chat, "ours", dataclasses.replace(base, router_changes=(RouterChange(at, restart=True),))
    )
    before, after = phase_summaries(result)
    assert before["requests"] == 30 and after["requests"] == len(chat.requests) - 30
    assert routed_by[chat.requests[29].rid] == 0 and routed_by[chat.requests[30].rid] == 1


def test_a_router_handed_its_predecessors_index_keeps_the_hits_a_restart_loses() -> None:
    """--warm-start file: the fresh router takes the index its predecessor wrote at its stop
    (warm_start.Handover, the server's code), so the window after a lone router's restart
    keeps (nearly) what the unchanged router had; peer: a surge's successor takes the index
    of the router it replaces while both route; without a peer routing (a restart in
    place) a peer handover has nothing to take."""
    for seed in (0, 1, 2):
        chat = PRESETS["small-multi-turn"](seed=seed)
        base = SimParams(replicas=4, capacity_tokens=20_000, seed=seed)
        marks = (RouterChange(8.0, replicas=1), RouterChange(14.0, replicas=1))
        static = phase_summaries(
            simulate(chat, "ours", dataclasses.replace(base, router_changes=marks))
        )
        window = {}
        for warm, change in (
            ("none", RouterChange(8.0, restart=True)),
            ("file", RouterChange(8.0, restart=True)),
            ("peer", RouterChange(8.0, restart=True)),
            ("none+surge", RouterChange(8.0, restart=True, overlap_s=1.0)),
            ("peer+surge", RouterChange(8.0, restart=True, overlap_s=1.0)),
        ):
            params = dataclasses.replace(
                base, router_changes=(change, marks[1]), warm_start=warm.split("+")[0]
            )
            result = simulate(chat, "ours", params)
            assert all(r.ttft_ms > 0 for r in result.records)
            phases = phase_summaries(result, with_tokens=True)
            hits = sum(p["hit_tokens"] for p in phases if 8.0 <= p["from_s"] < 14.0)
            prompt = sum(p["prompt_tokens"] for p in phases if 8.0 <= p["from_s"] < 14.0)
            window[warm] = hits / prompt
        lost = static[1]["hit_ratio"] - window["none"]
        assert lost > 0.01, seed
        assert window["file"] > window["none"] + 0.6 * lost, (seed, window)
        assert window["peer"] == window["none"], seed  # nobody routing to take it from
        assert window["peer+surge"] > window["none+surge"] + 0.01, (seed, window)


def test_cli_warm_start_needs_router_changes(tmp_path) -> None:
    sim = ["bench", "simulate", "--workload", "small-multi-turn", "--replicas", "4"]
    sim += ["--policies", "ours", "--no-progress", "--warm-start", "file"]
    with pytest.raises(SystemExit, match="add --router-changes"):
        main(sim)
    out = tmp_path / "sim.json"
    assert main([*sim, "--router-changes", "8:restart", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["params"]["warm_start"] == "file"
    with pytest.raises(SystemExit):
        main([*sim[:-1], "sideways", "--router-changes", "8:restart"])


def test_a_router_started_mid_run_does_not_read_the_servers_history_as_its_traffic(
    chat: Workload, monkeypatch
) -> None:
    """Its first reading of a server gives no window (as the server's scraper: a first
    reading has no previous one), so it does not count every prefill since the start as
    arrivals it did not send: a lone router restarted reads itself as alone again."""
    from extproc.sim import engine

    groups = []

    def capture(*args, **kwargs):
        groups.append(make_policy(*args, **kwargs))
        return groups[-1]

    monkeypatch.setattr(engine, "make_policy", capture)
    base = SimParams(replicas=4, capacity_tokens=20_000, seed=0)
    simulate(
        chat, "ours", dataclasses.replace(base, router_changes=parse_router_changes("6:restart"))
    )
    (group,) = groups
    fresh = group.instances[group.active[0]].router
    assert fresh.traffic_share_measured
    assert fresh.traffic_share > 0.9, fresh.traffic_share
