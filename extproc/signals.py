"""Scrape each endpoint's Prometheus /metrics for what the model server itself reports.

vLLM names (``vllm:*``) and SGLang equivalents (``sglang:*``): running and waiting requests,
KV-cache usage, and the prefix-cache counters, from which the **realised** hit ratio over the
last scrape window is published next to the router's predicted one; a stale index or a
silent degradation shows as a gap between the two. A dead or slow endpoint only marks its
signals down (metric + one log line per transition); routing never waits for a scrape.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from .poller import EndpointPoller, fetch_parsed

log = logging.getLogger(__name__)

# sample name -> field. A server that exports two names for one field (a new name and the
# one it replaced) is read by the first listed. A server with several engines (vLLM's data
# parallel behind one port: one series per ``engine`` label) is read as one endpoint: its
# engines' requests and counters add up, their KV usage is the mean (as vLLM's own log line
# has it; the sum of two half-full engines read as a full cache) and their KV blocks add up.
_GAUGES = {
    "vllm:num_requests_running": "running",
    "sglang:num_running_reqs": "running",
    "vllm:num_requests_waiting": "waiting",
    "sglang:num_queue_reqs": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",
    "sglang:token_usage": "kv_usage",
}
_MEAN_FIELDS = frozenset({"kv_usage"})
# The server process's start (Prometheus' process collector): a new value is a restart, after
# which the counters start over, even where they already exceed the last ones read.
_STARTED = "process_start_time_seconds"
# Start times this close are one process: a collector that derives the start from the boot
# time on every scrape (Go's client_golang, #289) reads it a second apart now and then, while
# a restarted model server loads its model for far longer before it answers a scrape.
START_TIME_TOLERANCE_SECONDS = 2.0
_COUNTERS = {
    "vllm:prefix_cache_hits_total": "hits",
    "vllm:prefix_cache_queries_total": "queries",
    # Per finished request: time from scheduled to first token, and KV tokens computed (not
    # cached) in that prefill; the router learns the prefill throughput from the two.
    "vllm:request_prefill_time_seconds_sum": "prefill_seconds",
    "vllm:request_prefill_time_seconds_count": "prefills",
    "vllm:request_prefill_kv_computed_tokens_sum": "prefill_tokens",
    # Read only to tell a restart where no start time is exported (SGLang's processes
    # share a multiprocess registry): it starts over with the server.
    "sglang:prompt_tokens_total": "prompt_tokens",
}


@dataclass
class EndpointSignals:
    up: bool = False
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    hits: float | None = None
    queries: float | None = None
    block_size: int | None = None
    num_blocks: int | None = None
    prefill_seconds: float | None = None
    prefills: float | None = None
    prefill_tokens: float | None = None
    prompt_tokens: float | None = None  # (SGLang's; only tells restarts)
    # Hits / queries between the last two scrapes that saw new queries.
    window_hit_ratio: float | None = None
    # (computed tokens, prefills, prefill seconds) of the requests finished since the previous
    # scrape; None when there were none (each window is reported once).
    window_prefill: tuple[float, float, float] | None = None
    started: float | None = None  # the server process's start, seconds since the epoch
    restarted: bool = False  # its server restarted since the last reading: its cache is empty
    # When the counters above were read (Unix time; a failed scrape keeps the last ones).
    read_at: float | None = None
    # Restarted: the new server started no earlier than this (its start time, or else when
    # the old one was last read), for telling a restart the KV-cache events told already.
    started_after: float | None = None
    asked_at: float | None = None  # when this reading was asked for (scraper.monotonic)

    @property
    def tells_restarts(self) -> bool:
        """A restart would show in the next reading: another start time, or counters that
        start over below these (vLLM with several API server processes exports no start
        time). An endpoint whose metrics tell restarts keeps its index while it misses
        probes (``Router.set_health``)."""
        return self.started is not None or any(
            (value or 0) > 0 for value in (self.queries, self.prefills, self.prompt_tokens)
        )


_CONFIG_INFO = "vllm:cache_config_info"
# A KV cache is read as at most this many tokens: the index is sized by it, 12 bytes a block
# allocated up front (25 MB an endpoint at the default 16 tokens a block; the largest real
# caches hold ~10 million tokens). A 400-digit size had ended the scraper.
MAX_KV_TOKENS = 2**25
_READ = frozenset((*_GAUGES, *_COUNTERS, _CONFIG_INFO, _STARTED))


def _samples_read(text: str) -> str:
    """Only the sample lines parse_metrics reads. A vLLM page is ~600 lines (50 KB, mostly
    histogram buckets), and parsing all of it took 12-19 ms per scrape on the router's
    event loop, a stall every decision waiting behind it shared; filtering it and parsing
    the ten lines it reads takes about 1 ms (docs/benchmarks.md, item 15)."""
    return "\n".join(
        line for line in text.splitlines() if line.partition("{")[0].partition(" ")[0] in _READ
    )


def parse_metrics(text: str) -> EndpointSignals:
    signals = EndpointSignals(up=True)
    series: dict[str, list[float]] = {}  # sample name -> its series' values
    blocks: dict[str, int] = {}  # engine -> its KV blocks
    for family in text_string_to_metric_families(_samples_read(text)):
        for sample in family.samples:
            name, value = sample.name, sample.value
            if not (math.isfinite(value) and value >= 0):
                continue  # (a NaN window once held the learned prefill rate at NaN for good)
            if name in _GAUGES or name in _COUNTERS:
                series.setdefault(name, []).append(value)
            elif name == _STARTED:
                signals.started = value
            elif name == _CONFIG_INFO:
                with contextlib.suppress(KeyError, ValueError):
                    block_size = int(sample.labels["block_size"])
                    num_blocks = int(sample.labels["num_gpu_blocks"])
                    if 0 < block_size <= MAX_KV_TOKENS and num_blocks > 0:
                        signals.block_size = block_size
                        blocks[sample.labels.get("engine", "")] = num_blocks
    if blocks and signals.block_size:
        signals.num_blocks = min(sum(blocks.values()), MAX_KV_TOKENS // signals.block_size)
    for name, field in (*_GAUGES.items(), *_COUNTERS.items()):
        values = series.get(name)
        if values and getattr(signals, field) is None:
            total = sum(values)
            setattr(signals, field, total / len(values) if field in _MEAN_FIELDS else total)
    return signals


class MetricsScraper(EndpointPoller[EndpointSignals]):
    task_name = "endpoint-metrics"
    # A new endpoint, or one back from missed probes (``unpolled``), is read at once: the
    # latter is picked again only then (Router.set_health).
    new_address_seconds = 0.1

    def __init__(
        self,
        addresses: Callable[[], list[str]],
        on_update: Callable[[str, EndpointSignals], None],
        path: str = "/metrics",
        interval_seconds: float = 2.0,
        timeout_seconds: float = 1.0,
    ) -> None:
        super().__init__(addresses, interval_seconds, timeout_seconds)
        self._on_update = on_update
        self.path = path
        self.latest: dict[str, EndpointSignals] = {}
        self.clock: Callable[[], float] = time.time  # (wall clock: start times are Unix time)
        self.monotonic: Callable[[], float] = time.monotonic  # (when readings were asked)

    async def poll(self, session: aiohttp.ClientSession, address: str) -> EndpointSignals:
        asked = self.monotonic()
        signals = await fetch_parsed(session, f"http://{address}{self.path}", parse_metrics)
        signals = EndpointSignals(up=False) if signals is None else signals
        signals.asked_at = asked
        return signals

    def forget(self, gone: set[str]) -> None:
        for address in gone:
            self.latest.pop(address, None)

    def record(self, address: str, signals: EndpointSignals) -> None:
        previous = self.latest.get(address)
        if (
            previous is not None
            and signals.asked_at is not None
            and previous.asked_at is not None
            and signals.asked_at < previous.asked_at
        ):
            # Asked before the reading already taken (a round's and a read at once of one
            # endpoint overlap): taken after it, its counters would read as gone down (a
            # restart) and its queues as shrunk and grown again (arrivals counted twice).
            return
        if previous is not None and previous.up != signals.up:
            log.warning(
                "metrics of %s %s; %s",
                address,
                "are back" if signals.up else "unavailable",
                "using its signals again" if signals.up else "routing on in-flight counts only",
            )
        if previous is not None:
            signals.window_hit_ratio = previous.window_hit_ratio
            if not signals.up:  # keep the last counters so the next window is measured
                signals.hits, signals.queries = previous.hits, previous.queries
                signals.prefill_seconds = previous.prefill_seconds
                signals.prefills = previous.prefills
                signals.prefill_tokens = previous.prefill_tokens
                signals.prompt_tokens = previous.prompt_tokens
                signals.started = previous.started
                signals.read_at = previous.read_at
            restarted = signals.up and restarted_between(previous, signals)
            signals.restarted = restarted
            if restarted:
                signals.started_after = (
                    previous.read_at if signals.started is None else signals.started
                )
            if not restarted:
                signals.window_prefill = prefill_window(previous, signals)
            if (
                not restarted
                and signals.up
                and previous.queries is not None
                and signals.queries is not None
                and signals.hits is not None
                and previous.hits is not None
                and signals.queries > previous.queries
            ):
                signals.window_hit_ratio = (signals.hits - previous.hits) / (
                    signals.queries - previous.queries
                )
        if signals.up:
            signals.read_at = self.clock()
        self.latest[address] = signals
        self._on_update(address, signals)


def restarted_between(previous: EndpointSignals, current: EndpointSignals) -> bool:
    """Whether the server answering now is another process than the one read before.
    Another start time is (an earlier one too: another server at the address); a start
    time gone is (vLLM brought back with several API server processes exports none, and
    nothing says its cache is the old one's); without start times, counters that went down
    are (vLLM with several API servers: its multiprocess registry has no process collector,
    so scrapes answered by different processes are still one server)."""
    if previous.started is not None:
        if current.started is None:
            return True
        return abs(current.started - previous.started) > START_TIME_TOLERANCE_SECONDS
    return any(
        before is not None and after is not None and after < before
        for before, after in (
            (previous.queries, current.queries),
            (previous.hits, current.hits),
            (previous.prefills, current.prefills),
            (previous.prefill_tokens, current.prefill_tokens),
            (previous.prompt_tokens, current.prompt_tokens),
        )
    )


def prefill_window(
    previous: EndpointSignals, current: EndpointSignals
) -> tuple[float, float, float] | None:
    """The prefill counters' increase between two scrapes, when requests finished in
    between (a counter that went down, a restarted server, gives no window)."""
    before = (previous.prefill_tokens, previous.prefills, previous.prefill_seconds)
    after = (current.prefill_tokens, current.prefills, current.prefill_seconds)
    if not current.up or None in before or None in after:
        return None
    tokens, count, seconds = (b - a for a, b in zip(before, after, strict=True))  # type: ignore[operator]
    if count <= 0 or seconds <= 0 or tokens < 0:
        return None
    return tokens, count, seconds
