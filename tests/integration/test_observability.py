"""Traces over a real OTLP/gRPC round trip, and metrics scraped after real Envoy traffic."""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from extproc.stack import LOOPBACK, Stack

from .conftest import chat_body, request, start_routed_stack

pytestmark = [pytest.mark.envoy]
FAST = ["--prefill-ms-per-token", "0.0001", "--decode-ms-per-token", "0.1"]


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    def Export(self, request, context):
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self):
        for export in self.requests:
            for resource_spans in export.resource_spans:
                attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    for span in scope.spans:
                        yield attrs, span


def get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def samples(admin_port: int) -> dict[tuple[str, tuple], float]:
    _, text = get(f"http://{LOOPBACK}:{admin_port}/metrics")
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(metrics, name, **labels) -> float:
    return sum(
        v
        for (n, lbls), v in metrics.items()
        if n == name and all(dict(lbls).get(k) == val for k, val in labels.items())
    )


@pytest.fixture
def otlp_receiver():
    """A minimal OTLP/gRPC TraceService on loopback, and the router env that exports to it."""
    receiver = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    receiver.port = server.add_insecure_port(f"{LOOPBACK}:0")
    receiver.env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{LOOPBACK}:{receiver.port}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
        "OTEL_SERVICE_NAME": "router-under-test",
    }
    server.start()
    yield receiver
    server.stop(0)


def test_spans_arrive_over_otlp_grpc(otlp_receiver):
    receiver, env = otlp_receiver, otlp_receiver.env
    with Stack() as stack:
        members = stack.start_replicas(2, FAST)
        router, _ = stack.start_router(members, env=env)
        envoy_port, _ = stack.start_proxy("override-host", members, router)

        parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        for i in range(3):
            response = request(
                envoy_port, chat_body(f"traced {i} " * 20), headers=[("traceparent", parent)]
            )
            assert response.status == 200
        deadline = time.monotonic() + 15
        while len(list(receiver.spans())) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
    spans = [(res, span) for res, span in receiver.spans() if span.name == "prefix_router.route"]
    assert len(spans) >= 3
    resource, span = spans[0]
    assert resource["service.name"] == "router-under-test"
    assert span.trace_id.hex() == "0af7651916cd43dd8448eb211c80319c"
    assert span.parent_span_id.hex() == "b7ad6b7169203331"
    attrs = {a.key for a in span.attributes}
    assert {"prefix_router.rule", "prefix_router.endpoint", "prefix_router.decision_ms"} <= attrs


@pytest.mark.parametrize("workers", [1, 2])
def test_metrics_and_decisions_after_traffic_through_envoy(tmp_path, workers):
    with Stack(workdir=tmp_path) as stack:
        members = stack.start_replicas(2, FAST)
        routed = start_routed_stack(
            stack,
            "override-host",
            "buffered",
            members,
            ["--workers", str(workers), "--set", "signals.interval_seconds=0.2"],
        )
        admin = stack.router_admin_ports["router"]
        deadline = time.monotonic() + 20
        while get(f"http://{LOOPBACK}:{admin}/readyz")[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert get(f"http://{LOOPBACK}:{admin}/healthz")[0] == 200
        assert get(f"http://{LOOPBACK}:{admin}/readyz")[0] == 200
        routed_requests = 20
        for i in range(routed_requests):
            conversation = [f"metrics conversation {i % 5} " * 20]
            assert routed.send(chat_body(*conversation)).status == 200
        passed = 5
        for _ in range(passed):
            assert routed.send(None, path="/v1/models", method="GET").status == 200

        def settled(metrics: dict[tuple[str, tuple], float]) -> None:
            """Every figure of the traffic, once each worker's gauges have refreshed."""
            assert (
                total(metrics, "prefix_router_requests_total", outcome="routed") == routed_requests
            )
            assert (
                total(
                    metrics, "prefix_router_requests_total", outcome="pass_through", reason="method"
                )
                == passed
            )
            assert total(metrics, "prefix_router_endpoint_decisions_total") == routed_requests
            assert total(metrics, "prefix_router_decision_seconds_count") == routed_requests
            prompt = total(metrics, "prefix_router_prompt_blocks_total")
            matched = total(metrics, "prefix_router_matched_blocks_total")
            assert 0 < matched < prompt  # 5 conversations seen 4 times each: 3/4 predicted hits
            assert total(metrics, "prefix_router_endpoint_in_flight") == 0
            assert total(metrics, "prefix_router_endpoint_queued_work") == 0
            # Learned from the replicas' prefill counters: these stand-ins prefill ~2 ms per
            # request, far faster than the configured start (60,000, an 8B model on an H200).
            assert total(metrics, "prefix_router_prefill_tokens_per_second") > 200_000
            assert total(metrics, "prefix_router_index_entries") > 0
            assert total(metrics, "prefix_router_endpoint_metrics_up") == len(members)
            realised = [
                v
                for (n, _), v in metrics.items()
                if n == "prefix_router_endpoint_realised_hit_ratio"
            ]
            assert realised and all(0 <= v <= 1 for v in realised) and max(realised) > 0

        deadline = time.monotonic() + 10  # gauges refresh every second; scrapes every 0.2 s
        while True:
            metrics = samples(admin)
            try:
                settled(metrics)
                break
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        status, body = get(f"http://{LOOPBACK}:{admin}/debug/decisions?limit=5&outcome=routed")
        assert status == 200
        decisions = json.loads(body)["decisions"]
        assert len(decisions) == 5
        assert {"rule", "endpoint", "candidates", "matched_blocks"} <= set(decisions[0]["decision"])
        routed.router.stop()


def test_router_span_is_a_child_of_envoys_ext_proc_call_when_envoy_traces(otlp_receiver):
    receiver, env, port = otlp_receiver, otlp_receiver.env, otlp_receiver.port
    with Stack() as stack:
        members = stack.start_replicas(2, FAST)
        router, _ = stack.start_router(members, env=env)
        envoy_port, _ = stack.start_proxy(
            "override-host", members, router, otlp_tracing=f"{LOOPBACK}:{port}"
        )
        assert request(envoy_port, chat_body("envoy traces this " * 20)).status == 200
        deadline = time.monotonic() + 20  # Envoy flushes its spans every 5 s
        while time.monotonic() < deadline:
            names = {span.name for _, span in receiver.spans()}
            if "prefix_router.route" in names and any("ext_proc" in n for n in names):
                break
            time.sleep(0.2)
    spans = list(receiver.spans())
    ours = next(span for _, span in spans if span.name == "prefix_router.route")
    call = next(span for _, span in spans if "ExternalProcessor" in span.name)
    assert ours.trace_id == call.trace_id
    assert ours.parent_span_id == call.span_id
