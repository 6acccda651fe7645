"""A stand-in for a vLLM replica, so the router can be tried and tested without GPUs.

Prefix-aware routing only pays off because a model server with a warm prefix cache answers
faster. This server reproduces just that behaviour, with vLLM's API and metric names:

* OpenAI-compatible ``/v1/chat/completions`` and ``/v1/completions`` (streaming SSE and
  plain JSON), ``usage.prompt_tokens_details.cached_tokens``, ``/v1/models``, ``/health``,
  ``POST /reset_prefix_cache``, ``POST /v1/load_lora_adapter`` (the adapter's name is
  listed and served from then on), ``POST /v1/unload_lora_adapter`` (no longer) and
  ``/metrics`` with vLLM's ``vllm:*`` series.
* A block-level prefix cache: the prompt is rendered with a toy chat template, "tokenized"
  as ``bytes_per_token`` UTF-8 bytes per token, cut into full blocks of ``block_tokens``
  tokens and chain-hashed with blake2b. It deliberately shares no code with the router's
  hashing, so tests compare two independent views of the same prompt. As in vLLM only full
  blocks are cached, at most ``prompt_tokens - 1`` tokens can hit (the last token is always
  recomputed), blocks become visible once their prefill is done, and released chains are
  LRU-ordered so eviction eats them from the tail. Simplifications: generated tokens are
  not cached, and blocks of running requests are not pinned against eviction.
* A time model: first token after ``base_ttft_ms + uncached_tokens * prefill_ms_per_token``
  with all prefills serialised behind one lock (one GPU, so a cold prefill delays
  everybody), then ``decode_ms_per_token`` per output token, concurrently. At most
  ``max_num_seqs`` requests run; the rest wait and show up in ``vllm:num_requests_waiting``.
* Deterministic replies, words drawn from a small vocabulary seeded by the prompt's hash, so
  multi-turn clients that append the reply to their history get reproducible runs.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import math
import random
import sys
import time
import uuid
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

# vLLM's buckets for vllm:time_to_first_token_seconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
VOCABULARY = ("the", "cache", "router", "prefix", "token", "block", "replica", "model", "fast",
              "warm", "cold", "request", "envoy", "queue", "reply", "again", "and", "with",
              "every", "shared", "prompt", "answer", "quick", "simple")  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class ReplicaSettings:
    """What the simulated replica serves and how fast; defaults roughly match a small GPU."""

    name: str = "fake"
    model: str = "demo-model"
    host: str = "127.0.0.1"
    port: int = 8001
    capacity_tokens: int = 65536
    block_tokens: int = 16
    bytes_per_token: int = 4
    prefill_ms_per_token: float = 0.05
    base_ttft_ms: float = 2.0
    decode_ms_per_token: float = 1.0
    max_num_seqs: int = 16
    output_tokens: int = 16
    max_output_tokens: int = 256
    # Headers every response carries ("name: value"), as a replica behind a proxy of its own
    # might send; tests check that the router's own markers cannot be forged this way.
    response_headers: tuple[str, ...] = ()
    # process_start_time_seconds, as vLLM's one API server process exports it (several
    # export none): the router tells a restart by it.
    exports_start_time: bool = True
    # vLLM's --api-key: every /v1 path then needs "Authorization: Bearer <key>" (401 without).
    api_key: str = ""
    # /metrics answers 503 for this long after start: a router's first scrape comes late
    # (tests of what the router does before it knows an endpoint's KV size).
    metrics_after_seconds: float = 0.0

    def __post_init__(self) -> None:
        for name in ("block_tokens", "bytes_per_token", "max_num_seqs", "output_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.capacity_tokens < self.block_tokens:
            raise ValueError("capacity_tokens must hold at least one block")
        if (
            min(
                self.prefill_ms_per_token,
                self.base_ttft_ms,
                self.decode_ms_per_token,
                self.metrics_after_seconds,
            )
            < 0
        ):
            raise ValueError("timings must not be negative")
        if self.max_output_tokens < self.output_tokens:
            raise ValueError("max_output_tokens must be >= output_tokens")
        for header in self.response_headers:
            if ":" not in header:
                raise ValueError(f"response header {header!r} is not 'name: value'")

    @property
    def capacity_blocks(self) -> int:
        return self.capacity_tokens // self.block_tokens


class PrefixCache:
    """Block-hash LRU; the oldest entry of the OrderedDict is evicted first."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self.blocks: OrderedDict[bytes, None] = OrderedDict()
        self.evictions = 0

    def hit_blocks(self, hashes: list[bytes]) -> int:
        """Length of the leading run of hashes that are cached."""
        count = 0
        for block_hash in hashes:
            if block_hash not in self.blocks:
                break
            count += 1
        return count

    def touch(self, hashes: list[bytes]) -> None:
        """Insert or refresh last-to-first, so the chain's tail is evicted before its head."""
        for block_hash in reversed(hashes):
            self.blocks[block_hash] = None
            self.blocks.move_to_end(block_hash)
        while len(self.blocks) > self.capacity_blocks:
            self.blocks.popitem(last=False)
            self.evictions += 1

    def clear(self) -> None:
        self.blocks.clear()


@dataclass
class ReplicaState:
    """Live counters, read by /metrics and directly by in-process tests (``app["state"]``)."""

    cache: PrefixCache
    requests: int = 0  # completed requests
    queries: int = 0  # prompt tokens looked up in the prefix cache
    hits: int = 0  # of which were cached
    prompt_tokens: int = 0
    generation_tokens: int = 0
    running: int = 0
    waiting: int = 0
    prefill_ms: float = 0.0  # simulated prefill time, summed
    # What vLLM observes per request: prefill seconds and KV tokens computed (not cached).
    prefills: int = 0
    prefill_seconds: float = 0.0
    prefill_computed_tokens: int = 0
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    ttft_sum: float = 0.0
    ttft_buckets: list[int] = field(default_factory=lambda: [0] * len(TTFT_BUCKETS))
    ttft_count: int = 0
    held_blocks: dict[bytes, int] = field(default_factory=dict)  # running requests' full blocks
    private_blocks: int = 0  # running requests' partial-prompt and output blocks
    started: float = field(default_factory=time.time)  # this server's start (Unix time)
    # LoRA adapters loaded at run time (vLLM's /v1/load_lora_adapter): name -> path.
    adapters: dict[str, str] = field(default_factory=dict)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft_sum += seconds
        self.ttft_count += 1
        for i, bound in enumerate(TTFT_BUCKETS):
            if seconds <= bound:
                self.ttft_buckets[i] += 1


class ApiError(Exception):
    """Becomes a vLLM-shaped JSON error response."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def error_response(status: int, message: str, kind: str) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status, dumps=lambda v: orjson.dumps(v).decode())


def _text_of(content: Any) -> str:
    """Message content as text; multimodal lists contribute their text parts only."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", ""))
            for p in content
            if isinstance(p, dict) and p.get("type") == "text"
        )
    raise ApiError(400, "message content must be a string, a list of parts or null")


def render_chat(body: dict[str, Any]) -> str:
    """A toy chat template: ``<|role|>\\ncontent\\n`` per message, then the assistant cue."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list")
    parts = []
    if body.get("tools"):
        try:
            tools = orjson.dumps(body["tools"], option=orjson.OPT_SORT_KEYS).decode()
        except TypeError as exc:  # nested deeper than orjson writes
            raise ApiError(400, f"'tools' cannot be rendered: {exc}") from None
        parts.append("<|tools|>\n" + tools)
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, "each message must be an object with a string 'role'")
        parts.append(f"<|{message['role']}|>\n{_text_of(message.get('content'))}\n")
    return "".join(parts) + "<|assistant|>\n"


def render_completion(body: dict[str, Any]) -> str:
    """Completions take the raw prompt; one string (or a one-element list of it) only."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ApiError(400, "'prompt' must be a string (batches and token ids are not simulated)")
    return prompt


def block_hashes(prompt: bytes, settings: ReplicaSettings) -> list[bytes]:
    """Chained blake2b hashes of the prompt's full blocks."""
    size = settings.block_tokens * settings.bytes_per_token
    previous = b"fake-replica-root"
    hashes = []
    for start in range(0, len(prompt) - size + 1, size):
        previous = hashlib.blake2b(previous + prompt[start : start + size], digest_size=16).digest()
        hashes.append(previous)
    return hashes


def reply_words(prompt: bytes, count: int) -> list[str]:
    """The same prompt always gets the same reply."""
    rng = random.Random(hashlib.blake2b(prompt, digest_size=8).digest())
    return [rng.choice(VOCABULARY) for _ in range(count)]


def output_budget(body: dict[str, Any], settings: ReplicaSettings) -> tuple[int, bool]:
    """(tokens to generate, whether the client's limit was what stopped us)."""
    limit = body.get("max_completion_tokens")
    if limit is None:
        limit = body.get("max_tokens")
    if limit is None:
        return settings.output_tokens, False
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ApiError(400, "max_tokens must be a positive integer")
    return min(limit, settings.max_output_tokens), limit <= settings.max_output_tokens


@dataclass
class Job:
    """One parsed request, plus what the engine learns about it while serving it."""

    chat: bool
    model: str
    prompt: bytes
    out_tokens: int
    client_limited: bool  # the client's max_tokens ended the reply ("length", not "stop")
    stream: bool
    include_usage: bool
    prompt_tokens: int = 0
    hashes: list[bytes] = field(default_factory=list)
    cached_tokens: int = 0
    arrived: float = 0.0
    prefill_seconds: float | None = None  # once prefilled

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.out_tokens,
            "total_tokens": self.prompt_tokens + self.out_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


class Replica:
    """One simulated engine: admission, the prefill lock, decode and the accounting."""

    def __init__(self, settings: ReplicaSettings) -> None:
        self.settings = settings
        self.state = ReplicaState(cache=PrefixCache(settings.capacity_blocks))
        self.seqs = asyncio.Semaphore(settings.max_num_seqs)
        self.gpu = asyncio.Lock()

    def parse(self, raw: bytes, chat: bool) -> Job:
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ApiError(400, f"invalid JSON body: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        model = body.get("model") or self.settings.model
        if model != self.settings.model and model not in self.state.adapters:
            raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError")
        prompt = (render_chat(body) if chat else render_completion(body)).encode()
        out_tokens, client_limited = output_budget(body, self.settings)
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        tokens = math.ceil(len(prompt) / self.settings.bytes_per_token)
        stream, hashes = bool(body.get("stream")), block_hashes(prompt, self.settings)
        return Job(chat, model, prompt, out_tokens, client_limited, stream, include_usage, tokens,
                   hashes)  # fmt: skip

    async def serve(self, request: web.Request, job: Job) -> web.StreamResponse:
        """Wait for one of max_num_seqs slots (counted as waiting), then run."""
        st = self.state
        job.arrived = time.perf_counter()  # TTFT includes the time spent waiting
        st.waiting += 1
        try:
            await self.seqs.acquire()
        finally:
            st.waiting -= 1
        st.running += 1
        try:
            return await self._run(request, job)
        finally:
            st.running -= 1
            self.seqs.release()
            if job.prefill_seconds is not None:  # vLLM observes a prefill as its request ends
                st.prefills += 1
                st.prefill_seconds += job.prefill_seconds
                st.prefill_computed_tokens += job.prompt_tokens - job.cached_tokens

    async def _prefill(self, job: Job) -> None:
        """Look up the cache and pay for the uncached tokens, one prefill at a time."""
        s, st = self.settings, self.state
        async with self.gpu:
            max_hit = (job.prompt_tokens - 1) // s.block_tokens  # vLLM recomputes the last token
            job.cached_tokens = min(st.cache.hit_blocks(job.hashes), max_hit) * s.block_tokens
            st.queries += job.prompt_tokens
            st.hits += job.cached_tokens
            ms = s.base_ttft_ms + (job.prompt_tokens - job.cached_tokens) * s.prefill_ms_per_token
            st.prefill_ms += ms
            started = time.perf_counter()
            await asyncio.sleep(ms / 1000)
            st.cache.touch(job.hashes)  # computed blocks are reusable from now on
            job.prefill_seconds = time.perf_counter() - started
        st.prompt_tokens += job.prompt_tokens

    async def _run(self, request: web.Request, job: Job) -> web.StreamResponse:
        s, st = self.settings, self.state
        words = reply_words(job.prompt, job.out_tokens)
        base = {
            "id": ("chatcmpl-" if job.chat else "cmpl-") + uuid.uuid4().hex,
            "object": "chat.completion.chunk" if job.chat else "text_completion",
            "created": int(time.time()),
            "model": job.model,
        }
        finish, response = "abort", None
        for h in job.hashes:  # shared full blocks count once, like vLLM's ref-counted blocks
            st.held_blocks[h] = st.held_blocks.get(h, 0) + 1
        private = math.ceil(job.prompt_tokens / s.block_tokens) - len(job.hashes)
        st.private_blocks += private  # the partial last block, then each output block
        try:
            if job.stream:
                # Headers first, as vLLM does (its StreamingResponse sends them before the
                # engine starts the request): a stream's headers say nothing of its prefill.
                response = web.StreamResponse(
                    headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                )
                await response.prepare(request)
            await self._prefill(job)
            if response is not None and job.chat:
                role = {"role": "assistant", "content": ""}
                first = {"index": 0, "delta": role, "logprobs": None, "finish_reason": None}
                await _sse(response, {**base, "choices": [first]})
            st.observe_ttft(time.perf_counter() - job.arrived)
            loop = asyncio.get_running_loop()
            decode_start = loop.time()
            for i, word in enumerate(words):
                due = decode_start + (i + 1) * s.decode_ms_per_token / 1000
                await asyncio.sleep(max(0.0, due - loop.time()))
                st.generation_tokens += 1
                total_blocks = math.ceil((job.prompt_tokens + i + 1) / s.block_tokens)
                st.private_blocks += total_blocks - len(job.hashes) - private
                private = total_blocks - len(job.hashes)
                if response is not None:
                    text = word if i == 0 else " " + word
                    await _sse(response, {**base, "choices": [_choice(job.chat, text, None)]})
            finish = "length" if job.client_limited else "stop"
            if response is None:
                kind = "chat.completion" if job.chat else "text_completion"
                choice = _choice(job.chat, " ".join(words), finish, final=True)
                body = {**base, "object": kind, "choices": [choice], "usage": job.usage()}
                return web.Response(body=orjson.dumps(body), content_type="application/json")
            await _sse(response, {**base, "choices": [_choice(job.chat, "", finish)]})
            if job.include_usage:
                await _sse(response, {**base, "choices": [], "usage": job.usage()})
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        except ConnectionResetError:  # the client left mid-stream: vLLM counts an abort
            return response or web.Response(status=499)
        finally:
            st.private_blocks -= private
            for h in job.hashes:
                st.held_blocks[h] -= 1
                if not st.held_blocks[h]:
                    del st.held_blocks[h]
            # Freed chains are re-queued last-to-first, as vLLM's free block queue does.
            st.cache.touch(job.hashes[: st.cache.hit_blocks(job.hashes)])
            st.finished[finish] += 1
            st.requests += 1


def _choice(chat: bool, text: str, finish: str | None, final: bool = False) -> dict[str, Any]:
    if chat:
        key, value = (
            ("message", {"role": "assistant", "content": text})
            if final
            else ("delta", {"content": text})
        )
        return {"index": 0, key: value, "logprobs": None, "finish_reason": finish}
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}


async def _sse(response: web.StreamResponse, event: dict[str, Any]) -> None:
    await response.write(b"data: " + orjson.dumps(event) + b"\n\n")


class VllmCollector:
    """Renders ReplicaState under vLLM's metric names at scrape time.

    A custom collector rather than Counter/Gauge objects: the numbers always equal the
    in-process state, and no ``_created`` series appear (vLLM's scrapers never see them).
    """

    def __init__(self, settings: ReplicaSettings, state: ReplicaState) -> None:
        self.settings, self.state = settings, state

    def collect(self) -> Iterator[Any]:
        s, st = self.settings, self.state
        names, values = ["engine", "model_name"], ["0", s.model]

        used = len(st.held_blocks) + st.private_blocks
        for kind, name, doc, value in (
            (GaugeMetricFamily, "num_requests_running", "Requests in model execution batches.",
             st.running),
            (GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be processed.",
             st.waiting),
            (GaugeMetricFamily, "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             min(1.0, used / s.capacity_blocks)),
            (CounterMetricFamily, "prefix_cache_queries",
             "Prefix cache queries, in terms of number of queried tokens.", st.queries),
            (CounterMetricFamily, "prefix_cache_hits",
             "Prefix cache hits, in terms of number of cached tokens.", st.hits),
            (CounterMetricFamily, "prompt_tokens", "Number of prefill tokens processed.",
             st.prompt_tokens),
            (CounterMetricFamily, "generation_tokens", "Number of generation tokens processed.",
             st.generation_tokens),
        ):  # fmt: skip
            family = kind(f"vllm:{name}", doc, labels=names)
            family.add_metric(values, value)
            yield family
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*names, "finished_reason"],
        )
        for reason, count in st.finished.items():
            success.add_metric([*values, reason], count)
        yield success
        ttft = HistogramMetricFamily(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            labels=names,
        )
        buckets = [(repr(b), c) for b, c in zip(TTFT_BUCKETS, st.ttft_buckets, strict=True)]
        ttft.add_metric(values, [*buckets, ("+Inf", st.ttft_count)], st.ttft_sum)
        yield ttft
        for name, doc, total in (
            ("vllm:request_prefill_time_seconds",
             "Histogram of time spent in PREFILL phase for request.", st.prefill_seconds),
            ("vllm:request_prefill_kv_computed_tokens",
             "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
             st.prefill_computed_tokens),
        ):  # fmt: skip
            family = HistogramMetricFamily(name, doc, labels=names)
            family.add_metric(values, [("+Inf", st.prefills)], total)
            yield family
        info = {
            "block_size": str(s.block_tokens),
            "num_gpu_blocks": str(s.capacity_blocks),
            "cache_dtype": "auto",
            "enable_prefix_caching": "True",
            "engine": "0",
        }
        config = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=list(info)
        )
        config.add_metric(list(info.values()), 1)
        yield config
        if s.exports_start_time:
            yield GaugeMetricFamily(
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds.",
                value=st.started,
            )


def _key_check(key: str) -> Any:
    """vLLM's --api-key: the /v1 paths answer 401 without the bearer token."""

    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.startswith("/v1") and (
            request.headers.get("Authorization") != f"Bearer {key}"
        ):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return check


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every failure becomes a vLLM-shaped JSON error; the server itself never dies."""
    try:
        return await handler(request)
    except ApiError as exc:
        return error_response(exc.status, exc.message, exc.kind)
    except web.HTTPException as exc:
        kind = "NotFoundError" if exc.status == 404 else "BadRequestError"
        return error_response(exc.status, exc.reason, kind)
    except (ConnectionResetError, asyncio.CancelledError):
        raise  # the client went away; nothing to answer
    except Exception as exc:
        return error_response(500, f"internal error: {exc!r}", "InternalServerError")


def build_app(settings: ReplicaSettings) -> web.Application:
    """The replica's aiohttp app; ``app["state"]`` exposes the live counters to tests."""
    # Long multi-turn histories outgrow aiohttp's 1 MiB default body limit.
    middlewares = [_errors] if not settings.api_key else [_errors, _key_check(settings.api_key)]
    app = web.Application(middlewares=middlewares, client_max_size=64 * 1024 * 1024)
    replica = Replica(settings)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(VllmCollector(settings, replica.state))
    with warnings.catch_warnings():  # plain string keys, so callers need no import: app["state"]
        warnings.simplefilter("ignore", web.NotAppKeyWarning)
        app["replica"], app["state"], app["settings"] = replica, replica.state, settings

    async def completions(request: web.Request) -> web.StreamResponse:
        job = replica.parse(await request.read(), chat=request.path.endswith("/chat/completions"))
        return await replica.serve(request, job)

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    async def models(_: web.Request) -> web.Response:
        cards = [
            {
                "id": name,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "vllm",
                "root": root,
                "parent": parent,
                "max_model_len": settings.capacity_tokens,
            }
            for name, root, parent in [
                (settings.model, settings.model, None),
                *((n, path, settings.model) for n, path in replica.state.adapters.items()),
            ]
        ]
        return web.json_response({"object": "list", "data": cards})

    async def load_lora_adapter(request: web.Request) -> web.Response:
        """As vLLM's (with VLLM_ALLOW_RUNTIME_LORA_UPDATING): the adapter is listed and
        served from now on."""
        body = orjson.loads(await request.read() or b"{}")
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if name in replica.state.adapters:
            raise ApiError(400, f"The lora adapter '{name}' has already been loaded.")
        replica.state.adapters[name] = path
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(request: web.Request) -> web.Response:
        """As vLLM's: the adapter is no longer listed; its requests get the 404."""
        body = orjson.loads(await request.read() or b"{}")
        name = body.get("lora_name")
        if not isinstance(name, str) or name not in replica.state.adapters:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
        del replica.state.adapters[name]
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def reset_prefix_cache(_: web.Request) -> web.Response:
        replica.state.cache.clear()
        return web.Response()

    started = time.monotonic()

    async def metrics(_: web.Request) -> web.Response:
        if time.monotonic() - started < settings.metrics_after_seconds:
            return web.Response(status=503, text="metrics not served yet")
        # Pinned to 0.0.4: newer prometheus_client advertises 1.0.0 by default.
        return web.Response(
            body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4}
        )

    extra_headers = [
        tuple(h.strip() for h in header.split(":", 1)) for header in settings.response_headers
    ]

    async def name_header(_: web.Request, response: web.StreamResponse) -> None:
        response.headers["x-replica-name"] = settings.name
        for name, value in extra_headers:
            response.headers[name] = value

    app.on_response_prepare.append(name_header)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_get("/metrics", metrics)
    return app


async def start_replica(settings: ReplicaSettings) -> tuple[web.AppRunner, int]:
    """Start in the running loop (tests); port 0 picks a free port. Stop with runner.cleanup()."""
    runner = web.AppRunner(build_app(settings), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    return runner, runner.addresses[0][1]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags mirror ReplicaSettings; --served-model-name is accepted as in vLLM."""
    d = ReplicaSettings()
    parser.add_argument("--host", default=d.host, help="bind address (default %(default)s)")
    parser.add_argument("--port", type=int, default=d.port, help="default %(default)s")
    parser.add_argument("--name", default=None, help="x-replica-name (default fake-PORT)")
    parser.add_argument(
        "--model",
        "--served-model-name",
        dest="model",
        default=d.model,
        help="served model name (default %(default)s)",
    )
    parser.add_argument(
        "--response-header",
        dest="response_headers",
        action="append",
        default=[],
        help="'name: value' every response carries (repeatable)",
    )
    parser.add_argument("--api-key", default=d.api_key, help="as vLLM's: /v1 paths need it")
    parser.add_argument(
        "--no-start-time",
        dest="exports_start_time",
        action="store_false",
        help="export no process_start_time_seconds (as vLLM with several API server processes)",
    )
    for flag, kind, doc in (
        ("capacity-tokens", int, "KV-cache size in tokens"),
        ("block-tokens", int, "tokens per cache block"),
        ("bytes-per-token", int, "UTF-8 bytes per simulated token"),
        ("prefill-ms-per-token", float, "prefill cost per uncached prompt token"),
        ("base-ttft-ms", float, "fixed cost of every prefill"),
        ("decode-ms-per-token", float, "time per generated token"),
        ("max-num-seqs", int, "concurrently running requests; the rest wait"),
        ("output-tokens", int, "reply length without max_tokens"),
        ("max-output-tokens", int, "cap on max_tokens"),
        ("metrics-after-seconds", float, "/metrics answers 503 for this long after start"),
    ):
        dest = flag.replace("-", "_")
        parser.add_argument(
            f"--{flag}",
            dest=dest,
            type=kind,
            default=getattr(d, dest),
            help=f"{doc} (default %(default)s)",
        )


def settings_from_args(args: argparse.Namespace) -> ReplicaSettings:
    """ReplicaSettings from parsed flags; the name defaults to fake-PORT."""
    fields = {k: getattr(args, k) for k in ReplicaSettings.__dataclass_fields__ if k != "name"}
    fields["response_headers"] = tuple(fields["response_headers"])
    return ReplicaSettings(name=args.name or f"fake-{args.port}", **fields)


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted (``prefix-router fake-replica``)."""
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        print(f"fake-replica: {exc}", file=sys.stderr)
        return 2
    print(
        f"fake-replica {settings.name}: serving {settings.model!r} on "
        f"http://{settings.host}:{settings.port}",
        flush=True,
    )
    web.run_app(
        build_app(settings), host=settings.host, port=settings.port, print=None, access_log=None
    )
    return 0
