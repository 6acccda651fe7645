"""Placements shared between router replicas: the log, its wire format, the admin endpoint,
the reader, and what a router does with another's placements."""

from __future__ import annotations

import aiohttp
import numpy as np
import orjson
import pytest
from aiohttp import web

from extproc.admin import DecisionLog, build_admin_app, start_admin
from extproc.config import EndpointConfig, PeersConfig, RoutingConfig
from extproc.peers import PeerReader
from extproc.placements import Placement, PlacementAnswer, PlacementLog, decode, encode, hash_scheme
from extproc.prompt import parse_request
from extproc.router import Router

ENDPOINTS = [EndpointConfig(address=f"10.0.0.{i}:8000") for i in range(1, 5)]


def _placement(i: int, blocks: int = 3, router: str = "r") -> Placement:
    return Placement(router, f"10.0.0.{i % 4 + 1}:8000", np.arange(blocks, dtype=np.uint64) + i)


def test_the_log_is_bounded_by_placements_too():
    log = PlacementLog(max_placements=4)
    for i in range(10):
        log.add(_placement(i, blocks=1))
    assert [int(p.hashes[0]) for p in log.after(0)] == [6, 7, 8, 9]


def test_the_log_is_bounded_by_blocks_and_answers_what_follows_a_number():
    log = PlacementLog(max_blocks=10)
    for i in range(6):
        log.add(_placement(i))
    assert log.last == 6
    # 10 blocks keep the last three placements of three blocks (numbers 4, 5, 6).
    assert [int(p.hashes[0]) for p in log.after(0)] == [3, 4, 5]
    assert [int(p.hashes[0]) for p in log.after(4)] == [4, 5]
    assert log.after(6) == []
    # An answer is cut to the newest that fit, never to nothing.
    assert [int(p.hashes[0]) for p in log.after(0, max_blocks=4)] == [5]
    assert [int(p.hashes[0]) for p in log.after(0, max_blocks=1)] == [5]


def test_the_wire_format_round_trips_and_rejects_anything_else():
    big = Placement("r1", "[::1]:8000", np.array([0, 1, 2**64 - 1], dtype=np.uint64))
    answer = decode(encode(PlacementAnswer("abc", 7, "xxh3-64/512", [big, _placement(1)])))
    assert (answer.log, answer.last, answer.scheme) == ("abc", 7, "xxh3-64/512")
    placements = answer.placements
    assert placements[0].router == "r1" and placements[0].endpoint == "[::1]:8000"
    assert placements[0].hashes.dtype == np.uint64
    assert placements[0].hashes.tolist() == [0, 1, 2**64 - 1]
    for bad in [
        b"not json",
        b"[]",
        orjson.dumps({"log": "a", "last": 1, "scheme": ""}),
        orjson.dumps({"log": "a", "last": 1, "placements": []}),
        orjson.dumps({"log": 1, "last": 1, "scheme": "", "placements": []}),
        orjson.dumps({"log": "a", "last": "1", "scheme": "", "placements": []}),
        orjson.dumps({"log": "a", "last": 1, "scheme": 5, "placements": []}),
        orjson.dumps({"log": "a", "last": 1, "scheme": "", "placements": [["r", "e"]]}),
        orjson.dumps({"log": "a", "last": 1, "scheme": "", "placements": [["r", "e", "***"]]}),
        orjson.dumps({"log": "a", "last": 1, "scheme": "", "placements": [["r", "e", "AAAA"]]}),
        orjson.dumps({"log": "a", "last": 1, "scheme": "", "placements": [[1, "e", ""]]}),
        orjson.dumps({"log": "a", "last": 1, "scheme": "", "placements": [7]}),
    ]:
        with pytest.raises(ValueError, match="not a placements answer"):
            decode(bad)


def test_a_reader_of_another_log_gets_the_newest_placements():
    """A restarted replica starts a new log numbered from 1: a reader's old number means
    nothing there."""
    log = PlacementLog()
    for i in range(3):
        log.add(_placement(i))
    assert len(decode(log.answer(2, log.id)).placements) == 1
    assert len(decode(log.answer(2, "an-older-log")).placements) == 3


def _chat(text: str, *turns: str) -> bytes:
    messages = [{"role": "system", "content": "You are a helpful assistant. " * 20}]
    messages.append({"role": "user", "content": text})
    for turn in turns:
        messages += [{"role": "assistant", "content": "Sure. " * 30}]
        messages += [{"role": "user", "content": turn}]
    return orjson.dumps({"model": "m", "messages": messages})


def test_a_router_finds_a_conversation_where_a_peer_placed_it():
    """Router B never saw the first turns; with A's placements it sends the second turns
    where A sent the first ones, wherever its own rendezvous order would have put them."""
    a = Router(RoutingConfig(), ENDPOINTS[:1], clock=lambda: 0.0)  # places all on .1
    a.placements = PlacementLog()
    b = Router(RoutingConfig(), ENDPOINTS, clock=lambda: 0.0)
    blind = Router(RoutingConfig(), ENDPOINTS, clock=lambda: 0.0)
    firsts = [_chat(f"conversation {i} " * 40) for i in range(12)]
    seconds = [_chat(f"conversation {i} " * 40, "and then?") for i in range(12)]
    for body in firsts:
        a.route(parse_request("chat", body))
    assert b.placements is None  # not shared unless configured: B logs nothing
    assert b.observe_peer_placements(a.placements.after(0)) == 12

    def served(router: Router, body: bytes) -> str | None:
        decision = router.route(parse_request("chat", body))
        router.finish(decision)  # one at a time: no load to balance
        return decision.endpoint

    with_peer = {served(b, body) for body in seconds}
    without = {served(blind, body) for body in seconds}
    assert with_peer == {ENDPOINTS[0].address}
    assert len(without) > 1  # the rendezvous order spreads them (the check can fail)


def test_a_router_skips_its_own_and_unknown_endpoints_placements():
    router = Router(RoutingConfig(), ENDPOINTS, clock=lambda: 0.0)
    own = Placement(router.instance, ENDPOINTS[0].address, np.arange(4, dtype=np.uint64))
    unknown = Placement("other", "10.9.9.9:8000", np.arange(4, dtype=np.uint64))
    empty = Placement("other", ENDPOINTS[0].address, np.zeros(0, dtype=np.uint64))
    assert router.observe_peer_placements([own, unknown, empty]) == 0
    assert router.index.stats().entries == 0


def _hashes(seed: int, count: int) -> np.ndarray:
    """Well-spread 64-bit block hashes (as the router's own are)."""
    return np.random.default_rng(seed).integers(0, 2**63, count, dtype=np.uint64)


def test_a_batch_of_placements_is_recorded_once_per_block_newest_first():
    """Peers' placements are recorded per endpoint in one update: a block shared by many
    placements (a system prompt) takes one slot, a placement longer than routing.max_blocks
    is cut there, and a batch larger than the endpoint's capacity keeps its newest blocks."""
    config = RoutingConfig(max_blocks=16, default_capacity_tokens=2048)
    address = ENDPOINTS[0].address
    router = Router(config, ENDPOINTS[:1], clock=lambda: 0.0)
    capacity = router.index.capacity(address)
    shared = _hashes(0, 4)
    batch = [Placement("peer", address, np.concatenate([shared, _hashes(i, 4)])) for i in (1, 2, 3)]
    long = _hashes(4, 100)
    batch.append(Placement("peer", address, long))
    assert router.observe_peer_placements(batch) == 4
    assert router.index.stats().entries == 4 + 3 * 4 + 16 <= capacity
    assert router.index.match(long, [address]) == {address: 16}  # cut at max_blocks
    # Far more than the endpoint holds: the newest placement's blocks are the ones kept.
    flood = [Placement("peer", address, _hashes(100 + i, 16)) for i in range(4 * capacity // 16)]
    router.observe_peer_placements(flood)
    assert router.index.match(flood[-1].hashes, [address]) == {address: 16}
    assert router.index.stats().entries <= capacity


async def _serve(app: web.Application) -> tuple[web.AppRunner, int]:
    return await start_admin(app, "127.0.0.1:0")


async def test_the_reader_reads_only_new_placements_from_a_peers_admin_port(monkeypatch):
    monkeypatch.setattr("extproc.peers.BLOCKS_PER_SLICE", 64 * 3)  # 64 placements of 3
    log = PlacementLog()
    runner, port = await _serve(build_admin_app(DecisionLog(10), lambda: True, log))
    heard: list[list[Placement]] = []
    reader = PeerReader(
        PeersConfig(addresses=(f"127.0.0.1:{port}",)), lambda *_: None, heard.append
    )
    address = f"127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session:
            for round_placements in ([0, 1], [2], [], list(range(3, 3 + 70))):
                for i in round_placements:
                    log.add(_placement(i))
                await reader.poll_all(session)
            async with session.get(f"http://{address}/peer/placements?after=x") as response:
                assert response.status == 400
    finally:
        await runner.cleanup()
    # Nothing new, no call; 70 at once, in slices of 64 (the event loop free in between).
    assert [[int(p.hashes[0]) for p in batch] for batch in heard] == [
        [0, 1],
        [2],
        list(range(3, 67)),
        list(range(67, 73)),
    ]


async def test_a_large_placements_answer_is_read_whole():
    """A busy peer's answer runs to megabytes (2,000 placements of 64 blocks: ~1.5 MB). The
    reader took only what the connection had buffered (~64 KB), failed to decode it, and
    asked for the same answer again at every poll: placements stopped, silently."""
    log = PlacementLog()
    runner, port = await _serve(build_admin_app(DecisionLog(10), lambda: True, log))
    heard: list[list[Placement]] = []
    reader = PeerReader(
        PeersConfig(addresses=(f"127.0.0.1:{port}",)), lambda *_: None, heard.append
    )
    try:
        for i in range(2000):
            log.add(_placement(i, 64))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as session:
            await reader.poll_all(session)
    finally:
        await runner.cleanup()
    assert sum(len(batch) for batch in heard) == 2000


async def test_a_router_that_shares_nothing_answers_an_empty_log():
    runner, port = await _serve(build_admin_app(DecisionLog(10), lambda: True))
    try:
        url = f"http://127.0.0.1:{port}/peer/placements"
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            assert response.status == 200
            answer = decode(await response.read())
    finally:
        await runner.cleanup()
    assert answer.placements == [] and answer.last == 0


async def test_placements_hashed_another_way_are_skipped_with_a_warning(caplog):
    """A peer with another routing.block_size_bytes hashes the same prompts differently:
    its placements would only fill index slots. The reader skips them (and says so once),
    and takes them again once the peer hashes as this router does."""
    log = PlacementLog(hash_scheme(256))
    runner, port = await _serve(build_admin_app(DecisionLog(10), lambda: True, log))
    address = f"127.0.0.1:{port}"
    heard: list[list[Placement]] = []
    reader = PeerReader(
        PeersConfig(addresses=(address,)), lambda *_: None, heard.append, hash_scheme(512)
    )
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session:
            for i in range(2):
                log.add(_placement(i))
                await reader.poll_all(session)
            log.scheme = hash_scheme(512)  # the peer now hashes as this router does
            log.add(_placement(2))
            await reader.poll_all(session)
    finally:
        await runner.cleanup()
    assert [[int(p.hashes[0]) for p in batch] for batch in heard] == [[2]]
    warnings = [r for r in caplog.records if "hashes prompts as xxh3-64/256" in r.getMessage()]
    assert len(warnings) == 1


@pytest.mark.parametrize("answer", ["garbled", "oversized"])
async def test_a_peer_with_a_broken_placements_page_still_counts_its_work(
    answer, monkeypatch, caplog
):
    page = "\n".join(
        [
            "# TYPE prefix_router_own_queued_work gauge",
            'prefix_router_own_queued_work{router="r1",endpoint="10.0.0.1:8000"} 5.0',
        ]
    )

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(text=page)

    async def placements_page(_request: web.Request) -> web.Response:
        if answer == "garbled":
            return web.Response(text='{"log": 1}')
        return web.Response(body=encode(PlacementAnswer("log", 1, "", [_placement(0, 64)])))

    monkeypatch.setattr("extproc.peers.MAX_ANSWER_BYTES", 256)  # a 64-block answer is ~700

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/peer/placements", placements_page)
    runner, port = await _serve(app)
    work: list[str] = []
    placements: list[list[Placement]] = []
    reader = PeerReader(PeersConfig(), lambda router, _: work.append(router), placements.append)
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session:
            answer = await reader.poll(session, f"127.0.0.1:{port}")
    finally:
        await runner.cleanup()
    assert answer.placements is None
    with caplog.at_level("WARNING", logger="extproc.peers"):
        reader.record(f"127.0.0.1:{port}", answer)
        reader.record(f"127.0.0.1:{port}", answer)
    assert work == ["r1", "r1"] and placements == [] and reader._pending == []
    (warning,) = [r.getMessage() for r in caplog.records if "placements" in r.getMessage()]
    assert "could not be read" in warning


async def test_a_peer_no_longer_listed_is_forgotten():
    """A peer pod replaced (DNS gives another address): what was kept of the old one (its
    log position, its answering state) goes, rather than piling up with pod churn."""
    log = PlacementLog()
    runner, port = await _serve(build_admin_app(DecisionLog(10), lambda: True, log))
    address = f"127.0.0.1:{port}"
    reader = PeerReader(PeersConfig(addresses=(address,)), lambda *_: None, lambda _: None)
    try:
        log.add(_placement(0))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as session:
            await reader.poll_all(session)
            assert address in reader._seen and address in reader._answering
            reader.config = PeersConfig(addresses=())
            await reader.poll_all(session)
    finally:
        await runner.cleanup()
    assert reader._seen == {} and reader._answering == {}
