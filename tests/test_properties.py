"""Property-based tests (hypothesis): the canonicaliser, the router's output, the servicer.

* parse_request never raises anything but NotRoutable, on any bytes and any JSON value, and a
  conversation's earlier turns are a byte prefix of its later turns (chat and responses).
* The router only ever names endpoints it knows (and, for the primary, that are healthy),
  whatever the endpoint set, health changes, served reports and subset hints.
* The ext_proc servicer, fed arbitrary sequences of ProcessingRequest messages over real
  in-process gRPC (out of order, duplicated, missing end of stream, body before headers,
  trailers only), always answers or closes, never fails a stream, keeps serving, and leaves
  no request counted in flight once the stream has ended.
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as epg
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.config import EndpointConfig, RoutingConfig, ServerConfig, load_config
from extproc.prompt import LLMRequest, NotRoutable, parse_request
from extproc.router import Router
from extproc.serve import RouterService
from extproc.server import ExternalProcessorService

APIS = ("chat", "completions", "responses")

# -- JSON values -------------------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=25,
)
# Values shaped like the fields the canonicaliser reads, with every type going wrong somewhere.
message_like = st.fixed_dictionaries(
    {},
    optional={
        "role": json_values | st.sampled_from(["user", "assistant", "system", "tool", "developer"]),
        "content": json_values
        | st.lists(
            st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "image_url", "input_text", "input_audio"])},
                optional={"text": json_values, "image_url": json_values},
            ),
            max_size=3,
        ),
        "type": st.sampled_from(["message", "function_call", "reasoning"]) | json_values,
        "name": json_values,
        "tool_calls": json_values,
        "tool_call_id": json_values,
    },
)
request_like = st.fixed_dictionaries(
    {},
    optional={
        "model": json_values | st.text(max_size=10),
        "cache_salt": json_values,
        "messages": st.lists(message_like | json_values, max_size=4) | json_values,
        "prompt": json_values
        | st.lists(st.integers(min_value=-5, max_value=2**33), max_size=6)
        | st.lists(st.text(max_size=10), max_size=3),
        "input": st.lists(message_like, max_size=3) | json_values,
        "instructions": json_values,
        "previous_response_id": json_values,
        "tools": json_values,
        "stream": json_values,
    },
)


def _check_parse(api: str, body: bytes) -> None:
    try:
        result = parse_request(api, body)
    except NotRoutable as exc:
        assert exc.kind and len(exc.kind) < 32  # a short, bounded metrics label
        return
    assert isinstance(result, LLMRequest)
    assert isinstance(result.prompt, bytes) and result.prompt
    assert 0 <= result.first_turn_end <= len(result.prompt)


@settings(max_examples=400, deadline=None)
@given(api=st.sampled_from(APIS), body=st.binary(max_size=300))
def test_canonicaliser_on_arbitrary_bytes(api, body):
    _check_parse(api, body)


@settings(max_examples=300, deadline=None)
@given(api=st.sampled_from(APIS), value=json_values)
def test_canonicaliser_on_arbitrary_json_values(api, value):
    try:
        body = orjson.dumps(value)
    except (orjson.JSONEncodeError, TypeError):
        return  # not representable as JSON (ints beyond 64 bits): nothing to send
    _check_parse(api, body)


@settings(max_examples=500, deadline=None)
@given(api=st.sampled_from(APIS), value=request_like)
def test_canonicaliser_on_request_shaped_json(api, value):
    try:
        body = orjson.dumps(value)
    except (orjson.JSONEncodeError, TypeError):
        return
    _check_parse(api, body)


text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=40)
content = text | st.lists(
    st.one_of(
        st.builds(lambda t: {"type": "text", "text": t}, text),
        st.builds(lambda u: {"type": "image_url", "image_url": {"url": u}}, text),
    ),
    max_size=3,
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant", "tool", "developer"]),
        "content": content,
    },
    optional={
        "name": text,
        "tool_call_id": text,
        "tool_calls": st.lists(
            st.fixed_dictionaries({"id": text, "type": st.just("function")}), max_size=2
        ),
    },
)


@settings(max_examples=300, deadline=None)
@given(
    messages=st.lists(message, min_size=1, max_size=8),
    cut=st.integers(min_value=1, max_value=8),
    tools=st.none() | st.lists(st.fixed_dictionaries({"name": text}), min_size=1, max_size=2),
    model=text,
)
def test_earlier_turns_are_a_byte_prefix_of_later_turns(messages, cut, tools, model):
    cut = min(cut, len(messages))
    extra = {"tools": tools} if tools else {}
    for api, key in (("chat", "messages"), ("responses", "input")):
        full = parse_request(api, orjson.dumps({"model": model, key: messages, **extra}))
        early = parse_request(api, orjson.dumps({"model": model, key: messages[:cut], **extra}))
        assert full.prompt.startswith(early.prompt)
        assert early.prompt != full.prompt or cut == len(messages)


# -- the router names only endpoints it knows --------------------------------------------

POOL = [f"10.0.0.{i}:8000" for i in range(1, 7)] + ["[fd00::1]:8000", "[fd00::2]:9000"]
STRANGERS = ["10.9.9.9:1", "127.0.0.1:8000", "localhost:8000", "", "10.0.0.1:8000,10.0.0.2:8000"]

operation = st.one_of(
    st.tuples(
        st.just("route"),
        st.integers(0, 30),
        st.integers(0, 3),
        st.none() | st.sets(st.sampled_from(POOL + STRANGERS), max_size=4),
    ),
    st.tuples(st.just("finish"), st.integers(0, 50)),
    st.tuples(st.just("served"), st.integers(0, 50), st.sampled_from(POOL + STRANGERS)),
    st.tuples(st.just("health"), st.sampled_from(POOL + STRANGERS), st.booleans()),
    st.tuples(st.just("endpoints"), st.lists(st.sampled_from(POOL), unique=True, max_size=6)),
)


def _request(conversation: int, turns: int) -> LLMRequest:
    messages = [{"role": "system", "content": "shared system prompt " * 8}]
    for turn in range(turns + 1):
        messages.append(
            {"role": "user", "content": f"conversation {conversation} turn {turn} " * 6}
        )
    return parse_request("chat", orjson.dumps({"model": "m", "messages": messages}))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    initial=st.lists(st.sampled_from(POOL), unique=True, min_size=0, max_size=6),
    operations=st.lists(operation, max_size=40),
    single=st.booleans(),
)
def test_router_only_emits_known_endpoints(initial, operations, single):
    config = RoutingConfig(default_capacity_tokens=2000, fallbacks=3)
    router = Router(config, [EndpointConfig(address=a) for a in initial])
    service = ExternalProcessorService(router, ServerConfig(single_destination=single))
    members = set(initial)
    healthy = set(initial)
    open_decisions = []
    for op in operations:
        if op[0] == "route":
            _, conversation, turns, allowed = op
            decision = router.route(
                _request(conversation, turns),
                allowed=frozenset(allowed) if allowed is not None else None,
            )
            if decision.endpoint is None:
                continue
            eligible = healthy if allowed is None else healthy & allowed
            assert decision.endpoint in eligible
            named = service._destination(decision).split(",")
            assert set(named) <= members
            assert len(named) == len(set(named))
            if single:
                assert named == [decision.endpoint]
            open_decisions.append(decision)
        elif op[0] == "finish" and open_decisions:
            router.finish(open_decisions.pop(op[1] % len(open_decisions)))
        elif op[0] == "served" and open_decisions:
            decision = open_decisions[op[1] % len(open_decisions)]
            router.served(decision, op[2])
            assert (decision.served or decision.endpoint) in POOL
        elif op[0] == "health":
            router.set_health(op[1], op[2])
            if op[1] in members:
                (healthy.add if op[2] else healthy.discard)(op[1])
        elif op[0] == "endpoints":
            router.set_endpoints([EndpointConfig(address=a) for a in op[1]])
            kept = set(op[1])
            healthy = (healthy & kept) | (kept - members)
            members = kept
        assert set(router.endpoints) == members
        assert set(router.healthy_endpoints()) == healthy
        assert set(router.in_flight()) == members
    for decision in open_decisions:
        router.finish(decision)
    assert all(count == 0 for count in router.in_flight().values())


# -- the servicer over real gRPC ---------------------------------------------------------

HEADER = "x-gateway-destination-endpoint"
CHAT = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "property " * 30}]})
ENDPOINTS = "127.0.0.1:8001,127.0.0.1:8002,127.0.0.1:8003"


def _headers(pairs, eos=False, full_duplex=None):
    msg = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
            ),
            end_of_stream=eos,
        )
    )
    if full_duplex is not None:
        msg.protocol_config.request_body_mode = (
            processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
            if full_duplex
            else processing_mode_pb2.ProcessingMode.BUFFERED
        )
    return msg


request_headers = st.builds(
    lambda path, method, extra, eos, fd: _headers(
        [(":path", path), (":method", method), *extra], eos, fd
    ),
    st.sampled_from(
        [
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/responses",
            "/v1/models",
            "",
            "/v1/chat/completions?x=1",
        ]
    ),
    st.sampled_from(["POST", "GET", "HEAD", ""]),
    st.lists(
        st.sampled_from(
            [
                ("content-length", "12"),
                ("content-length", "not a number"),
                ("content-length", "-5"),
                ("content-length", str(10**12)),
                ("content-encoding", "gzip"),
                ("content-encoding", "IDENTITY"),
                ("content-type", "application/json"),
                (HEADER, "10.9.9.9:1"),
                ("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
                ("traceparent", "garbage"),
            ]
        ),
        max_size=3,
    ),
    st.booleans(),
    st.none() | st.booleans(),
)
request_body = st.builds(
    lambda data, eos: ep.ProcessingRequest(request_body=ep.HttpBody(body=data, end_of_stream=eos)),
    st.sampled_from(
        [CHAT, CHAT[:40], CHAT[40:], b"", b"not json", b"[]", b'{"model": 1}', b"\xff\xfe"]
    )
    | st.binary(max_size=64),
    st.booleans(),
)
response_headers = st.builds(
    lambda served, status: ep.ProcessingRequest(
        response_headers=ep.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[
                    base_pb2.HeaderValue(key=":status", raw_value=status.encode()),
                    base_pb2.HeaderValue(key=HEADER + "-served", raw_value=served.encode()),
                ]
            )
        )
    ),
    st.sampled_from(
        [*ENDPOINTS.split(","), "10.9.9.9:1", "", "garbage", "127.0.0.1:8001,127.0.0.1:8002"]
    ),
    st.sampled_from(["200", "503", "", "abc"]),
)
processing_request = st.one_of(
    request_headers,
    request_body,
    response_headers,
    st.just(ep.ProcessingRequest(request_trailers=ep.HttpTrailers())),
    st.just(ep.ProcessingRequest(response_trailers=ep.HttpTrailers())),
    st.just(ep.ProcessingRequest(response_body=ep.HttpBody(body=b"x", end_of_stream=True))),
    st.just(ep.ProcessingRequest()),  # no oneof set at all
)
# Mostly well-formed openings with arbitrary continuations, plus fully arbitrary sequences.
sequences = st.one_of(
    st.lists(processing_request, max_size=8),
    st.tuples(request_headers, st.lists(processing_request, max_size=6)).map(
        lambda t: [t[0], *t[1]]
    ),
    st.tuples(request_headers, request_body, st.lists(processing_request, max_size=4)).map(
        lambda t: [t[0], t[1], *t[2]]
    ),
)


class _ServiceThread:
    """RouterService on its own event loop in a thread; tests talk to it with sync gRPC."""

    def __init__(self, body_mode: str) -> None:
        self.config = load_config(
            overrides={
                "server.listen": "127.0.0.1:0",
                "server.admin_listen": "",
                "server.body_mode": body_mode,
                "server.decisions_kept": 0,
                "endpoints": ENDPOINTS,
                "health.enabled": False,
                "signals.enabled": False,
            },
            environ={},
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.service = RouterService(self.config)
        self.ended = 0
        observe = self.service.observe

        def counting(outcome):
            observe(outcome)
            self.ended += 1

        self.service.observe = counting  # the servicer calls this once per ended stream
        self.port = asyncio.run_coroutine_threadsafe(self.service.start(), self.loop).result(30)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = epg.ExternalProcessorStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def close(self) -> None:
        self.channel.close()
        asyncio.run_coroutine_threadsafe(self.service.stop(0), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def services():
    started = {mode: _ServiceThread(mode) for mode in ("buffered", "full_duplex_streamed")}
    yield started
    for service in started.values():
        service.close()


def _wait(predicate, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.002)
    return predicate()


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(mode=st.sampled_from(["buffered", "full_duplex_streamed"]), messages=sequences)
def test_servicer_survives_any_message_sequence(services, mode, messages):
    svc = services[mode]
    ended_before = svc.ended
    errors_before = sum(
        n for (kind, _), n in svc.service.outcomes.counts.items() if kind == "error"
    )
    try:
        responses = list(svc.stub.Process(iter(messages), timeout=10))
    except grpc.RpcError as exc:  # the stream must end on its own, never by our deadline
        pytest.fail(f"stream failed with {exc.code()}: {exc.details()}")
    # At most one answer per message (an ImmediateResponse ends the exchange early).
    assert len(responses) <= len(messages) + 16  # echoes may split a body in 1 MiB pieces
    for response in responses:
        assert response.WhichOneof("response") is not None
        if response.HasField("immediate_response"):
            assert response.immediate_response.status.code in (429, 503)
    assert _wait(lambda: svc.ended == ended_before + 1), "the stream's end was not observed"
    assert all(n == 0 for n in svc.service.router.in_flight().values())
    errors = sum(n for (kind, _), n in svc.service.outcomes.counts.items() if kind == "error")
    assert errors == errors_before
    reply = svc.health.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_servicer_client_cancel_mid_stream_leaves_nothing_in_flight(services):
    svc = services["buffered"]
    ended_before = svc.ended
    release = threading.Event()

    def messages():
        yield _headers([(":path", "/v1/chat/completions"), (":method", "POST")])
        yield ep.ProcessingRequest(request_body=ep.HttpBody(body=CHAT, end_of_stream=True))
        release.wait(10)

    call = svc.stub.Process(messages(), timeout=10)
    first, second = next(call), next(call)
    assert second.request_body.response.header_mutation.set_headers  # a decision was made
    assert _wait(lambda: sum(svc.service.router.in_flight().values()) == 1)
    call.cancel()
    release.set()
    assert _wait(lambda: svc.ended == ended_before + 1)
    assert all(n == 0 for n in svc.service.router.in_flight().values())
    assert first.WhichOneof("response") == "request_headers"
