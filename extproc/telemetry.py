"""OpenTelemetry traces of routing decisions, configured only by the standard OTEL_* variables.

One span per request the processor sees, a child of the request's W3C ``traceparent`` (or of
Envoy's ext_proc call span when Envoy itself traces: its context comes as gRPC metadata). The
span covers the router's part of the request (headers in → stream closed) and carries the
decision: model, API, prompt size, chosen endpoint and fallbacks, matched blocks, the rule,
the top candidates (as at most TOP_K span events: bounded cardinality), the decision latency
and, on the response path, the endpoint that really served. Its context is injected into the
upstream request (``traceparent`` header) so the model server's spans join the same trace.

Exporter selection: OTEL_TRACES_EXPORTER = otlp | console | none (comma list allowed). When
it is unset, otlp is used only if an OTLP endpoint is configured, otherwise tracing is off
(no collector, no error spam). OTLP protocol from OTEL_EXPORTER_OTLP[_TRACES]_PROTOCOL
(grpc default, or http/protobuf); endpoint, headers, sampler (OTEL_TRACES_SAMPLER[_ARG]),
service name and resource attributes are read by the SDK itself. The sampler defaults to
always_on (not the SDK's parent-based default: a client's traceparent must not decide
whether a decision is traced); spans still unexported two seconds into the exit are dropped.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from .server import Outcome

log = logging.getLogger(__name__)
TOP_K = 3
_PROPAGATOR = TraceContextTextMapPropagator()
SPAN_NAME = "prefix_router.route"
# Spans not exported this long after the process starts to exit are dropped.
SHUTDOWN_SECONDS = 2.0


def _exporters_from_env(environ: Mapping[str, str]) -> list[str]:
    configured = environ.get("OTEL_TRACES_EXPORTER")
    if configured is None:
        has_endpoint = any(
            environ.get(k)
            for k in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        )
        return ["otlp"] if has_endpoint else []
    return [e.strip() for e in configured.split(",") if e.strip() and e.strip() != "none"]


def tracer_from_env(environ: Mapping[str, str] | None = None) -> trace.Tracer | None:
    """A tracer wired to the exporters the environment asks for, or None when tracing is off."""
    environ = os.environ if environ is None else environ
    names = _exporters_from_env(environ)
    if not names:
        return None
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON

    class _BoundedExitProcessor(BatchSpanProcessor):
        """The SDK's batch processor, whose flush at exit gives up after SHUTDOWN_SECONDS: with
        the collector down it retried for ~27 s, past a pod's termination grace period."""

        def shutdown(self) -> None:
            self._batch_processor.shutdown(timeout_millis=int(SHUTDOWN_SECONDS * 1000))

    resource = Resource.create({SERVICE_NAME: environ.get("OTEL_SERVICE_NAME", "prefix-router")})
    # Every decision is traced: unless OTEL_TRACES_SAMPLER says otherwise, not the SDK's
    # parent-based default, under which a client's traceparent flag 00 left no span (and 01
    # forced one).
    sampler = None if environ.get("OTEL_TRACES_SAMPLER") else ALWAYS_ON
    provider = TracerProvider(resource=resource, sampler=sampler)
    for name in names:
        if name == "otlp":
            _check_otlp_protos()
            protocol = environ.get(
                "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            )
            if protocol == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                    OTLPSpanExporter,
                )
            else:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter,
                )
            provider.add_span_processor(_BoundedExitProcessor(OTLPSpanExporter()))
        elif name == "console":
            provider.add_span_processor(_BoundedExitProcessor(ConsoleSpanExporter()))
        else:
            raise ValueError(f"OTEL_TRACES_EXPORTER: unsupported exporter {name!r}")
    log.info("tracing on: exporters %s", ",".join(names))
    return provider.get_tracer("prefix-router")


def _check_otlp_protos() -> None:
    """xds-protos ships an old copy of opentelemetry/proto/*; if it was installed after
    opentelemetry-proto it replaced that package's files and the OTLP exporter cannot load."""
    from opentelemetry.proto.common.v1 import common_pb2

    if not hasattr(common_pb2, "InstrumentationScope"):
        raise RuntimeError(
            "OTLP exporter unavailable: xds-protos overwrote opentelemetry-proto's files; run "
            "pip install --no-deps --force-reinstall opentelemetry-proto (scripts/setup does)"
        )


class DecisionTracer:
    """Starts, annotates and ends the per-request span; no-op when tracer is None."""

    def __init__(self, tracer: trace.Tracer | None) -> None:
        self.tracer = tracer

    def start(
        self, headers: Mapping[str, str], call_metadata: Mapping[str, str] | None = None
    ) -> trace.Span | None:
        """Parent: Envoy's ext_proc call span when Envoy traces (its context arrives in the
        gRPC call metadata), else the client's ``traceparent`` request header."""
        if self.tracer is None:
            return None
        carrier = call_metadata if call_metadata and "traceparent" in call_metadata else headers
        parent = _PROPAGATOR.extract(carrier)
        return self.tracer.start_span(SPAN_NAME, context=parent, kind=SpanKind.SERVER)

    @staticmethod
    def inject(span: trace.Span | None) -> dict[str, str]:
        """Headers that make the upstream request a child of this span."""
        if span is None or not span.get_span_context().is_valid:
            return {}
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
        return carrier

    @staticmethod
    def finish(span: trace.Span | None, outcome: Outcome, block_tokens: float) -> None:
        if span is None:
            return
        attrs: dict[str, str | int | float | bool] = {
            "prefix_router.outcome": outcome.kind,
            "prefix_router.api": outcome.api,
            "prefix_router.model": outcome.model,
            "prefix_router.body_bytes": outcome.body_bytes,
            "prefix_router.prompt_bytes": outcome.prompt_bytes,
            "prefix_router.decision_ms": round(outcome.decide_seconds * 1000, 3),
            "http.request.method": outcome.headers.get(":method", ""),
            "url.path": outcome.headers.get(":path", "").split("?", 1)[0],
        }
        if outcome.list_wait:
            attrs["prefix_router.list_wait"] = outcome.list_wait
            attrs["prefix_router.list_wait_ms"] = round(outcome.list_wait_seconds * 1000, 3)
        decision = outcome.decision
        if decision is not None:
            attrs.update(
                {
                    "prefix_router.rule": decision.rule,
                    "prefix_router.endpoint": decision.endpoint or "",
                    "prefix_router.fallbacks": ",".join(decision.fallbacks),
                    "prefix_router.prompt_blocks": decision.total_blocks,
                    "prefix_router.matched_blocks": decision.matched_blocks,
                    "prefix_router.matched_tokens": int(decision.matched_blocks * block_tokens),
                }
            )
            for candidate in decision.explain(top_k=TOP_K)["candidates"]:
                span.add_event(
                    "candidate",
                    {
                        "endpoint": candidate["endpoint"],
                        "matched_blocks": candidate["matched_blocks"],
                        "load": candidate["load"],
                        "score": candidate["score"],
                        "eligible": candidate["eligible"],
                    },
                )
        else:
            attrs["prefix_router.rule"] = "pass_through" if outcome.kind == "pass_through" else ""
            attrs["prefix_router.reason"] = outcome.detail
        if outcome.served:
            attrs["prefix_router.served_endpoint"] = outcome.served
            if decision is not None and outcome.served != decision.endpoint:
                span.add_event("fallback", {"served": outcome.served})
        if outcome.status:
            attrs["http.response.status_code"] = int(outcome.status or 0)
        span.set_attributes(attrs)
        if outcome.kind == "error":
            span.set_status(Status(StatusCode.ERROR, outcome.detail))
        elif outcome.kind == "no_endpoint":
            span.set_status(Status(StatusCode.ERROR, "no ready endpoint"))
        span.end(end_time=time.time_ns())
