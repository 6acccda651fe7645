"""Scheduler rules through the routing core: affinity, load guard, cold-start agreement."""

import orjson

from extproc.config import EndpointConfig, RoutingConfig
from extproc.prompt import parse_request
from extproc.router import Router
from extproc.scheduler import (
    RULE_AFFINITY,
    RULE_COLD_START,
    RULE_LOAD_GUARD,
    RULE_NO_ENDPOINT,
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


def test_no_endpoints_and_subset_hint():
    empty = Router(RoutingConfig(), [])
    assert empty.route(chat("x " * 40)).rule == RULE_NO_ENDPOINT
    router = Router(RoutingConfig(), ENDPOINTS)
    only = frozenset({ENDPOINTS[2].address})
    assert router.route(chat("y " * 40), allowed=only).endpoint == ENDPOINTS[2].address
    assert router.route(chat("y " * 40), allowed=frozenset({"9.9.9.9:1"})).rule == RULE_NO_ENDPOINT


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
