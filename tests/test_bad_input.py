"""Bad input through the real Envoy, the router and stand-in replicas.

Every kind of malformed, odd or hostile request gets either a pass-through (served by a
replica, which may answer 4xx) or a clear HTTP error from Envoy — never a 5xx, never a
crash, never a hang (every request has a timeout) — and the router counts it: its
``prefix_router_requests_total{outcome,reason}`` moves by exactly the expected label pair.
After the corpus the router still routes normally.
"""

from __future__ import annotations

import gzip
import http.client
import json
import select
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest

from extproc.stack import LOOPBACK, Stack

from .integration.conftest import Response as Reply
from .reliability.conftest import (
    FAST,
    Rig,
    envoy_stats,
    report,
    requests_by_outcome,
    start_rig,
    wait_until,
)

pytestmark = [pytest.mark.envoy]
CHAT = "/v1/chat/completions"
MIB = 1024 * 1024
TIMEOUT = 60.0
ROUTED = ("routed", None)  # any routing rule


def raw_request(
    port: int,
    head: bytes,
    pieces: list[bytes] = (),  # type: ignore[assignment]
    pause: float = 0.0,
    method: str = "POST",
) -> Reply:
    """Send a hand-written request (head + body pieces, with pauses); parse the answer.

    Like a careful client, stop sending once the server answered early (Envoy's 413)."""
    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=TIMEOUT)
    try:
        conn.connect()
        sock = conn.sock
        assert sock is not None
        sock.sendall(head)
        try:
            for piece in pieces:
                if pause:
                    time.sleep(pause)
                for start in range(0, len(piece), MIB):
                    if select.select([sock], [], [], 0)[0]:
                        raise BrokenPipeError  # an early answer: read it
                    sock.sendall(piece[start : start + MIB])
        except (BrokenPipeError, ConnectionResetError):
            pass
        response = http.client.HTTPResponse(sock, method=method)
        response.begin()
        body = response.read()
        return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, body)
    finally:
        conn.close()


def http_request(
    port: int,
    body: bytes | None,
    path: str = CHAT,
    method: str = "POST",
    headers: dict[str, str] | None = None,
    content_type: str | None = "application/json",
) -> Reply:
    lines = [f"{method} {path} HTTP/1.1", f"host: {LOOPBACK}:{port}"]
    if content_type:
        lines.append(f"content-type: {content_type}")
    for name, value in (headers or {}).items():
        lines.append(f"{name}: {value}")
    if body is not None:
        lines.append(f"content-length: {len(body)}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode()
    return raw_request(port, head, [body] if body else [], method=method)


def chunked_request(port: int, pieces: list[bytes], pause: float, path: str = CHAT) -> Reply:
    head = (
        f"POST {path} HTTP/1.1\r\nhost: {LOOPBACK}:{port}\r\n"
        "content-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n"
    ).encode()
    chunks = [f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in pieces] + [b"0\r\n\r\n"]
    return raw_request(port, head, chunks, pause)


def chat(content="Hello there, this is a perfectly ordinary question. " * 4, **extra) -> dict:
    return {
        "model": "demo-model",
        "messages": [
            {"role": "system", "content": "You are terse. " * 10},
            {"role": "user", "content": content},
        ],
        "max_tokens": 2,
        **extra,
    }


def dumps(value) -> bytes:
    return json.dumps(value).encode()


@dataclass
class Case:
    name: str
    send: Callable[[int], Reply]
    statuses: set[int]
    counted: tuple[str, str | None]  # (outcome, reason); reason None = any
    by_replica: bool = True  # the answer comes from a replica (else from Envoy)
    modes: tuple[str, ...] = ("buffered",)
    slow: bool = False
    notes: dict = field(default_factory=dict)


def post(body: bytes | None, **kwargs) -> Callable[[int], Reply]:
    return lambda port: http_request(port, body, **kwargs)


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def _big_chat(size: int) -> bytes:
    body = dumps(chat("word " * (size // 5)))
    assert len(body) >= size
    return body


CASES = [
    # -- bodies that are not JSON, or not the JSON we route on --------------------------
    Case("empty_body", post(b""), {400}, ("pass_through", "empty_body")),
    Case("no_body_at_all", post(None), {400}, ("pass_through", "empty_body")),
    Case("not_json", post(b"this is not json {"), {400}, ("pass_through", "invalid_json")),
    Case(
        "invalid_utf8",
        post(b'{"model":"demo-model","messages":[{"role":"user","content":"\xff\xfe\xfd"}]}'),
        {400},
        ("pass_through", "invalid_json"),
    ),
    Case("truncated_json", post(dumps(chat())[:-7]), {400}, ("pass_through", "invalid_json")),
    Case("deeply_nested_json", post(_nested(100_000)), {400}, ("pass_through", "invalid_json")),
    Case(
        "deeply_nested_content",
        post(dumps(chat(json.loads(_nested(200))))),
        {200, 400},
        ("pass_through", "bad_content"),
    ),
    # Nested deeper than orjson writes (254 levels; it reads 1,024): the router re-encodes
    # such parts for its hashes. Once a failed stream: Envoy failed open in buffered mode,
    # and in full-duplex mode, where the body was already handed over, answered 500.
    Case(
        "deeply_nested_part",
        post(dumps(chat([{"type": "image_url", "image_url": {"x": json.loads(_nested(300))}}]))),
        {200},
        ("pass_through", "bad_content"),
        modes=("buffered", "full_duplex_streamed"),
    ),
    Case(
        "deeply_nested_tools",
        post(dumps(chat(tools=[{"type": "function", "x": json.loads(_nested(300))}]))),
        {400},  # the stand-in replica's answer: it cannot render them either
        ("pass_through", "bad_content"),
        modes=("buffered", "full_duplex_streamed"),
    ),
    Case("bom", post(b"\xef\xbb\xbf" + dumps(chat())), {400}, ("pass_through", "invalid_json")),
    Case(
        "nan_literal",
        post(dumps(chat())[:-1] + b', "temperature": NaN}'),
        {400},
        ("pass_through", "invalid_json"),
    ),
    Case(
        "infinity_literal",
        post(dumps(chat())[:-1] + b', "temperature": Infinity}'),
        {400},
        ("pass_through", "invalid_json"),
    ),
    Case(
        "lone_surrogate",
        post(b'{"model":"demo-model","messages":[{"role":"user","content":"\\ud800"}]}'),
        {400},
        ("pass_through", "invalid_json"),
    ),
    Case("json_array", post(b"[1, 2, 3]"), {400}, ("pass_through", "not_object")),
    Case("json_scalar", post(b"42"), {400}, ("pass_through", "not_object")),
    # -- wrong types -----------------------------------------------------------------------
    Case("content_number", post(dumps(chat(42))), {400}, ("pass_through", "bad_content")),
    Case("content_object", post(dumps(chat({"a": 1}))), {400}, ("pass_through", "bad_content")),
    Case(
        "messages_object",
        post(dumps({"model": "demo-model", "messages": {"role": "user", "content": "x"}})),
        {400},
        ("pass_through", "no_prompt"),
    ),
    Case(
        "messages_empty",
        post(dumps({"model": "demo-model", "messages": []})),
        {400},
        ("pass_through", "no_prompt"),
    ),
    Case(
        "message_not_object",
        post(dumps({"model": "demo-model", "messages": ["hello"]})),
        {400},
        ("pass_through", "bad_messages"),
    ),
    Case(
        "role_number",
        post(dumps({"model": "demo-model", "messages": [{"role": 7, "content": "x"}]})),
        {400},
        ("pass_through", "bad_messages"),
    ),
    Case(
        "too_many_messages",
        post(
            dumps({"model": "demo-model", "messages": [{"role": "user", "content": "x"}] * 100_001})
        ),
        {200},
        ("pass_through", "too_many_messages"),
    ),
    Case("model_number", post(dumps(chat(model=123))), {404}, ("pass_through", "bad_model")),
    Case(
        "cache_salt_number", post(dumps(chat(cache_salt=5))), {200}, ("pass_through", "bad_model")
    ),
    Case(
        "no_messages_key",
        post(dumps({"model": "demo-model"})),
        {400},
        ("pass_through", "no_prompt"),
    ),
    # -- odd but valid requests: routed, the replica decides -----------------------------------
    Case(
        "huge_messages_array",
        post(
            dumps(
                {
                    "model": "demo-model",
                    "messages": [{"role": "user", "content": f"m{i}"} for i in range(100_000)],
                    "max_tokens": 1,
                }
            )
        ),
        {200},
        ROUTED,
    ),
    Case(
        "multimodal_parts",
        post(
            dumps(
                chat(
                    [
                        {"type": "text", "text": "What is in this image?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                    ]
                )
            )
        ),
        {200},
        ROUTED,
    ),
    Case(
        "tool_calls",
        post(
            dumps(
                {
                    "model": "demo-model",
                    "tools": [{"type": "function", "function": {"name": "get_weather"}}],
                    "messages": [
                        {"role": "user", "content": "Weather in Paris?"},
                        {
                            "role": "assistant",
                            "content": None,
                            "tool_calls": [
                                {
                                    "id": "call_1",
                                    "type": "function",
                                    "function": {"name": "get_weather", "arguments": "{}"},
                                }
                            ],
                        },
                        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                    ],
                    "max_tokens": 2,
                }
            )
        ),
        {200},
        ROUTED,
    ),
    Case("unknown_model", post(dumps(chat(model="no-such-model"))), {404}, ROUTED),
    Case("long_model_name", post(dumps(chat(model="m" * MIB))), {404}, ROUTED),
    Case("stream_true", post(dumps(chat(stream=True))), {200}, ROUTED),
    Case("stream_false", post(dumps(chat(stream=False))), {200}, ROUTED),
    Case("stream_yes_string", post(dumps(chat(stream="yes"))), {200}, ROUTED),
    Case("stream_null", post(dumps(chat(stream=None))), {200}, ROUTED),
    Case(
        "duplicate_keys",
        post(b'{"model": "x", "model": "demo-model", ' + dumps(chat())[1:]),
        {200},
        ROUTED,
    ),
    Case("control_characters", post(dumps(chat("a\u0000b\u0001c\u001bd"))), {200}, ROUTED),
    Case("missing_content_type", post(dumps(chat()), content_type=None), {200}, ROUTED),
    Case("text_plain_content_type", post(dumps(chat()), content_type="text/plain"), {200}, ROUTED),
    Case("query_string", post(dumps(chat()), path=CHAT + "?debug=1&x=%00"), {200}, ROUTED),
    Case("tools_not_a_list", post(dumps(chat(tools="nope"))), {200}, ROUTED),
    Case(
        "responses_api_string",
        post(dumps({"model": "demo-model", "input": "Hello"}), path="/v1/responses"),
        {404},
        ROUTED,
    ),
    Case(
        "responses_api_items",
        post(
            dumps(
                {
                    "model": "demo-model",
                    "instructions": "Be brief.",
                    "input": [
                        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                        {"type": "function_call_output", "call_id": "c1", "output": "42"},
                    ],
                }
            ),
            path="/v1/responses",
        ),
        {404},
        ROUTED,
    ),
    Case(
        "completions_string",
        post(
            dumps({"model": "demo-model", "prompt": "Once upon a time", "max_tokens": 2}),
            path="/v1/completions",
        ),
        {200},
        ROUTED,
    ),
    Case(
        "completions_token_array",
        post(dumps({"model": "demo-model", "prompt": [1, 2, 3, 50256]}), path="/v1/completions"),
        {400},
        ROUTED,
    ),
    Case(
        "completions_batch",
        post(dumps({"model": "demo-model", "prompt": ["a", "b"]}), path="/v1/completions"),
        {400},
        ROUTED,
    ),
    Case(
        "completions_negative_tokens",
        post(dumps({"model": "demo-model", "prompt": [-1, 2]}), path="/v1/completions"),
        {400},
        ("pass_through", "bad_prompt"),
    ),
    # -- encodings, methods, paths --------------------------------------------------------------
    Case(
        "gzip_content_encoding",
        post(gzip.compress(dumps(chat())), headers={"content-encoding": "gzip"}),
        {200, 400},
        ("pass_through", "content_encoding"),
    ),
    Case("get_on_chat_path", post(None, method="GET"), {405}, ("pass_through", "method")),
    Case(
        "head_models",
        post(None, method="HEAD", path="/v1/models"),
        {200},
        ("pass_through", "method"),
    ),
    Case("options_chat", post(None, method="OPTIONS"), {405}, ("pass_through", "method")),
    Case("delete_chat", post(dumps(chat()), method="DELETE"), {405}, ("pass_through", "method")),
    Case(
        "unknown_path", post(dumps(chat()), path="/v1/embeddings"), {404}, ("pass_through", "path")
    ),
    Case("root_path", post(dumps(chat()), path="/"), {404}, ("pass_through", "path")),
    Case(
        "slow_chunked_body",
        lambda port: chunked_request(port, _pieces(dumps(chat()), 5), pause=0.3),
        {200},
        ROUTED,
        modes=("buffered", "full_duplex_streamed"),
    ),
    # -- sizes -------------------------------------------------------------------------------------
    Case(
        "body_50_mib",
        post(_big_chat(50 * MIB)),
        {413},
        ("pass_through", "no_body"),
        by_replica=False,
        slow=True,
        notes={"limit": "Envoy request_body_buffer_limit 16 MiB (BUFFERED)"},
    ),
    Case(
        "body_70_mib_over_router_limit",
        post(_big_chat(70 * MIB)),
        {413},
        ("pass_through", "body_too_large"),
        by_replica=False,
        slow=True,
    ),
    Case(
        "chunked_20_mib",
        lambda port: chunked_request(port, _pieces(_big_chat(20 * MIB), 20), pause=0.0),
        {413},
        ("pass_through", "no_body"),
        by_replica=False,
        slow=True,
    ),
]


def _pieces(data: bytes, n: int) -> list[bytes]:
    size = -(-len(data) // n)
    return [data[i : i + size] for i in range(0, len(data), size)]


FULL_DUPLEX_CASES = [
    Case("not_json", post(b"this is not json {"), {400}, ("pass_through", "invalid_json")),
    Case("get_on_chat_path", post(None, method="GET"), {405}, ("pass_through", "method")),
    Case(
        "gzip_content_encoding",
        post(gzip.compress(dumps(chat())), headers={"content-encoding": "gzip"}),
        {200, 400},
        ("pass_through", "content_encoding"),
    ),
    Case(
        "body_50_mib",
        post(_big_chat(50 * MIB)),
        {200},
        ROUTED,
        slow=True,
        notes={"limit": "no body limit in full duplex; the router buffers it (max_body_bytes)"},
    ),
]


@pytest.fixture(scope="module")
def rigs() -> Iterator[dict[str, Rig]]:
    with Stack() as stack:
        members = stack.start_replicas(2, FAST)
        yield {
            body_mode: start_rig(stack, "override-host", body_mode, members, name=body_mode)
            for body_mode in ("buffered", "full_duplex_streamed")
        }


FIGURES: list[dict] = []


# Envoy's ext_proc counters that say the router never saw a request (transport trouble).
BYPASSED = ("failure_mode_allowed", "streams_failed", "message_timeouts")


def _bypassed(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {
        name: after[name] - before.get(name, 0)
        for name in after
        if name.endswith(BYPASSED) and after[name] > before.get(name, 0)
    }


def _send_and_count(rig: Rig, case: Case) -> tuple[Reply, Counter, float, dict[str, int]]:
    admin = rig.router_admin
    before, stats_before = requests_by_outcome(admin), envoy_stats(rig.envoy_admin)
    started = time.monotonic()
    reply = case.send(rig.envoy_port)
    seconds = time.monotonic() - started
    # The router counts a request when its processing stream ends (just after the answer).
    wait_until(lambda: sum(requests_by_outcome(admin).values()) > sum(before.values()), 10, 0.05)
    time.sleep(0.05)
    delta = requests_by_outcome(admin)
    delta.subtract(before)
    moved = Counter({k: v for k, v in delta.items() if v})
    return reply, moved, seconds, _bypassed(stats_before, envoy_stats(rig.envoy_admin))


def _run_case(rig: Rig, case: Case) -> None:
    reply, moved, seconds, bypassed = _send_and_count(rig, case)
    retried = False
    if not moved and bypassed:
        # Envoy failed open on its own (its gRPC stream to the router failed or timed out on
        # a loaded machine: one CI run), so the router never saw this input; send it again.
        # Failing open is the documented behaviour; the case is about the router's handling.
        retried = True
        reply, moved, seconds, bypassed = _send_and_count(rig, case)
    FIGURES.append(
        {"case": case.name, "body_mode": rig.body_mode, "status": reply.status,
         "counted": [f"{o}/{r}" for (o, r) in moved], "seconds": round(seconds, 2),
         **({"retried_after_envoy_bypass": True} if retried else {})}
    )  # fmt: skip
    assert reply.status < 500, (case.name, reply.status, reply.body[:300])
    assert reply.status in case.statuses, (case.name, reply.status, reply.body[:300])
    if case.by_replica:
        assert reply.replica, (case.name, "not answered by a replica", reply.headers)
    assert sum(moved.values()) == 1, (case.name, moved, "envoy ext_proc bypass:", bypassed)
    ((outcome, reason),) = moved
    assert outcome == case.counted[0], (case.name, moved)
    if case.counted[1] is not None:
        assert reason == case.counted[1], (case.name, moved)
    assert rig.router.alive()


def _params(cases: list[Case]):
    return [pytest.param(c, id=c.name, marks=[pytest.mark.slow] if c.slow else []) for c in cases]


@pytest.mark.parametrize("case", _params([c for c in CASES if "buffered" in c.modes]))
def test_bad_input_buffered(rigs, case):
    _run_case(rigs["buffered"], case)


@pytest.mark.parametrize(
    "case",
    _params([c for c in CASES if "full_duplex_streamed" in c.modes] + FULL_DUPLEX_CASES),
)
def test_bad_input_full_duplex(rigs, case):
    _run_case(rigs["full_duplex_streamed"], case)


def test_corpus_is_large_enough():
    assert len({c.name for c in CASES}) >= 30


def test_router_still_routes_normally_after_the_corpus(rigs):
    for body_mode, rig in rigs.items():
        assert rig.routing_works(f"after the corpus {body_mode}"), body_mode
        errors = sum(n for (kind, _), n in requests_by_outcome(rig.router_admin).items()
                     if kind == "error")  # fmt: skip
        assert errors == 0
        assert rig.router.alive()
    if FIGURES:
        report("bad_input", cases=len(FIGURES), figures=FIGURES)
