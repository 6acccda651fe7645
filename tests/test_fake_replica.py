"""The stand-in replica behaves like vLLM where the router can observe it.

Replicas run in-process on 127.0.0.1 with ephemeral ports. Timing assertions compare the
simulated prefill accounting, plus wall-clock checks only with wide margins.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

import aiohttp
import orjson
import pytest

from extproc import cli
from extproc.fake_replica import ReplicaSettings, settings_from_args, start_replica

Start = Callable[..., Awaitable[tuple[str, dict[str, Any]]]]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


@pytest.fixture
async def start() -> AsyncIterator[Start]:
    """start(**settings) -> (base URL, live state); every replica is stopped afterwards."""
    runners = []

    async def _start(**overrides: Any) -> tuple[str, dict[str, Any]]:
        settings = replace(ReplicaSettings(name="r1", port=0), **overrides)
        runner, port = await start_replica(settings)
        runners.append(runner)
        return f"http://127.0.0.1:{port}", runner.app

    yield _start
    for runner in runners:
        await runner.cleanup()


async def post(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with session.post(url, data=orjson.dumps(body)) as response:
        return response.status, await response.json()


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "demo-model", "messages": [{"role": "user", "content": text}], **extra}


def template_tokens(text: str) -> int:
    """Prompt tokens of a one-message chat under the replica's template (4 bytes a token)."""
    return math.ceil(len(f"<|user|>\n{text}\n<|assistant|>\n".encode()) / 4)


async def read_sse(response: aiohttp.ClientResponse) -> list[Any]:
    """Events of an SSE body; the [DONE] sentinel is kept as the string."""
    raw = (await response.read()).decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = []
    for frame in raw.split("\n\n")[:-1]:
        assert frame.startswith("data: "), frame
        payload = frame[len("data: ") :]
        events.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return events


async def test_repeated_prompt_hits_cache_and_is_faster(start: Start, session) -> None:
    url, app = await start(prefill_ms_per_token=1.0, base_ttft_ms=1)
    state = app["state"]
    text = "the quick brown fox jumps over the lazy dog. " * 30
    tokens = template_tokens(text)  # 344
    runs = []  # (wall-clock TTFT, simulated prefill ms, cached tokens)
    for _ in range(2):
        prefill_before, hits_before = state.prefill_ms, state.hits
        began = time.perf_counter()
        async with session.post(url + CHAT, json=chat(text, stream=True)) as response:
            await response.content.readuntil(b"\n\n")  # the first chunk: time to first token
            ttft = time.perf_counter() - began
            await response.read()
        runs.append((ttft, state.prefill_ms - prefill_before, state.hits - hits_before))
    (cold_wall, cold_ms, cold_hit), (warm_wall, warm_ms, warm_hit) = runs
    assert (cold_hit, warm_hit) == (0, tokens // 16 * 16)  # full blocks only
    assert cold_ms == 1 + tokens * 1.0
    assert warm_ms == 1 + (tokens - warm_hit) * 1.0 < 1 + 16
    assert cold_wall - warm_wall > 0.2  # ~330 ms of simulated prefill saved


async def test_a_prefill_is_counted_in_metrics_when_its_request_finishes(start: Start, session):
    """As vLLM's request_prefill_time_seconds: observed at the request's end, not its first
    token (a router reading it sees running requests lag; Router._arrivals)."""
    url, app = await start(decode_ms_per_token=50.0)
    state = app["state"]
    async with session.post(url + CHAT, json=chat("hello " * 40, stream=True)) as response:
        await response.content.readuntil(b"\n\n")  # the first token is out
        assert (state.prefills, state.prefill_computed_tokens, state.running) == (0, 0, 1)
        await response.read()
    assert state.prefills == 1 and state.prefill_computed_tokens == template_tokens("hello " * 40)
    assert state.prefill_seconds > 0


async def test_usage_cached_tokens_and_identical_replies(start: Start, session) -> None:
    url, _ = await start()
    text = "hello world " * 40
    first = await post(session, url + CHAT, chat(text))
    second = await post(session, url + CHAT, chat(text))
    assert first[0] == second[0] == 200
    tokens = template_tokens(text)
    usage = second[1]["usage"]
    assert usage["prompt_tokens"] == tokens
    assert usage["completion_tokens"] == 16
    assert usage["total_tokens"] == tokens + 16
    assert first[1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert usage["prompt_tokens_details"]["cached_tokens"] == tokens // 16 * 16
    reply = first[1]["choices"][0]
    assert reply["message"]["role"] == "assistant"
    assert reply["finish_reason"] == "stop"
    assert reply["message"]["content"] == second[1]["choices"][0]["message"]["content"]
    assert len(reply["message"]["content"].split()) == 16
    assert first[1]["object"] == "chat.completion"


async def test_last_token_is_never_a_hit(start: Start, session) -> None:
    """Like vLLM, a block-aligned prompt that is fully cached still recomputes its last block."""
    url, _ = await start()
    prompt = "x" * (4 * 16 * 3)  # exactly 3 blocks
    await post(session, url + COMPLETIONS, {"prompt": prompt})
    _, body = await post(session, url + COMPLETIONS, {"prompt": prompt})
    assert body["usage"]["prompt_tokens"] == 48
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


async def test_max_tokens_and_cap(start: Start, session) -> None:
    url, _ = await start(decode_ms_per_token=0)
    _, body = await post(session, url + COMPLETIONS, {"prompt": "a" * 100, "max_tokens": 7})
    assert body["object"] == "text_completion"
    assert body["usage"]["prompt_tokens"] == 25
    assert body["usage"]["completion_tokens"] == 7
    assert len(body["choices"][0]["text"].split()) == 7
    assert body["choices"][0]["finish_reason"] == "length"
    _, body = await post(session, url + CHAT, chat("hi", max_completion_tokens=10_000))
    assert body["usage"]["completion_tokens"] == 256


async def test_lru_evicts_chains_from_the_tail(start: Start, session) -> None:
    url, app = await start(capacity_tokens=64)  # 4 blocks of 16 tokens (64 bytes)
    a, b = "A" * 200, "B" * 200  # 50 tokens: 3 full blocks each

    async def cached(prompt: str) -> int:
        _, body = await post(session, url + COMPLETIONS, {"prompt": prompt, "max_tokens": 1})
        return body["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert await cached(a) == 0
    assert await cached(a) == 48
    assert await cached(b) == 0  # evicts A's last two blocks, keeps A's head
    assert app["state"].cache.evictions == 2
    assert await cached(a) == 16
    assert len(app["state"].cache.blocks) == 4


async def test_concurrent_twin_reuses_the_first_prefill(start: Start, session) -> None:
    """Prefills are serialised, so an identical request queued behind one hits its blocks."""
    url, app = await start(prefill_ms_per_token=0.2)
    text = "shared system prompt. " * 40
    results = await asyncio.gather(*(post(session, url + CHAT, chat(text)) for _ in range(2)))
    hits = sorted(r[1]["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results)
    assert hits == [0, template_tokens(text) // 16 * 16]
    assert app["state"].requests == 2


async def test_streaming_sse_format(start: Start, session) -> None:
    url, _ = await start()
    body = chat("tell me a story", stream=True, stream_options={"include_usage": True})
    async with session.post(url + CHAT, json=body) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        assert response.headers["x-replica-name"] == "r1"
        events = await read_sse(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 16
    _, plain = await post(session, url + CHAT, chat("tell me a story"))
    assert text == plain["choices"][0]["message"]["content"]

    async with session.post(url + COMPLETIONS, json={"prompt": "p", "stream": True}) as response:
        events = await read_sse(response)
    assert events[-1] == "[DONE]"
    assert "usage" not in events[-2]  # only with stream_options.include_usage, as in vLLM
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert len(events) == 16 + 2


def parse_metrics(text: str) -> dict[str, float]:
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            samples[series] = float(value)
    return samples


async def test_metrics_names_labels_and_values(start: Start, session) -> None:
    url, app = await start(model="m1")
    for text in ("one " * 50, "one " * 50, "two " * 20):
        assert (await post(session, url + CHAT, {**chat(text), "model": "m1"}))[0] == 200
    async with session.get(url + "/metrics") as response:
        assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        text = await response.text()
    samples = parse_metrics(text)
    labels = '{engine="0",model_name="m1"}'
    state = app["state"]
    assert samples[f"vllm:num_requests_running{labels}"] == 0
    assert samples[f"vllm:num_requests_waiting{labels}"] == 0
    assert samples[f"vllm:kv_cache_usage_perc{labels}"] == 0
    assert samples[f"vllm:prefix_cache_queries_total{labels}"] == state.queries > 0
    assert samples[f"vllm:prefix_cache_hits_total{labels}"] == state.hits > 0
    assert samples[f"vllm:prompt_tokens_total{labels}"] == state.queries
    assert samples[f"vllm:generation_tokens_total{labels}"] == 48
    stop = '{engine="0",finished_reason="stop",model_name="m1"}'
    assert samples[f"vllm:request_success_total{stop}"] == state.requests == 3
    assert samples[f"vllm:time_to_first_token_seconds_count{labels}"] == 3
    inf = '{engine="0",le="+Inf",model_name="m1"}'
    assert samples[f"vllm:time_to_first_token_seconds_bucket{inf}"] == 3
    info = [s for s in samples if s.startswith("vllm:cache_config_info{")]
    assert len(info) == 1 and 'block_size="16"' in info[0] and 'num_gpu_blocks="4096"' in info[0]
    names = {re.sub(r"\{.*", "", s) for s in samples}
    assert not any(n.endswith("_created") for n in names)
    assert samples[f"vllm:request_prefill_time_seconds_count{labels}"] == 3
    assert samples[f"vllm:request_prefill_time_seconds_sum{labels}"] > 0
    computed = samples[f"vllm:request_prefill_kv_computed_tokens_sum{labels}"]
    assert computed == state.queries - state.hits
    histograms = (
        "vllm:time_to_first_token_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_prefill_kv_computed_tokens",
    )
    assert {n for n in names if not n.startswith(histograms)} == {
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_success_total",
        "vllm:cache_config_info",
        "process_start_time_seconds",
    }
    assert samples["process_start_time_seconds"] == state.started  # (vLLM's process collector)


async def test_waiting_and_kv_usage_under_load(start: Start, session) -> None:
    url, app = await start(max_num_seqs=2, decode_ms_per_token=20, output_tokens=10)
    state = app["state"]
    tasks = [
        asyncio.create_task(post(session, url + COMPLETIONS, {"prompt": f"{i}" * 400}))
        for i in range(5)
    ]
    deadline = time.monotonic() + 2
    while state.waiting < 3 and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    assert (state.running, state.waiting) == (2, 3)
    async with session.get(url + "/metrics") as response:
        samples = parse_metrics(await response.text())
    labels = '{engine="0",model_name="demo-model"}'
    assert samples[f"vllm:num_requests_waiting{labels}"] == 3
    assert samples[f"vllm:num_requests_running{labels}"] == 2
    assert 0 < samples[f"vllm:kv_cache_usage_perc{labels}"] < 0.01
    results = await asyncio.gather(*tasks)
    assert all(status == 200 for status, _ in results)
    assert (state.running, state.waiting, state.requests) == (0, 0, 5)
    assert not state.held_blocks and state.private_blocks == 0


async def test_bad_requests_get_vllm_errors(start: Start, session) -> None:
    url, app = await start()
    status, body = await post(session, url + CHAT, {**chat("hi"), "model": "other"})
    assert status == 404
    assert body["error"]["type"] == "NotFoundError" and body["error"]["code"] == 404
    async with session.post(url + CHAT, data=b"{not json") as response:
        assert response.status == 400
        assert response.headers["x-replica-name"] == "r1"
        assert (await response.json())["error"]["code"] == 400
    for path, bad in (
        (CHAT, {"model": "demo-model"}),
        (CHAT, {"messages": []}),
        (CHAT, {"messages": ["hi"]}),
        (CHAT, {"messages": [{"role": "user", "content": 5}]}),
        (CHAT, [1, 2]),
        (CHAT, chat("hi", max_tokens=0)),
        (CHAT, chat("hi", max_tokens="5")),
        (COMPLETIONS, {"model": "demo-model"}),
        (COMPLETIONS, {"prompt": ["a", "b"]}),
    ):
        status, body = await post(session, url + path, bad)
        assert status == 400, bad
        assert body["error"]["type"] == "BadRequestError"
    assert app["state"].requests == 0
    async with session.get(url + "/health") as response:
        assert response.status == 200


async def test_reset_prefix_cache(start: Start, session) -> None:
    url, app = await start()
    await post(session, url + COMPLETIONS, {"prompt": "z" * 300})
    assert app["state"].cache.blocks
    async with session.post(url + "/reset_prefix_cache") as response:
        assert response.status == 200
    assert not app["state"].cache.blocks
    _, body = await post(session, url + COMPLETIONS, {"prompt": "z" * 300})
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_models_health_and_multimodal_text(start: Start, session) -> None:
    url, _ = await start(name="r2", model="m2")
    async with session.get(url + "/v1/models") as response:
        assert response.headers["x-replica-name"] == "r2"
        assert [m["id"] for m in (await response.json())["data"]] == ["m2"]
    parts = [
        {"type": "text", "text": "look at "},
        {"type": "image_url", "image_url": {"url": "http://example.invalid/cat.png"}},
        {"type": "text", "text": "this"},
    ]
    as_parts = {"model": "m2", "messages": [{"role": "user", "content": parts}]}
    _, body = await post(session, url + CHAT, as_parts)
    assert body["usage"]["prompt_tokens"] == template_tokens("look at this")


async def test_lora_adapters_load_and_unload_as_vllms(start: Start, session) -> None:
    """vLLM's run-time adapter API (VLLM_ALLOW_RUNTIME_LORA_UPDATING): a loaded adapter is
    listed and served; unloaded, it is not, its requests and a second unload get 404s."""
    url, _ = await start(model="m2")

    async def listed() -> list[str]:
        async with session.get(url + "/v1/models") as response:
            return [m["id"] for m in (await response.json())["data"]]

    adapter = {"lora_name": "x", "lora_path": "/adapters/x"}
    async with session.post(url + "/v1/load_lora_adapter", json=adapter) as response:
        assert response.status == 200
    assert await listed() == ["m2", "x"]
    assert (await post(session, url + CHAT, {**chat("hi"), "model": "x"}))[0] == 200
    for expected in (200, 404):
        async with session.post(url + "/v1/unload_lora_adapter", json={"lora_name": "x"}) as r:
            assert r.status == expected, await r.text()
    assert await listed() == ["m2"]
    status, body = await post(session, url + CHAT, {**chat("hi"), "model": "x"})
    assert status == 404 and body["error"]["type"] == "NotFoundError", body


async def test_replicas_are_independent(start: Start, session) -> None:
    (url1, app1), (url2, app2) = await start(), await start(name="r2")
    await post(session, url1 + COMPLETIONS, {"prompt": "q" * 300})
    _, body = await post(session, url2 + COMPLETIONS, {"prompt": "q" * 300})
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert app1["state"].requests == app2["state"].requests == 1


def test_cli_flags_map_to_settings() -> None:
    args = cli.build_parser(only="fake-replica").parse_args(
        ["fake-replica", "--port", "9001", "--served-model-name", "m", "--capacity-tokens",
         "1024", "--prefill-ms-per-token", "0.5", "--max-num-seqs", "4"]
    )  # fmt: skip
    settings = settings_from_args(args)
    assert settings == ReplicaSettings(
        name="fake-9001",
        model="m",
        port=9001,
        capacity_tokens=1024,
        prefill_ms_per_token=0.5,
        max_num_seqs=4,
    )
    assert settings.host == "127.0.0.1"
    with pytest.raises(ValueError):
        ReplicaSettings(block_tokens=0)


async def test_client_disconnect_mid_stream_is_an_abort(start: Start, session) -> None:
    url, app = await start(decode_ms_per_token=20, output_tokens=20)
    state = app["state"]
    response = await session.post(url + COMPLETIONS, json={"prompt": "bye", "stream": True})
    await response.content.readuntil(b"\n\n")
    response.close()  # drop the connection while tokens are still coming
    deadline = time.monotonic() + 2
    while state.running and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    assert (state.running, state.finished["abort"], state.private_blocks) == (0, 1, 0)
    assert (await post(session, url + COMPLETIONS, {"prompt": "still alive"}))[0] == 200
