"""The discrete-event loop: arrivals → policy → replica queues → prefill → decode → finish.

Events live in one heapq ordered by (time, sequence), so equal-time events run in the order
they were created and a run is a pure function of (workload, policy, params, seed).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import RoutingConfig
from ..scheduler import CostModel as RouterCostModel
from .policies import PolicyContext, make_policy
from .replica import DEFAULT_KV_POOL, CostModel, Replica, cache_units
from .workloads import SimRequest, Workload

ARRIVAL, PREFILL_DONE, FINISH, GROW, ROUTERS = 0, 1, 2, 3, 4


@dataclass(frozen=True)
class RouterChange:
    """At ``at_s`` (simulated seconds), the router replicas become ``replicas`` (fresh ones
    join, the newest leave), or with ``restart`` the oldest is replaced by a fresh one: a
    deployment of routers scaling or rolling. Fresh means as a started process is: an empty
    index, its traffic share unmeasured. The count it had is a phase boundary alone. With
    ``overlap_s`` the fresh one joins at ``at_s`` and the oldest leaves that much later, as
    a Kubernetes rollout with maxSurge 1 replaces a pod once its successor is ready."""

    at_s: float
    replicas: int | None = None
    restart: bool = False
    overlap_s: float = 0.0


@dataclass(frozen=True)
class _Leave:
    """An overlapping restart's second half: router instance ``instance`` leaves."""

    at_s: float
    instance: int


def parse_router_changes(spec: str) -> tuple[RouterChange, ...]:
    """``"60:restart,120:4,180:2"`` -> changes in time order; a message naming the flag on
    anything else."""
    changes: list[RouterChange] = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        at, sep, what = item.partition(":")
        try:
            at_s = float(at)
        except ValueError:
            at_s = math.nan
        if not sep or not math.isfinite(at_s) or at_s < 0:
            raise ValueError(
                f"--router-changes: {item!r} is not TIME:restart or TIME:COUNT "
                "(TIME in simulated seconds, at least 0)"
            )
        restart, plus, overlap = what.strip().partition("+")
        try:
            overlap_s = float(overlap) if plus else 0.0
        except ValueError:
            overlap_s = math.nan
        if restart == "restart" and math.isfinite(overlap_s) and overlap_s >= 0:
            change = RouterChange(at_s, restart=True, overlap_s=overlap_s)
        elif what.strip().isdigit() and int(what) >= 1:
            change = RouterChange(at_s, replicas=int(what))
        else:
            raise ValueError(
                f"--router-changes: {item!r}: after the time, 'restart', 'restart+SECONDS' "
                "(the old one leaves that much later) or a count of router replicas (at least 1)"
            )
        if changes and at_s < changes[-1].at_s:
            raise ValueError(f"--router-changes: {item!r} comes before the change ahead of it")
        changes.append(change)
    if not changes:
        raise ValueError("--router-changes: no change given (e.g. 60:restart,120:4)")
    return tuple(changes)


@dataclass(frozen=True)
class SimParams:
    replicas: int = 8
    capacity_tokens: int = 500_000
    router_replicas: int = 1
    seed: int = 0
    cost: CostModel = field(default_factory=CostModel)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    router_cost: RouterCostModel | None = None
    # Check every decision against the replicas' true caches (RunResult.audit); costs a
    # cache lookup per replica per request.
    audit: bool = False
    # Ours' K router replicas read each other's queued work (config ``peers``).
    share_queues: bool = False
    # ... and the placements each makes (what went where), into each other's indexes.
    share_placements: bool = False
    # The replicas' memory model (replica.py): "preempt", vLLM's one block pool with output
    # blocks taken as generated and preemption when it is full; "shared", the same pool with
    # each output reserved at admission (items 24-25); "split", the model before item 24.
    kv_pool: str = DEFAULT_KV_POOL
    # Ours hashes prompts in its configured blocks (64 bytes, as a server does) instead of
    # one block per workload chunk (sim_routing_config): a Mooncake prompt is then ~700
    # blocks to hash and match instead of ~23.
    server_blocks: bool = False
    # A finished chat request's reply stays in its replica's cache (vLLM v1 caches every
    # full block it computes), so the next turn, which carries it, can hit it there. The
    # default since Dec 4 (fifteenth session); False is the prompt-only model of earlier
    # figures, and the only one kv_pool "split" has.
    cache_outputs: bool = True
    # Ours' router replicas read the replicas' KV-cache events (vLLM's BlockStored /
    # BlockRemoved), each this many ms after it happened; None: they do not (the default,
    # as the server's cache_events section is optional: it needs the model's files).
    kv_events_ms: float | None = None
    # With kv_events_ms: each replica keeps its last this-many event messages, and a router
    # replica that starts during the run (router_changes) reads them first, as the server
    # asks vLLM's replay_endpoint (cache_events.replay; vLLM keeps 10,000); 0: it does not.
    kv_events_replay: int = 0
    # The router replicas scale or restart during the run (RouterChange); policies that
    # know the truth (the oracle) are one instance and ignore them.
    router_changes: tuple[RouterChange, ...] = ()
    # What a router replica of ours that starts during the run is handed (warm_start.py):
    # "none"; "file", at a restart in place, the index its predecessor wrote at its stop;
    # "peer", the index of the oldest router still routing (a surge's predecessor, or a
    # peer of a pair or a scale-out).
    warm_start: str = "none"


@dataclass(slots=True)
class RequestRecord:
    replica: int = -1
    hit_tokens: int = 0
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0


@dataclass(slots=True)
class RuleAudit:
    """Decisions of one rule, against what the replicas really held when each was made."""

    decisions: int = 0
    # Decisions that sent the request elsewhere than to a replica holding more of its prompt.
    off_best_holder: int = 0
    # The prompt tokens those decisions left behind (the best holder's match minus the pick's).
    tokens_lost: int = 0


@dataclass
class RunResult:
    policy: str
    params: SimParams
    records: list[RequestRecord]
    replicas: list[Replica]
    requests: list[SimRequest]
    rules: dict[str, int]
    sim_seconds: float
    audit: dict[str, RuleAudit] = field(default_factory=dict)
    # (from seconds, router replicas then) at the start and after each router change.
    router_phases: list[tuple[float, int]] = field(default_factory=list)


def simulate(
    workload: Workload,
    policy: str,
    params: SimParams,
    progress: Callable[[int], None] | None = None,
) -> RunResult:
    """Replay ``workload`` through ``policy``; ``progress(n)`` is told of every n arrivals."""
    requests = workload.requests
    replicas = [
        Replica(i, params.capacity_tokens, params.cost, params.kv_pool, params.cache_outputs)
        for i in range(params.replicas)
    ]
    ctx = PolicyContext(
        replicas=replicas,
        rng=random.Random(params.seed),
        capacity_tokens=params.capacity_tokens,
        routing=params.routing,
        kv_block_tokens=params.cost.kv_block_tokens,
        router_cost=params.router_cost,
        share_queues=params.share_queues,
        share_placements=params.share_placements,
        server_blocks=params.server_blocks,
        cache_events_delay=None if params.kv_events_ms is None else params.kv_events_ms / 1000.0,
        cache_events_replay=params.kv_events_replay,
        labelling=params.seed if workload.fixed else 0,
        warm_start=params.warm_start,
    )
    chunk_tokens = requests[0].chunk_tokens if requests else 16
    router = make_policy(policy, ctx, params.router_replicas, chunk_tokens)
    records = [RequestRecord() for _ in requests]
    handles: dict[int, object] = {}
    # (time ms, sequence, kind, request (ROUTERS: the change), the request's epoch, GROW's
    # output token)
    heap: list[tuple[float, int, int, SimRequest | RouterChange | _Leave, int, int]] = []
    seq = 0
    for request in requests:
        heap.append((request.arrival_s * 1000.0, seq, ARRIVAL, request, 0, 0))
        seq += 1
    changeable = router.changeable
    # Router changes go before anything else at their time (negative sequence numbers): a
    # request arriving at a change's instant is routed by the routers after it, as the
    # stretch it is counted in says.
    changes = params.router_changes if changeable else ()
    for i, change in enumerate(changes):
        heap.append((change.at_s * 1000.0, i - len(changes), ROUTERS, change, 0, 0))
    leave_seq = -len(changes)
    going: set[int] = set()  # router instances an overlapping restart will retire
    heapq.heapify(heap)
    started: set[int] = set()
    phases = [(0.0, len(router.active))]

    def push(at: float, kind: int, request: SimRequest, replica: Replica, token: int = 0) -> None:
        nonlocal seq
        heapq.heappush(heap, (at, seq, kind, request, replica.epoch(request), token))
        seq += 1

    def try_start(replica: Replica, now: float) -> None:
        while replica.can_start():
            batch, duration = replica.start_batch()
            for request, hit in batch:
                if request.rid not in started:  # not a preempted request's recomputation
                    started.add(request.rid)
                    record = records[request.rid]
                    record.hit_tokens = hit
                    record.queue_ms = now - request.arrival_s * 1000.0
                    record.prefill_ms = duration
                push(now + duration, PREFILL_DONE, request, replica)

    def decode(replica: Replica, request: SimRequest, now: float) -> None:
        """kv_pool="preempt": the request's next output block, or its end."""
        state = replica.progress[request.rid]
        token = replica.next_block(request)
        if token:
            push(now + (token - state.generated) * state.step_ms, GROW, request, replica, token)
        else:
            gap = (request.output_tokens - state.generated) * state.step_ms
            push(now + max(0.0, gap), FINISH, request, replica)

    audit: dict[str, RuleAudit] = {}
    block_tokens = params.cost.kv_block_tokens
    arrived, now, last_ms = 0, 0.0, 0.0  # last_ms: the last request event (not a change)
    while heap:
        now, _, kind, request, epoch, token = heapq.heappop(heap)
        ctx.now = now / 1000.0
        if kind == ROUTERS:
            if isinstance(request, _Leave):
                router.leave(request.instance)
            else:
                assert isinstance(request, RouterChange)
                if request.restart and request.overlap_s > 0:
                    # The oldest not already on its way out (overlaps may overlap).
                    oldest = next(k for k in router.active if k not in going)
                    going.add(oldest)
                    leaving = _Leave(request.at_s + request.overlap_s, oldest)
                    router.join()
                    leave_seq -= 1
                    heapq.heappush(heap, (leaving.at_s * 1000.0, leave_seq, ROUTERS, leaving, 0, 0))
                elif request.restart:
                    router.restart()
                elif request.replicas is not None:
                    router.resize(request.replicas)
            phases.append((request.at_s, len(router.active)))
            continue
        last_ms = now
        if kind != ARRIVAL:
            replica = replicas[records[request.rid].replica]
            if replica.preempts and epoch != replica.epoch(request):
                continue  # the request was preempted since: it is queued again
        if kind == ARRIVAL:
            if params.audit:
                full, last = cache_units(request, block_tokens)
                held = [r.cache.match(request.ids, full, last) for r in replicas]
            index, handle = router.route(request, now / 1000.0)
            if params.audit:
                rule = getattr(handle[1], "rule", None) or policy
                entry = audit.setdefault(rule, RuleAudit())
                entry.decisions += 1
                if held[index] < max(held):
                    entry.off_best_holder += 1
                    entry.tokens_lost += max(held) - held[index]
            handles[request.rid] = handle
            records[request.rid].replica = index
            replicas[index].enqueue(request)
            try_start(replicas[index], now)
            arrived += 1
            if progress is not None and arrived % 256 == 0:
                progress(256)
        elif kind == PREFILL_DONE:
            # No signal to ours: a streamed response's headers came at admission and a
            # non-streamed one's come at the end (server.py, Router.prefill_done). A peer
            # that counts prefill work until the first token streams by (Dynamo) hears it.
            if not records[request.rid].ttft_ms:  # a recomputation's end is not a first token
                records[request.rid].ttft_ms = now - request.arrival_s * 1000.0
                router.prefill_done(handles[request.rid])  # (a peer that streams: Dynamo)
            if replica.preempts:
                replica.end_prefill(request, now)
                decode(replica, request, now)
            else:
                push(now + replica.end_prefill(request), FINISH, request, replica)
            try_start(replica, now)
        elif kind == GROW:
            if replica.grow(request, token, now):
                decode(replica, request, now)
            try_start(replica, now)
        else:
            replica.finish(request)
            router.finish(handles.pop(request.rid))
            try_start(replica, now)
    if progress is not None and arrived % 256:
        progress(arrived % 256)
    return RunResult(
        policy,
        params,
        records,
        replicas,
        requests,
        router.rules(),
        last_ms / 1000.0,
        audit,
        phases if changeable and params.router_changes else [],
    )
