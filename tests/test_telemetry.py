"""Decision spans: attributes per rule, parent from traceparent, context injected upstream."""

from __future__ import annotations

import grpc
import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as epg
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from extproc.config import load_config
from extproc.serve import RouterService
from extproc.telemetry import SPAN_NAME, TOP_K, DecisionTracer, tracer_from_env

from .test_server import ENDPOINTS, body_msg, destination, exchange, headers_msg

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.fixture
async def traced():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    cfg = load_config(
        overrides={
            "server.listen": "127.0.0.1:0",
            "server.admin_listen": "",
            "endpoints": ENDPOINTS,
            "health.enabled": False,
            "signals.enabled": False,
            "routing.load_epsilon": 0.0,
            "routing.load_slack": 1,
        },
        environ={},
    )
    svc = RouterService(cfg, tracer=DecisionTracer(provider.get_tracer("test")))
    port = await svc.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    svc.stub = epg.ExternalProcessorStub(channel)
    svc.exporter = exporter
    yield svc
    await channel.close()
    await svc.stop(0)


def chat(text: str) -> bytes:
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]})


def only_span(exporter):
    spans = exporter.get_finished_spans()
    assert len(spans) == 1
    exporter.clear()
    return spans[0]


async def test_routed_span_is_a_child_of_traceparent_and_is_injected_upstream(traced):
    responses = await exchange(
        traced.stub, [headers_msg(extra=[("traceparent", TRACEPARENT)]), body_msg(chat("hi " * 50))]
    )
    span = only_span(traced.exporter)
    assert span.name == SPAN_NAME
    assert f"{span.context.trace_id:032x}" == TRACE_ID
    assert f"{span.parent.span_id:016x}" == PARENT_ID
    attrs = span.attributes
    assert attrs["prefix_router.rule"] == "cold_start_hash"
    assert attrs["prefix_router.outcome"] == "routed"
    assert attrs["prefix_router.model"] == "m" and attrs["prefix_router.api"] == "chat"
    assert attrs["prefix_router.prompt_blocks"] > 0 and attrs["prefix_router.matched_blocks"] == 0
    assert attrs["prefix_router.endpoint"] in ENDPOINTS.split(",")
    assert attrs["prefix_router.decision_ms"] >= 0
    assert 1 <= len([e for e in span.events if e.name == "candidate"]) <= TOP_K
    injected = {
        h.header.key: h.header.raw_value.decode()
        for h in responses[1].request_body.response.header_mutation.set_headers
    }
    assert injected["traceparent"] == f"00-{TRACE_ID}-{span.context.span_id:016x}-01"


async def test_affinity_and_load_guard_rules_are_recorded(traced):
    body = chat("shared prefix " * 60)
    await exchange(traced.stub, [headers_msg(), body_msg(body)])
    first = only_span(traced.exporter)
    await exchange(traced.stub, [headers_msg(), body_msg(body)])
    second = only_span(traced.exporter)
    assert second.attributes["prefix_router.rule"] == "prefix_affinity"
    assert second.attributes["prefix_router.endpoint"] == first.attributes["prefix_router.endpoint"]
    assert (
        second.attributes["prefix_router.matched_blocks"]
        == second.attributes["prefix_router.prompt_blocks"]
    )
    # Hold streams open on the same prefix: the guard (slack 1, eps 0) moves some elsewhere.
    home = first.attributes["prefix_router.endpoint"]
    calls, primaries = [], []
    for _ in range(4):
        call = traced.stub.Process()
        await call.write(headers_msg())
        await call.read()
        await call.write(body_msg(body))
        primaries.append(destination(await call.read())[0].split(",")[0])
        calls.append(call)
    assert list(traced.exporter.get_finished_spans()) == []  # all still open
    for call in calls:
        await call.done_writing()
        while await call.read() != grpc.aio.EOF:
            pass
    spans = traced.exporter.get_finished_spans()
    guarded = [s for s in spans if s.attributes["prefix_router.rule"] == "load_guard"]
    assert guarded and all(s.attributes["prefix_router.endpoint"] != home for s in guarded)
    assert {s.attributes["prefix_router.endpoint"] for s in spans} == set(primaries)
    assert home in primaries and len(set(primaries)) > 1


async def test_pass_through_and_no_endpoint_spans(traced):
    await exchange(traced.stub, [headers_msg(method="GET", path="/v1/models", eos=True)])
    span = only_span(traced.exporter)
    assert span.attributes["prefix_router.rule"] == "pass_through"
    assert span.attributes["prefix_router.reason"] == "method"
    assert span.status.status_code == StatusCode.UNSET

    for address in ENDPOINTS.split(","):
        traced.router.set_health(address, False)
    await exchange(traced.stub, [headers_msg(), body_msg(chat("nobody " * 30))])
    span = only_span(traced.exporter)
    assert span.attributes["prefix_router.outcome"] == "no_endpoint"
    assert span.status.status_code == StatusCode.ERROR


def test_exporter_selection_from_standard_variables():
    assert tracer_from_env({}) is None
    assert tracer_from_env({"OTEL_TRACES_EXPORTER": "none"}) is None
    assert tracer_from_env({"OTEL_TRACES_EXPORTER": "console"}) is not None
    assert tracer_from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}) is not None
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER"):
        tracer_from_env({"OTEL_TRACES_EXPORTER": "zipkin"})


def test_a_clients_trace_flags_do_not_decide_whether_a_decision_is_traced():
    """The SDK's default sampler follows the parent: a client's traceparent ending in 00
    left no span of the decision. Unless OTEL_TRACES_SAMPLER is set, every one is kept."""
    unsampled = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"}
    tracer = DecisionTracer(tracer_from_env({"OTEL_TRACES_EXPORTER": "console"}))
    span = tracer.start(unsampled)
    assert span is not None and span.is_recording()
    assert format(span.get_span_context().trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
    chosen = {"OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER": "parentbased_always_on"}
    span = DecisionTracer(tracer_from_env(chosen)).start(unsampled)
    assert span is not None and not span.is_recording()


def test_exit_with_the_collector_down_is_bounded():
    """With the collector unreachable the SDK's flush at exit retried for ~27 s, past the
    pod's termination grace; the router's processor gives up after SHUTDOWN_SECONDS."""
    import subprocess
    import sys
    import time

    script = (
        "from extproc.telemetry import DecisionTracer, tracer_from_env\n"
        "from extproc.server import Outcome\n"
        "tracer = DecisionTracer(tracer_from_env())\n"
        "for _ in range(2000):\n"
        "    tracer.finish(tracer.start({}), Outcome('pass_through', 'x'), 16)\n"
    )
    from pathlib import Path

    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1",
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
    }
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60)
    assert time.monotonic() - started < 15  # (27 s before; ~3 s now)
