"""An index handed to a router that starts (warm_start.py): copied regions, the merge with
what the new router recorded itself, the snapshot format, and when a region is not taken."""

import io
import random
import struct
import time
import zipfile

import numpy as np
import orjson
import pytest

from extproc import warm_start
from extproc.config import EndpointConfig, RoutingConfig
from extproc.index import WAYS, PrefixIndex
from extproc.placements import hash_scheme
from extproc.prompt import parse_request
from extproc.router import Router
from extproc.scheduler import RULE_AFFINITY
from extproc.signals import EndpointSignals

ENDPOINTS = [EndpointConfig(address=f"10.0.0.{i}:8000") for i in range(1, 5)]
SCHEME = hash_scheme(RoutingConfig().block_size_bytes)


def chain(rng: random.Random, length: int) -> np.ndarray:
    return np.array([rng.getrandbits(64) for _ in range(length)], dtype=np.uint64)


def chat(text: str):
    body = {"model": "m", "messages": [{"role": "user", "content": text}]}
    return parse_request("chat", orjson.dumps(body))


def reading(started: float | None = 1000.0, queries: float | None = 50.0) -> EndpointSignals:
    return EndpointSignals(up=True, started=started, queries=queries, read_at=time.time())


def test_a_copied_region_matches_as_the_original_and_the_original_is_untouched():
    rng = random.Random(1)
    old, new = PrefixIndex(), PrefixIndex()
    for index in (old, new):
        index.set_endpoints({"a": 4000, "b": 4000})
    chains = [chain(rng, rng.randint(1, 300)) for _ in range(60)]
    for n, blocks in enumerate(chains):
        old.record("ab"[n % 2], blocks)
    for address in "ab":
        copy = old.export_region(address)
        assert copy is not None
        new.make_room_below(old.clock)
        assert new.adopt_region(address, copy) == old.entries_by_endpoint()[address]
    for blocks in chains:
        assert new.match(blocks, "ab") == old.match(blocks, "ab")
    assert new.entries_by_endpoint() == old.entries_by_endpoint()
    assert new.clock > old.clock
    # Another capacity, or an endpoint not there, takes nothing.
    other = PrefixIndex()
    other.set_endpoints({"a": 8000})
    assert other.adopt_region("a", old.export_region("a")) == 0
    assert other.adopt_region("b", old.export_region("b")) == 0
    assert other.stats().entries == 0


def test_what_the_new_index_recorded_itself_is_newer_than_what_it_was_handed():
    """A single bucket (an exact LRU): the handed blocks fill the free ways, the new index's
    own stay, and the next new block evicts a handed one, not its own."""
    rng = random.Random(2)
    old, new = PrefixIndex(), PrefixIndex()
    old.set_endpoints({"a": WAYS})
    new.set_endpoints({"a": WAYS})
    handed = chain(rng, 6)
    old.record("a", handed)
    own = chain(rng, 3)
    new.record("a", own)
    shared = handed[:1]
    new.record("a", shared)  # held by both: kept once, with its own (newer) stamp
    new.make_room_below(old.clock)
    assert new.adopt_region("a", old.export_region("a")) == WAYS - 4
    assert new.stats().entries == WAYS
    assert new.match(own, ["a"]) == {"a": 3}
    # Of the handed chain the head is held (bucket full: its tail went, as an LRU drops it).
    assert new.match(handed, ["a"]) == {"a": 5}
    new.record("a", chain(rng, 1))
    assert new.match(own, ["a"]) == {"a": 3}
    assert new.match(shared, ["a"]) == {"a": 1}


def test_a_snapshot_survives_its_format_and_a_garbled_one_is_refused():
    rng = random.Random(3)
    router = Router(RoutingConfig(), ENDPOINTS)
    for _ in range(20):
        router.finish(router.route(chat(f"question {rng.random()} " * 40)))
    readings = {ENDPOINTS[0].address: reading()}
    snapshot = warm_start.take(router, SCHEME, readings)
    data = warm_start.encode(snapshot)
    back = warm_start.decode(data)
    assert back.scheme == SCHEME and back.clock == snapshot.clock
    assert back.servers[ENDPOINTS[0].address]["started"] == 1000.0
    assert set(back.regions) == {e.address for e in ENDPOINTS}
    for address, region in snapshot.regions.items():
        assert np.array_equal(back.regions[address].fingerprints, region.fingerprints)
        assert np.array_equal(back.regions[address].stamps, region.stamps)
    for bad in (b"", b"not a zip", data[: len(data) // 2]):
        with pytest.raises(ValueError, match="not an index snapshot"):
            warm_start.decode(bad)
    # Arrays not the shape their capacity gives; a stamp at or past the clock; a limit.
    header = orjson.loads(np.load(io.BytesIO(data))["header"].tobytes())
    header["endpoints"][0]["capacity"] += WAYS * 10
    with pytest.raises(ValueError, match="fingerprints_0 is"):
        warm_start.decode(_with_header(data, header))
    header = orjson.loads(np.load(io.BytesIO(data))["header"].tobytes())
    header["clock"] = 1
    with pytest.raises(ValueError, match="not below the clock"):
        warm_start.decode(_with_header(data, header))
    with pytest.raises(ValueError, match="unpacks to more than"):
        warm_start.decode(data, limit=1000)


def _npy_header_only(shape: tuple[int, ...], dtype: str) -> bytes:
    """An .npy member that claims ``shape`` and holds nothing after its header."""
    text = f"{{'descr': '{dtype}', 'fortran_order': False, 'shape': {shape!r}, }}".encode()
    text += b" " * (63 - (len(text) + 10) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text


def test_a_crafted_snapshot_is_refused_before_it_can_hurt():
    """What a planted or damaged file could hold: an array header claiming a huge shape (numpy
    would allocate it before reading), a damaged deflate stream, an encrypted or unknown
    compression flag, a clock that would wrap the index's stamps, turnover figures that are
    NaN or negative. Each is a ValueError (the router starts empty), never another error."""
    router = Router(RoutingConfig(), ENDPOINTS[:1])
    _routed(router, ["hello " * 100])
    data = warm_start.encode(warm_start.take(router, SCHEME, {}))
    with np.load(io.BytesIO(data)) as archive:
        arrays = {name: archive[name] for name in archive.files}
    header = orjson.loads(arrays["header"].tobytes())

    def zipped(members: dict[str, bytes], method: int = zipfile.ZIP_STORED) -> bytes:
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w", method) as z:
            for name, body in members.items():
                z.writestr(f"{name}.npy", body)
        return out.getvalue()

    def npy(array: np.ndarray) -> bytes:
        out = io.BytesIO()
        np.save(out, array)
        return out.getvalue()

    members = {name: npy(array) for name, array in arrays.items()}
    huge = {**members, "fingerprints_0": _npy_header_only((2**45,), "<u4")}
    deflated = bytearray(zipped(members, zipfile.ZIP_DEFLATED))
    at = deflated.find(b"header.npy") + len(b"header.npy") + 5
    deflated[at] ^= 0xFF
    encrypted = bytearray(zipped(members))
    for signature, offset in ((b"PK\x03\x04", 6), (b"PK\x01\x02", 8)):
        encrypted[encrypted.find(signature) + offset] |= 1
    unknown = bytearray(zipped(members))
    for signature, offset in ((b"PK\x03\x04", 8), (b"PK\x01\x02", 10)):
        where = unknown.find(signature) + offset
        unknown[where : where + 2] = struct.pack("<H", 99)
    # A header member claiming a 300 MB element type; an endpoint whose capacity alone is
    # over the limit; a deflated member (even an honest one: np.savez stores).
    void = {**members, "header": _npy_header_only((1,), "|V300000000")}
    crafted = [zipped(huge), bytes(deflated), bytes(encrypted), bytes(unknown), zipped(void)]
    crafted.append(zipped(members, zipfile.ZIP_DEFLATED))
    for change in (
        {"clock": 2**64 - 1},
        {"endpoints": [{**header["endpoints"][0], "stamps_seen": "nan"}]},
        {"endpoints": [{**header["endpoints"][0], "new_seen": -1.0}]},
        {"endpoints": [{**header["endpoints"][0], "server": {"started": "soon"}}]},
        {"created": float("nan")},
        {"endpoints": [{**header["endpoints"][0], "capacity": 2**40}]},
    ):
        crafted.append(_with_header(data, {**header, **change}))
    for body in crafted:
        with pytest.raises(ValueError, match="not an index snapshot"):
            warm_start.decode(body)
    assert warm_start.decode(zipped(members)).clock == header["clock"]  # (the honest one)


def _with_header(data: bytes, header: dict) -> bytes:
    with np.load(io.BytesIO(data)) as archive:
        arrays = {name: archive[name] for name in archive.files}
    arrays["header"] = np.frombuffer(orjson.dumps(header), dtype=np.uint8)
    out = io.BytesIO()
    np.savez(out, **arrays)
    return out.getvalue()


def test_a_snapshot_file_is_written_whole_and_an_old_or_foreign_one_is_not_used(tmp_path):
    router = Router(RoutingConfig(), ENDPOINTS)
    router.finish(router.route(chat("hello " * 100)))
    path = tmp_path / "index.snapshot"
    assert warm_start.read_file(str(path), SCHEME, 600) is None  # none yet
    snapshot = warm_start.take(router, SCHEME, {})
    warm_start.write_file(str(path), snapshot)
    assert path.read_bytes() == warm_start.encode(snapshot)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # (no temporary file left)
    assert warm_start.read_file(str(path), SCHEME, 600) is not None
    assert warm_start.read_file(str(path), "xxh3-64/128", 600) is None  # another block size
    old = warm_start.take(router, SCHEME, {}, now=time.time() - 700)
    warm_start.write_file(str(path), old)
    assert warm_start.read_file(str(path), SCHEME, 600) is None  # too old
    path.write_bytes(b"garbage")
    assert warm_start.read_file(str(path), SCHEME, 600) is None
    # What a write killed midway leaves is removed at start; the snapshot itself stays.
    (tmp_path / ".index.snapshot.k2j3h4").write_bytes(b"half")
    (tmp_path / "other").write_bytes(b"kept")
    assert warm_start.remove_leftovers(str(path)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.snapshot", "other"]
    # Over the limit: not read at all.
    path.write_bytes(b"\0" * 64)
    monkey = warm_start.MAX_SNAPSHOT_BYTES
    try:
        warm_start.MAX_SNAPSHOT_BYTES = 32
        assert warm_start.read_file(str(path), SCHEME, 600) is None
    finally:
        warm_start.MAX_SNAPSHOT_BYTES = monkey


def _routed(router: Router, texts: list[str]) -> dict[str, str]:
    placed = {}
    for text in texts:
        decision = router.route(chat(text))
        router.finish(decision)
        placed[text] = decision.endpoint
    return placed


def test_a_router_handed_its_predecessors_index_sends_each_prefix_where_it_was_placed():
    texts = [f"conversation {n}: " + "tell me more about it. " * 60 for n in range(24)]
    old = Router(RoutingConfig(), ENDPOINTS)
    placed = _routed(old, texts)
    readings = {e.address: reading(started=1000.0 + n) for n, e in enumerate(ENDPOINTS)}
    snapshot = warm_start.decode(warm_start.encode(warm_start.take(old, SCHEME, readings)))

    new = Router(RoutingConfig(), ENDPOINTS)
    own = new.route(chat("a prompt the new router places itself " * 50))
    new.finish(own)
    handover = warm_start.Handover(snapshot, "test", new, reads_metrics=True)
    restarted = ENDPOINTS[3].address
    for n, endpoint in enumerate(ENDPOINTS):
        started = 5000.0 if endpoint.address == restarted else 1000.0 + n
        new.observe_signals(endpoint.address, True)
        handover.endpoint_read(endpoint.address, reading(started=started))
    assert handover.done
    assert handover.skipped == {restarted: "its server restarted since"}
    assert set(handover.applied) == {e.address for e in ENDPOINTS[:3]}
    for text, endpoint in placed.items():
        decision = new.route(chat(text + " and then?"))
        new.finish(decision)
        if endpoint != restarted:
            assert decision.rule == RULE_AFFINITY and decision.endpoint == endpoint, text
        else:
            assert decision.matched_blocks == 0
    again = new.route(chat("a prompt the new router places itself " * 50))
    assert again.endpoint == own.endpoint and again.rule == RULE_AFFINITY


def test_regions_wait_for_their_endpoints_size_and_readiness_and_expire():
    """A provisional index size (the KV size not read yet) or an endpoint out for failed
    probes takes nothing yet and waits; another KV size drops the region; a region whose
    endpoint is never read goes after APPLY_WITHIN_SECONDS; and one whose server the
    snapshot cannot tell from a restarted one (no reading of it) is not taken."""
    old = Router(RoutingConfig(), ENDPOINTS)
    _routed(old, [f"prompt {n} " * 80 for n in range(8)])
    readings = {e.address: reading() for e in ENDPOINTS[:3]}  # (the fourth never read)
    snapshot = warm_start.take(old, SCHEME, readings)
    now = [100.0]
    new = Router(RoutingConfig(), ENDPOINTS, learns_capacity=True)
    handover = warm_start.Handover(snapshot, "test", new, reads_metrics=True, clock=lambda: now[0])
    first, second, third, fourth = (e.address for e in ENDPOINTS)
    assert new.handover_refusal(first, snapshot.regions[first]) == "size not read yet"
    new.observe_signals(first, True)
    handover.endpoint_read(first, reading())
    assert first in handover.applied and handover.applied[first] > 0
    # Another KV size read: dropped.
    new.observe_signals(second, True, kv_capacity_tokens=123_456)
    handover.endpoint_read(second, reading())
    assert handover.skipped[second] == "another KV capacity"
    # Out for failed probes (its metrics telling restarts, its index kept): it waits.
    new.observe_signals(third, True, tells_restarts=True)
    new.set_health(third, False)
    handover.endpoint_read(third, reading())
    assert third not in handover.applied and third not in handover.skipped
    new.set_health(third, True)
    new.observe_signals(third, True, tells_restarts=True)
    handover.endpoint_read(third, reading())
    assert third in handover.applied
    # The fourth was never read by the old router: its server cannot be checked.
    new.observe_signals(fourth, True)
    handover.endpoint_read(fourth, reading())
    assert handover.skipped[fourth] == "its server cannot be told from a restarted one"
    assert handover.done
    # Never read here: dropped in time.
    late = warm_start.Handover(
        warm_start.take(old, SCHEME, readings), "t", new, reads_metrics=True, clock=lambda: now[0]
    )
    now[0] += warm_start.APPLY_WITHIN_SECONDS
    late.expire()
    assert late.done and set(late.skipped.values()) == {"not taken in time"}


def test_without_metrics_regions_go_in_at_once_for_the_members():
    old = Router(RoutingConfig(), ENDPOINTS)
    placed = _routed(old, [f"prompt {n} " * 80 for n in range(8)])
    new = Router(RoutingConfig(), ENDPOINTS[:2], learns_capacity=False)
    handover = warm_start.Handover(warm_start.take(old, SCHEME, {}), "t", new, False)
    assert set(handover.applied) == {e.address for e in ENDPOINTS[:2]}
    new.set_endpoints(ENDPOINTS)
    handover.apply_members()
    assert handover.done and set(handover.applied) == {e.address for e in ENDPOINTS}
    for text, endpoint in placed.items():
        decision = new.route(chat(text))
        new.finish(decision)
        assert decision.endpoint == endpoint and decision.rule == RULE_AFFINITY


async def test_a_starting_reader_skips_peers_whose_index_is_garbage_missing_or_raises():
    """Five peers on one test server (a path prefix each): one is starting itself (503), one
    serves garbage, one has no index (an older router, a supervisor of --workers N: 404),
    one makes the taker raise, one serves a real snapshot. The reader asks each once, in order, until one is taken,
    and asks no more after that; nothing escapes the round."""
    import aiohttp
    from aiohttp import web

    from extproc.admin import start_admin
    from extproc.config import PeersConfig
    from extproc.peers import PeerReader

    old = Router(RoutingConfig(), ENDPOINTS)
    _routed(old, [f"prompt {n} " * 80 for n in range(4)])
    good = warm_start.encode(warm_start.take(old, SCHEME, {}))
    pages = {"starting": (503, b""), "garbage": (200, b"\x00garbage"), "missing": (404, b"")}
    pages["raises"] = (200, good)
    pages["good"] = (200, good)
    asked: list[str] = []

    async def handler(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        asked.append(name)
        status, body = pages[name]
        return web.Response(status=status, body=body)

    app = web.Application()
    app.router.add_get("/{name}/peer/index", handler)
    runner, port = await start_admin(app, "127.0.0.1:0")
    taken: list[str] = []

    async def on_index(address: str, data: bytes) -> bool:
        if address.endswith("/raises"):
            raise RuntimeError("a fault in the taker")
        snapshot = warm_start.usable_answer(data, address, SCHEME)
        if snapshot is None:
            return False
        taken.append(address)
        return True

    reader = PeerReader(
        PeersConfig(addresses=("127.0.0.1:1",)),
        lambda router, work: None,
        wants_index=lambda: not taken,
        on_index=on_index,
    )
    reader._addresses_now = [f"127.0.0.1:{port}/{name}" for name in pages]
    reader._answering = dict.fromkeys(reader._addresses_now, True)
    try:
        async with aiohttp.ClientSession() as session:
            await reader._read_an_index(session)
            await reader._read_an_index(session)  # (taken: no more asked)
    finally:
        await runner.cleanup()
    assert asked == ["starting", "garbage", "missing", "raises", "good"]
    assert taken == [f"127.0.0.1:{port}/good"]
    # A peer starting itself (503) is asked again in a later round; the others are not.
    assert reader._index_asked == set(reader._addresses_now) - {f"127.0.0.1:{port}/starting"}


async def test_a_snapshot_that_cannot_be_written_is_counted_and_the_router_routes_on(tmp_path):
    """The file cannot be replaced (a directory took its name: root writes anywhere, so a
    read-only directory would not stop it): the write fails, is counted and logged, the
    next one succeeds, and the stop writes the index the router has then."""
    from extproc import serve
    from extproc.config import Config
    from extproc.serve import RouterService

    path = tmp_path / "index.snapshot"
    config = Config.model_validate(
        {
            "server": {"listen": "127.0.0.1:0", "admin_listen": ""},
            "health": {"enabled": False},
            "signals": {"enabled": False},
            "models": {"enabled": False},
            "endpoints": [e.address for e in ENDPOINTS],
            "warm_start": {"path": str(path), "interval_seconds": 0},
        }
    )
    service = RouterService(config)
    real_take = serve.take
    failed = service.metrics.index_snapshots.labels("failed")
    written = service.metrics.index_snapshots.labels("written")
    before_failed, before_written = failed._value.get(), written._value.get()
    await service.start()
    try:
        path.mkdir()
        assert await service.write_snapshot() is False
        assert failed._value.get() == before_failed + 1
        path.rmdir()

        def no_memory(*args, **kwargs):
            raise MemoryError

        serve.take = no_memory  # (taking the copy fails too: counted, the writes go on)
        try:
            assert await service.write_snapshot() is False
        finally:
            serve.take = real_take
        assert failed._value.get() == before_failed + 2
        path.mkdir()
        path.rmdir()
        _routed(service.router, ["a conversation of its own " * 40])
        assert await service.write_snapshot() is True
    finally:
        await service.stop(grace=0)
    assert written._value.get() == before_written + 2  # (and once at the stop)
    snapshot = warm_start.read_file(str(path), SCHEME, 600)
    assert snapshot is not None and snapshot.router == service.router.instance
    assert sum(int((r.fingerprints != 0).sum()) for r in snapshot.regions.values()) > 0
