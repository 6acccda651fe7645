"""The simulator: cache model, accounting, bounds, determinism and the CLI end to end."""

from __future__ import annotations

import dataclasses
import functools
import json
import random

import pytest

from extproc.cli import main
from extproc.config import RoutingConfig
from extproc.sim.cache import ChunkLRU, KVPool
from extproc.sim.engine import SimParams, simulate
from extproc.sim.policies import (
    ALL_POLICIES,
    PolicyContext,
    PromptBytes,
    RouterGroup,
    ideal_hit_tokens,
    make_policy,
)
from extproc.sim.replica import CostModel, Replica, cache_units
from extproc.sim.report import summarize
from extproc.sim.workloads import PRESETS, SimRequest, Workload, load_mooncake


def _ours(
    workload: Workload,
    replicas: int,
    capacity_tokens: int,
    router_replicas: int = 1,
    cost: CostModel | None = None,
    **routing,
) -> dict:
    """Ours' summary on ``workload`` with ``routing`` settings over the defaults."""
    params = SimParams(
        replicas=replicas,
        capacity_tokens=capacity_tokens,
        router_replicas=router_replicas,
        cost=cost or CostModel(),
        routing=RoutingConfig(**routing),
    )
    return summarize(simulate(workload, "ours", params), 1.0)


def _request(rid: int, ids: tuple[int, ...], last: int = 16, arrival: float = 0.0) -> SimRequest:
    return SimRequest(rid, arrival, 16 * (len(ids) - 1) + last, 4, ids, 16, last)


def test_lru_respects_capacity_and_evicts_tails_first() -> None:
    cache = ChunkLRU(capacity=64)
    cache.touch([1, 2, 3], 16, 16)
    cache.touch([10, 11, 12], 16, 16)
    assert cache.used <= 64
    # The older chain loses its tail first and stays prefix-closed.
    assert 1 in cache and 3 not in cache
    assert cache.match([1, 2, 3], 16, 16) == 16 * sum(c in cache for c in (1, 2, 3))
    assert cache.match([10, 11, 12], 16, 16) == 48


def test_partial_last_chunk_counts_held_units_only() -> None:
    cache = ChunkLRU()
    cache.touch([1, 2], 16, 5)
    assert cache.match([1, 2], 16, 16) == 21  # chunk 2 only partly held
    cache.touch([1, 2], 16, 16)
    assert cache.match([1, 2, 3], 16, 16) == 32


def test_replica_cache_never_exceeds_capacity() -> None:
    replica = Replica(0, capacity_tokens=160, cost=CostModel())
    for rid in range(50):
        replica.enqueue(_request(rid, tuple(range(rid * 3, rid * 3 + 4))))
        request, _, _ = replica.start_prefill()
        replica.end_prefill(request)
        replica.finish(request)
        assert replica.cache.used <= 160


def test_kv_pool_agrees_with_a_recount_after_every_step() -> None:
    """Random admissions and finishes over chains that share prefixes: ``pinned`` is every
    running chunk once plus the private units, ``used`` adds the free cached chunks, only free
    chunks are evicted, and the pool is over capacity only when running requests alone are."""
    rng = random.Random(5)
    pool = KVPool(capacity=400)
    running: list[tuple[tuple[int, ...], int, int]] = []
    for _ in range(2_000):
        if running and (rng.random() < 0.45 or len(running) > 6):
            ids, last, private = running.pop(rng.randrange(len(running)))
            # Half keep their reply's whole blocks cached (units out of the private ones).
            reply = [(hash((ids, "reply", j)), 16) for j in range(private // 16)]
            pool.release(ids, private, reply if rng.random() < 0.5 else ())
        else:
            root = rng.randrange(4)
            ids = (root, *(root * 100 + rng.randrange(3) * 10 + j for j in range(rng.randrange(5))))
            # Chained ids: an id always follows the same predecessor.
            ids = tuple(hash(ids[: i + 1]) for i in range(len(ids)))
            last, private = rng.choice((16, 5)), rng.randrange(1, 40)
            before = pool.pinned
            cost = pool.pin_cost(ids, 16, last, private)
            pool.pin(ids, 16, last, private)
            assert pool.pinned == before + cost
            running.append((ids, last, private))
        pinned_chunks = {c for ids, _, _ in running for c in ids}
        held = pool._held
        assert pinned_chunks <= set(held)  # nothing running is ever evicted
        privates = sum(p for _, _, p in running)
        assert pool.pinned == sum(held[c] for c in pinned_chunks) + privates
        assert pool.used == sum(held.values()) + privates
        assert set(pool._free) == set(held) - pinned_chunks
        assert pool.used <= max(pool.capacity, pool.pinned)


def test_running_requests_hold_a_shared_prefix_once_in_one_pool() -> None:
    """vLLM's block pool: a second request on the same 48-token prefix adds only its own
    chunk, output and nothing else; the split model (before item 24) charged it all again."""
    first, second = _request(0, (1, 2, 3, 4)), _request(1, (1, 2, 3, 5))
    other = _request(2, (10, 11, 12, 13))
    for kv_pool, admits_second in (("shared", True), ("split", False)):
        replica = Replica(0, capacity_tokens=100, cost=CostModel(), kv_pool=kv_pool)
        for request in (first, second, other):
            replica.enqueue(request)
        started, _, _ = replica.start_prefill()
        replica.end_prefill(started)
        assert replica.can_start() is admits_second
        if kv_pool == "shared":
            assert replica.kv_usage() == pytest.approx(68 / 100)  # 4 chunks + 4 output
            _, hit, _ = replica.start_prefill()
            replica.end_prefill(second)
            assert hit == 48 and replica.kv_usage() == pytest.approx(88 / 100)
            assert not replica.can_start()  # the unrelated third needs 68 more


def test_the_prefix_cache_is_what_running_requests_leave_of_the_pool() -> None:
    replica = Replica(0, capacity_tokens=100, cost=CostModel())
    done = _request(0, (20, 21, 22, 23))
    replica.enqueue(done)
    replica.start_prefill()
    replica.end_prefill(done)
    replica.finish(done)
    assert replica.cached_tokens(done) == 64 and replica.kv_usage() == 0
    running = _request(1, (1, 2, 3, 4))
    replica.enqueue(running)
    replica.start_prefill()
    # 68 pinned + 64 cached > 100: the finished chain gives up its tail, two chunks.
    assert replica.cached_tokens(done) == 32 and replica.cache.used == 100
    replica.end_prefill(running)
    replica.finish(running)
    assert replica.cached_tokens(running) == 64  # its output is not cached


def test_a_finished_reply_stays_cached_for_the_next_turn_only_when_asked() -> None:
    """vLLM v1 caches every full block a sequence computes, its reply's too: the next turn,
    which carries the reply, hits it on that replica. The reply is the chain's tail, so it
    is evicted before the prompt it follows."""
    first = dataclasses.replace(_request(0, (1, 2, 3, 4)), output_tokens=40, output_ids=(5, 6, 7))
    second = _request(1, (1, 2, 3, 4, 5, 6, 7, 8))
    for kv_pool in ("preempt", "shared"):
        for cache_outputs, held in ((False, 64), (True, 96)):  # 40 tokens: 2 whole blocks
            replica = Replica(0, 200, CostModel(), kv_pool=kv_pool, cache_outputs=cache_outputs)
            replica.enqueue(first)
            replica.start_prefill()
            replica.end_prefill(first)
            if kv_pool == "preempt":
                for token in (17, 33):  # its second and third output blocks
                    assert replica.grow(first, token, 0.0)
            replica.finish(first)
            assert replica.cached_tokens(second) == held, (kv_pool, cache_outputs)
            assert replica.kv_usage() == 0 and replica.cache.used == held
    replica = Replica(0, 100, CostModel(), cache_outputs=True)
    replica.enqueue(first)
    replica.start_prefill()
    replica.end_prefill(first)
    replica.grow(first, 17, 0.0)
    replica.grow(first, 33, 0.0)
    replica.finish(first)
    other = _request(2, (10, 11))  # 32 tokens + 4 output: 96 + 36 > 100
    replica.enqueue(other)
    replica.start_prefill()
    assert replica.cached_tokens(second) == 64  # the reply went first, the prompt stayed
    with pytest.raises(ValueError, match="cache_outputs needs one KV pool"):
        Replica(0, 100, CostModel(), kv_pool="split", cache_outputs=True)


def test_cached_replies_raise_chat_hits_within_the_ideal(small_chat: Workload) -> None:
    """With replies cached, every policy's hits still reconcile with the replicas' counters
    and stay under the ideal (which caches replies too); a policy that keeps a conversation
    on one replica gains the replies it carries, one that scatters it gains little."""
    base = SimParams(replicas=4, capacity_tokens=20_000, seed=1, cache_outputs=False)
    replies = dataclasses.replace(base, cache_outputs=True)
    assert SimParams().cache_outputs  # the default since Dec 4, as vLLM v1 caches replies
    ideal = ideal_hit_tokens(small_chat.requests, 16, cache_outputs=True)
    assert ideal > ideal_hit_tokens(small_chat.requests, 16)
    gains = {}
    for policy in ("ours", "random"):
        before = simulate(small_chat, policy, base)
        after = simulate(small_chat, policy, replies)
        hits = sum(r.hit_tokens for r in after.records)
        assert hits == sum(x.hit_tokens for x in after.replicas) and hits <= ideal
        gains[policy] = hits - sum(r.hit_tokens for r in before.records)
    assert gains["ours"] > 0 and gains["ours"] > 2 * gains["random"]


def test_replica_rejects_an_unknown_memory_model() -> None:
    with pytest.raises(ValueError, match="kv_pool"):
        Replica(0, capacity_tokens=100, cost=CostModel(), kv_pool="paged")


def test_preempt_admits_on_the_prompt_and_preempts_the_newest_when_output_needs_room() -> None:
    """kv_pool="preempt", vLLM's allocation: two requests whose outputs the reserving pool
    could not hold together are both admitted; when the older one's output needs a block the
    pool lacks, the newer is preempted to the head of the queue, keeps what it generated,
    and recomputes it (its prompt still cached) when admitted again."""
    cost = CostModel()
    older = SimRequest(0, 0.0, 32, 48, (1, 2), 16, 16)
    newer = SimRequest(1, 0.0, 32, 48, (10, 11), 16, 16)
    reserving = Replica(0, capacity_tokens=100, cost=cost, kv_pool="shared")
    replica = Replica(0, capacity_tokens=100, cost=cost, kv_pool="preempt")
    for r in (reserving, replica):
        r.enqueue(older)
        r.enqueue(newer)
        r.start_prefill()
        r.end_prefill(older)
    assert not reserving.can_start()  # 32 + 48 each: 160 > 100
    assert replica.can_start()  # prompt + first output block each: 96
    replica.start_prefill()
    step = replica.end_prefill(newer, now_ms=0.0)
    assert replica.kv_usage() == pytest.approx(0.96)
    # The older request's 17th token needs a second block: the newer one makes room.
    assert replica.grow(older, 17, now_ms=16 * step)
    assert replica.preemptions == 1 and list(replica.waiting) == [newer]
    assert replica.running == 1 and replica.kv_usage() == pytest.approx(0.64)
    assert replica.progress[1].generated == 17  # decoded 16 more tokens after its first
    assert replica.cached_tokens(newer) == 32  # its prompt stays as prefix cache
    assert not replica.can_start()  # 64 + 32 more (its 17 tokens' two blocks) > 100
    assert replica.grow(older, 33, now_ms=32 * step)
    assert replica.cached_tokens(newer) == 16  # 80 pinned: the cache gave up its tail
    assert replica.next_block(older) == 0  # its last block: it finishes next
    replica.finish(older)
    assert replica.kv_usage() == 0 and replica.can_start()
    again, hit, ms = replica.start_prefill()
    assert again is newer and hit == 0  # a recomputation is not counted as a request
    assert replica.recomputed_tokens == 33 and ms == pytest.approx(cost.prefill_ms(49, 16))
    assert replica.requests == 2 and replica.hit_tokens == 0


def test_preempt_during_a_prefill_leaves_nothing_of_it_cached() -> None:
    """A request preempted before its prefill ended computed nothing that later requests (or
    its own recomputation) could reuse; the part of its prompt cached before stays, and the
    events of a finished request are all stale."""
    replica = Replica(0, capacity_tokens=120, cost=CostModel(), kv_pool="preempt")
    first = SimRequest(0, 0.0, 32, 16, (1, 2), 16, 16)
    replica.enqueue(first)
    replica.start_prefill()
    replica.end_prefill(first, now_ms=0.0)
    assert replica.epoch(first) == 0
    replica.finish(first)  # (1, 2) cached
    assert replica.epoch(first) == -1
    older = SimRequest(1, 0.0, 32, 48, (20, 21), 16, 16)
    newer = SimRequest(2, 0.0, 48, 48, (1, 2, 3), 16, 16)
    for request in (older, newer):
        replica.enqueue(request)
    replica.start_prefill()
    replica.end_prefill(older, now_ms=0.0)
    _, hit, _ = replica.start_prefill()  # newer: (1, 2) cached, chunk 3 being computed
    assert hit == 32 and replica.prefilling and replica.cached_tokens(newer) == 48
    assert replica.grow(older, 17, now_ms=1.0)  # 112 + 16 > 120: the newest goes
    assert replica.preemptions == 1 and not replica.prefilling
    assert replica.cached_tokens(newer) == 32  # chunk 3 was never computed
    assert replica.epoch(newer) == 1 and list(replica.waiting) == [newer]


def test_preempt_lets_a_request_running_alone_grow_past_the_pool() -> None:
    replica = Replica(0, capacity_tokens=40, cost=CostModel(), kv_pool="preempt")
    alone = SimRequest(0, 0.0, 32, 48, (1, 2), 16, 16)
    replica.enqueue(alone)
    replica.start_prefill()
    replica.end_prefill(alone, now_ms=0.0)
    assert replica.grow(alone, 17, now_ms=1.0) and replica.grow(alone, 33, now_ms=2.0)
    assert replica.preemptions == 0 and replica.cache.pinned == 80
    replica.finish(alone)
    assert replica.cache.pinned == 0 and replica.cache.used <= 40


@pytest.mark.parametrize("policy", ["ours", "round-robin", "sglang", "random"])
def test_preempted_requests_are_all_served_with_one_first_token_each(policy: str) -> None:
    """Long outputs in small pools: hundreds of preemptions, and still every request gets one
    TTFT, hits are counted once (the replicas' counters agree), recomputation costs prefill
    time, and the pools end empty of running requests."""
    workload = PRESETS["small-shared-prefix"](seed=1, output_tokens=400, requests=300)
    params = SimParams(replicas=2, capacity_tokens=3_000, seed=1, kv_pool="preempt")
    result = simulate(workload, policy, params)
    replicas = result.replicas
    assert sum(x.preemptions for x in replicas) > 100
    assert all(r.ttft_ms > 0 and r.ttft_ms >= r.queue_ms for r in result.records)
    assert sum(r.hit_tokens for r in result.records) == sum(x.hit_tokens for x in replicas)
    assert sum(x.requests for x in replicas) == len(workload.requests)
    assert sum(x.recomputed_tokens for x in replicas) > 0
    # One request a step: a record's prefill time is its own, so recomputation adds to them
    # (batched, every request of a step counts the whole step).
    alone = dataclasses.replace(params, cost=CostModel(prefill_batch_tokens=0))
    one_each = simulate(workload, policy, alone)
    assert sum(x.prefill_ms for x in one_each.replicas) > sum(
        r.prefill_ms for r in one_each.records
    )
    assert all(x.running == 0 and not x.waiting and not x.progress for x in replicas)
    assert all(x.cache.pinned == 0 and x.cache.used <= 3_000 for x in replicas)
    assert summarize(result, 1.0)["preemptions"] == sum(x.preemptions for x in replicas)
    reserving = simulate(workload, policy, dataclasses.replace(params, kv_pool="shared"))
    assert sum(x.preemptions for x in reserving.replicas) == 0
    assert "preemptions" not in summarize(reserving, 1.0)


def test_a_replica_reports_a_prefill_when_its_request_finishes_as_vllm_does() -> None:
    """vLLM observes request_prefill_time_seconds (and the computed tokens) at a request's
    end; the router reads its traffic share from them (Router._arrivals), so the simulated
    /metrics must lag the same way while requests run."""
    for kv_pool in ("preempt", "shared", "split"):
        replica = Replica(0, 1_000, CostModel(), kv_pool=kv_pool)
        warm, again = _request(0, (1, 2, 3)), _request(1, (1, 2, 3, 4))
        for request in (warm, again):
            replica.enqueue(request)
            _, hit, _ = replica.start_prefill()
            replica.end_prefill(request)
            assert replica.finished_prefills == request.rid  # first token out, not finished
            replica.finish(request)
        assert (replica.requests, replica.finished_prefills) == (2, 2)
        assert replica.finished_prefill_tokens == replica.prompt_tokens - replica.hit_tokens
        assert replica.hit_tokens == hit == 48
        assert replica.finished_prefill_ms == pytest.approx(replica.prefill_ms)


def test_a_prefill_step_takes_the_queued_requests_that_fit_its_token_budget() -> None:
    """vLLM fills a step with up to max_num_batched_tokens (the decoding requests' one token
    each included), FIFO: the step pays its fixed cost once, every request in it gets its
    first token at the step's end and counts the whole step as its prefill time; the first
    request that does not fit waits for the next step."""
    cost = CostModel(prefill_batch_tokens=100)
    replica = Replica(0, capacity_tokens=1_000, cost=cost)
    first, second, third = (_request(i, (10 * i + 1, 10 * i + 2, 10 * i + 3)) for i in range(3))
    fourth = _request(3, (31, 32))
    for request in (first, second, third, fourth):
        replica.enqueue(request)
    batch, step = replica.start_batch()
    assert [r for r, _ in batch] == [first, second]  # 48 + 48; the third's 48 > 4 left
    assert step == pytest.approx(cost.prefill_ms(48, 0) + cost.prefill_tokens_ms(48, 0))
    assert step < 2 * cost.prefill_ms(48, 0)
    assert replica.prefill_ms == pytest.approx(step) and replica.prefilling == 2
    assert not replica.can_start()  # the step is under way
    replica.end_prefill(first)
    assert not replica.can_start()
    replica.end_prefill(second)
    assert replica.can_start()
    # Two requests decode now: 98 tokens left, 48 + 32 fit.
    batch, step = replica.start_batch()
    assert [r for r, _ in batch] == [third, fourth]
    for request in (third, fourth):
        replica.end_prefill(request)
    for request in (first, second, third, fourth):
        replica.finish(request)
    assert replica.finished_prefill_ms == pytest.approx(2 * replica.prefill_ms)
    # The decoding requests' tokens count: 60 decoding leave 40, under the third's 48.
    busy = Replica(0, capacity_tokens=100_000, cost=cost)
    decoding = [_request(100 + i, (1000 + i,)) for i in range(60)]
    for request in decoding:
        busy.enqueue(request)
        busy.start_batch()  # one at a time: each is alone in the queue
        busy.end_prefill(request)
    for request in (first, third):
        busy.enqueue(request)
    batch, _ = busy.start_batch()
    assert [r for r, _ in batch] == [first]
    # prefill_batch_tokens 0: one request a step, the model of every figure before Dec 6.
    alone = Replica(0, capacity_tokens=1_000, cost=CostModel(prefill_batch_tokens=0))
    for request in (first, fourth):
        alone.enqueue(request)
    batch, step = alone.start_batch()
    assert [r for r, _ in batch] == [first] and step == cost.prefill_ms(48, 0)


def test_a_prefill_step_counts_uncached_tokens_to_its_budget_and_admits_each_request() -> None:
    """The budget is in tokens to compute: a request that fills it exactly joins, a warm
    one joins on its uncached tail though its prompt would not fit; every request after the
    head must still be admitted (KV memory), as the head is."""
    cold = _request(0, (50, 51, 52))  # 48 tokens
    exact = _request(1, (60, 61, 62, 63), last=4)  # 52 tokens: 48 + 52 = 100
    replica = Replica(0, capacity_tokens=1_000, cost=CostModel(prefill_batch_tokens=100))
    for request in (cold, exact):
        replica.enqueue(request)
    assert [r for r, _ in replica.start_batch()[0]] == [cold, exact]
    # 64 tokens, 48 of them cached: 16 to compute, in the 22 the cold head leaves of 70.
    warm_replica = Replica(0, capacity_tokens=1_000, cost=CostModel(prefill_batch_tokens=70))
    done = _request(2, (1, 2, 3))
    warm_replica.enqueue(done)
    warm_replica.start_batch()
    warm_replica.end_prefill(done)
    warm_replica.finish(done)
    warm = _request(3, (1, 2, 3, 4))
    for request in (cold, warm):
        warm_replica.enqueue(request)
    batch, _ = warm_replica.start_batch()
    assert [(r, hit) for r, hit in batch] == [(cold, 0), (warm, 48)]
    # KV memory: each needs 48 + its first output's 4 units; two do not fit in 100.
    full = Replica(0, capacity_tokens=100, cost=CostModel(prefill_batch_tokens=1_000))
    other = _request(4, (70, 71, 72))
    for request in (cold, other):
        full.enqueue(request)
    assert [r for r, _ in full.start_batch()[0]] == [cold]


def test_requests_queued_together_share_a_prefill_step_end_to_end() -> None:
    """Four requests at one instant on one replica: the first starts a step alone as it
    arrives; batched, the three queued behind it share the next step and their first tokens
    come together at its end; one at a time, each waits for those before it."""
    requests = [SimRequest(i, 0.0, 256, 4, (i,), 256, 256) for i in range(4)]
    workload = Workload("burst", requests, {})
    ttfts = {}
    for budget in (8192, 0):
        params = SimParams(
            replicas=1, capacity_tokens=100_000, cost=CostModel(prefill_batch_tokens=budget)
        )
        ttfts[budget] = sorted(r.ttft_ms for r in simulate(workload, "round-robin", params).records)
    one = CostModel().prefill_ms(256, 0)
    batched = simulate(
        workload, "round-robin", SimParams(replicas=1, capacity_tokens=100_000)
    ).records
    # Each request counts the step it was in as its prefill time.
    three = one + 2 * CostModel().prefill_tokens_ms(256, 0)
    assert sorted(r.prefill_ms for r in batched) == pytest.approx([one, three, three, three])
    assert ttfts[8192] == pytest.approx([one, one + three, one + three, one + three])
    assert ttfts[0] == pytest.approx([one, 2 * one, 3 * one, 4 * one])


def test_prefill_cost_matches_the_h200_calibration() -> None:
    cost = CostModel()
    assert cost.prefill_ms(16_384, 0) == pytest.approx(592, rel=0.05)
    assert cost.prefill_ms(16_384, int(16_384 * 0.9)) == pytest.approx(121, rel=0.1)
    assert cost.prefill_ms(4_096, 0) == pytest.approx(123, rel=0.05)
    assert cost.prefill_ms(4_096, int(4_096 * 0.9)) == pytest.approx(48, rel=0.1)


def test_prompt_bytes_share_prefixes_exactly_when_ids_do() -> None:
    prompts = PromptBytes()
    a = prompts.request(_request(0, (1, 2, 3)))
    b = prompts.request(_request(1, (1, 2, 4)))
    assert len(a.prompt) == 3 * 64
    assert a.prompt[:128] == b.prompt[:128] and a.prompt[128:] != b.prompt[128:]


@pytest.fixture(scope="module")
def small_chat() -> Workload:
    return PRESETS["small-multi-turn"](seed=3)


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_hit_accounting_matches_replica_counters_and_ideal_bounds_it(
    small_chat: Workload, policy: str
) -> None:
    params = SimParams(replicas=4, capacity_tokens=20_000, router_replicas=2, seed=1)
    result = simulate(small_chat, policy, params)
    assert all(r.replica >= 0 and r.ttft_ms > 0 for r in result.records)
    assert sum(r.hit_tokens for r in result.records) == sum(x.hit_tokens for x in result.replicas)
    assert sum(x.requests for x in result.replicas) == len(small_chat.requests)
    assert all(x.running == 0 and not x.waiting for x in result.replicas)
    for x in result.replicas:  # what /metrics reported by the end: every request finished
        assert (x.finished_prefills, x.finished_prefill_tokens) == (
            x.requests,
            x.prompt_tokens - x.hit_tokens,
        )
        # Each request of a prefill step counts the step's time, as vLLM does; the replica's
        # own prefill time counts each step once.
        assert x.finished_prefill_ms >= x.prefill_ms - 1e-6
    ideal = ideal_hit_tokens(small_chat.requests, 16, params.cache_outputs)
    assert sum(r.hit_tokens for r in result.records) <= ideal


def test_runs_are_deterministic_for_a_seed(small_chat: Workload) -> None:
    params = SimParams(replicas=4, capacity_tokens=20_000, router_replicas=2, seed=7)
    for policy in ("ours", "random", "gaie", "dynamo"):
        first = summarize(simulate(small_chat, policy, params), 0.5)
        again = summarize(simulate(small_chat, policy, params), 0.5)
        assert first == again


def test_the_audit_checks_each_decision_against_the_true_caches(small_chat: Workload) -> None:
    params = SimParams(replicas=4, capacity_tokens=20_000, router_replicas=2, seed=1)
    assert simulate(small_chat, "ours", params).audit == {}  # only when asked for
    audited = dataclasses.replace(params, audit=True)
    ours = simulate(small_chat, "ours", audited)
    # Every decision once, under the rule that made it; auditing changes nothing else.
    assert {rule: a.decisions for rule, a in ours.audit.items()} == ours.rules
    plain, checked = summarize(simulate(small_chat, "ours", params), 1.0), summarize(ours, 1.0)
    assert {k: v for k, v in checked.items() if k != "audit"} == plain
    # Random placement misses holders; the oracle, which routes on the true caches, never.
    random = simulate(small_chat, "random", audited).audit["random"]
    assert random.decisions == len(small_chat.requests)
    assert random.off_best_holder > 0 and random.tokens_lost > 0
    oracle = simulate(small_chat, "oracle", audited).audit["oracle"]
    assert oracle.off_best_holder == 0 and oracle.tokens_lost == 0


def _three_routers(
    workload: Workload, requests: int, **sharing: bool
) -> tuple[PolicyContext, RouterGroup]:
    """Three instances of ours on four replicas, after ``requests`` of ``workload``."""
    ctx = PolicyContext(
        [Replica(i, 20_000, CostModel()) for i in range(4)], random.Random(0), 20_000, **sharing
    )
    group = make_policy("ours", ctx, 3, 16)
    for request in workload.requests[:requests]:
        ctx.now = request.arrival_s
        group.route(request, request.arrival_s)
    return ctx, group


def test_shared_queues_wire_each_router_replica_to_the_others(small_chat: Workload) -> None:
    for share in (False, True):
        _, group = _three_routers(small_chat, 30, share_queues=share)
        for instance in group.instances:
            heard = instance.router.peers()
            expected = {p.router.instance for p in group.instances if p is not instance}
            assert set(heard) == (expected if share else set())


def test_router_replicas_share_placements_only_when_asked(small_chat: Workload) -> None:
    """With share_placements each of ours' instances reads the others' placements into its
    index: every instance's index then holds every request's blocks, not a third."""
    entries = {}
    for share in (False, True):
        ctx, group = _three_routers(small_chat, 30, share_placements=share)
        ctx.now += 2.0  # past the next read: each reads what the others placed
        group.route(small_chat.requests[30], ctx.now)
        entries[share] = [i.router.index.stats().entries for i in group.instances]
        assert all(not i.router.peers() for i in group.instances)  # queues not shared
    assert min(entries[True]) > max(entries[False])


def test_prefix_aware_policies_beat_random(small_chat: Workload) -> None:
    params = SimParams(replicas=4, capacity_tokens=20_000, seed=0)
    hit = {
        p: summarize(simulate(small_chat, p, params), 1.0)["hit_ratio"] for p in ("ours", "random")
    }
    assert hit["ours"] > hit["random"]


def test_mooncake_loader_reads_partial_last_block(tmp_path) -> None:
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 2000, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1, 2]},
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    workload = load_mooncake(trace, speedup=2.0)
    first, second = workload.requests
    assert first.last_tokens == 188 and second.last_tokens == 76
    assert second.arrival_s == pytest.approx(1.0)
    # 188 tokens of block 1 are cacheable as 11 whole 16-token blocks.
    assert ideal_hit_tokens(workload.requests, 16) == 512 + 176


def _names_seen(monkeypatch, workload: Workload, seed: int) -> tuple[set[str], set[str]]:
    """The addresses ours knows the replicas by, and the hash ring's names for them."""
    from extproc.sim import policies

    addresses: set[str] = set()
    original = policies.Router.observe_signals

    def spy(self, address, *args, **kw):
        addresses.add(address)
        return original(self, address, *args, **kw)

    monkeypatch.setattr(policies.Router, "observe_signals", spy)
    params = SimParams(replicas=3, capacity_tokens=20_000, seed=seed)
    simulate(workload, "ours", params)
    ring: set[str] = set()
    name = policies.PolicyContext.ring_name

    def ring_spy(self, replica):
        ring.add(name(self, replica))
        return name(self, replica)

    monkeypatch.setattr(policies.PolicyContext, "ring_name", ring_spy)
    simulate(workload, "consistent-hash", params)
    monkeypatch.undo()
    return addresses, ring


def test_a_traces_seed_renames_its_replicas(tmp_path, monkeypatch, small_chat: Workload) -> None:
    """A trace is the same requests whatever the seed, so before Dec 7 its five seeds ran ours
    (one router) and consistent hashing five times alike. The seed now names the
    replicas: ours' rendezvous order and the hash ring place keys by those names, so each
    seed is one draw of a deployment's addresses. Seed 0 keeps the earlier names, and a
    generated workload, which the seed draws anew, keeps them whatever its seed."""
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 150 * i, "input_length": 1000, "output_length": 4,
         "hash_ids": [1000 + i % 24, 5000 + i]}
        for i in range(96)
    ]  # fmt: skip
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    workload = load_mooncake(trace)

    def placements(policy: str, seed: int) -> list[int]:
        params = SimParams(replicas=4, capacity_tokens=100_000, seed=seed)
        return [r.replica for r in simulate(workload, policy, params).records]

    for policy in ("ours", "consistent-hash"):
        assert placements(policy, 1) == placements(policy, 1)
        assert placements(policy, 0) != placements(policy, 1), policy
    # SGLang names no replica (ties go to the first of identical replicas): nothing moves.
    assert placements("sglang", 0) == placements("sglang", 1)
    # Round robin starts at a random replica: another one, the same figures.
    params = [SimParams(replicas=4, capacity_tokens=100_000, seed=s) for s in (0, 1)]
    rr = [summarize(simulate(workload, "round-robin", p), 1.0) for p in params]
    assert rr[0] == rr[1]
    old_names = (
        {f"10.0.0.{r + 1}:8000" for r in range(3)},
        {f"replica-{r}" for r in range(3)},
    )
    assert _names_seen(monkeypatch, workload, 0) == old_names
    assert _names_seen(monkeypatch, workload, 3) == (
        {f"10.0.0.{r + 1}:8003" for r in range(3)},
        {f"replica-{r}@3" for r in range(3)},
    )
    assert _names_seen(monkeypatch, small_chat, 3) == old_names


def test_cli_simulate_end_to_end(tmp_path, capsys) -> None:
    out, png = tmp_path / "out.json", tmp_path / "out.png"
    code = main(
        [
            "bench",
            "simulate",
            "--workload",
            "small-shared-prefix",
            "--requests",
            "200",
            "--replicas",
            "4",
            "--capacity-tokens",
            "20000",
            "--policies",
            "ours,random,oracle",
            "--json",
            str(out),
            "--plot",
            str(png),
            "--sweep-k",
            "1,2",
            "--audit",
            "--no-progress",
        ]
    )
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["policies"]["random"]["audit"]["random"]["decisions"] == 200
    assert set(doc["policies"]) == {"ours", "random", "oracle"}
    for stats in doc["policies"].values():
        assert {"hit_ratio", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms"} <= set(stats)
        assert stats["hit_ratio"] <= doc["ideal_hit_ratio"]
    assert doc["params"]["replicas"] == 4 and "cost_model" in doc["params"]
    assert set(doc["sweep_k"]["ours"]) == {"1", "2"}
    assert png.stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "ideal hit ratio" in printed and "against the replicas' true caches" in printed


def test_cli_simulate_sweeps_ours_with_peers_beside_ours_without(tmp_path, capsys) -> None:
    def run(*extra: str) -> dict:
        out = tmp_path / "out.json"
        args = ["bench", "simulate", "--workload", "small-multi-turn", "--replicas", "4"]
        args += ["--capacity-tokens", "20000", "--policies", "ours", "--no-progress"]
        assert main([*args, "--json", str(out), *extra]) == 0
        return json.loads(out.read_text())

    swept = run("--sweep-k", "1,2", "--sweep-peers", "--plot", str(tmp_path / "k.png"))
    with_peers = run("--router-replicas", "2", "--share-queues", "--share-placements")
    without = run("--router-replicas", "2")
    line = swept["sweep_k"]["ours, peers"]
    assert line["1"] == swept["sweep_k"]["ours"]["1"]
    assert line["2"] == with_peers["policies"]["ours"]["hit_ratio"]
    assert swept["sweep_k"]["ours"]["2"] == without["policies"]["ours"]["hit_ratio"]
    assert line["2"] != swept["sweep_k"]["ours"]["2"]  # the runs differ, so the check bites
    assert "ours, peers" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--share-queues"):
        run("--sweep-k", "1,2", "--sweep-peers", "--share-placements")
    with pytest.raises(SystemExit, match="needs --sweep-k"):
        run("--sweep-peers")


def _simulate_ours_on_small_chat(tmp_path, *flags: str) -> dict:
    """`bench simulate` of ours alone on the small chat workload, 4 replicas: its JSON."""
    out = tmp_path / "out.json"
    args = ["bench", "simulate", "--workload", "small-multi-turn", "--replicas", "4"]
    args += ["--policies", "ours", "--no-progress", "--json", str(out), *flags]
    assert main(args) == 0
    return json.loads(out.read_text())


def test_cli_simulate_routing_overrides_reach_ours(tmp_path, capsys) -> None:
    run = functools.partial(_simulate_ours_on_small_chat, tmp_path)

    default = run()
    never_move = run("--routing", "stickiness=1000", "--routing", "load_slack=1000")
    assert never_move["params"]["routing_overrides"] == {"stickiness": 1000.0, "load_slack": 1000}
    assert (
        "routing overrides for ours: load_slack=1000, stickiness=1000.0" in capsys.readouterr().out
    )
    assert never_move["policies"]["ours"] != default["policies"]["ours"]
    with pytest.raises(SystemExit, match=r"routing\.stickyness"):
        run("--routing", "stickyness=2")


def test_cli_cache_outputs_reaches_the_replicas_and_the_ideal(tmp_path, capsys) -> None:
    run = functools.partial(_simulate_ours_on_small_chat, tmp_path)

    default, replies, prompts = run(), run("--cache-outputs"), run("--no-cache-outputs")
    assert default["params"]["cache_outputs"]  # by default, as vLLM v1 does
    assert default["policies"]["ours"]["hit_ratio"] == replies["policies"]["ours"]["hit_ratio"]
    assert replies["params"]["cache_outputs"] and not prompts["params"]["cache_outputs"]
    out = capsys.readouterr().out
    assert "; replies cached" in out and "prompts only (--no-cache-outputs)" in out
    assert replies["ideal_hit_ratio"] > prompts["ideal_hit_ratio"]
    assert replies["policies"]["ours"]["hit_ratio"] > prompts["policies"]["ours"]["hit_ratio"]
    with pytest.raises(SystemExit, match="--cache-outputs needs one KV pool"):
        run("--cache-outputs", "--kv-pool", "split")
    split = run("--kv-pool", "split")  # the split model has no replies to keep
    assert not split["params"]["cache_outputs"]


def test_server_blocks_keep_ours_at_its_configured_block_size(tmp_path, capsys) -> None:
    """By default ours hashes a Mooncake prompt one block per 512-token id (fast, exact
    matches); --server-blocks keeps the server's 64-byte blocks, whose index errs as a
    server's does (docs/benchmarks.md, item 27)."""
    from extproc.sim.policies import PolicyContext, make_policy

    def router_block_bytes(server_blocks: bool) -> int:
        ctx = PolicyContext(
            replicas=[Replica(i, 100_000, CostModel()) for i in range(2)],
            rng=random.Random(0),
            capacity_tokens=100_000,
            server_blocks=server_blocks,
        )
        return make_policy("ours", ctx, 1, 512).instances[0].router.config.block_size_bytes

    assert router_block_bytes(False) == 2048
    assert router_block_bytes(True) == RoutingConfig().block_size_bytes == 64
    rng = random.Random(4)
    rows = []
    for i in range(120):
        group = rng.randrange(6)
        shared = list(range(group * 100, group * 100 + 12))  # six 6,144-token preambles
        rows.append(
            {
                "timestamp": i * 100,
                "input_length": 512 * len(shared) + 100,
                "output_length": 8,
                "hash_ids": [*shared, 10_000 + i],
            }
        )
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def run(*extra: str) -> dict:
        out = tmp_path / "out.json"
        args = ["bench", "simulate", "--trace", str(trace), "--replicas", "2"]
        args += ["--capacity-tokens", "20000", "--policies", "ours", "--no-progress"]
        assert main([*args, "--json", str(out), *extra]) == 0
        return json.loads(out.read_text())

    coarse, fine = run(), run("--server-blocks")
    assert fine["params"]["server_blocks"] and not coarse["params"]["server_blocks"]
    assert "(--server-blocks)" in capsys.readouterr().out
    assert 0 < fine["policies"]["ours"]["hit_ratio"] <= fine["ideal_hit_ratio"]


def test_ours_runs_on_simulated_time() -> None:
    # The router's queued prefill work drains by the simulation clock, not the wall clock.
    import random

    from extproc.sim.policies import PolicyContext, make_policy

    ctx = PolicyContext(
        replicas=[Replica(i, 100_000, CostModel()) for i in range(2)],
        rng=random.Random(0),
        capacity_tokens=100_000,
    )
    group = make_policy("ours", ctx, 1, 16)
    router = group.instances[0].router
    _, handle = group.route(_request(0, tuple(range(1, 400))), 0.0)
    address = handle[1].endpoint
    charged = router.queued_work()[address]
    assert charged == handle[1].work > 6_000
    ctx.now = 0.05
    assert router.queued_work()[address] == pytest.approx(
        charged - 0.05 * router.cost.drain_per_second
    )
    ctx.now = 10.0
    assert router.queued_work()[address] == 0 and router.in_flight()[address] == 1
    group.finish(handle)
    assert router.in_flight()[address] == 0


def test_ours_reads_the_replicas_metrics_like_the_server_does(small_chat: Workload) -> None:
    """The server scrapes every model server's /metrics (signals.py, on by default); in the
    simulator ours gets the replicas' running, waiting and KV usage at the same interval."""
    from extproc.config import SignalsConfig
    from extproc.sim import policies

    seen: list[tuple[str, float | None]] = []
    original = policies.Router.observe_signals

    def spy(self, address, up, running=None, waiting=None, kv_usage=None, **kw):
        seen.append((address, kv_usage))
        return original(self, address, up, running, waiting, kv_usage, **kw)

    policies.Router.observe_signals = spy  # type: ignore[method-assign]
    try:
        params = SimParams(replicas=3, capacity_tokens=20_000)
        result = simulate(small_chat, "ours", params, progress=None)
    finally:
        policies.Router.observe_signals = original  # type: ignore[method-assign]
    assert {address for address, _ in seen} == {f"10.0.0.{r + 1}:8000" for r in range(3)}
    scrapes = len(seen) // 3
    interval = SignalsConfig().interval_seconds
    # One scrape per interval of simulated time in which a request arrived, at most.
    assert 1 < scrapes <= result.sim_seconds / interval + 1
    assert all(kv is not None and 0.0 <= kv <= 1.0 for _, kv in seen)


def test_documents_sent_as_chat_keep_their_hit_ratio_with_router_replicas() -> None:
    """The GAIE shape as chat requests (document = system message): each request is a new
    conversation, and four router replicas that share nothing still send one document's
    questions to one replica (placed by the preamble, item 12 of docs/benchmarks.md). Placed
    by each conversation's own key, the four lost 0.4 of hit ratio at 8 x 100k."""
    from extproc.sim.workloads import shared_prefix

    workload = shared_prefix(
        groups=32,
        prompts=8,
        system_tokens=1024,
        question_tokens=128,
        output_tokens=16,
        rate=40.0,
        requests=800,
        chat=True,
    )
    assert all(r.first_turn_tokens == r.input_tokens for r in workload.requests)
    assert all(r.preamble_tokens == 1024 for r in workload.requests)
    hit = {k: _ours(workload, 8, 40_000, router_replicas=k)["hit_ratio"] for k in (1, 4)}
    assert hit[1] > 0.75 and hit[4] > hit[1] - 0.03, hit


def test_a_router_alone_copies_a_hot_document_into_free_room_to_cut_the_tail() -> None:
    """Loose caches (16 x 400k, 64 documents): with the premium scaled by the target's fill
    (stickiness_fill: 1, off by default; item 13 of docs/benchmarks.md) a request waiting
    behind its document's holder moves to an idle endpoint with free room; with the full
    premium it waits. Four router replicas keep the full premium once they measure their
    share of the traffic. Replicas prefill one request at a time (as before Dec 6), so a
    queue builds behind the holder."""
    from extproc.sim.workloads import shared_prefix

    workload = shared_prefix(
        groups=64,
        prompts=16,
        system_tokens=2048,
        question_tokens=256,
        output_tokens=64,
        rate=60.0,
        requests=1024,
    )

    def run(k: int, fill: float) -> dict:
        # The balance of cold starts shortens both tails: off, to isolate the premium.
        return _ours(
            workload,
            16,
            400_000,
            k,
            CostModel(prefill_batch_tokens=0),
            stickiness_fill=fill,
            balance_cold_starts=False,
        )

    scaled, full = run(1, 1.0), run(1, 0.0)
    assert scaled["ttft_p99_ms"] < 0.9 * full["ttft_p99_ms"], (scaled, full)
    assert scaled["hit_ratio"] > full["hit_ratio"] - 0.02
    assert scaled["rules"].get("load_guard", 0) > full["rules"].get("load_guard", 0)
    shared, shared_full = run(4, 1.0), run(4, 0.0)
    assert shared["ttft_p99_ms"] == pytest.approx(shared_full["ttft_p99_ms"], rel=0.02)
    assert shared["hit_ratio"] == pytest.approx(shared_full["hit_ratio"], abs=0.005)


def test_session_rounds_extend_each_session_round_after_round() -> None:
    """inference-perf's multi-turn shared prefix: request i continues session i mod S with
    its whole earlier context (system prompt, questions, answers) as the prompt's prefix,
    sent as a completion; sessions of a group share its system prompt and nothing more."""
    from extproc.sim.workloads import session_rounds

    workload = session_rounds(
        groups=2,
        sessions=5,
        system_tokens=160,
        question_tokens=64,
        output_tokens=32,
        rate=10.0,
        requests=30,
        question_std=16.0,
        output_std=8.0,
        seed=1,
    )
    requests = workload.requests
    assert len(requests) == 30 and all(r.first_turn_tokens == 0 for r in requests)
    order = [r.session for r in requests[:10]]
    assert sorted(order) == list(range(10))
    for r in requests[10:]:
        assert r.session == order[r.rid % 10]
        earlier = requests[r.rid - 10]
        # The previous request's prompt, then its answer, then a new question.
        assert r.ids[: len(earlier.ids)] == earlier.ids
        assert len(r.ids) > len(earlier.ids) + -(-earlier.output_tokens // 16)
    sys_chunks = 160 // 16
    for a in requests[:10]:
        for b in requests[:10]:
            same_group = a.session // 5 == b.session // 5
            assert (a.ids[:sys_chunks] == b.ids[:sys_chunks]) == same_group
            if a.session != b.session:
                assert a.ids[sys_chunks] != b.ids[sys_chunks]
    assert len({r.output_tokens for r in requests}) > 1  # drawn, not fixed


def test_cli_refuses_a_workload_parameter_its_generator_does_not_take(capsys) -> None:
    args = ["bench", "simulate", "--workload", "gaie-multi-chat", "--turns", "3", "--no-progress"]
    with pytest.raises(SystemExit, match="does not take turns"):
        main(args)
    assert PRESETS["gaie-multi-chat"].takes >= {"groups", "sessions", "rate", "requests"}
    assert "turns" in PRESETS["multi-turn-chat"].takes
    assert "sessions" not in PRESETS["gaie-high-cache"].takes


def test_completions_sharing_a_popular_preamble_spread_over_the_replicas() -> None:
    """The GAIE multi-chat shape, small: conversations of a few system prompts sent as
    completions, every session's second request after the first round. Followed, the
    system prompt piles every conversation onto its holders (max/mean requests 1.7 on the
    full shape, hit ratio 0.24 against round robin's 0.31); spread as new sessions, the
    load is even and the second requests still find their first."""
    from extproc.sim.workloads import session_rounds

    workload = session_rounds(
        groups=2,
        sessions=120,
        system_tokens=512,
        question_tokens=1024,
        output_tokens=64,
        rate=20.0,
        requests=480,
    )

    on, off = (_ours(workload, 8, 400_000, spread_popular_completions=s) for s in (True, False))
    assert on["load_max_over_mean"] < 1.3 < off["load_max_over_mean"], (on, off)
    assert on["hit_ratio"] >= off["hit_ratio"] - 0.005, (on, off)


def test_a_router_alone_balances_few_groups_over_the_replicas() -> None:
    """24 documents over 8 replicas: the rendezvous order alone gives one replica about
    twice another's groups; balanced cold starts (a router alone measures its whole share of
    the traffic) even out the load at the same hit ratio, and the busiest replica's tail
    goes (llm-d's precise prefix-cache shape at 8 x 1M: p99 494 -> 211 ms, docs/benchmarks.md)."""
    from extproc.sim.workloads import shared_prefix

    workload = shared_prefix(
        groups=24,
        prompts=16,
        system_tokens=4096,
        question_tokens=512,
        output_tokens=256,
        rate=40.0,
        requests=384,
    )

    on, off = (_ours(workload, 8, 400_000, balance_cold_starts=b) for b in (True, False))
    assert on["load_max_over_mean"] < 1.25 < off["load_max_over_mean"], (on, off)
    assert on["hit_ratio"] >= off["hit_ratio"] - 0.005, (on, off)
    assert on["ttft_p99_ms"] < off["ttft_p99_ms"], (on, off)


def test_a_replica_out_of_batch_slots_is_priced_by_how_fast_it_admits() -> None:
    """Long answers, 32 batch slots per replica and KV memory to spare: a replica holding
    its 32 running sequences admits the next only as one finishes, seconds apart. Priced as
    its queued prefills, conversations kept joining its queue (p99 over 40 s); priced at its
    admission rate, they move while another replica has a slot (the GAIE multi-chat shape
    at 4 x 4M, one seed: p99 3,556 -> 418 ms, docs/benchmarks.md)."""
    from extproc.sim.workloads import session_rounds

    workload = session_rounds(
        groups=2,
        sessions=100,
        system_tokens=1000,
        question_tokens=1000,
        output_tokens=1000,
        output_std=300.0,
        rate=6.0,
        requests=800,
    )
    slots = CostModel(max_batch=32)
    on, off = (
        _ours(workload, 4, 4_000_000, cost=slots, slot_blocked_fraction=f) for f in (0.95, 0.0)
    )
    assert on["ttft_p99_ms"] < off["ttft_p99_ms"] / 4, (on, off)
    assert on["load_max_over_mean"] < off["load_max_over_mean"], (on, off)


def test_a_replica_announces_computed_blocks_at_the_end_of_prefill_and_evictions_at_once() -> None:
    """KV-cache events as vLLM sends them: a prompt's new blocks once its prefill computed
    them, an eviction when it happens, nothing for a hit."""
    published: list[list[tuple[bool, int, int]]] = []
    replica = Replica(0, 64, CostModel())
    replica.listen_cache_events(published.append)
    first = _request(0, (1, 2, 3))
    replica.enqueue(first)
    replica.start_prefill()
    assert published == []  # computing: not announced yet
    replica.end_prefill(first)
    assert published == [[(True, 3, 16), (True, 2, 16), (True, 1, 16)]]
    replica.finish(first)
    again = _request(1, (1, 2, 3))  # all cached: a hit announces nothing
    replica.enqueue(again)
    replica.start_prefill()
    replica.end_prefill(again)
    replica.finish(again)
    assert len(published) == 1
    other = _request(2, (7, 8))  # 32 tokens + 4 output: the pool evicts 3, then 2
    replica.enqueue(other)
    replica.start_prefill()
    assert published[1:] == [[(False, 3, 0), (False, 2, 0)]]  # evicted at once
    replica.end_prefill(other)
    assert published[2] == [(True, 8, 16), (True, 7, 16)]
    with pytest.raises(ValueError, match="one KV pool"):
        Replica(0, 64, CostModel(), kv_pool="split").listen_cache_events(published.append)


@pytest.mark.parametrize(
    ("capacity", "cache_outputs"), [(800, False), (800, True), (20_000, False), (20_000, True)]
)
def test_replaying_the_cache_events_gives_what_each_replica_holds(
    small_chat: Workload, capacity: int, cache_outputs: bool
) -> None:
    """What a subscriber learns from the events (stored minus removed, in order) is each
    replica's cache: evictions, preemptions (800 tokens preempts) and cached replies
    included."""
    seen: list[dict[int, int]] = []

    def listen(replicas: list[Replica]) -> None:
        for replica in replicas:
            held: dict[int, int] = {}
            seen.append(held)

            def apply(events, held=held) -> None:
                for stored, chunk, units in events:
                    if stored:
                        held[chunk] = units
                    else:
                        held.pop(chunk, None)

            replica.listen_cache_events(apply)

    params = SimParams(replicas=4, capacity_tokens=capacity, seed=1, cache_outputs=cache_outputs)
    original = Replica.__init__

    def init(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        listen([self])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Replica, "__init__", init)
        result = simulate(small_chat, "round-robin", params)
    assert [dict(r.cache._held) for r in result.replicas] == seen
    assert all(seen) and (capacity > 800 or sum(r.preemptions for r in result.replicas))


def test_cache_events_let_router_replicas_find_each_others_prefixes(small_chat: Workload) -> None:
    """Four router replicas without shared state send requests away from the replica that
    holds most of their prompt (other routers placed it there); reading the replicas' cache
    events, they do so less and hit more. One router alone knows its placements already."""
    audit = {}
    for k in (1, 4):
        for delay in (None, 50.0):
            params = SimParams(
                replicas=4, capacity_tokens=20_000, seed=1, router_replicas=k, audit=True
            )
            result = simulate(small_chat, "ours", dataclasses.replace(params, kv_events_ms=delay))
            hits = sum(r.hit_tokens for r in result.records)
            assert hits == sum(x.hit_tokens for x in result.replicas)
            missed = sum(a.off_best_holder for a in result.audit.values())
            audit[k, delay] = (missed, summarize(result, 1.0)["hit_ratio"])
    assert audit[4, 50.0][0] < audit[4, None][0] and audit[4, 50.0][1] > audit[4, None][1]
    assert audit[1, 50.0] == audit[1, None]


def test_cli_kv_events_reach_ours_and_are_recorded(tmp_path, capsys) -> None:
    run = functools.partial(_simulate_ours_on_small_chat, tmp_path)
    default = run("--router-replicas", "4")
    events = run("--router-replicas", "4", "--kv-events", "50")
    assert events["params"]["kv_events_ms"] == 50 and default["params"]["kv_events_ms"] is None
    assert "KV-cache events 50 ms late (--kv-events)" in capsys.readouterr().out
    assert events["policies"]["ours"]["hit_ratio"] != default["policies"]["ours"]["hit_ratio"]
    for bad in (["--kv-events", "-1"], ["--kv-events", "5", "--kv-pool", "split"]):
        with pytest.raises(SystemExit, match="--kv-events"):
            run(*bad)


def test_dynamo_counts_prefill_work_until_the_first_token_and_shared_blocks_once() -> None:
    """Dynamo's cost (selector.rs): (the worker's tokens still in prefill + this request's
    uncached ones) / block + its active blocks with this request's added, each block once.
    (1) Of two workers as busy in blocks, the one whose request is still in prefill is
    avoided. (2) A request sharing a finished-prefill request's 1,000-token prefix goes
    where it is (its blocks counted twice made that worker look as busy as a cold one).
    Both were ties, broken at random, in the earlier reading: checked over 20 draws."""
    a = SimRequest(0, 0.0, 63 * 16, 4, tuple(range(1, 64)), 16, 16)
    other = SimRequest(1, 0.0, 63 * 16, 4, tuple(range(100, 163)), 16, 16)
    small = SimRequest(2, 0.0, 10 * 16, 4, tuple(range(200, 210)), 16, 16)
    sharing = SimRequest(3, 0.0, 64 * 16, 4, (*range(1, 64), 99), 16, 16)
    for seed in range(20):
        ctx = PolicyContext(
            [Replica(i, 100_000, CostModel()) for i in range(2)], random.Random(seed), 100_000
        )
        dynamo = make_policy("dynamo", ctx, 1, 16)
        decoding, handle = dynamo.route(a, 0.0)
        dynamo.prefill_done(handle)
        prefilling, _ = dynamo.route(other, 0.0)
        assert prefilling != decoding
        assert dynamo.route(small, 0.0)[0] == decoding
        dynamo = make_policy("dynamo", ctx, 1, 16)
        home, handle = dynamo.route(a, 0.0)
        dynamo.prefill_done(handle)
        assert dynamo.route(sharing, 0.0)[0] == home


def test_gaies_prefix_index_is_as_large_as_each_servers_cache() -> None:
    """The prefix plugin sizes each server's LRU from its KV cache (AutoTune, upstream's
    default), not the fixed 31,250 blocks of the earlier default."""
    for capacity in (50_000, 4_000_000):
        ctx = PolicyContext(
            [Replica(i, capacity, CostModel()) for i in range(2)], random.Random(0), capacity
        )
        gaie = make_policy("gaie", ctx, 1, 16).instances[0]
        assert {lru.capacity for lru in gaie.index} == {capacity // 16}


def test_gaie_reads_the_servers_metrics_as_last_refreshed_every_50_ms() -> None:
    """The picker's queue and KV figures are scraped every 50 ms (upstream's default
    --refresh-metrics-interval) and none of its own picks count in between: a queue that
    grew since is not seen until the next refresh."""
    request = SimRequest(0, 0.0, 4 * 16, 4, (1, 2, 3, 4), 16, 16)
    other = SimRequest(1, 0.0, 4 * 16, 4, (9, 8, 7, 6), 16, 16)
    later = SimRequest(2, 0.0, 4 * 16, 4, (5, 5, 5, 5), 16, 16)
    picks = []
    for seed in range(20):
        replicas = [Replica(i, 100_000, CostModel()) for i in range(2)]
        gaie = make_policy("gaie", PolicyContext(replicas, random.Random(seed), 100_000), 1, 16)
        gaie.route(other, 0.0)  # (a refresh: both queues empty)
        replicas[0].waiting.extend([other] * 5)  # replica 0's queue grows
        stale = gaie.route(request, 0.04)[0]
        fresh = gaie.route(later, 0.06)[0]
        picks.append((stale, fresh))
    assert {fresh for _, fresh in picks} == {1}  # the longer queue seen: avoided
    assert {stale for stale, _ in picks} == {0, 1}  # not seen yet: a tie, either way


def test_dynamo_with_kv_events_scores_the_workers_true_caches() -> None:
    """Dynamo's default index is fed by the engines' KV events. (1) A prefix a server holds
    that no decision of this router put there draws the request every time; the approximate
    mode, predicting from its own decisions, sees a tie. (2) A prefix it placed that the
    server does not hold (evicted, or never computed) draws nothing; the approximate mode
    follows its prediction every time. Over 20 draws each."""
    held = SimRequest(0, 0.0, 64 * 16, 4, tuple(range(1, 65)), 16, 16)
    full, last = cache_units(held, 16)

    def context(seed: int, holder: int | None) -> PolicyContext:
        replicas = [Replica(i, 100_000, CostModel(), kv_pool="split") for i in range(2)]
        if holder is not None:
            replicas[holder].cache.touch(held.ids, full, last)
        return PolicyContext(replicas, random.Random(seed), 100_000)

    def picks(name: str, holder: int | None, placed_first: bool) -> set[int]:
        chosen = set()
        for seed in range(20):
            policy = make_policy(name, context(seed, holder), 1, 16)
            if placed_first:
                first, handle = policy.route(held, 0.0)
                policy.finish(handle)
                chosen.add(policy.route(held, 0.0)[0] == first)
            else:
                chosen.add(policy.route(held, 0.0)[0])
        return chosen

    assert picks("dynamo-events", 1, placed_first=False) == {1}
    assert picks("dynamo", 1, placed_first=False) == {0, 1}
    assert picks("dynamo-events", None, placed_first=True) == {True, False}
    assert picks("dynamo", None, placed_first=True) == {True}
