"""Endpoint probes and metrics scraping against real HTTP servers (the stand-in replica)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from extproc import poller
from extproc.admin import start_admin
from extproc.config import HealthCheckConfig
from extproc.endpoints import HealthChecker
from extproc.fake_replica import ReplicaSettings, start_replica
from extproc.signals import EndpointSignals, MetricsScraper, parse_metrics
from extproc.stack import free_port

VLLM_TEXT = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 5.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 600.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="2048"} 1.0
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 12.0
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 12.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 0.75
# TYPE vllm:request_prefill_kv_computed_tokens histogram
vllm:request_prefill_kv_computed_tokens_bucket{engine="0",le="+Inf",model_name="m"} 12.0
vllm:request_prefill_kv_computed_tokens_count{engine="0",model_name="m"} 12.0
vllm:request_prefill_kv_computed_tokens_sum{engine="0",model_name="m"} 4800.0
"""
SGLANG_TEXT = """# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 2.0
sglang:num_queue_reqs{model_name="m"} 7.0
sglang:token_usage{model_name="m"} 0.5
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="m"} 8128.0
"""


def test_parse_vllm_and_sglang_names():
    v = parse_metrics(VLLM_TEXT)
    assert (v.up, v.running, v.waiting, v.kv_usage) == (True, 3.0, 5.0, 0.25)
    assert (v.hits, v.queries, v.block_size, v.num_blocks) == (600.0, 1000.0, 32, 2048)
    assert (v.prefills, v.prefill_seconds, v.prefill_tokens) == (12.0, 0.75, 4800.0)
    s = parse_metrics(SGLANG_TEXT)
    assert (s.running, s.waiting, s.kv_usage, s.hits) == (2.0, 7.0, 0.5, None)
    # SGLang exports no start time (a multiprocess registry): its prompt-token counter,
    # starting over with the server, tells restarts.
    assert s.prompt_tokens == 8128.0 and s.started is None and s.tells_restarts
    restarted = parse_metrics(SGLANG_TEXT.replace("8128.0", "64.0"))
    assert [u.restarted for u in _readings(s, restarted)] == [False, True]


def test_a_server_with_several_engines_reads_as_one_endpoint():
    """vLLM with data parallel behind one port exports one series per engine: their requests,
    counters and KV blocks add up, their KV usage is the mean (two engines at 0.6 are not a
    cache 1.2 full, which read as saturated). A server exporting a field under two names is
    read by the first listed."""
    second = VLLM_TEXT.replace('engine="0"', 'engine="1"').replace(" 0.25\n", " 0.75\n")
    v = parse_metrics(VLLM_TEXT + second)
    assert (v.running, v.waiting, v.kv_usage) == (6.0, 10.0, 0.5)
    assert (v.hits, v.queries, v.prefills, v.prefill_tokens) == (1200.0, 2000.0, 24.0, 9600.0)
    assert (v.block_size, v.num_blocks) == (32, 4096)
    both = VLLM_TEXT + 'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.9\n'
    assert parse_metrics(both).kv_usage == 0.25


def test_window_hit_ratio_and_down_transitions_keep_counters():
    updates: list[tuple[str, EndpointSignals]] = []
    scraper = MetricsScraper(lambda: ["a"], lambda a, s: updates.append((a, s)))
    scraper.record("a", EndpointSignals(up=True, hits=100, queries=200))
    assert updates[-1][1].window_hit_ratio is None  # one sample: no window yet
    scraper.record("a", EndpointSignals(up=True, hits=190, queries=300))
    assert updates[-1][1].window_hit_ratio == pytest.approx(0.9)
    scraper.record("a", EndpointSignals(up=False))  # dead scrape: counters kept, ratio kept
    assert updates[-1][1].hits == 190 and updates[-1][1].window_hit_ratio == pytest.approx(0.9)
    scraper.record("a", EndpointSignals(up=True, hits=200, queries=400))
    assert updates[-1][1].window_hit_ratio == pytest.approx(0.1)
    scraper.record("a", EndpointSignals(up=True, hits=300, queries=500, started=1000.0))
    scraper.record("a", EndpointSignals(up=True, hits=900, queries=1000, started=2000.0))
    assert updates[-1][1].window_hit_ratio == pytest.approx(1.0)  # restarted: the last kept
    assert updates[-1][1].restarted
    # An earlier start time is another process too (another server at the address).
    scraper.record("a", EndpointSignals(up=True, hits=950, queries=1100, started=1500.0))
    assert updates[-1][1].restarted
    scraper.record("a", EndpointSignals(up=True, hits=990, queries=1200, started=1500.0))
    assert not updates[-1][1].restarted


def _readings(*readings: EndpointSignals) -> list[EndpointSignals]:
    """What a scraper reports for these readings of one endpoint, each a second apart."""
    updates: list[EndpointSignals] = []
    scraper = MetricsScraper(lambda: ["a"], lambda a, s: updates.append(s))
    for second, reading in enumerate(readings):
        scraper.clock = lambda second=second: 5000.0 + second
        scraper.record("a", reading)
    return updates


def test_a_start_time_read_a_second_off_is_the_same_process():
    """Go's process collector derives the start from the boot time at every scrape, which
    reads a second apart now and then (client_golang #289): not a restart, which a model
    server, loading its model for longer, never shows that close to the last start."""
    updates = _readings(
        EndpointSignals(up=True, started=1000.0, queries=10),
        EndpointSignals(up=True, started=1001.0, queries=20),
        EndpointSignals(up=True, started=1000.0, queries=30),
        EndpointSignals(up=True, started=1004.0, queries=40),
    )
    assert [u.restarted for u in updates] == [False, False, False, True]
    assert updates[-1].started_after == 1004.0


def test_without_start_times_counters_that_go_down_tell_a_restart():
    """vLLM with several API server processes exports no start time; its counters (summed
    over its processes) start over when it restarts, even across failed scrapes. The new
    server started after the old one was last read (``started_after``)."""
    updates = _readings(
        EndpointSignals(up=True, queries=0.0, prefills=0.0),
        EndpointSignals(up=True, queries=9000.0, hits=4000.0, prefills=12.0),
        EndpointSignals(up=False),  # at 5002: dead meanwhile
        EndpointSignals(up=True, queries=64.0, hits=0.0, prefills=0.0),
        EndpointSignals(up=True, queries=64.0, hits=0.0, prefills=0.0),
        EndpointSignals(up=True, queries=900.0, hits=836.0, prefills=1.0),
    )
    assert [u.restarted for u in updates] == [False, False, False, True, False, False]
    assert updates[3].started_after == 5001.0
    assert [u.tells_restarts for u in updates] == [False, True, True, True, True, True]
    assert updates[-1].window_hit_ratio == pytest.approx(1.0)  # (836 queries, all hits)


def test_a_start_time_that_vanishes_is_another_process():
    """The endpoint's metrics had a start time; the new server's have none (vLLM brought
    back with several API servers): nothing says its cache is the old one's, whatever its
    counters read."""
    updates = _readings(
        EndpointSignals(up=True, started=1000.0, queries=10.0),
        EndpointSignals(up=False),
        EndpointSignals(up=True, queries=50.0),
        EndpointSignals(up=True, queries=10.0),  # (no start time before: counters tell)
    )
    assert [u.restarted for u in updates] == [False, False, True, True]
    assert updates[1].tells_restarts  # (the last reading's start time is kept while down)


def test_prefill_window_is_each_scrapes_increase_reported_once():
    updates: list[EndpointSignals] = []
    scraper = MetricsScraper(lambda: ["a"], lambda a, s: updates.append(s))

    def scrape(up=True, **counters):
        scraper.record("a", EndpointSignals(up=up, **counters))
        return updates[-1].window_prefill

    assert scrape(prefills=10, prefill_seconds=1.0, prefill_tokens=5000) is None  # first
    assert scrape(prefills=14, prefill_seconds=1.5, prefill_tokens=7000) == (2000, 4, 0.5)
    assert scrape(prefills=14, prefill_seconds=1.5, prefill_tokens=7000) is None  # none new
    assert scrape(up=False) is None  # a dead scrape keeps the counters...
    assert scrape(prefills=15, prefill_seconds=1.75, prefill_tokens=7100) == (100, 1, 0.25)
    assert scrape(prefills=2, prefill_seconds=0.1, prefill_tokens=50) is None  # restarted
    assert scrape() is None  # a server without these metrics
    # A restart between two scrapes whose counters already exceed the last ones read: told
    # by the process's start time, it gives no window (nor a hit ratio) either.
    assert scrape(prefills=20, prefill_seconds=2.0, prefill_tokens=9000, started=100.0) is None
    assert scrape(prefills=25, prefill_seconds=2.5, prefill_tokens=9500, started=100.0)
    assert scrape(prefills=40, prefill_seconds=9.0, prefill_tokens=20000, started=200.0) is None
    assert scrape(up=False) is None
    assert scrape(prefills=41, prefill_seconds=9.5, prefill_tokens=20100, started=200.0)


async def _metrics_server(handler) -> tuple[web.AppRunner, str]:
    """A /metrics page served on 127.0.0.1 by ``handler``: (its runner, its address)."""
    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner, port = await start_admin(app, "127.0.0.1:0")
    return runner, f"127.0.0.1:{port}"


async def test_scraper_reads_a_live_replica_and_marks_a_dead_one_down():
    runner, port = await start_replica(ReplicaSettings(name="r", port=0))
    try:
        live, dead = f"127.0.0.1:{port}", f"127.0.0.1:{free_port()}"
        got: dict[str, EndpointSignals] = {}
        scraper = MetricsScraper(lambda: [live, dead], got.__setitem__, timeout_seconds=1.0)
        async with aiohttp.ClientSession() as session:
            await scraper.poll_all(session)
        assert got[live].up and got[live].queries == 0 and got[live].block_size == 16
        assert not got[dead].up
    finally:
        await runner.cleanup()


async def test_health_checker_thresholds():
    runner, port = await start_replica(ReplicaSettings(name="r", port=0))
    live, dead = f"127.0.0.1:{port}", f"127.0.0.1:{free_port()}"
    health: dict[str, bool] = {}
    checker = HealthChecker(
        HealthCheckConfig(unhealthy_threshold=2, timeout_seconds=1.0),
        lambda: [live, dead],
        health.__setitem__,
    )
    try:
        async with aiohttp.ClientSession() as session:
            await checker.poll_all(session)
            assert health == {live: True}  # one failure is not enough
            await checker.poll_all(session)
            assert health == {live: True, dead: False}
    finally:
        await runner.cleanup()


def test_a_real_vllm_page_parses_alike_when_only_the_read_samples_are_parsed(monkeypatch):
    """A whole /metrics page of vLLM 0.32.0 (CPU, after one request): 614 lines, of which
    parse_metrics reads ten. Filtering the rest out first must not change what it reads."""
    from pathlib import Path

    from extproc import signals

    text = (Path(__file__).parent / "data" / "vllm-0.32.0-metrics.txt").read_text()
    filtered = parse_metrics(text)
    assert (filtered.running, filtered.waiting, filtered.kv_usage) == (0.0, 0.0, 0.0)
    assert (filtered.queries, filtered.hits, filtered.block_size) == (13.0, 0.0, 32)
    assert (filtered.num_blocks, filtered.prefills, filtered.prefill_tokens) == (8192, 1.0, 13.0)
    assert filtered.started == pytest.approx(1.79606920183e09)
    assert len(signals._samples_read(text).splitlines()) == 10
    monkeypatch.setattr(signals, "_samples_read", lambda page: page)
    assert parse_metrics(text) == filtered


def test_figures_no_server_means_are_not_read():
    """A NaN or negative figure (one NaN prefill window held the learned prefill throughput
    at NaN for good) is left out, and an absurd KV size is capped: the index is allocated
    by it (a 400-digit one raised OverflowError and ended the scraper)."""
    text = VLLM_TEXT.replace(
        'vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 0.75',
        'vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} NaN',
    ).replace(
        'vllm:num_requests_waiting{engine="0",model_name="m"} 5.0',
        'vllm:num_requests_waiting{engine="0",model_name="m"} -5.0',
    )
    signals = parse_metrics(text)
    assert signals.prefill_seconds is None and signals.waiting is None
    assert signals.running == 3.0 and signals.prefills == 12.0
    huge = VLLM_TEXT.replace('num_gpu_blocks="2048"', f'num_gpu_blocks="{10**400}"')
    signals = parse_metrics(huge)
    assert signals.block_size == 32 and signals.num_blocks * 32 <= 2**25


async def test_a_page_too_large_reads_as_down_and_a_fault_recording_it_ends_nothing(
    monkeypatch: pytest.MonkeyPatch,
):
    page = VLLM_TEXT + "# filler\n" * 2000

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=page)

    runner, address = await _metrics_server(metrics)
    got: list[EndpointSignals] = []

    def record(_: str, signals: EndpointSignals) -> None:
        got.append(signals)
        if len(got) == 1:
            raise OverflowError("a fault in what the answer feeds")

    scraper = MetricsScraper(lambda: [address], record, interval_seconds=0.01)
    try:
        scraper.start()
        for _ in range(200):
            if len(got) >= 2:
                break
            await asyncio.sleep(0.01)
        assert len(got) >= 2 and got[-1].up  # the poller went on after the fault
        monkeypatch.setattr(poller, "MAX_PAGE_BYTES", len(page) - 1)
        async with aiohttp.ClientSession() as session:
            assert not (await scraper.poll(session, address)).up
    finally:
        await scraper.stop()
        await runner.cleanup()


async def test_more_than_a_hundred_slow_endpoints_are_all_scraped_in_time():
    """aiohttp pools 100 connections by default and a request's timeout counts the wait
    for one: with 130 endpoints answering in 0.6 s under a 1 s timeout, 30 read as down."""

    async def metrics(_: web.Request) -> web.Response:
        await asyncio.sleep(0.6)
        return web.Response(text=VLLM_TEXT)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    addresses = []
    for _ in range(130):
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        addresses.append(f"127.0.0.1:{site._server.sockets[0].getsockname()[1]}")
    got: dict[str, EndpointSignals] = {}
    scraper = MetricsScraper(lambda: addresses, got.__setitem__, interval_seconds=60)
    try:
        scraper.start()
        for _ in range(300):
            if len(got) == len(addresses):
                break
            await asyncio.sleep(0.01)
        assert sum(s.up for s in got.values()) == len(addresses)
    finally:
        await scraper.stop()
        await runner.cleanup()


async def test_an_endpoint_slow_to_answer_holds_back_no_others_reading():
    """Each answer is recorded as it comes: the results used to wait for the round's slowest
    endpoint (up to the timeout), so one hung server made every other's load a second old."""

    async def slow(_: web.Request) -> web.Response:
        await asyncio.sleep(0.8)
        return web.Response(text=VLLM_TEXT)

    async def fast(_: web.Request) -> web.Response:
        return web.Response(text=VLLM_TEXT)

    servers = [await _metrics_server(handler) for handler in (slow, fast)]
    runners, addresses = [r for r, _ in servers], [a for _, a in servers]
    loop = asyncio.get_running_loop()
    when: dict[str, float] = {}
    scraper = MetricsScraper(lambda: addresses, lambda a, _: when.setdefault(a, loop.time()))
    try:
        async with aiohttp.ClientSession() as session:
            await scraper.poll_all(session)
        slow_address, fast_address = addresses
        assert when[fast_address] + 0.3 < when[slow_address]
    finally:
        for runner in runners:
            await runner.cleanup()


def test_a_reading_asked_before_the_one_taken_is_dropped():
    """A round's scrape and a read at once of the same endpoint overlap (a new endpoint, or
    one back from missed probes): the older one answered last must not be taken after the
    newer, whose counters it would read as gone down (a false restart: the index emptied)."""
    updates = _readings(
        EndpointSignals(up=True, started=1000.0, queries=500.0, asked_at=2.0),
        EndpointSignals(up=True, started=1000.0, queries=400.0, asked_at=1.0),  # older
        EndpointSignals(up=False, asked_at=1.5),  # older too
    )
    assert [u.restarted for u in updates] == [False]
    without_start = _readings(
        EndpointSignals(up=True, queries=500.0, asked_at=2.0),
        EndpointSignals(up=True, queries=400.0, asked_at=1.0),
        EndpointSignals(up=True, queries=600.0, asked_at=3.0),
    )
    assert [u.restarted for u in without_start] == [False, False]
