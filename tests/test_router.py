"""Scheduler rules through the routing core: affinity, load guard, cold-start agreement."""

import dataclasses
from collections import Counter

import numpy as np
import orjson
import pytest

from extproc.bench_share import HandClock as Clock
from extproc.bench_share import share_over_time
from extproc.config import EndpointConfig, RoutingConfig
from extproc.placements import Placement, PlacementLog
from extproc.prompt import parse_request
from extproc.router import UNMEASURED_EVICTIONS_SKIP_SECONDS, Router
from extproc.scheduler import (
    RULE_AFFINITY,
    RULE_COLD_START,
    RULE_LOAD_GUARD,
    RULE_NO_ENDPOINT,
    RULE_SPREAD,
    CostModel,
    EndpointTable,
    Scheduler,
    address_hash,
)

ENDPOINTS = [EndpointConfig(address=f"10.0.0.{i}:8000") for i in range(1, 5)]
SYSTEM = "You are a meticulous assistant that answers with care. " * 20


def chat(*turns: str, system: str = SYSTEM):
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return parse_request("chat", orjson.dumps({"model": "m", "messages": messages}))


def test_cold_start_then_affinity_for_the_next_turn():
    router = Router(RoutingConfig(), ENDPOINTS)
    first = router.route(chat("What is a B-tree? " * 10))
    assert first.rule == RULE_COLD_START and first.matched_blocks == 0
    router.finish(first)
    second = router.route(chat("What is a B-tree? " * 10, "A tree.", "And a trie?"))
    assert second.rule == RULE_AFFINITY
    assert second.endpoint == first.endpoint
    assert second.matched_blocks == first.total_blocks


def test_decision_explains_itself():
    router = Router(RoutingConfig(), ENDPOINTS)
    decision = router.route(chat("hello " * 40))
    explained = decision.explain()
    assert explained["rule"] == RULE_COLD_START
    assert explained["endpoint"] == decision.endpoint
    assert len(explained["candidates"]) == 4
    assert {"endpoint", "matched_blocks", "load", "load_cap", "eligible", "score"} <= set(
        explained["candidates"][0]
    )
    assert explained["candidates"][0]["endpoint"] == decision.endpoint  # ranked, chosen first
    assert len(decision.fallbacks) == 2 and decision.endpoint not in decision.fallbacks


def test_two_independent_routers_agree_on_new_prefixes():
    a, b = Router(RoutingConfig(), ENDPOINTS), Router(RoutingConfig(), list(reversed(ENDPOINTS)))
    chosen = set()
    for i in range(40):
        request = chat("tell me more", system=f"conversation {i}: topic {i * 7919} " * 8)
        da, db = a.route(request), b.route(request)
        assert da.endpoint == db.endpoint
        chosen.add(da.endpoint)
        a.finish(da)
        b.finish(db)
    assert chosen == {e.address for e in ENDPOINTS}  # and new prefixes spread


def test_later_turns_agree_across_routers_without_shared_state():
    a, b = Router(RoutingConfig(), ENDPOINTS), Router(RoutingConfig(), ENDPOINTS)
    for i in range(20):
        turn1 = chat(f"question {i} " * 8)
        turn3 = chat(f"question {i} " * 8, "answer", "follow-up")
        first = a.route(turn1)
        a.finish(first)
        later = b.route(turn3)  # b never saw turn 1
        b.finish(later)
        assert later.endpoint == first.endpoint


def test_load_guard_moves_requests_off_a_hot_endpoint():
    router = Router(RoutingConfig(load_epsilon=0.25, load_slack=1), ENDPOINTS)
    prefix = "shared document " * 50
    held = [router.route(chat(prefix + f"q{i}")) for i in range(12)]
    rules = [d.rule for d in held]
    assert RULE_LOAD_GUARD in rules
    loads = router.in_flight()
    assert max(loads.values()) <= 5  # (1+eps) * 12/4 + slack, never all 12 on one
    assert sum(loads.values()) == 12
    for d in held:
        router.finish(d)
    assert set(router.in_flight().values()) == {0}


def test_affinity_prefers_the_longest_match():
    router = Router(RoutingConfig(), ENDPOINTS)
    short = router.route(chat("alpha " * 20))
    router.finish(short)
    router.index.record(ENDPOINTS[0].address, [])  # no-op guard
    long_turn = chat("alpha " * 20, "beta " * 20, "gamma " * 20)
    # Teach another endpoint the whole long conversation.
    other = next(e.address for e in ENDPOINTS if e.address != short.endpoint)
    decision = router.route(long_turn)
    router.finish(decision)
    router.index.forget(decision.endpoint)
    from extproc.hashing import block_hashes, root_hash

    hashes = block_hashes(long_turn.prompt, root_hash("m"), 64, 1024)
    router.index.record(other, hashes)
    again = router.route(long_turn)
    assert again.endpoint == other and again.rule == RULE_AFFINITY


def test_unhealthy_endpoints_are_skipped_and_forgotten():
    router = Router(RoutingConfig(), ENDPOINTS)
    first = router.route(chat("sticky " * 30))
    router.finish(first)
    router.set_health(first.endpoint, False)
    moved = router.route(chat("sticky " * 30))
    assert moved.endpoint != first.endpoint and first.endpoint not in moved.fallbacks
    router.finish(moved)
    router.set_health(first.endpoint, True)
    # Its index was dropped: the prefix now lives only where it moved.
    assert router.route(chat("sticky " * 30)).endpoint == moved.endpoint


def test_an_endpoint_whose_metrics_tell_restarts_keeps_its_index_while_unhealthy():
    """Missed probes alone (a stall, an overloaded API server) leave a cache as it was; when
    the endpoint's metrics tell restarts (a process start time, or counters that would
    start over) a restart is told by them, so the index is kept until they do. Without
    (scrapes off, a server exporting neither) it is emptied as before; a failed scrape
    changes neither."""
    router = Router(RoutingConfig(), ENDPOINTS)
    first = router.route(chat("sticky " * 30))
    router.finish(first)
    address = first.endpoint
    router.observe_signals(address, True, 0, 0, tells_restarts=True)
    router.observe_signals(address, False)  # a failed scrape: still told
    router.set_health(address, False)
    moved = router.route(chat("sticky " * 30))
    assert moved.endpoint != address
    router.finish(moved)
    assert router.index.match(first.hashes, [address])  # kept while it is out
    assert router.set_health(address, True)  # back: read its metrics at once...
    assert not router.set_health(address, True)  # (asked once)
    assert router.index.match(first.hashes, [address])
    # ... and until they are read, it is not picked: it may have restarted.
    assert address not in router.healthy_endpoints()
    assert router.route(chat("sticky " * 30), allowed=frozenset({address})).endpoint is None
    router.restarted(address)  # the first scrape the new server answers...
    router.observe_signals(address, True, 0, 0, tells_restarts=False)  # ... read
    assert router.index.match(first.hashes, [address]) == {}
    assert address in router.healthy_endpoints()
    router.record(router.route(chat("sticky " * 30), allowed=frozenset({address})))
    assert not router.set_health(address, False)
    assert router.index.match(first.hashes, [address]) == {}


@pytest.mark.parametrize("read", [True, False])
def test_an_endpoint_back_from_missed_probes_is_picked_once_its_metrics_are_read(read):
    """A reading that shows no restart returns it with its index (a stall); a failed one
    tells nothing, so it returns with its index emptied, as without such metrics."""
    router = Router(RoutingConfig(), ENDPOINTS)
    first = router.route(chat("sticky " * 30))
    router.finish(first)
    address = first.endpoint
    router.observe_signals(address, True, 0, 0, tells_restarts=True)
    router.set_health(address, False)
    assert router.set_health(address, True)
    assert router.route(chat("sticky " * 30)).endpoint != address
    router.observe_signals(address, read, 0, 0, tells_restarts=True)
    assert address in router.healthy_endpoints()
    assert bool(router.index.match(first.hashes, [address])) == read
    assert (router.route(chat("sticky " * 30)).endpoint == address) == read


def test_an_endpoint_that_fails_again_before_its_metrics_are_read_stays_out():
    """Back by its probes, then failing them again before the reading came: the reading
    (a failed scrape of a dead server) must not return it."""
    router = Router(RoutingConfig(), ENDPOINTS)
    address = ENDPOINTS[0].address
    router.observe_signals(address, True, 0, 0, tells_restarts=True)
    router.set_health(address, False)
    assert router.set_health(address, True)
    assert not router.set_health(address, False)
    router.observe_signals(address, False)
    assert address not in router.healthy_endpoints()
    assert router.set_health(address, True)  # back again: read again


@pytest.mark.parametrize("tells_restarts", [True, False])
def test_a_member_not_ready_is_not_picked_and_keeps_its_index_while_its_metrics_tell_restarts(
    tells_restarts,
):
    """Kubernetes' not-ready pod (``EndpointConfig.ready`` false) stays a member: not picked,
    its index kept where a restart would show in its metrics (else emptied: it may be
    restarting in place); ready again, it is picked once those have been read."""
    endpoints = list(ENDPOINTS)
    router = Router(RoutingConfig(), endpoints)
    first = router.route(chat("sticky " * 30))
    router.finish(first)
    address = first.endpoint
    router.observe_signals(address, True, 0, 0, tells_restarts=tells_restarts)
    held = [e.model_copy(update={"ready": e.address != address}) for e in endpoints]
    assert router.set_endpoints(held) == []
    assert router.endpoints == [e.address for e in ENDPOINTS]
    assert address not in router.healthy_endpoints()
    assert router.route(chat("sticky " * 30), allowed=frozenset({address})).endpoint is None
    assert bool(router.index.match(first.hashes, [address])) == tells_restarts
    assert router.set_endpoints(endpoints) == [address]  # ready again: read its lists
    if tells_restarts:  # picked once its metrics are read
        assert address not in router.healthy_endpoints()
        router.observe_signals(address, True, 0, 0, tells_restarts=True)
    assert address in router.healthy_endpoints()
    assert bool(router.index.match(first.hashes, [address])) == tells_restarts
    assert router.route(chat("sticky " * 30), allowed=frozenset({address})).endpoint == address


def test_nothing_is_recorded_on_a_member_not_ready_whose_index_was_emptied():
    """Not ready, its metrics telling no restarts: its index was emptied (it may be
    restarting), so neither this router's deferred record of a request sent just before
    nor a peer's late placement may claim its blocks; one whose metrics tell restarts
    keeps taking them (a restart, when told, empties them)."""
    for tells in (False, True):
        router = Router(RoutingConfig(), ENDPOINTS)
        address = ENDPOINTS[0].address
        router.observe_signals(address, True, 0, 0, tells_restarts=tells)
        own = router.route(
            chat("recorded late " * 30), allowed=frozenset({address}), defer_record=True
        )
        placed = Router(RoutingConfig(), ENDPOINTS).route(chat("a peer's " * 30))
        router.set_endpoints(
            [e.model_copy(update={"ready": e.address != address}) for e in ENDPOINTS]
        )
        router.record(own)
        router.finish(own)
        taken = router.observe_peer_placements([Placement("peer", address, placed.hashes)])
        assert bool(router.index.match(own.hashes, [address])) == tells
        assert taken == int(tells)


def test_nothing_is_recorded_on_an_endpoint_while_it_is_dead():
    """A peer's placement on an endpoint this router finds dead (peers read a second or more
    late, some placed before they noticed), or this router's own deferred record of a
    request sent there just before: a restarted server comes back with an empty cache, so
    neither may claim its blocks once it is back."""
    router, peer = Router(RoutingConfig(), ENDPOINTS), Router(RoutingConfig(), ENDPOINTS)
    placed = peer.route(chat("placed by a peer " * 30))
    own = router.route(chat("recorded late " * 30), defer_record=True)
    for address in {placed.endpoint, own.endpoint}:
        router.set_health(address, False)
    assert router.observe_peer_placements([Placement("peer", placed.endpoint, placed.hashes)]) == 0
    router.record(own)
    router.finish(own)
    for address in {placed.endpoint, own.endpoint}:
        router.set_health(address, True)
    assert router.index.match(placed.hashes, [placed.endpoint]) == {}
    assert router.index.match(own.hashes, [own.endpoint]) == {}
    # Alive, the same placement is recorded.
    assert router.observe_peer_placements([Placement("peer", placed.endpoint, placed.hashes)]) == 1
    assert router.index.match(placed.hashes, [placed.endpoint])


def test_no_endpoints_and_subset_hint():
    empty = Router(RoutingConfig(), [])
    assert empty.route(chat("x " * 40)).rule == RULE_NO_ENDPOINT
    router = Router(RoutingConfig(), ENDPOINTS)
    only = frozenset({ENDPOINTS[2].address})
    assert router.route(chat("y " * 40), allowed=only).endpoint == ENDPOINTS[2].address
    assert router.route(chat("y " * 40), allowed=frozenset({"9.9.9.9:1"})).rule == RULE_NO_ENDPOINT


def test_a_deferred_record_reaches_the_index_and_the_peers_log_once_at_record():
    router = Router(RoutingConfig(), ENDPOINTS)
    router.placements = PlacementLog()
    decision = router.route(chat("deferred " * 30), defer_record=True)
    endpoint, blocks = decision.endpoint, len(decision.hashes)
    assert endpoint is not None and blocks > 0
    assert router.index.match(decision.hashes, [endpoint]) == {}  # holds none of it
    assert router.placements.after(0) == []
    assert router.in_flight()[endpoint] == 1 and router.queued_work()[endpoint] > 0
    router.record(decision)
    router.record(decision)  # once only
    assert router.index.match(decision.hashes, [endpoint]) == {endpoint: blocks}
    assert [p.endpoint for p in router.placements.after(0)] == [endpoint]
    # Without defer_record, route() records at once (the simulator's path); a request that
    # Envoy served elsewhere before its record is recorded there only.
    assert router.route(chat("deferred " * 30, "ok", "more")).matched_blocks == blocks
    moved = router.route(chat("moved " * 30), defer_record=True)
    actual = next(e.address for e in ENDPOINTS if e.address != moved.endpoint)
    assert router.served(moved, actual)
    router.record(moved)
    assert router.index.match(moved.hashes, [moved.endpoint or "", actual]) == {
        actual: len(moved.hashes)
    }


def test_served_report_moves_load_and_learns_blocks():
    router = Router(RoutingConfig(), ENDPOINTS)
    decision = router.route(chat("report " * 30))
    actual = next(e.address for e in ENDPOINTS if e.address != decision.endpoint)
    assert router.served(decision, actual)
    assert router.in_flight()[actual] == 1
    assert not router.served(decision, "8.8.8.8:80")  # never learns a non-member
    router.finish(decision)
    assert sum(router.in_flight().values()) == 0
    assert router.index.match(decision.hashes, [actual]) == {actual: len(decision.hashes)}


def test_set_endpoints_keeps_survivors_and_drops_removed():
    router = Router(RoutingConfig(), ENDPOINTS)
    d = router.route(chat("keep " * 30))
    router.set_endpoints([e for e in ENDPOINTS if e.address != d.endpoint])
    assert d.endpoint not in router.endpoints
    router.finish(d)  # finishing a removed endpoint's request is harmless
    assert router.route(chat("keep " * 30)).endpoint in router.endpoints


def test_an_endpoint_added_again_is_not_the_one_its_old_requests_were_charged_to():
    """Removed and added again (a flapping readiness probe, a reused pod IP) with requests of
    its old incarnation still running: their late finishes, and a late record of their
    blocks, belong to the old one and leave the new one's count and index alone."""
    router = Router(RoutingConfig(), ENDPOINTS)
    address = ENDPOINTS[0].address
    only = frozenset({address})
    old = [
        router.route(completion(f"old {i} " * 30), allowed=only, defer_record=True)
        for i in range(3)
    ]
    router.set_endpoints(ENDPOINTS[1:])
    router.set_endpoints(ENDPOINTS)
    new = [router.route(completion(f"new {i} " * 30), allowed=only) for i in range(2)]
    for decision in old:
        router.record(decision)
        router.finish(decision)
    assert router.in_flight()[address] == 2
    assert router.queued_work()[address] > 0
    assert router.index.match(old[0].hashes, [address]) == {}
    assert router.index.match(new[0].hashes, [address])
    for decision in new:
        router.finish(decision)
    assert router.in_flight()[address] == 0


def completion(text: str):
    return parse_request("completions", orjson.dumps({"model": "m", "prompt": text}))


BIG = "a long document nobody else shares. " * 6000  # ~54k tokens at 4 bytes/token


def test_new_sessions_avoid_an_endpoint_busy_with_a_long_prefill():
    # Request counts alone cannot see it: every endpoint but one is idle and the busy one
    # has a single request in flight, well under the count guard.
    router = Router(RoutingConfig(), ENDPOINTS, clock=Clock())
    big = router.route(completion(BIG))
    assert router.queued_work()[big.endpoint] == big.work > 100_000
    placed = []
    for i in range(40):
        d = router.route(chat("tell me more", system=f"conversation {i}: topic {i * 7919} " * 8))
        placed.append(d.endpoint)
        router.finish(d)
    assert big.endpoint not in placed
    assert len(set(placed)) == 3
    router.finish(big)
    assert router.queued_work()[big.endpoint] == 0
    again = []
    for i in range(40, 80):
        d = router.route(chat("tell me more", system=f"conversation {i}: topic {i * 7919} " * 8))
        again.append(d.endpoint)
        router.finish(d)
    assert big.endpoint in again  # its share of new sessions comes back once it is idle


def test_a_session_leaves_its_holder_only_when_the_queue_costs_more_than_the_hit_saves():
    clock = Clock()
    router = Router(RoutingConfig(), ENDPOINTS, clock=clock)
    turn1 = chat("explain rendezvous hashing " * 600)  # ~4k tokens: a hit saves a lot
    first = router.route(turn1)
    router.finish(first)
    turn2 = chat("explain rendezvous hashing " * 600, "sure: ...", "and with weights?")
    # A short queue on the holder: staying is cheaper than a cold prefill elsewhere.
    small = router.route(completion("short job " * 40), allowed=frozenset({first.endpoint}))
    stay = router.route(turn2)
    assert stay.rule == RULE_AFFINITY and stay.endpoint == first.endpoint
    router.finish(stay)
    router.finish(small)
    # A long prefill queued on the holder: moving wins, and the decision says why.
    big = router.route(completion(BIG), allowed=frozenset({first.endpoint}))
    moved = router.route(turn2)
    assert moved.rule == RULE_LOAD_GUARD and moved.endpoint != first.endpoint
    costs = {c["endpoint"]: c for c in moved.explain()["candidates"]}
    assert costs[first.endpoint]["queued_work"] == round(big.work)
    assert costs[moved.endpoint]["est_cost"] < costs[first.endpoint]["est_cost"]
    router.finish(moved)
    # The queued work drains at the prefill throughput: once it is done, the session is
    # back on its holder even though the long request is still in flight (decoding).
    clock.now += big.work / router.cost.drain_per_second
    assert router.queued_work()[first.endpoint] == 0 and router.in_flight()[first.endpoint] == 1
    back = router.route(turn2)
    assert back.rule == RULE_AFFINITY and back.endpoint == first.endpoint


def test_queued_work_follows_the_served_endpoint_and_is_taken_back_at_finish():
    clock = Clock()
    router = Router(RoutingConfig(), ENDPOINTS, clock=clock)
    decision = router.route(completion(BIG))
    assert decision.explain()["work"] == round(decision.work)
    assert decision.explain()["prompt_tokens"] == round(len(BIG) / 4)
    actual = next(e.address for e in ENDPOINTS if e.address != decision.endpoint)
    assert router.served(decision, actual)
    work = router.queued_work()
    assert work[decision.endpoint] == 0 and work[actual] == decision.work
    clock.now += 1.0
    assert router.queued_work()[actual] == decision.work - router.cost.drain_per_second
    router.finish(decision)
    assert set(router.queued_work().values()) == {0}


def test_a_request_sent_where_prefill_work_is_queued_is_charged_without_the_steps_fixed_cost():
    """vLLM prefills the requests queued together in one step (up to max_num_batched_tokens):
    with prefill_batch_tokens, a request sent to an endpoint with more than a step's fixed
    cost queued is charged its tokens only, when they fit in a step; one sent to an idle
    endpoint pays the fixed cost."""
    work = {}
    for step in (0, 1_000, 100):  # off; the next's ~400 uncached tokens fit in a step; not
        router = Router(RoutingConfig(prefill_batch_tokens=step), ENDPOINTS, clock=Clock())
        first = router.route(completion(BIG))
        # Its prompt held where the first's whole prefill is queued, but a ~400-token tail.
        following = router.route(completion(BIG + "and one more question to answer. " * 50))
        assert following.endpoint == first.endpoint
        work[step] = (first.work, following.work)
    base = RoutingConfig().prefill_base_tokens
    assert work[1_000][0] == work[0][0]  # to an idle endpoint: the fixed cost too
    assert work[1_000][1] == pytest.approx(work[0][1] - base)
    assert work[100] == work[0]
    # A request that fits a step pays the fixed cost where nothing is queued, or less than a
    # step's fixed cost (the queue's last step under way: the request waits for the next).
    clock = Clock()
    router = Router(RoutingConfig(prefill_batch_tokens=1_000), ENDPOINTS, clock=clock)
    short = "a short question of its own. " * 20  # ~150 tokens
    assert router.route(completion(short)).work > base
    first = router.route(completion(BIG))
    clock.now += (first.work - base / 2) / router.cost.drain_per_second
    following = router.route(completion(BIG + "and one more question to answer. " * 50))
    assert following.endpoint == first.endpoint
    assert following.work == pytest.approx(work[0][1])  # the fixed cost included


def test_a_shared_system_prompt_does_not_pull_new_sessions_onto_its_holder():
    # The preamble makes a new session cheaper to prefill where it is cached; following that
    # would put every conversation on the first endpoint that saw the system prompt. (A
    # preamble under shared_prefix_fraction of the prompt; a longer one does attract, see
    # test_long_shared_prefix_attracts_new_sessions_but_a_short_preamble_does_not.)
    router = Router(RoutingConfig(), ENDPOINTS, clock=Clock())
    placed = []
    for i in range(40):
        # system ~1.1k tokens, first turn ~1.6k tokens
        d = router.route(chat(f"question number {i}. " * 300, system=SYSTEM * 4))
        assert d.rule == RULE_COLD_START
        placed.append(d.endpoint)
        router.finish(d)
    assert len(set(placed)) == 4


def test_cost_model_comes_from_the_routing_config():
    from extproc.scheduler import CostModel

    config = RoutingConfig(prefill_tokens_per_second=1000.0, stickiness=0.5, cold_margin=2.0)
    router = Router(config, ENDPOINTS)
    assert router.cost == CostModel.from_config(config)
    assert router.cost.drain_per_second == 1000.0 and router.cost.stickiness == 0.5
    assert CostModel.from_config(RoutingConfig()) == CostModel()  # defaults agree


def test_the_stickiness_premium_scales_with_the_targets_fill_only_when_it_is_idle():
    from extproc.scheduler import CostModel

    model = CostModel(stickiness=8.0, stickiness_fill=0.5)
    fill, idle = np.array([0.0, 0.25, 0.5, 1.0]), np.zeros(4)
    assert model.premium(fill, idle).tolist() == [0.0, 4.0, 8.0, 8.0]
    busy = np.full(4, model.base_tokens + 1)  # more queued than one request's fixed cost
    assert model.premium(fill, busy).tolist() == [8.0] * 4
    shared = dataclasses.replace(model, stickiness_floor=0.5)
    assert shared.premium(fill, idle).tolist() == [4.0, 4.0, 8.0, 8.0]
    assert model.premium(None, idle) == 8.0
    assert dataclasses.replace(model, stickiness_fill=0.0).premium(fill, idle) == 8.0


def _session_behind_a_queued_job(
    config: RoutingConfig,
    *,
    others_busy: bool = False,
    completions: bool = False,
    session_repeats: int = 600,
    job_repeats: int = 4000,
):
    """A ~4k-token session on its holder, which then gets a ~12k-token job queued: less than
    the full premium for the session's tokens (8 x 4k), more than a cold prefill elsewhere.
    ``completions``: the same prompts as completions, which have no turns. The repeats set
    the session's and the job's lengths (27 and 12 bytes each, ~4 bytes a token)."""
    router = Router(config, ENDPOINTS, clock=Clock())
    for i in range(24):  # enough finished requests to measure the traffic share by
        router.finish(router.route(chat(f"conversation {i} " * 30)))
    text = "explain rendezvous hashing " * session_repeats
    turn1 = completion(text) if completions else chat(text)
    first = router.route(turn1)
    router.finish(first)
    job = router.route(
        completion("queued job. " * job_repeats), allowed=frozenset({first.endpoint})
    )
    assert job.endpoint == first.endpoint
    if others_busy:
        for endpoint in ENDPOINTS:
            if endpoint.address != first.endpoint:
                router.route(completion("short job " * 40), allowed=frozenset({endpoint.address}))
    if completions:
        return router, first, completion(text + "sure: ... and with weights?")
    return router, first, chat(text, "sure: ...", "and with weights?")


def test_a_router_alone_copies_a_session_into_an_idle_endpoints_free_room():
    """stickiness_fill (docs/benchmarks.md, item 13): a copy on an endpoint with free room
    and nothing queued evicts nothing and delays nobody, so the session moves off a queue
    shorter than its full premium; it waits by default (off), when the others are busy, or
    when other router replicas serve most of the traffic."""
    scaled = RoutingConfig(stickiness_fill=1.0)
    router, first, turn2 = _session_behind_a_queued_job(scaled)
    moved = router.route(turn2)
    assert moved.rule == RULE_LOAD_GUARD and moved.endpoint != first.endpoint
    router, first, turn2 = _session_behind_a_queued_job(RoutingConfig())
    stay = router.route(turn2)
    assert stay.rule == RULE_AFFINITY and stay.endpoint == first.endpoint
    router, first, turn2 = _session_behind_a_queued_job(scaled, others_busy=True)
    assert router.route(turn2).endpoint == first.endpoint
    router, first, turn2 = _session_behind_a_queued_job(scaled)
    _report_finished(router, 4.0)  # this router sends a quarter of what they serve
    assert router.cost.stickiness_floor == 1.0
    assert router.route(turn2).endpoint == first.endpoint


def test_a_conversation_moves_its_history_off_a_queue_for_the_session_premium_only():
    """session_stickiness (docs/benchmarks.md, item 22): a conversation's later turns follow
    its history, so a copy of it on an idle endpoint loses no later reuse; it moves off a
    queue longer than that premium. Not with the full premium, not into a busy endpoint,
    not for a completion (no turns: its prefix may be any request's), and not once other
    router replicas serve most of the traffic (their next turn looks for the old holder)."""
    premium = RoutingConfig(session_stickiness=2.0)
    router, first, turn2 = _session_behind_a_queued_job(premium)
    moved = router.route(turn2)
    assert moved.rule == RULE_LOAD_GUARD and moved.endpoint != first.endpoint
    router.finish(moved)
    turn3 = chat(
        "explain rendezvous hashing " * 600, "sure: ...", "and with weights?", "ok", "more"
    )
    assert router.route(turn3).endpoint == moved.endpoint  # the history followed
    router, first, turn2 = _session_behind_a_queued_job(RoutingConfig(session_stickiness=8.0))
    stay = router.route(turn2)
    assert stay.rule == RULE_AFFINITY and stay.endpoint == first.endpoint
    router, first, turn2 = _session_behind_a_queued_job(premium, others_busy=True)
    assert router.route(turn2).endpoint == first.endpoint
    router, first, prompt2 = _session_behind_a_queued_job(premium, completions=True)
    assert router.route(prompt2).endpoint == first.endpoint
    router, first, turn2 = _session_behind_a_queued_job(premium)
    _report_finished(router, 4.0)  # this router sends a quarter of what they serve
    assert router.route(turn2).endpoint == first.endpoint


def test_a_long_held_prefix_stays_behind_a_queue_a_short_one_would_leave():
    """long_prefix_tokens (docs/benchmarks.md, item 29): a request whose held prefix is at
    least that long pays long_prefix_stickiness per lacking token instead of stickiness.
    A ~9k-token conversation behind a ~35k-token job (~114k token-equivalents queued): more
    than a cold prefill elsewhere plus 8 per lacking token (~88k), less than with 16
    (~160k). It stays by default, moves with the rule off or the threshold above it."""

    def second_turn(config: RoutingConfig):
        # ~9,200-token session, ~35k-token job
        router, first, turn2 = _session_behind_a_queued_job(
            config, session_repeats=1370, job_repeats=11_700
        )
        return first, router.route(turn2)

    first, stay = second_turn(RoutingConfig())
    assert stay.rule == RULE_AFFINITY and stay.endpoint == first.endpoint
    for config in (RoutingConfig(long_prefix_tokens=0), RoutingConfig(long_prefix_tokens=16_384)):
        first, moved = second_turn(config)
        assert moved.rule == RULE_LOAD_GUARD and moved.endpoint != first.endpoint
    first, moved = second_turn(RoutingConfig(long_prefix_stickiness=8.0))
    assert moved.endpoint != first.endpoint


def test_the_long_prefix_model_applies_from_its_threshold_only():
    cost = CostModel.from_config(RoutingConfig(long_prefix_tokens=8192, long_prefix_stickiness=16))
    assert cost.for_held(8191.9) is cost
    assert cost.for_held(8192).stickiness == 16 and cost.for_held(1e6).stickiness == 16
    assert cost.for_held(8192).cold_margin == cost.cold_margin
    off = CostModel.from_config(RoutingConfig(long_prefix_tokens=0))
    assert off.for_held(1e9) is off


def test_long_shared_prefix_attracts_new_sessions_but_a_short_preamble_does_not():
    document = "A long shared document about caches. " * 60  # ~2,200 bytes
    router = Router(RoutingConfig(), ENDPOINTS)
    homes = set()
    for i in range(12):
        d = router.route(chat(f"question {i}?", system=document))
        router.finish(d)
        homes.add(d.endpoint)
        if i:
            assert d.rule == RULE_AFFINITY  # the document is > half of each prompt
    assert len(homes) == 1
    # A short preamble under long, distinct first turns: new sessions spread by rendezvous.
    router = Router(RoutingConfig(), ENDPOINTS)
    homes = set()
    for i in range(24):
        d = router.route(chat(f"session {i}: " + "own material " * 80, system="Be brief. " * 8))
        router.finish(d)
        homes.add(d.endpoint)
        assert d.rule == RULE_COLD_START
    assert len(homes) == len(ENDPOINTS)


def test_requests_waiting_beyond_this_routers_own_count_as_work_until_they_would_have_drained():
    """Several router replicas: an endpoint that reports more requests waiting than this
    router has in flight there holds another router's queue. It is priced at this router's
    typical prefill and drains on the router's clock from the scrape on."""
    clock = Clock()
    config = RoutingConfig(load_slack=1000)  # no count guard: the queued work alone decides
    router = Router(config, ENDPOINTS, clock=clock)
    turn1 = chat("explain rendezvous hashing " * 600)  # ~4k tokens: a hit saves a lot
    first = router.route(turn1)
    router.finish(first)
    home = first.endpoint
    turn2 = chat("explain rendezvous hashing " * 600, "sure: ...", "and with weights?")
    router.observe_signals(home, up=True, running=1, waiting=0)  # nothing unseen
    stay = router.route(turn2)
    assert stay.endpoint == home and stay.rule == RULE_AFFINITY
    router.finish(stay)
    typical = (first.work + stay.work) / 2
    # Twenty requests wait there that this router never sent.
    router.observe_signals(home, up=True, running=4, waiting=20)
    moved = router.route(turn2)
    assert moved.endpoint != home and moved.rule == RULE_LOAD_GUARD
    candidates = {c["endpoint"]: c for c in moved.explain()["candidates"]}
    assert candidates[home]["queued_work"] == round(20 * typical)
    router.finish(moved)

    def queued_at_home() -> int:
        decision = router.route(completion("an unrelated question"))
        router.finish(decision)
        return {c["endpoint"]: c for c in decision.explain()["candidates"]}[home]["queued_work"]

    # It drains at the prefill throughput: half of it is left half-way, none at the end.
    drain_seconds = 20 * typical / router.cost.drain_per_second
    clock.now += drain_seconds / 2
    assert queued_at_home() == round(10 * typical)
    clock.now += drain_seconds / 2
    assert queued_at_home() == 0
    # What this router has in flight there is its own, not another router's: 20 of its
    # own waiting, and nothing reported beyond them.
    mine = [router.route(completion(f"own request {i}"), allowed={home}) for i in range(20)]
    router.observe_signals(home, up=True, running=0, waiting=20)
    assert queued_at_home() == round(sum(d.work for d in mine))
    # Switched off, or the endpoint's metrics gone: only this router's own queue counts.
    switched_off = config.model_copy(update={"count_unseen_waiting": False})
    for other_config, up in ((switched_off, True), (config, False)):
        other = Router(other_config, ENDPOINTS, clock=clock)
        other.finish(other.route(turn1))
        other.observe_signals(home, up=up, running=4, waiting=20)
        assert other.route(turn2).endpoint == home


def test_waiting_requests_count_as_others_by_the_others_share_of_what_endpoints_report():
    """Two router replicas: this one's own requests outnumber those waiting at an endpoint,
    yet the endpoints report running more than this router has in flight: part of their
    queues is the other router's. The waiting requests count as others' queued work in the
    share the others hold of everything reported; a router whose in-flight count covers
    what the endpoints report (one router alone) counts none."""

    def home_queue(others_running: int) -> tuple[float, float]:
        router = Router(RoutingConfig(load_slack=1000), ENDPOINTS, clock=Clock())
        home = ENDPOINTS[0].address
        mine = [router.route(completion(f"own {i}"), allowed={home}) for i in range(8)]
        for endpoint in ENDPOINTS[1:]:
            router.observe_signals(endpoint.address, up=True, running=others_running, waiting=0)
        # 6 waiting, 8 of this router's own in flight there: none beyond them.
        router.observe_signals(home, up=True, running=2 + others_running, waiting=6)
        probe = router.route(completion("an unrelated question"))
        queued = {c["endpoint"]: c for c in probe.explain()["candidates"]}[home]["queued_work"]
        typical = float(np.mean([d.work for d in mine]))
        return queued - sum(d.work for d in mine), typical

    others, typical = home_queue(others_running=6)
    reported = (2 + 6 + 6) + 3 * 6
    share = (reported - 8) / reported  # everything reported beyond this router's 8
    assert others == pytest.approx(6 * share * typical, abs=1)
    assert others > 2 * typical
    others, _ = home_queue(others_running=0)
    assert others == pytest.approx(0, abs=1)


def test_requests_waiting_for_kv_memory_count_as_work_though_this_router_sent_them():
    """One router: the requests an endpoint reports waiting are its own, and their charges
    drained on its clock as if they were being prefilled. With the KV cache nearly full they
    are waiting for memory instead, and a conversation moves off rather than queue behind
    them; with room in the cache, with every cache full (a move would only trade places),
    or with the rule off, it stays."""
    clock = Clock()
    config = RoutingConfig(load_slack=1000)  # no count guard: the queued work alone decides
    turn1 = chat("explain rendezvous hashing " * 600)
    turn2 = chat("explain rendezvous hashing " * 600, "sure: ...", "and with weights?")

    def second_turn(config: RoutingConfig, kv_usage: float, others_full: bool = False):
        router = Router(config, ENDPOINTS, clock=clock)
        if others_full:
            for endpoint in ENDPOINTS:
                router.observe_signals(endpoint.address, up=True, waiting=0, kv_usage=0.97)
        first = router.route(turn1)
        router.finish(first)
        home = first.endpoint
        assert home is not None
        # 24 in flight there, all this router's: 4 running, 20 waiting.
        mine = [router.route(completion(f"own request {i}"), allowed={home}) for i in range(24)]
        clock.now += 60.0  # their charges have drained on the router's clock
        router.observe_signals(home, up=True, running=4, waiting=20, kv_usage=kv_usage)
        decision = router.route(turn2)
        typical = (first.work + sum(d.work for d in mine)) / 25
        queued = {c["endpoint"]: c for c in decision.explain()["candidates"]}[home]
        return home, decision, queued["queued_work"], typical

    home, stay, queued, _ = second_turn(config, kv_usage=0.5)
    assert stay.endpoint == home and stay.rule == RULE_AFFINITY and queued == 0
    home, moved, queued, typical = second_turn(config, kv_usage=0.95)
    assert moved.endpoint != home and moved.rule == RULE_LOAD_GUARD
    assert queued == round(20 * typical)
    home, stay, _, _ = second_turn(config, kv_usage=0.95, others_full=True)
    assert stay.endpoint == home
    off = config.model_copy(update={"kv_blocked_fraction": 0.0})
    home, stay, _, _ = second_turn(off, kv_usage=0.95)
    assert stay.endpoint == home


LONG_TURN1 = chat("explain rendezvous hashing " * 600)
LONG_TURN2 = chat("explain rendezvous hashing " * 600, "sure: ...", "and with weights?")


def _placed_long_turn(config: RoutingConfig, own: int):
    """A router on a test clock that placed LONG_TURN1 and sent ``own`` requests of its own
    to the same endpoint: (the clock, the router, its first decision, that endpoint, the
    decisions of its own requests)."""
    clock = Clock()
    router = Router(config, ENDPOINTS, clock=clock)
    first = router.route(LONG_TURN1)
    router.finish(first)
    home = first.endpoint
    assert home is not None
    mine = [router.route(completion(f"own request {i}"), allowed={home}) for i in range(own)]
    return clock, router, first, home, mine


def _second_turn_after_two_scrapes(config: RoutingConfig, first_scrape: dict, second_scrape: dict):
    """A router places LONG_TURN1, sends five requests of its own to the same endpoint, reads
    two scrapes of it two seconds apart and routes LONG_TURN2: (home, the decision, the queued
    work it priced at home, its typical charge, its drain rate)."""
    clock, router, first, home, mine = _placed_long_turn(config, own=5)
    router.observe_signals(home, up=True, **first_scrape)
    clock.now += 2.0
    router.observe_signals(home, up=True, **second_scrape)
    decision = router.route(LONG_TURN2)
    queued = {c["endpoint"]: c for c in decision.explain()["candidates"]}[home]
    typical = (first.work + sum(d.work for d in mine)) / 6
    return home, decision, queued["queued_work"], typical, router.cost.drain_per_second


def test_the_wait_for_kv_memory_is_priced_by_how_fast_the_endpoint_admits_requests():
    """An endpoint whose KV memory is full admits a waiting request only as a running one
    finishes (long outputs: seconds each), not at the pace of their prefills. Five waiting
    requests priced as five short prefills keep a conversation there; at the half a request
    per second the endpoint reports finishing they are a ten-second wait, and it moves. The
    rate comes from its counters between two scrapes; with the option off it stays."""

    def second_turn(config: RoutingConfig, finished: float):
        window = (1000.0, finished, 0.1) if finished else None
        return _second_turn_after_two_scrapes(
            config,
            dict(running=4, waiting=5, kv_usage=0.5),
            dict(running=4, waiting=5, kv_usage=0.95, prefill_window=window),
        )

    config = RoutingConfig(load_slack=1000)  # no count guard: the queued work alone decides
    home, moved, queued, _, drain = second_turn(config, finished=1.0)
    assert moved.endpoint != home and moved.rule == RULE_LOAD_GUARD
    assert queued == pytest.approx(5 / 0.5 * drain, rel=0.01)
    # Priced by the prefills alone (option off, or no rate measured yet): it stays.
    off = config.model_copy(update={"kv_wait_from_admissions": False})
    home, stay, queued, typical, _ = second_turn(off, finished=1.0)
    assert stay.endpoint == home and queued == round(5 * typical)
    home, stay, queued, typical, _ = second_turn(config, finished=0.0)
    assert stay.endpoint == home and queued == round(5 * typical)

    # None finished, one more running: admitted all the same (vLLM counts a prefill when its
    # request finishes, so the finished count lags admissions by a request's decode).
    def growing(counts_finished: bool):
        return _second_turn_after_two_scrapes(
            config,
            dict(running=4, waiting=5, kv_usage=0.5, counts_finished=counts_finished),
            dict(running=5, waiting=5, kv_usage=0.95, counts_finished=counts_finished),
        )

    home, moved, queued, _, drain = growing(counts_finished=True)
    assert moved.endpoint != home and queued == pytest.approx(5 / 0.5 * drain, rel=0.01)
    # A server that does not count finished requests (SGLang, TGI): no rate, it stays.
    home, stay, queued, typical, _ = growing(counts_finished=False)
    assert stay.endpoint == home and queued == round(5 * typical)


def test_requests_waiting_for_a_batch_slot_are_priced_like_those_waiting_for_memory():
    """An endpoint running as many requests as it ever has (vLLM's max_num_seqs, which it
    does not export) with requests waiting admits one only as a running one finishes, even
    with KV memory free. Priced by its admission rate, the wait moves a conversation off.
    Below its ceiling the waiting requests are a prefill queue, and a ceiling under
    ``routing.slot_ceiling_min`` (32) is more likely the load than a limit: they are this
    router's own charges, drained on its clock, and it stays; and with the rule off."""

    def second_turn(config: RoutingConfig, ceiling: int, running: int):
        home, decision, queued, typical, drain = _second_turn_after_two_scrapes(
            config,
            dict(running=ceiling, waiting=5, kv_usage=0.3),
            dict(running=running, waiting=5, kv_usage=0.3, prefill_window=(1e3, 1, 0.1)),
        )
        return home, decision, queued, typical, drain

    config = RoutingConfig(load_slack=1000)
    home, moved, queued, _, drain = second_turn(config, ceiling=128, running=128)
    assert moved.endpoint != home and moved.rule == RULE_LOAD_GUARD
    assert queued == pytest.approx(5 / 0.5 * drain, rel=0.01)
    off = config.model_copy(update={"slot_blocked_fraction": 0.0})
    for other_config, ceiling, running in ((config, 128, 64), (config, 16, 16), (off, 128, 128)):
        home, stay, queued, typical, _ = second_turn(other_config, ceiling, running)
        # Not priced as a wait for a slot: the waiting requests are a prefill queue, the
        # share of them others sent (the running ones are not this router's) at its
        # typical prefill, its own charges drained.
        others = running / (running + 5)
        assert stay.endpoint == home and queued == pytest.approx(5 * others * typical, abs=1)
    # A server configured with few slots: the operator lowers the floor, and it counts.
    few_slots = config.model_copy(update={"slot_ceiling_min": 16})
    home, moved, _, _, _ = second_turn(few_slots, ceiling=16, running=16)
    assert moved.endpoint != home and moved.rule == RULE_LOAD_GUARD


def test_a_blocked_wait_priced_without_an_admission_rate_holds_past_the_next_reading():
    """Before a router has seen a blocked endpoint admit anything (its first readings, a
    router restarted beside saturated servers, a server that does not count finished
    requests), it prices the requests waiting there by their prefills. Drained at the
    prefill rate, as a prefill queue's price is, that price was gone long before the
    endpoint admitted any of them: it now stays whole past the endpoint's next reading (twice
    the time between its readings; a second after the first one; five at most), then
    drains. A reading re-prices it (a down one zeroes it). With the option off it drains
    from the reading, as before."""

    def queued_at_home(
        config: RoutingConfig,
        readings: list[float],
        after: float,
        down_at: float | None = None,
        slower_at: float | None = None,
        **signals,
    ) -> tuple[float, float, float]:
        # 40 of its own in flight there (no one else's): 32 running, all its batch slots,
        # and 8 waiting for one.
        clock, router, first, home, mine = _placed_long_turn(config, own=40)
        for at in readings:  # readings of the same figures: nothing admitted in between
            clock.now = 60.0 + at  # (by 60 s its prefill charges have drained)
            router.observe_signals(home, up=True, running=32, waiting=8, kv_usage=0.3, **signals)
        if down_at is not None:
            clock.now = 60.0 + down_at
            router.observe_signals(home, up=False)
        if slower_at is not None:  # the other endpoints' readings teach a slower prefill rate
            clock.now = 60.0 + slower_at
            for _ in range(3):
                for other in (e.address for e in ENDPOINTS if e.address != home):
                    router.observe_signals(other, up=True, prefill_window=(8000, 8, 2.0))
            assert router.cost.drain_per_second < 20_000
        clock.now += after
        decision = router.route(LONG_TURN2)
        queued = {c["endpoint"]: c for c in decision.explain()["candidates"]}[home]
        typical = (first.work + sum(d.work for d in mine)) / 41
        return queued["queued_work"], 8 * typical, router.cost.drain_per_second

    config = RoutingConfig(load_slack=1000)
    queued, blocked, drain = queued_at_home(config, [0.0], after=0.9)
    assert blocked < 0.45 * drain  # drained from the reading, nothing would be left
    assert queued == round(blocked)
    queued, blocked, drain = queued_at_home(config, [0.0], after=1.2)
    assert queued == pytest.approx(blocked - 0.2 * drain, abs=1)
    # Counted finishes that show no admission: no rate, held all the same.
    queued, blocked, _ = queued_at_home(config, [0.0, 0.5], after=0.9, counts_finished=True)
    assert queued == round(blocked)
    queued, blocked, _ = queued_at_home(config, [0.0, 2.0], after=3.9)
    assert queued == round(blocked)
    queued, _, _ = queued_at_home(config, [0.0, 2.0], after=4.0 + blocked / drain)
    assert queued == 0
    # Readings far apart (an endpoint down in between) hold it at most five seconds.
    queued, blocked, drain = queued_at_home(config, [0.0, 60.0], after=4.9)
    assert queued == round(blocked)
    queued, _, _ = queued_at_home(config, [0.0, 60.0], after=5.0 + blocked / drain)
    assert queued == 0
    # The prefill rate learned while it is held: still whole until the hold ends, then it
    # drains at the new rate.
    queued, blocked, slower = queued_at_home(config, [0.0], after=0.4, slower_at=0.5)
    assert queued == round(blocked)
    draining = 1.5 * blocked / drain  # past when it would have drained at the old rate
    queued, blocked, slower = queued_at_home(config, [0.0], after=0.5 + draining, slower_at=0.5)
    assert blocked > draining * slower  # (some left)
    assert queued == pytest.approx(blocked - draining * slower, abs=1)
    # A failed reading after it: nothing priced there.
    queued, _, _ = queued_at_home(config, [0.0], down_at=0.5, after=0.1)
    assert queued == 0
    off = config.model_copy(update={"kv_wait_from_admissions": False})
    queued, blocked, drain = queued_at_home(off, [0.0], after=0.1)
    assert queued == pytest.approx(blocked - 0.1 * drain, abs=1)


def test_reported_load_from_other_routers_counts_in_the_guard():
    config = RoutingConfig(load_epsilon=0.0, load_slack=1)
    router = Router(config, ENDPOINTS)
    first = router.route(chat("busy elsewhere " * 30))
    router.finish(first)
    home = first.endpoint
    # The endpoint reports a deep queue this router never saw (another router's traffic).
    router.observe_signals(home, up=True, running=16, waiting=20)
    moved = router.route(chat("busy elsewhere " * 30))
    assert moved.endpoint != home and moved.rule == RULE_LOAD_GUARD
    router.finish(moved)
    # Its metrics go dark: back to in-flight counts only, and the prefix is followed again.
    router.observe_signals(home, up=False)
    assert router.route(chat("busy elsewhere " * 30)).endpoint in {home, moved.endpoint}
    explained = {
        c["endpoint"]: c for c in router.route(chat("busy elsewhere " * 30)).explain()["candidates"]
    }
    assert explained[home]["load"] < 16


def test_saturated_kv_cache_takes_no_new_sessions_while_others_can():
    """New sessions avoid a KV cache reported full; a request whose own prefix it holds still
    goes there (moving those cost up to 0.22 of hit ratio in the simulator's overloaded
    cells, docs/benchmarks.md). Nearly full is not full (item 25): its waits are priced."""
    router = Router(RoutingConfig(), ENDPOINTS)
    brief = "Be brief. " * 8  # a short preamble: sessions spread by rendezvous

    def session(i: int, *more: str):
        return chat(f"kv pressure {i} " * 30, *more, system=brief)

    homes = {}
    for i in range(24):
        d = router.route(session(i))
        router.finish(d)
        homes[i] = d.endpoint
    full = max(set(homes.values()), key=list(homes.values()).count)
    router.observe_signals(full, up=True, running=1, waiting=0, kv_usage=0.99)
    nearly = set()
    for i in range(200, 240):  # 99% is not full: new sessions still go there by rendezvous
        d = router.route(session(i))
        router.finish(d)
        nearly.add(d.endpoint)
    assert full in nearly
    router.observe_signals(full, up=True, running=1, waiting=0, kv_usage=1.0)
    for i in range(24):  # known sessions stay with their prefix, full or not
        d = router.route(session(i, "an answer", "a follow-up"))
        router.finish(d)
        assert d.endpoint == homes[i] and d.rule == RULE_AFFINITY
    placed = set()
    for i in range(24, 64):  # new sessions: never the full one
        d = router.route(session(i))
        router.finish(d)
        placed.add(d.endpoint)
    assert full not in placed and len(placed) == len(ENDPOINTS) - 1
    # A new session drawn by a long shared prompt that only the full endpoint holds: it goes
    # elsewhere (and pays for the prompt there once).
    document = "A long shared document about caches. " * 60
    holder = router.route(chat("question zero?", system=document), allowed=frozenset({full}))
    router.finish(holder)
    drawn = router.route(chat("question one? " * 12, system=document))
    assert drawn.endpoint != full
    for e in ENDPOINTS:  # every endpoint full: new sessions go by rendezvous as usual
        router.observe_signals(e.address, up=True, running=1, waiting=0, kv_usage=1.0)
    placed = set()
    for i in range(64, 104):
        d = router.route(session(i))
        router.finish(d)
        placed.add(d.endpoint)
    assert full in placed


def test_kv_capacity_learned_from_the_endpoint_sizes_the_index_unless_configured():
    configured = EndpointConfig(address="10.0.0.9:8000", capacity_tokens=1600)
    router = Router(RoutingConfig(), [*ENDPOINTS[:1], configured])
    learned = ENDPOINTS[0].address
    router.observe_signals(learned, up=True, kv_capacity_tokens=3200)  # 3,200 tokens
    router.observe_signals(configured.address, up=True, kv_capacity_tokens=999_999)
    capacities = {a: router.index.capacity(a) for a in router.endpoints}
    assert capacities[learned] == 3200 * 4 // 64  # tokens x bytes/token / block bytes
    assert capacities[configured.address] == 1600 * 4 // 64
    router.set_endpoints([*ENDPOINTS[:1], configured])  # a re-sync keeps the learned size
    assert router.index.capacity(learned) == 200


def test_placements_before_the_first_scrape_outlive_the_index_resize_it_brings():
    """The first scrape sizes an endpoint's index (its KV size) and a resized region starts
    empty: what the router placed before it is replayed from the endpoint's journal."""
    clock = Clock()
    router = Router(RoutingConfig(), ENDPOINTS, clock=clock)
    later = EndpointConfig(address="10.0.0.9:8000")

    def converse(i: int):
        system = f"session {i}: you answer questions about B-trees. " * 10
        first = router.route(chat("What is a B-tree?", system=system))
        router.finish(first)
        return first, chat("What is a B-tree?", "A tree.", "And a trie?", system=system)

    turns = [converse(i) for i in range(8)]
    router.set_endpoints([*ENDPOINTS, later])  # a pod added later starts its own journal
    clock.now += 5.0
    added = None
    for i in range(8, 40):
        first, follow_up = converse(i)
        if first.endpoint == later.address:
            added = (first, follow_up)
            break
    assert added is not None
    # An endpoint that restarted before its first scrape held nothing: nothing is replayed.
    restarted = turns[0][0].endpoint
    router.restarted(restarted)
    for e in [*ENDPOINTS, later]:
        # Each endpoint's KV size differs from the provisional one.
        router.observe_signals(e.address, up=True, kv_capacity_tokens=100_000)
        assert router.index.capacity(e.address) == 100_000 * 4 // 64
    assert router.index.entries_by_endpoint()[restarted] == 0
    kept = [(first, follow_up) for first, follow_up in turns if first.endpoint != restarted]
    assert len(kept) >= 4
    for first, follow_up in [*kept, added]:
        second = router.route(follow_up)
        router.finish(second)
        assert second.rule == RULE_AFFINITY and second.endpoint == first.endpoint
        assert second.matched_blocks == first.total_blocks
    # The journal ends with the first scrape: a resize after it starts empty, as before.
    router.observe_signals(later.address, up=True, kv_capacity_tokens=200_000)
    assert router.index.entries_by_endpoint()[later.address] == 0


def test_an_endpoint_journal_is_bounded_in_blocks_not_in_time():
    clock = Clock()
    router = Router(RoutingConfig(default_capacity_tokens=1600), ENDPOINTS[:1], clock=clock)
    address = ENDPOINTS[0].address
    requests = [chat("hello", system=f"conversation {i} " * 200) for i in range(6)]
    decisions = []
    for request in requests:  # 1,600 tokens: 100 blocks; each request's prompt ~47 of them
        decision = router.route(request)
        router.finish(decision)
        decisions.append(decision)
    assert sum(d.total_blocks for d in decisions) > 100
    router.observe_signals(address, up=True, kv_capacity_tokens=100_000)
    matched = [router.index.match(d.hashes, [address]).get(address, 0) for d in decisions]
    assert matched[-1] == decisions[-1].total_blocks and matched[0] == 0  # oldest dropped
    # However late the first readable scrape (its metrics failing meanwhile), everything
    # placed until then is replayed (a 30 s limit had lost it all: a review finding).
    router = Router(RoutingConfig(), ENDPOINTS[:1], clock=clock)
    decisions = []
    for request in requests:
        decisions.append(router.route(request))
        router.finish(decisions[-1])
        router.observe_signals(address, up=False)
        clock.now += 20.0
    router.observe_signals(address, up=True, kv_capacity_tokens=100_000)
    for decision in decisions:
        held = router.index.match(decision.hashes, [address]).get(address, 0)
        assert held == decision.total_blocks


def test_an_endpoint_journal_outlasts_a_server_loading_its_model():
    """Servers that load their model for minutes: a journal that ran from the endpoint's
    addition ended before it was first sent a request (a review finding); and an endpoint
    whose capacity is no longer configured has a provisional size again."""
    clock = Clock()
    configured = [e.model_copy(update={"capacity_tokens": 200_000}) for e in ENDPOINTS]
    router = Router(RoutingConfig(), configured, clock=clock)
    router.set_endpoints(ENDPOINTS)  # the configured size dropped: provisional again
    for e in ENDPOINTS:
        router.observe_signals(e.address, up=False)
        router.set_health(e.address, False)
    clock.now += 90.0
    for e in ENDPOINTS:
        router.set_health(e.address, True)
    decisions = [router.route(chat("hi", system=f"session {i}: " * 60)) for i in range(8)]
    for decision in decisions:
        router.finish(decision)
    clock.now += 0.5
    for e in ENDPOINTS:
        router.observe_signals(e.address, up=True, kv_capacity_tokens=100_000)
    for decision in decisions:
        held = router.index.match(decision.hashes, [decision.endpoint])
        assert held.get(decision.endpoint, 0) == decision.total_blocks


def test_prefill_done_releases_the_charge_but_not_the_in_flight_count():
    clock = Clock()
    router = Router(RoutingConfig(), ENDPOINTS, clock=clock)
    decision = router.route(chat("a long prompt " * 400))
    assert router.queued_work()[decision.endpoint] > 0
    router.prefill_done(decision)
    assert router.queued_work()[decision.endpoint] == 0
    assert router.in_flight()[decision.endpoint] == 1
    router.prefill_done(decision)  # twice is harmless
    router.finish(decision)
    assert router.in_flight()[decision.endpoint] == 0
    assert router.queued_work()[decision.endpoint] == 0


def test_a_request_finished_before_its_prefill_keeps_draining_its_charge():
    clock = Clock()
    router = Router(RoutingConfig(), ENDPOINTS, clock=clock)
    decision = router.route(chat("a long prompt " * 400))
    router.finish(decision, prefill_over=False)  # e.g. a full-duplex stream's headers
    assert router.in_flight()[decision.endpoint] == 0
    assert router.queued_work()[decision.endpoint] == decision.work
    clock.now += decision.work / 2 / router.cost.drain_per_second
    assert router.queued_work()[decision.endpoint] == decision.work / 2
    clock.now += decision.work / router.cost.drain_per_second
    assert router.queued_work()[decision.endpoint] == 0


def test_the_prefill_rate_is_learned_from_what_the_endpoints_report():
    clock = Clock()
    router = Router(RoutingConfig(), ENDPOINTS, clock=clock)
    assert router.prefill_rate == 60_000  # the configured start
    # 8 prefills of 1,000 computed tokens in 2 s per window: a much slower server.
    router.observe_signals(ENDPOINTS[0].address, up=True, prefill_window=(8000, 8, 2.0))
    assert router.prefill_rate == 60_000  # too few prefills yet
    router.observe_signals(ENDPOINTS[1].address, up=True, prefill_window=(8000, 8, 2.0))
    router.observe_signals(ENDPOINTS[2].address, up=True, prefill_window=(8000, 8, 2.0))
    cost = router.cost
    per_request = 1000 + cost.base_tokens + cost.ctx_factor * 1000 * 1000 / 2
    assert router.prefill_rate == pytest.approx(8 * per_request / 2.0)  # ~12,900
    # vLLM records a request that failed before it was scheduled with a prefill time of its
    # clock (the host's uptime): that window teaches no rate, but its finishes still count.
    share_arrived = router._share_arrived
    router.observe_signals(ENDPOINTS[0].address, up=True, prefill_window=(9000, 9, 86_402.0))
    assert router.prefill_rate == pytest.approx(8 * per_request / 2.0)
    assert router._share_arrived > share_arrived + 8
    # Queued work now drains at that rate.
    decision = router.route(chat("a long prompt " * 400))
    clock.now += decision.work / 2 / router.prefill_rate
    assert router.queued_work()[decision.endpoint] == pytest.approx(decision.work / 2)
    for config in (
        RoutingConfig(learn_prefill_rate=False),
        RoutingConfig(prefill_tokens_per_second=0),
    ):
        fixed = Router(config, ENDPOINTS)
        for e in ENDPOINTS:
            fixed.observe_signals(e.address, up=True, prefill_window=(8000, 8, 2.0))
        assert fixed.prefill_rate == config.prefill_tokens_per_second


def test_a_session_drawn_by_a_shared_prompt_lands_where_other_routers_look_for_it():
    """A new conversation under a long shared system prompt follows the prompt's holders,
    and among holders with about the same queue it takes the rendezvous pick, not simply
    the least queued: a router replica that sees only a later turn cold-starts it there."""
    clock = Clock()
    a, b = Router(RoutingConfig(), ENDPOINTS, clock=clock), Router(RoutingConfig(), ENDPOINTS)
    for e in ENDPOINTS:  # steady state: both indexes know every endpoint holds the prompt
        for router in (a, b):
            warm = chat(f"warm-up for {e.address}? " * 10)
            router.finish(router.route(warm, allowed=frozenset({e.address})))
    homes = set()
    for i in range(20):
        # A little queued work (well within the cold-start margin) everywhere but endpoint 1.
        jobs = [
            a.route(completion("short job " * 40), allowed=frozenset({e.address}))
            for e in ENDPOINTS[1:]
        ]
        # b sees jobs like them, already done: replicas behind one balancer see the same mix
        # of traffic, so they measure the prompt's share of new sessions alike (item 23: a
        # preamble that is most of the prompt counts as popular only beyond chance, so a
        # router whose own traffic put it near one endpoint's share could decide otherwise
        # than one that saw nothing else).
        for e in ENDPOINTS[1:]:
            b.finish(b.route(completion("short job " * 40), allowed=frozenset({e.address})))
        clock.now += 0.035
        first = a.route(chat(f"question {i}? " * 10))
        assert first.rule in (RULE_AFFINITY, RULE_SPREAD)  # drawn by the shared prompt
        later = b.route(chat(f"question {i}? " * 10, "an answer", "a follow-up"))  # b: new
        assert later.endpoint == first.endpoint
        homes.add(first.endpoint)
        for d in [first, *jobs]:
            a.finish(d)
        b.finish(later)
    assert len(homes) > 1  # not simply the one endpoint without queued work


def _report_finished(
    router: Router, finished_per_sent: float, queued_per_sent: float | None = None
) -> None:
    """Each endpoint reports finishing ``finished_per_sent`` x what this router sent it (and,
    with ``queued_per_sent``, that many x running, none waiting; without, no queue gauges)."""
    for address, sent in zip(router.endpoints, router._sent.tolist(), strict=True):
        if sent:
            window = (1000.0 * sent, sent * finished_per_sent, 0.1 * sent)
            running = waiting = None
            if queued_per_sent is not None:
                running, waiting = sent * queued_per_sent, 0.0
            router.observe_signals(
                address,
                up=True,
                running=running,
                waiting=waiting,
                prefill_window=window,
                counts_finished=True,
            )


ALONE, SHARED = RoutingConfig().cold_margin, RoutingConfig().shared_cold_margin


@pytest.mark.parametrize(
    ("finished_per_sent", "share", "widened"),
    [(1.0, 1.0, 0.0), (4 / 3, 0.75, 0.5), (2.0, 0.5, 1.0), (4.0, 0.25, 1.0)],
)
def test_the_cold_margin_widens_as_other_routers_serve_more_of_the_traffic(
    finished_per_sent, share, widened
):
    """From cold_margin with all the traffic to shared_cold_margin with half, linearly."""
    router = Router(RoutingConfig(), ENDPOINTS)
    assert (router.traffic_share, router.cold_margin) == (1.0, ALONE)
    for i in range(24):
        router.finish(router.route(chat(f"conversation {i} " * 30)))
    _report_finished(router, finished_per_sent)
    assert router.traffic_share == pytest.approx(share)
    margin = ALONE + (SHARED - ALONE) * widened
    assert router.cold_margin == router.scheduler.cost.cold_margin == pytest.approx(margin)


def test_requests_queued_at_the_endpoints_count_as_arrived_so_one_of_four_routers_reads_a_quarter():
    """vLLM counts a prefill when its request finishes: while queues fill, what this router
    sent leads what finished; the requests the endpoints hold running or waiting arrived."""
    router, alone = Router(RoutingConfig(), ENDPOINTS), Router(RoutingConfig(), ENDPOINTS)
    for r in (router, alone):
        for address in r.endpoints:  # idle endpoints: no window yet (nothing finished)
            r.observe_signals(address, up=True, running=0, waiting=0, counts_finished=True)
        for i in range(24):
            r.route(chat(f"conversation {i} " * 30))
    # Four routers sent 4x this one's requests; a quarter of them finished, the rest queued.
    _report_finished(router, 1.0, queued_per_sent=3.0)
    assert router.traffic_share == pytest.approx(0.25)
    assert router.cold_margin == pytest.approx(SHARED)
    _report_finished(alone, 0.25, queued_per_sent=0.75)  # its own requests, mostly queued
    assert alone.traffic_share == 1.0 and alone.cold_margin == ALONE


def test_a_router_measures_its_share_before_any_request_finishes():
    """Arrivals are read from the endpoints' queues too, so a router alone knows it is alone
    while its first requests still run (cold starts balance from then on)."""
    router = Router(RoutingConfig(), ENDPOINTS)
    blind = Router(RoutingConfig(), ENDPOINTS)  # its endpoints do not count finished requests
    for r in (router, blind):
        for address in r.endpoints:
            r.observe_signals(address, up=True, running=0, waiting=0, counts_finished=r is router)
        for i in range(24):
            r.route(chat(f"conversation {i} " * 30))
        assert not r._share_measured
        for address, sent in zip(r.endpoints, r._sent.tolist(), strict=True):
            r.observe_signals(
                address,
                up=True,
                running=min(sent, 2),
                waiting=max(0, sent - 2),
                counts_finished=r is router,
            )
    assert router._share_measured and router.traffic_share == 1.0
    # SGLang, TGI: queues without finished counts tell nothing of other routers' traffic.
    assert not blind._share_measured and blind.cold_margin == ALONE


def test_the_traffic_share_waits_for_enough_finished_requests_and_can_be_switched_off():
    router = Router(RoutingConfig(), ENDPOINTS)
    for i in range(3):
        router.route(chat(f"conversation {i} " * 30))
    _report_finished(router, 4.0)  # 12 finished: too few to judge
    assert (router.traffic_share, router.cold_margin) == (1.0, ALONE)
    fixed = Router(RoutingConfig(cold_margin=0.7, shared_cold_margin=0.7), ENDPOINTS)
    for i in range(24):
        fixed.route(chat(f"conversation {i} " * 30))
    _report_finished(fixed, 4.0)
    assert fixed.traffic_share == pytest.approx(0.25) and fixed.cold_margin == 0.7


def _share_at_low_traffic(
    endpoints: int, scrape_seconds: float, every: int, request_seconds: float = 1.0
) -> Router:
    """The router of ``share_over_time`` (extproc/bench_share.py) after 40 s, sent every
    ``every``-th request."""
    *_, (_, router) = share_over_time(
        endpoints, scrape_seconds, lambda _: every, request_seconds, 40.0
    )
    return router


def test_a_router_measures_its_share_at_low_traffic_however_many_endpoints_it_reads():
    """A real router reads every endpoint every 0.5 s, traffic or not. Sums that decayed at
    every reading (by 1/64) held about 32 / N seconds of arrivals at N endpoints: at 1
    request a second over 16 endpoints, 2 requests, never the 16 a share needs, so one
    router of four took itself for alone for good (and one alone never balanced its cold
    starts). Decaying with time, a router measures the same share however many endpoints
    it reads and however often, as the simulator's router, which reads them only when it
    routes, does."""
    for endpoints in (2, 16):
        for scrape_seconds in (0.5, 0.1, 2.0):
            for every in (1, 4):
                router = _share_at_low_traffic(endpoints, scrape_seconds, every)
                case = (endpoints, scrape_seconds, every)
                assert router.traffic_share_measured, case
                assert router.traffic_share == pytest.approx(1.0 / every, abs=0.05), case
                expected = ALONE if every == 1 else SHARED
                assert router.cold_margin == pytest.approx(expected, abs=0.05), case
    # One request every 4 s: the sums hold about 8, too few to judge; taken for alone.
    quiet = _share_at_low_traffic(16, 0.5, 4, request_seconds=4.0)
    assert not quiet.traffic_share_measured and quiet.cold_margin == ALONE


def test_with_a_minor_share_a_cold_start_stays_on_the_pick_other_routers_make():
    """Queued work between cold_margin and 1 cold prefill above the least: a router alone moves the
    new conversation off its rendezvous pick, one of several keeps it there (where the other
    routers, which do not see that work, will send its later turns)."""
    first = chat("a short question", system="A brief system prompt. " * 20)

    def loaded(finished_per_sent: float) -> tuple[Router, str]:
        # Without the balance of a router alone, which would move it off the pick as well.
        router = Router(RoutingConfig(balance_cold_starts=False), ENDPOINTS)
        for i in range(24):
            router.finish(router.route(chat(f"warm-up {i} " * 30)))
        _report_finished(router, finished_per_sent)
        return router, router.route(first).endpoint

    alone, busy = loaded(1.0)
    shared, busy_too = loaded(4.0)
    assert busy == busy_too and (alone.cold_margin, shared.cold_margin) == (ALONE, SHARED)
    queued = alone.queued_work()[busy]
    for i in range(200):
        conversation = chat(f"a new conversation {i} " * 120)
        if Router(RoutingConfig(), ENDPOINTS).route(conversation).endpoint != busy:
            continue  # not a conversation whose rendezvous pick is the busy endpoint
        cold = alone.cost.prefill(conversation_tokens(conversation), 0)
        assert ALONE * cold < queued <= SHARED * cold  # the case this test is about
        assert alone.route(conversation).endpoint != busy
        assert shared.route(conversation).endpoint == busy
        return
    pytest.fail("no conversation hashed to the busy endpoint")


def conversation_tokens(request) -> float:
    return len(request.prompt) / RoutingConfig().bytes_per_token


def test_other_replicas_reported_work_counts_and_drains():
    clock = Clock()
    router = Router(RoutingConfig(), ENDPOINTS, clock=clock)
    busy = ENDPOINTS[0].address
    router.observe_peer_work(router.instance, {busy: 1e9})  # its own figures: skipped
    assert router.queued_work()[busy] == 0 and router.peers() == []
    router.observe_peer_work("peer-a", {busy: 120_000.0, "10.9.9.9:8000": 5.0})  # unknown: ignored
    router.observe_peer_work("peer-b", {busy: 60_000.0})
    assert router.peers() == ["peer-a", "peer-b"]
    weight = RoutingConfig().peer_work_weight  # 0.5: a damped share of it counts
    assert router.queued_work()[busy] == pytest.approx(weight * 180_000)
    assert router.own_queued_work()[busy] == 0  # what it tells its peers: its own only
    clock.now += 1.0  # drains at the prefill throughput (60,000/s), from each report
    assert router.queued_work()[busy] == pytest.approx(weight * 120_000)
    full = Router(RoutingConfig(peer_work_weight=1.0), ENDPOINTS, clock=clock)
    full.observe_peer_work("peer-a", {busy: 120_000.0})
    assert full.queued_work()[busy] == pytest.approx(120_000)
    # A new conversation whose rendezvous pick is the busy endpoint goes elsewhere now.
    for i in range(100):
        conversation = chat(f"a new conversation {i} " * 30, system="Be brief.")
        if Router(RoutingConfig(), ENDPOINTS).route(conversation).endpoint == busy:
            assert router.route(conversation).endpoint != busy
            break
    else:
        pytest.fail("no conversation hashed to the busy endpoint")
    clock.now += 40.0  # a silent peer stops counting
    router.observe_peer_work("peer-b", {busy: 0.0})
    assert router.peers() == ["peer-b"]


def test_a_peers_junk_or_its_silence_leaves_no_queued_work_behind():
    """A peer's figures that are not work (NaN, infinite, negative) count for nothing, and a
    huge one counts only while the peer reports: when every peer falls silent, their work
    stops counting at once, not when the next report comes (none may)."""
    clock = Clock()
    router = Router(RoutingConfig(prefill_tokens_per_second=1.0), ENDPOINTS, clock=clock)
    a, b, c, d = (e.address for e in ENDPOINTS[:4])
    router.observe_peer_work("peer-a", {a: float("nan"), b: float("inf"), c: -5e9, d: 1e12})
    queued = router.queued_work()
    assert (queued[a], queued[b], queued[c]) == (0.0, 0.0, 0.0)
    assert queued[d] > 1e11
    clock.now += 31.0  # past PEER_FORGET_SECONDS: the peer fell silent
    assert router.peers() == [] and router.queued_work()[d] == 0.0


def test_a_system_prompt_every_conversation_shares_spreads_them_and_their_later_turns():
    """A long system prompt (most of each first turn) that every new conversation starts
    with draws more than one endpoint's share of them: they are placed as cold starts, not
    piled onto the prompt's first holder. With the count guard off, so that it is this rule
    and not the guard that spreads them; switched off, all go to the first holder."""
    system = SYSTEM * 8  # ~2.2k tokens against ~100 of the conversation's own first message
    for spread in (True, False):
        config = RoutingConfig(load_slack=1000, spread_popular_prefixes=spread)
        router = Router(config, ENDPOINTS)
        first_turns = []
        for i in range(48):
            d = router.route(chat(f"conversation {i}: " + "my own question " * 20, system=system))
            router.finish(d)
            first_turns.append(d)
        homes = Counter(d.endpoint for d in first_turns)
        if not spread:
            assert len(homes) == 1
            continue
        assert len(homes) == len(ENDPOINTS) and max(homes.values()) <= 2 * 48 / len(ENDPOINTS)
        assert Counter(d.rule for d in first_turns[16:]) == {RULE_SPREAD: 32}
        # Each conversation's next turn follows it, in this router and in a router replica
        # that never saw the first turns (it cold-starts them by the same rendezvous order).
        other = Router(config, ENDPOINTS)
        for i, first in enumerate(first_turns):
            turns = (f"conversation {i}: " + "my own question " * 20, "an answer", "more?")
            for router_replica in (router, other):
                later = router_replica.route(chat(*turns, system=system))
                router_replica.finish(later)
                assert later.endpoint == first.endpoint


def test_completions_sharing_a_popular_preamble_spread_and_their_later_requests_follow():
    """The GAIE multi-chat benchmarks send conversations as completions (inference-perf:
    the context is one string), so the router sees no turns: a 1k-token system prompt that
    every conversation starts with, then a ~1.5k-token question of its own. The held
    prefix is under shared_prefix_fraction of the prompt and popular, so the conversations
    spread, placed by their own first blocks after it; each one's next request (the same
    prompt, an answer and a question longer) meets it there, at this router and at a router
    replica that never saw it but has seen the preamble's popularity in its own traffic
    (before that, the first sessions follow the holder). Switched off, all pile onto the
    system prompt's holder."""
    system = "You are a careful assistant. " * 140  # ~1k tokens
    first_prompts = [
        system + f"Conversation {i}: " + "my own long question " * 280 for i in range(48)
    ]
    for spread in (True, False):
        config = RoutingConfig(load_slack=1000, spread_popular_completions=spread)
        router = Router(config, ENDPOINTS)
        firsts = []
        for prompt in first_prompts:
            d = router.route(completion(prompt))
            router.finish(d)
            firsts.append(d)
        homes = Counter(d.endpoint for d in firsts)
        if not spread:
            assert len(homes) == 1
            continue
        assert len(homes) == len(ENDPOINTS) and max(homes.values()) <= 2 * 48 / len(ENDPOINTS)
        assert Counter(d.rule for d in firsts[16:]) == {RULE_SPREAD: 32}
        other = Router(config, ENDPOINTS)  # its own traffic: the same preamble, other questions
        for i in range(32):
            other.finish(other.route(completion(system + f"other {i}: " + "words " * 1200)))
        for first, prompt in zip(firsts, first_prompts, strict=True):
            longer = prompt + " An answer. " * 40 + "And a follow-up question? " * 20
            spread_first = first.rule == RULE_SPREAD
            for router_replica in (router, other) if spread_first else (router,):
                later = router_replica.route(completion(longer))
                router_replica.finish(later)
                assert later.endpoint == first.endpoint


def _question_on_document(q: int, g: int):
    """Question q on document g of 16, the document a system message (the GAIE shape as chat)."""
    document = f"Document {g}: " + f"fact {g} about caches. " * 120
    return chat(f"Question {q} about document {g}: " + "please explain " * 20, system=document)


def test_group_documents_are_followed_each_to_its_holder():
    """Many documents, each drawing a small share of the new sessions (a question about one
    of 16 documents per request, the GAIE shape sent as chat): each stays on one endpoint,
    and not copied to others."""
    router = Router(RoutingConfig(), ENDPOINTS)
    homes: dict[int, set[str]] = {g: set() for g in range(16)}
    rules = Counter()
    for q in range(6):
        for g in range(16):
            d = router.route(_question_on_document(q, g))
            router.finish(d)
            homes[g].add(d.endpoint)
            if q:
                rules[d.rule] += 1
    assert all(len(endpoints) == 1 for endpoints in homes.values())
    assert rules == {RULE_AFFINITY: 5 * 16}


def test_a_few_documents_asked_in_turn_are_not_taken_for_a_popular_preamble():
    """Six documents over four endpoints draw 1/6 of the new sessions each, under one
    endpoint's share, but over the first few dozen a document's measured share is noise:
    in this shuffle one reaches 5 of the first 16 questions, which the bare share took for
    a popular preamble and spread, copying the whole document (two routers on four real
    vLLM servers lost 0.06 of hit ratio so, docs/benchmarks.md). A document must be popular
    beyond chance; one preamble that every session shares still is at its fifth."""
    order = [g for g in range(6) for _ in range(8)]
    np.random.default_rng(0).shuffle(order)
    assert max(Counter(order[:16]).values()) >= 5  # the bare share (> 1/4 of 16) is passed
    router = Router(RoutingConfig(), ENDPOINTS)
    rules = Counter()
    for q, g in enumerate(order):
        d = router.route(_question_on_document(q, g))
        router.finish(d)
        rules[d.rule] += 1
    assert RULE_SPREAD not in rules
    assert rules == {RULE_COLD_START: 6, RULE_AFFINITY: 42}
    router = Router(RoutingConfig(), ENDPOINTS)
    one = [router.route(_question_on_document(q, 0)) for q in range(8)]
    assert [d.rule for d in one[4:]] == [RULE_SPREAD] * 4


def test_router_replicas_send_the_questions_on_one_document_to_one_endpoint():
    """Questions on 16 documents (system message, user message) split between two router
    replicas that share nothing: each document's questions, at either router, meet on one
    endpoint. Placed by the whole first turn, each router's first question on a document
    would go to its own rendezvous pick and copy the document there."""
    routers = [Router(RoutingConfig(), ENDPOINTS), Router(RoutingConfig(), ENDPOINTS)]
    homes: dict[int, set[str]] = {g: set() for g in range(16)}
    for q in range(6):
        for g in range(16):
            router = routers[(q + g) % 2]
            d = router.route(_question_on_document(q, g))
            router.finish(d)
            homes[g].add(d.endpoint)
    assert all(len(endpoints) == 1 for endpoints in homes.values())
    assert len(set().union(*homes.values())) == len(ENDPOINTS)  # and the documents spread


def test_a_question_follows_its_partly_held_document_to_the_holder():
    """A document (system message) whose holder keeps only its first blocks, the rest evicted:
    the next question goes to that holder, as a completion's would, not to the document's
    rendezvous pick where nothing is held. Requiring half the prompt held sent it to the
    pick (chat-form GAIE 8 x 100k in the simulator: 0.855 against 0.876 now)."""
    document = "Document 7: " + "fact 7 about caches. " * 120
    question = "Question {} about document 7: " + "please explain " * 20

    fresh = Router(RoutingConfig(), ENDPOINTS)
    pick = fresh.route(chat(question.format(0), system=document)).endpoint
    holder = next(e.address for e in ENDPOINTS if e.address != pick)
    router = Router(RoutingConfig(), ENDPOINTS)
    head = chat(question.format(1), system=document[: len(document) * 2 // 5])
    router.finish(router.route(head, allowed=frozenset({holder})))
    decision = router.route(chat(question.format(2), system=document))
    assert decision.endpoint == holder
    assert 4 <= decision.matched_blocks < decision.total_blocks / 2


EIGHT = [EndpointConfig(address=f"10.0.1.{i}:8000") for i in range(1, 9)]


def _conversations_placed(router: Router, count: int, name: str) -> Counter:
    """Route (and finish, so that no queued work steers them) ``count`` new conversations."""
    placed: Counter = Counter()
    for i in range(count):
        decision = router.route(chat(f"{name} conversation {i} " * 40, system="Be brief."))
        assert decision.cold_start and decision.rule == RULE_COLD_START
        placed[decision.endpoint] += 1
        router.finish(decision)
    return placed


def test_a_router_alone_balances_its_cold_starts_and_replicas_keep_the_rendezvous_pick():
    """Few groups over many endpoints: the rendezvous order alone places them unevenly; a router
    that measures all the traffic evens out the prefill work it places. One that measures a
    quarter (router replicas without peers) keeps each pick where the others make it."""

    def placed(finished_per_sent: float, **routing) -> Counter:
        """Where 24 conversations (before the share is measured) and 32 more went."""
        router = Router(RoutingConfig(**routing), EIGHT)
        first = _conversations_placed(router, 24, "first")
        _report_finished(router, finished_per_sent)
        return first + _conversations_placed(router, 32, "later")

    balanced, rendezvous = placed(1.0), placed(1.0, balance_cold_starts=False)
    assert max(balanced.values()) <= 8 and min(balanced.values()) >= 6, balanced  # 7 is even
    assert max(rendezvous.values()) >= 10, rendezvous
    assert placed(4.0) == rendezvous


def _idle_table_with_placed(placed: list[float], placed_choices: int = 0) -> EndpointTable:
    """EIGHT with nothing queued or held anywhere and this placed cold-start work."""
    addresses = [e.address for e in EIGHT]
    return EndpointTable(
        addresses=addresses,
        load=np.zeros(8),
        work=np.zeros(8),
        matched=np.zeros(8, dtype=np.int64),
        address_hash=np.array([address_hash(a) for a in addresses], dtype=np.uint64),
        placed=np.array(placed),
        placed_choices=placed_choices,
    )


def _router_replicas_place(count: int, share_placed: bool, **routing) -> Counter:
    """Four router replicas sharing placements (peers) each take every fourth of ``count``
    new conversations; after every four they read each other's placements and, with
    ``share_placed``, each other's placed cold-start work (a peer read)."""
    routers = [Router(RoutingConfig(**routing), EIGHT) for _ in range(4)]
    for router in routers:
        router.placements = PlacementLog()
    placed: Counter = Counter()
    for i in range(count):
        router = routers[i % 4]
        decision = router.route(chat(f"conversation {i} " * 40, system="Be brief."))
        assert decision.cold_start
        placed[decision.endpoint] += 1
        router.finish(decision)
        if i % 4 == 3:
            for reader in routers:
                for peer in routers:
                    if peer is not reader:
                        assert peer.placements is not None
                        reader.observe_peer_placements(peer.placements.after(0))
                        if share_placed:
                            reader.observe_peer_placed(peer.instance, peer.own_placed_work())
    return placed


def test_router_replicas_sharing_placements_balance_cold_starts_over_all_of_theirs():
    """Each of four replicas sends a quarter of the traffic, so on its own it keeps the
    rendezvous pick; reading the others' placed work, it balances what all of them placed,
    as one router does. Without that figure (an older peer), or with the balance off, they
    keep the rendezvous order (14 of 56 on one endpoint, 7 is even)."""
    shared = _router_replicas_place(56, share_placed=True)
    rendezvous = _router_replicas_place(56, share_placed=False)
    assert max(shared.values()) <= 9 and min(shared.values()) >= 5, shared
    assert max(rendezvous.values()) >= 12, rendezvous
    assert _router_replicas_place(56, True, balance_cold_starts=False) == rendezvous


def test_router_replicas_leave_a_rendezvous_pick_only_past_the_margin():
    """With peers' placed work (placed_choices 2) a new session goes to its second rendezvous
    pick only when the first has placed more than SHARED_BALANCE_MARGIN of its cold prefills
    beyond it: a second's placements, which the replicas do not yet share, must not part them."""
    addresses = [e.address for e in EIGHT]

    def pick(placed: list[float]) -> str:
        table = _idle_table_with_placed(placed, placed_choices=2)
        return Scheduler(RoutingConfig()).pick(table, 8, key=42, prompt_tokens=500).endpoint

    first = pick([0.0] * 8)
    cold = Scheduler(RoutingConfig()).cost.prefill(500, 0)
    heavier = [0.0] * 8
    heavier[addresses.index(first)] = 1.9 * cold  # within the margin: stays
    assert pick(heavier) == first
    heavier[addresses.index(first)] = 2.1 * cold  # past it: the second pick
    second = pick(heavier)
    assert second != first
    # The second rendezvous pick, not the lightest endpoint: all others are lighter still.
    everywhere = [0.1 * cold] * 8
    everywhere[addresses.index(first)] = 2.2 * cold
    everywhere[addresses.index(second)] = 0.15 * cold
    assert pick(everywhere) == second


def test_peers_placed_work_counts_while_fresh_and_not_for_unknown_endpoints():
    clock = Clock()
    router = Router(RoutingConfig(), EIGHT, clock=clock)
    router.placements = PlacementLog()
    busy = EIGHT[0].address
    router.observe_peer_placed(router.instance, {busy: 1e9})  # its own: skipped
    assert router._placed_view(np.arange(8), clock.now) == (None, 0)
    router.observe_peer_placed("peer-a", {busy: 5000.0, "10.9.9.9:8000": 7.0})
    placed, choices = router._placed_view(np.arange(8), clock.now)
    assert placed is not None and placed.tolist() == [5000.0] + [0.0] * 7 and choices == 2
    clock.now += 31.0  # a silent peer stops counting: the router is on its own again
    assert router._placed_view(np.arange(8), clock.now) == (None, 0)
    assert router.own_placed_work() == dict.fromkeys((e.address for e in EIGHT), 0.0)


def test_a_balanced_cold_start_sends_a_key_back_to_where_it_placed_it():
    """A key cold-started again (its prefix evicted) returns to its endpoint, even when that one
    has had the most placements since: the balance alone would look elsewhere."""
    addresses = [e.address for e in EIGHT]
    table = _idle_table_with_placed

    scheduler = Scheduler(RoutingConfig())
    even = [1000.0] * 8
    first = scheduler.pick(table(even), 8, key=42)
    home = addresses.index(first.endpoint)
    crowded = even.copy()
    crowded[home] = 9000.0
    assert scheduler.pick(table(crowded), 8, key=42).endpoint == first.endpoint
    assert scheduler.pick(table(crowded), 8, key=43).endpoint != first.endpoint
    assert first.cold_start and "placed_work" in first.explain()["candidates"][0]
    # Balanced (the table carries placed work) but without going back to a key's endpoint,
    # which the option switches off with the balance: the crowded endpoint loses the key.
    forgetful = Scheduler(RoutingConfig(balance_cold_starts=False))
    forgetful.pick(table(even), 8, key=42)
    assert forgetful.pick(table(crowded), 8, key=42).endpoint != first.endpoint


def test_a_prompt_longer_than_every_cache_stays_with_its_holder():
    """A 512 KiB prompt is 8,192 blocks, twice what these endpoints' caches (65,536 tokens,
    4,096 blocks) hold: holding as much of it as a cache can counts as holding it, so it
    stays on its replica when that one reports its cache full (as it does after such a
    request), instead of being a new session each time."""
    endpoints = [
        EndpointConfig(address=f"10.0.0.{i}:8000", capacity_tokens=65_536) for i in range(4)
    ]
    router = Router(RoutingConfig(), endpoints)
    body = orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "word " * (600 * 1024 // 5)}]}
    )
    first = router.route(parse_request("chat", body))
    assert first.total_blocks == RoutingConfig().max_blocks == 8192
    router.finish(first)
    for endpoint in endpoints:
        full = endpoint.address == first.endpoint
        router.observe_signals(
            endpoint.address, up=True, running=0, waiting=0, kv_usage=1.0 if full else 0.1
        )
    again = router.route(parse_request("chat", body))
    assert (again.endpoint, again.rule) == (first.endpoint, RULE_AFFINITY)


def test_an_endpoints_cache_events_teach_the_index_what_it_holds_in_order():
    """KV-cache events (what an endpoint reports storing and evicting, as this router's block
    hashes) put another router's placement in this one's index, take an eviction out, and
    apply in order: a chain stored again after its removal is held. Until the router has
    measured its traffic share it reads the stores only (evictions cost a router alone)."""
    a, b = Router(RoutingConfig(), ENDPOINTS), Router(RoutingConfig(), ENDPOINTS)
    request = chat("What is a B-tree? " * 40)
    placed = a.route(request)  # another router replica placed it; b never saw it
    hashes = placed.hashes
    other = next(e.address for e in ENDPOINTS if e.address != placed.endpoint)
    blocks = len(hashes)

    def held(where: str) -> int:
        return b.index.match(hashes, [where]).get(where, 0)

    assert held(placed.endpoint) == 0
    assert b.observe_cache_events(placed.endpoint, [(True, hashes)])
    assert held(placed.endpoint) == blocks and held(other) == 0
    seen = b.route(request)  # b now sends it where its prefix is
    assert seen.endpoint == placed.endpoint and seen.matched_blocks == blocks
    b.observe_cache_events(placed.endpoint, [(False, hashes[blocks // 2 :])])
    assert held(placed.endpoint) == blocks  # its share not yet measured: not applied
    # A batch of both: the stores applied, the evictions not (what it returns says which).
    more = a.route(chat("What is a heap? " * 40)).hashes
    assert b.observe_cache_events(placed.endpoint, [(False, hashes), (True, more)]) == {True}
    assert held(placed.endpoint) == blocks
    assert b.index.match(more, [placed.endpoint]) == {placed.endpoint: len(more)}
    for i in range(24):
        b.finish(b.route(chat(f"conversation {i} " * 30)))
    _report_finished(b, 4.0)  # one router of four
    assert b._share_measured and b._traffic_share < 0.5
    b.observe_cache_events(placed.endpoint, [(False, hashes[blocks // 2 :])])
    assert held(placed.endpoint) == blocks // 2
    b.observe_cache_events(placed.endpoint, [(True, hashes[blocks // 2 :]), (False, hashes)])
    assert held(placed.endpoint) == 0
    b.observe_cache_events(placed.endpoint, [(False, hashes), (True, hashes[:3])])
    assert held(placed.endpoint) == 3
    b.observe_cache_events("10.9.9.9:8000", [(True, hashes)])  # not an endpoint: ignored
    b.observe_cache_events(placed.endpoint, [])
    assert held(placed.endpoint) == 3


def test_a_router_yet_to_measure_its_share_reads_evictions_after_a_while():
    """Evictions are skipped until the share is measured, for at most
    UNMEASURED_EVICTIONS_SKIP_SECONDS after the first events: at low traffic the share may
    stay unmeasured, and a router of several must not go without them for good. Skipped,
    they do not mark the index as shared either."""
    clock = Clock()
    router = Router(RoutingConfig(), ENDPOINTS, clock=clock)
    hashes = Router(RoutingConfig(), ENDPOINTS).route(chat("What is a B-tree? " * 40)).hashes
    target = ENDPOINTS[0].address

    def held() -> int:
        return router.index.match(hashes, [target]).get(target, 0)

    assert router.observe_cache_events(target, [(False, hashes)]) == set()
    assert not router._index_shared()
    assert router.observe_cache_events(target, [(True, hashes)]) == {True}
    assert router._index_shared()
    clock.now += UNMEASURED_EVICTIONS_SKIP_SECONDS - 1
    assert router.observe_cache_events(target, [(False, hashes)]) == set()
    assert held() == len(hashes)
    clock.now += 1
    assert router.observe_cache_events(target, [(False, hashes)]) == {False}
    assert held() == 0


@pytest.mark.parametrize(("finished_per_sent", "applied"), [(1.0, False), (4.0, True)])
def test_a_router_alone_ignores_cache_events_one_of_several_reads_them(finished_per_sent, applied):
    """A router that places all the traffic recorded every placement itself (and reading
    the events cost it hit ratio in the simulator's overloaded cells); one that places a
    quarter learns the others' placements from them."""
    router = Router(RoutingConfig(), ENDPOINTS)
    for i in range(24):
        router.finish(router.route(chat(f"conversation {i} " * 30)))
    _report_finished(router, finished_per_sent)
    request = chat("What is a B-tree? " * 40, system="another application's prompt " * 20)
    hashes = Router(RoutingConfig(), ENDPOINTS).route(request).hashes
    target = ENDPOINTS[0].address
    router.observe_cache_events(target, [(True, hashes)])
    held = router.index.match(hashes, [target]).get(target, 0)
    assert held == (len(hashes) if applied else 0)


def test_a_backlog_on_every_endpoint_makes_leaving_a_held_prefix_dearer():
    """backlog_stickiness (1 by default): when even the least-queued endpoint has a
    backlog, a copy's recomputed prefix is work every request queued there waits for, and in
    a full cache it evicts another prefix; the request then stays with its prefix past a
    queue difference that moves it when the other endpoint is idle (or with the setting
    off)."""
    addresses = [e.address for e in ENDPOINTS[:2]]
    prompt, held = 2304.0, 2048

    def pick(work: list[float], **routing) -> str | None:
        table = EndpointTable(
            addresses=addresses,
            load=np.zeros(2),
            work=np.array(work),
            matched=np.array([held, 0], dtype=np.int64),
            address_hash=np.array([address_hash(a) for a in addresses], dtype=np.uint64),
        )
        scheduler = Scheduler(RoutingConfig(**routing))
        decision = scheduler.pick(table, int(prompt), key=1, session_blocks=held)
        return decision.endpoint

    holder, other = addresses
    gap = 60_000.0  # a second of prefill more on the holder: more than the copy's premium
    assert pick([gap, 0.0], backlog_stickiness=3.0) == other  # the other is idle
    assert pick([100_000.0 + gap, 100_000.0], backlog_stickiness=3.0) == holder
    assert pick([100_000.0 + gap, 100_000.0], backlog_stickiness=0.0) == other
    assert pick([100_000.0 + gap, 100_000.0]) == holder  # on by default (docs/benchmarks.md)
    assert pick([gap, 0.0]) == other


def test_other_routers_requests_waiting_everywhere_are_a_backlog_that_keeps_a_prefix():
    """Several router replicas: the requests other routers sent, waiting on every endpoint,
    are left out of each endpoint's queued work (only the excess over the median says where
    to send), but they are a backlog all the same: leaving a held prefix then costs
    backlog_stickiness, as this router's own backlog does. The same excess queue moves the
    request when another endpoint has nothing waiting (or with the setting off): with two
    endpoints the median is half the busy one's queue, yet the other is idle."""

    def second_turn(
        waiting_elsewhere: int, endpoints=ENDPOINTS, **routing
    ) -> tuple[str, str, dict]:
        router = Router(RoutingConfig(load_slack=1000, **routing), endpoints, clock=Clock())
        first = router.route(chat("explain rendezvous hashing " * 600))
        router.finish(first)
        home = first.endpoint
        for endpoint in endpoints:
            waiting = waiting_elsewhere + (20 if endpoint.address == home else 0)
            router.observe_signals(endpoint.address, up=True, running=4, waiting=waiting)
        turn2 = chat("explain rendezvous hashing " * 600, "sure: ...", "and with weights?")
        decision = router.route(turn2)
        queued = {c["endpoint"]: c["queued_work"] for c in decision.explain()["candidates"]}
        return decision.endpoint, home, queued

    moved, home, alone = second_turn(waiting_elsewhere=0)
    assert moved != home
    stayed, home, everywhere = second_turn(waiting_elsewhere=20)
    assert stayed == home
    assert everywhere == alone  # the same queued work: 20 requests' worth more at home
    assert everywhere[home] > 0 and min(everywhere.values()) == 0
    moved, home, _ = second_turn(waiting_elsewhere=20, backlog_stickiness=0.0)
    assert moved != home
    moved, home, _ = second_turn(waiting_elsewhere=0, endpoints=ENDPOINTS[:2])
    assert moved != home
    stayed, home, _ = second_turn(waiting_elsewhere=20, endpoints=ENDPOINTS[:2])
    assert stayed == home


def _two_cold_endpoints():
    """Two endpoints that hold nothing, and a table of them with the given queued work (and
    other routers' backlog): a cold start's choice between its rendezvous pick and the other."""
    addresses = [e.address for e in ENDPOINTS[:2]]
    hashes = np.array([address_hash(a) for a in addresses], dtype=np.uint64)

    def table(work: list[float], backlog: float = 0.0) -> EndpointTable:
        return EndpointTable(
            addresses=addresses,
            load=np.zeros(2),
            work=np.array(work),
            matched=np.zeros(2, dtype=np.int64),
            address_hash=hashes,
            backlog=backlog,
        )

    return addresses, table


def test_a_key_placed_before_keeps_to_its_pick_while_a_backlog_lasts_everywhere():
    """A cold start skips its rendezvous pick queued more than the margin past the least;
    a key this router placed before (its index lost the prefix, or the next question on a
    document) stays on the pick while other routers' requests wait on every endpoint (the
    table's backlog): the queue difference passes, a copy elsewhere stays, and the other
    router replicas see the same queues. A key seen first is placed by the queues."""
    addresses, table = _two_cold_endpoints()
    prompt, key = 2304, 7
    scheduler = Scheduler(RoutingConfig())
    pick = scheduler.pick(table([0.0, 0.0], 0.0), prompt, key=key).endpoint
    assert pick is not None
    other = next(a for a in addresses if a != pick)
    gap = 60_000.0  # a second of prefill: far past the margin of a 2,304-token prompt
    queued = [gap if a == pick else 0.0 for a in addresses]
    assert scheduler.pick(table(queued, 0.0), prompt, key=key).endpoint == other
    assert scheduler.pick(table(queued, 100_000.0), prompt, key=key).endpoint == pick
    fresh = Scheduler(RoutingConfig())  # never placed the key
    assert fresh.pick(table(queued, 100_000.0), prompt, key=key).endpoint == other
    off = Scheduler(RoutingConfig(backlog_stickiness=0.0))
    off.pick(table([0.0, 0.0], 0.0), prompt, key=key)
    assert off.pick(table(queued, 100_000.0), prompt, key=key).endpoint == other


def test_router_replicas_keep_a_cold_start_on_its_pick_while_keys_come_back():
    """A router among several (the shared margin: one cold prefill, stickiness_floor 1) moves a
    cold start off its rendezvous pick queued past the margin while most requests bring keys
    it has not seen; once most come back to keys seen before (a few hundred documents'
    questions, conversations' later turns), a copy off the pick would serve this router's
    requests alone, and the margin widens by up to recurring_cold_margin cold prefills. A
    router alone (stickiness_floor 0), or with the option off, keeps the queues' margin."""
    addresses, table = _two_cold_endpoints()
    prompt, key = 2304, 7

    def scheduler(keys: list[int], floor: float = 1.0, **routing: float) -> Scheduler:
        config = RoutingConfig(**routing)
        cost = CostModel.from_config(config)
        cost = dataclasses.replace(cost, cold_margin=1.0, stickiness_floor=floor)
        placed = Scheduler(config, cost)
        for k in keys:
            placed.recurrence.observe(k)
        return placed

    pick = Scheduler(RoutingConfig()).pick(table([0.0, 0.0]), prompt, key=key).endpoint
    other = next(a for a in addresses if a != pick)
    # 2.5 cold prefills past the least: over the shared margin (1) and the margin until
    # measured (2.1), within the margin when every key comes back (5).
    gap = 2.5 * CostModel().prefill(prompt, 0)
    queued = [gap if a == pick else 0.0 for a in addresses]
    once = list(range(100, 3100))  # every key new: recurrence near 0
    again = [i % 50 for i in range(3000)]  # fifty documents asked in turn: near 1
    assert scheduler(once).pick(table(queued), prompt, key=key).endpoint == other
    recurring = scheduler(again)
    assert recurring.recurrence.rate > 0.99
    assert recurring.pick(table(queued), prompt, key=key).endpoint == pick
    # An index told of the others' placements or evictions finds a copy off the pick too.
    shared = recurring.pick(table(queued), prompt, key=key, index_shared=True)
    assert shared.endpoint == other
    assert scheduler(again, floor=0.0).pick(table(queued), prompt, key=key).endpoint == other
    off = scheduler(again, recurring_cold_margin=0.0)
    assert off.pick(table(queued), prompt, key=key).endpoint == other
    # Until measured (0.5): a little wider than the shared margin, not the whole addition.
    fresh = scheduler([])
    assert fresh.cost.recurring_margin(fresh.recurrence.rate) == pytest.approx(4 * 0.2 / 0.7)
    assert fresh.pick(table(queued), prompt, key=key).endpoint == other
    # The router tells the scheduler while peers' placements or KV-cache events come in.
    for told in ("", "peer placements", "cache events"):
        router = Router(RoutingConfig(), ENDPOINTS)
        if told == "peer placements":
            router.observe_peer_placements([Placement("peer", addresses[0], np.arange(3))])
        elif told == "cache events":
            router.observe_cache_events(addresses[0], [(True, np.arange(3, dtype=np.uint64))])
        seen: list[bool] = []

        def spy(*args, original=router.scheduler.pick, seen=seen, **kwargs):
            seen.append(kwargs["index_shared"])
            return original(*args, **kwargs)

        router.scheduler.pick = spy
        router.route(chat("a new conversation " * 30))
        assert seen == [bool(told)], told


def test_a_router_counts_how_often_its_requests_come_back_to_a_placement_key():
    """The share is of placement keys, as a cold start would place the request: questions
    on forty long documents (each preamble most of its first turn, and none popular: the
    document's group key) come back to forty keys though every question is new; new
    conversations after a short common system prompt (their own first turns) do not. The
    gauge exports it."""
    from prometheus_client import CollectorRegistry

    from extproc.metrics import RouterMetrics

    router = Router(RoutingConfig(), ENDPOINTS)
    assert router.key_recurrence == 0.5  # until measured
    for i in range(1500):
        document = f"document {i % 40} says " * 200
        router.finish(router.route(chat(f"question {i} " * 10, system=document)))
    assert router.key_recurrence > 0.9
    conversations = Router(RoutingConfig(), ENDPOINTS)
    for i in range(1500):
        conversations.finish(conversations.route(chat(f"conversation {i} " * 30)))
    assert conversations.key_recurrence < 0.1
    registry = CollectorRegistry()
    RouterMetrics(registry).refresh(router)
    exported = registry.get_sample_value("prefix_router_key_recurrence")
    assert exported == pytest.approx(router.key_recurrence)


def test_a_request_for_n_samples_counts_as_the_n_requests_the_server_counts():
    """vLLM runs and counts each of n samples (and each prompt of a completions batch) as a
    request of its own (measured on vLLM 0.32: n=3 adds 3 to its finished prefills): a
    router alone sending n=3 reads its share as 1, not a third."""
    router = Router(RoutingConfig(), ENDPOINTS)
    for i in range(24):
        body = {"model": "m", "messages": [{"role": "user", "content": f"c{i} " * 30}], "n": 3}
        request = parse_request("chat", orjson.dumps(body))
        assert request.engine_requests == 3
        router.finish(router.route(request))
    assert sum(router._sent.tolist()) == 72
    _report_finished(router, 1.0)  # each endpoint finished what it was sent
    assert router.traffic_share == 1.0 and router.cold_margin == ALONE
    batch = {"model": "m", "prompt": ["a " * 40, "b " * 40], "n": 2}
    assert parse_request("completions", orjson.dumps(batch)).engine_requests == 4
    for n in (0, -1, True, "3", 2.0):
        one = {"model": "m", "prompt": "a " * 40, "n": n}
        assert parse_request("completions", orjson.dumps(one)).engine_requests == 1
    huge = {"model": "m", "prompt": "a " * 40, "n": 10**9}
    assert parse_request("completions", orjson.dumps(huge)).engine_requests == 256


def test_n_samples_in_flight_are_not_read_as_another_routers_load():
    """vLLM reports a request with n=3 as 3 running: counted once in flight, the other 2
    read as other routers' requests (load and unseen queued work) on a router alone."""
    router = Router(RoutingConfig(), ENDPOINTS)
    decisions = []
    for i in range(8):
        body = {"model": "m", "messages": [{"role": "user", "content": f"c{i} " * 30}], "n": 3}
        decisions.append(router.route(parse_request("chat", orjson.dumps(body))))
    running = Counter(d.endpoint for d in decisions)
    for address in router.endpoints:  # what vLLM reports: 3 running per request
        router.observe_signals(address, True, running=3 * running[address], waiting=0)
    assert sum(router.in_flight().values()) == 24
    assert not router._others_load.any()
    for decision in decisions:
        router.finish(decision)
    assert sum(router.in_flight().values()) == 0


def test_a_copy_off_the_rendezvous_pick_leaves_the_index_sooner_when_other_routers_serve_most():
    """A router with a quarter of the traffic enters a request it placed off every
    rendezvous pick of its keys as if three quarters of the endpoint's cache had turned
    over since (the other routers' new blocks there, unseen): after half a cache of new
    blocks more it is gone, while the same copy on the pick, and any copy by a router
    alone, with the setting at 0, or with an index told of more than its own placements
    (peers' placements, KV-cache events), is still held; and so is a copy on the pick among
    the endpoints serving its model, though another model's endpoint is the pick of all."""
    capacity_tokens = 16_384  # 1,024 index blocks of 64 bytes
    endpoints = [
        EndpointConfig(address=f"10.0.0.{i}:8000", capacity_tokens=capacity_tokens)
        for i in range(1, 5)
    ]

    def prompt(name: str):  # 66 blocks, no prefix in common with another name's
        return chat(f"{name} question " * 300, system=f"{name} system")

    def pick_of(request) -> str:  # its cold start where nothing is queued: the pick
        return Router(RoutingConfig(), endpoints).route(request).endpoint

    copy = prompt("copy")
    pick = pick_of(copy)
    off = next(e.address for e in endpoints if e.address != pick)
    held: dict[tuple[str, float, float, str], int] = {}
    cases = [(1.0, 1.0, ""), (0.25, 1.0, ""), (0.25, 0.0, ""), (0.25, 1.0, "peer placements")]
    cases.append((0.25, 1.0, "cache events"))
    for share, aging, told in cases:
        for where in (off, pick):
            router = Router(RoutingConfig(off_pick_aging=aging), endpoints)
            for i in range(24):
                router.finish(router.route(chat(f"conversation {i} " * 30)))
            _report_finished(router, 1.0 / share)
            assert router.traffic_share == pytest.approx(share)
            other = np.array([1, 2, 3], dtype=np.uint64)
            if told == "peer placements":  # the index sees the others' copies
                router.observe_peer_placements([Placement("peer", pick, other)])
            elif told == "cache events":  # the index is told of evictions
                router.observe_cache_events(pick, [(True, other)])
            only = frozenset({where})
            for i in range(24):  # a cache and a half of other prompts there first
                router.finish(router.route(prompt(f"before {i}"), allowed=only))
            placed = router.route(copy, allowed=only)
            router.finish(placed)
            for i in range(8):  # half a cache more
                router.finish(router.route(prompt(f"after {i}"), allowed=only))
            matched = router.index.match(placed.hashes, [where]).get(where, 0)
            held["off" if where == off else "pick", share, aging, told] = matched
    blocks = len(placed.hashes)
    assert held.pop(("off", 0.25, 1.0, "")) < blocks // 2  # (15 of 66 when written)
    assert held == dict.fromkeys(held, blocks)
    # The pick is among the endpoints serving the request's model: where only ``off``
    # serves it (another model the other three), a copy there is on its pick and kept.
    router = Router(RoutingConfig(), endpoints)
    for e in endpoints:
        router.observe_models(e.address, frozenset({"m" if e.address == off else "n"}))
    own_pick = off
    for i in range(24):
        router.finish(router.route(chat(f"conversation {i} " * 30)))
    _report_finished(router, 4.0)
    only = frozenset({own_pick})
    for i in range(24):
        router.finish(router.route(prompt(f"before {i}"), allowed=only))
    placed = router.route(copy, allowed=only)
    router.finish(placed)
    for i in range(8):
        router.finish(router.route(prompt(f"after {i}"), allowed=only))
    assert router.index.match(placed.hashes, [own_pick]) == {own_pick: blocks}
