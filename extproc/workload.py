"""A multi-turn, shared-system-prompt chat workload sent through a real HTTP endpoint.

Conversations run concurrently; the turns of one conversation run in order, each turn
carrying the whole history (system prompt, earlier questions and the replica's actual
answers), exactly as a chat client does. The text is generated from a seed, so two runs
(prefix routing vs round robin) send byte-identical first turns.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

_VOCABULARY = (
    "cache prefix token replica router envoy latency throughput model prompt batch decode "
    "prefill kernel memory tensor layer request stream header cluster metric queue policy "
    "schedule index block hash window context answer question system assistant user data "
    "network service deploy config signal health score weight share budget limit"
)
_WORDS = _VOCABULARY.split()


@dataclass(frozen=True)
class ChatWorkload:
    conversations: int = 16
    turns: int = 4
    concurrency: int = 8
    system_prompt_words: int = 300  # ~600 tokens, shared by every conversation
    first_message_words: int = 1200  # ~2,300 tokens: the conversation's own document
    followup_words: int = 60
    max_tokens: int = 32
    model: str = "demo-model"
    seed: int = 7


@dataclass
class RequestRecord:
    conversation: int
    turn: int
    status: int
    ttft_ms: float
    latency_ms: float
    replica: str
    error: str = ""


@dataclass
class RunResult:
    records: list[RequestRecord] = field(default_factory=list)
    seconds: float = 0.0


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(count))


def conversation_openers(workload: ChatWorkload) -> tuple[str, list[str]]:
    rng = random.Random(workload.seed)
    system = "You are a careful assistant. " + _words(rng, workload.system_prompt_words)
    openers = [
        f"Conversation {i}. " + _words(rng, workload.first_message_words)
        for i in range(workload.conversations)
    ]
    return system, openers


async def _send_turn(
    session: aiohttp.ClientSession, url: str, body: bytes
) -> tuple[int, float, str, str]:
    """POST one streaming chat request; returns status, TTFT, answer text, replica name."""
    started = time.perf_counter()
    ttft = 0.0
    pieces: list[str] = []
    async with session.post(
        url, data=body, headers={"content-type": "application/json"}
    ) as response:
        replica = response.headers.get("x-replica-name", "")
        if response.status != 200:
            await response.read()
            return response.status, 0.0, "", replica
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            if not ttft:
                ttft = (time.perf_counter() - started) * 1000
            chunk = orjson.loads(payload)
            for choice in chunk.get("choices", []):
                pieces.append((choice.get("delta") or {}).get("content") or "")
    return 200, ttft, "".join(pieces), replica


async def run_chat_workload(
    base_url: str,
    workload: ChatWorkload,
    on_request: Callable[[RequestRecord], None] | None = None,
    timeout_seconds: float = 120.0,
) -> RunResult:
    """Send the whole workload; bounded by request count and a total time limit."""
    system, openers = conversation_openers(workload)
    rng = random.Random(workload.seed + 1)
    followups = [
        [_words(rng, workload.followup_words) for _ in range(workload.turns)]
        for _ in range(workload.conversations)
    ]
    url = base_url.rstrip("/") + "/v1/chat/completions"
    result = RunResult()
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(workload.conversations):
        queue.put_nowait(i)

    async def converse(session: aiohttp.ClientSession, index: int) -> None:
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": openers[index]},
        ]
        for turn in range(workload.turns):
            if turn:
                messages.append({"role": "user", "content": followups[index][turn]})
            body = orjson.dumps(
                {
                    "model": workload.model,
                    "messages": messages,
                    "stream": True,
                    "max_tokens": workload.max_tokens,
                }
            )
            started = time.perf_counter()
            try:
                status, ttft, answer, replica = await _send_turn(session, url, body)
                error = "" if status == 200 else f"HTTP {status}"
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                status, ttft, answer, replica, error = 0, 0.0, "", "", type(exc).__name__
            record = RequestRecord(
                index, turn, status, ttft, (time.perf_counter() - started) * 1000, replica, error
            )
            result.records.append(record)
            if on_request is not None:
                on_request(record)
            messages.append({"role": "assistant", "content": answer})

    async def worker(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            await converse(session, queue.get_nowait())

    timeout = aiohttp.ClientTimeout(total=60)
    started = time.perf_counter()
    connector = aiohttp.TCPConnector(limit=workload.concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        workers = [
            worker(session) for _ in range(min(workload.concurrency, workload.conversations))
        ]
        await asyncio.wait_for(asyncio.gather(*workers), timeout_seconds)
    result.seconds = time.perf_counter() - started
    return result


# -- replica-side truth ------------------------------------------------------------------
async def scrape_prefix_counters(replicas: list[str]) -> dict[str, tuple[float, float]]:
    """(hits, queries) in tokens per replica, from vLLM-named /metrics counters."""
    out: dict[str, tuple[float, float]] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for address in replicas:
            async with session.get(f"http://{address}/metrics") as response:
                text = await response.text()
            hits = queries = 0.0
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == "vllm:prefix_cache_hits_total":
                        hits += sample.value
                    elif sample.name == "vllm:prefix_cache_queries_total":
                        queries += sample.value
            out[address] = (hits, queries)
    return out


async def reset_prefix_caches(replicas: list[str]) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        for address in replicas:
            async with session.post(f"http://{address}/reset_prefix_cache") as response:
                response.raise_for_status()


def aligned_table(rows: list[tuple[str, ...]]) -> str:
    """Rows of strings as columns: the first left-aligned, the rest right-aligned, a rule
    under the header row."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[rank]


def summarise(
    result: RunResult,
    before: dict[str, tuple[float, float]],
    after: dict[str, tuple[float, float]],
) -> dict[str, object]:
    hits = sum(after[a][0] - before.get(a, (0, 0))[0] for a in after)
    queries = sum(after[a][1] - before.get(a, (0, 0))[1] for a in after)
    ok = [r for r in result.records if not r.error]
    ttfts = [r.ttft_ms for r in ok]
    shares = Counter(r.replica or "?" for r in ok)
    return {
        "requests": len(result.records),
        "errors": len(result.records) - len(ok),
        "hit_ratio": round(hits / queries, 4) if queries else 0.0,
        "ttft_p50_ms": round(percentile(ttfts, 50), 1),
        "ttft_p99_ms": round(percentile(ttfts, 99), 1),
        "replica_share": {name: round(count / len(ok), 3) for name, count in sorted(shares.items())}
        if ok
        else {},
        "seconds": round(result.seconds, 2),
    }
