"""Envoy ext_proc servicer: the per-request state machine and nothing else.

One gRPC stream per HTTP request. BUFFERED: answer the request headers at once, decide on
the buffered body. FULL_DUPLEX_STREAMED: hold the headers answer until the whole body has
arrived, decide, answer the headers with the decision, then echo the body back in chunks.
Requests that are not routable LLM calls pass through with no decision (in BUFFERED mode
the headers answer tells Envoy to skip sending the body at all).
The decision's endpoint counts one in-flight request until the stream ends.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import orjson
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from .config import ServerConfig
from .prompt import LLMRequest, NotRoutable, api_for_path, parse_request
from .router import Router
from .scheduler import RULE_NO_ENDPOINT, Decision
from .telemetry import DecisionTracer

log = logging.getLogger(__name__)

FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_SKIP_BODY = ext_pb.ProcessingResponse(
    request_headers=ext_pb.HeadersResponse(),
    mode_override=processing_mode_pb2.ProcessingMode(
        request_body_mode=processing_mode_pb2.ProcessingMode.NONE,
        response_header_mode=processing_mode_pb2.ProcessingMode.SKIP,
    ),
)
_EMPTY_REQUEST_HEADERS = ext_pb.ProcessingResponse(request_headers=ext_pb.HeadersResponse())
_EMPTY_RESPONSE_HEADERS = ext_pb.ProcessingResponse(response_headers=ext_pb.HeadersResponse())
_EMPTY_REQUEST_TRAILERS = ext_pb.ProcessingResponse(request_trailers=ext_pb.TrailersResponse())
_EMPTY_RESPONSE_TRAILERS = ext_pb.ProcessingResponse(response_trailers=ext_pb.TrailersResponse())
_EMPTY_RESPONSE_BODY = ext_pb.ProcessingResponse(response_body=ext_pb.BodyResponse())
# Echoed body chunks stay well under gRPC's default 4 MiB message limit on Envoy's side.
ECHO_CHUNK_BYTES = 1024 * 1024
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
# Set by the Envoy configs (envoyconf.py) on Envoy's own reply when the upstream was unreachable.
UPSTREAM_FAILURE_HEADER = "x-prefix-router-upstream-failure"
# The same two facts as Envoy's ext_proc response attributes (envoyconf: response_attributes),
# which a gateway whose Envoy config adds neither header has too (Istio, Envoy Gateway), and
# which no replica can forge (a gateway does not strip those headers from its responses): the
# endpoint the response came from, and Envoy's response flags for the last attempt. The
# endpoint is dead where the marker's rule says so: Envoy could not connect (UF), or it reset
# the connection (UC, UR) on the last of the retries (URX). Not URX alone: retries used up
# on a live endpoint's 5xx answers, which Envoy forwards.
# A third, the number of attempts (Envoy 1.33 on), tells what neither says: which endpoints
# failed an attempt of a request a retry saved. Envoy tries the router's list in order, one
# entry per attempt (override-host), so the one that answered attempt n is the list's n-th
# and the entries before it failed; under original-dst attempt 1 went to the pick itself.
# Retries are for failures where the server did not answer (our configs: connect-failure,
# refused-stream, reset, a 503; Istio's default: connect-failure, refused-stream,
# unavailable, cancelled, a 503), so those endpoints are out until their next passing probe,
# unless one passed since the decision (a long answer reports a failure long past).
EXT_PROC_FILTER = "envoy.filters.http.ext_proc"
SERVED_ATTRIBUTE = "upstream.address"
FLAGS_ATTRIBUTE = "response.flags"
ATTEMPTS_ATTRIBUTE = "upstream.request_attempt_count"
_UPSTREAM_REMOTE_RESET = 1 << 4  # UR
_UPSTREAM_CONNECTION_FAILURE = 1 << 5  # UF
_UPSTREAM_CONNECTION_TERMINATION = 1 << 6  # UC
_UPSTREAM_RETRY_LIMIT_EXCEEDED = 1 << 15  # URX


def unreachable_by_flags(flags: int) -> bool:
    """Whether Envoy's response flags say the endpoint could not be reached (see above)."""
    reset = flags & (_UPSTREAM_REMOTE_RESET | _UPSTREAM_CONNECTION_TERMINATION)
    return bool(flags & _UPSTREAM_CONNECTION_FAILURE) or bool(
        reset and flags & _UPSTREAM_RETRY_LIMIT_EXCEEDED
    )


@dataclass(slots=True)
class Outcome:
    """What happened to one request; handed to the observer when its stream ends."""

    kind: str  # "routed" | "pass_through" | "no_endpoint" | "error"
    detail: str = ""
    decision: Decision | None = None
    api: str = ""
    model: str = ""
    prompt_bytes: int = 0
    body_bytes: int = 0
    decide_seconds: float = 0.0
    # Its model was in no list read: how long it waited for the lists read again, and how
    # that ended ("listed": a list names it now; "not_listed"; "timeout"; "cancelled").
    list_wait: str = ""
    list_wait_seconds: float = 0.0
    served: str = ""
    status: str = ""
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class _Exchange:
    """Per-stream state."""

    full_duplex: bool
    headers_seen: bool = False
    routable_api: str | None = None
    passing_through: bool = False
    decided: bool = False
    decided_at: float = 0.0  # router clock
    chunks: list[bytes] = field(default_factory=list)
    size: int = 0
    held: int = 0  # full duplex: bytes of chunks counted against max_held_body_bytes
    subset: frozenset[str] | None = None
    span: Any = None
    call_metadata: dict[str, str] | None = None
    # The response is a server-sent-events stream (its headers came before its prefill).
    event_stream: bool = False
    # Waiting for the model lists read again: the parsed request, what is awaited, and what
    # answers the message once it is done (``_after_the_lists``).
    request: LLMRequest | None = None
    waiting: asyncio.Future[None] | None = None
    resume: Callable[[], list] | None = None
    outcome: Outcome = field(default_factory=lambda: Outcome("pass_through", "no_body"))


def _header_map(headers: ext_pb.HttpHeaders) -> dict[str, str]:
    result = {}
    for h in headers.headers.headers:
        result[h.key] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return result


def _is_event_stream(status: str, headers: dict[str, str]) -> bool:
    """A successful server-sent-events response. vLLM and SGLang (FastAPI's
    StreamingResponse) send its headers when they accept the request, before its prefill
    starts, so they say nothing about the prefill: its charge keeps draining on the
    router's clock. Any other response's headers come after the whole generation, or are
    an error's (no prefill to wait for)."""
    content_type = headers.get("content-type", "").lower()
    return status.startswith("2") and content_type.startswith("text/event-stream")


def _content_length(headers: dict[str, str]) -> int:
    """Declared body size; 0 when absent or malformed (Envoy rejects those itself)."""
    value = headers.get("content-length", "").strip()
    return int(value) if value.isdigit() else 0


def _subset_hint(request: ext_pb.ProcessingRequest) -> frozenset[str] | None:
    if not request.HasField("metadata_context"):
        return None
    namespace = request.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_KEY]
    if value.HasField("list_value"):
        return frozenset(v.string_value for v in value.list_value.values)
    return frozenset(p.strip() for p in value.string_value.split(",") if p.strip())


def immediate_response(status: int, message: str) -> ext_pb.ProcessingResponse:
    body = orjson.dumps({"error": {"message": message, "type": "prefix_router", "code": status}})
    return ext_pb.ProcessingResponse(
        immediate_response=ext_pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=ext_pb.HeaderMutation(
                set_headers=[
                    base_pb2.HeaderValueOption(
                        header=base_pb2.HeaderValue(
                            key="content-type", raw_value=b"application/json"
                        ),
                        append_action=_OVERWRITE,
                    )
                ]
            ),
            body=body,
            details=f"prefix_router_{status}",
        )
    )


class ExternalProcessorService(ext_grpc.ExternalProcessorServicer):
    def __init__(
        self,
        router: Router,
        config: ServerConfig,
        observer: Callable[[Outcome], None] | None = None,
        tracer: DecisionTracer | None = None,
        progress: Callable[[], None] | None = None,
        probes: bool = True,
        read_lists_for: Callable[[str], asyncio.Future[None] | None] | None = None,
        list_wait_seconds: float = 0.0,
        read_list_of: Callable[[str], None] | None = None,
    ) -> None:
        """``progress`` is called after every message handled: the worker's heartbeat
        (serve.py), so that a loop busy with long requests is not taken for hung.
        ``probes``: the router probes its endpoints (health.enabled). Only then does what
        Envoy reports of a failed attempt take an endpoint out: a passing probe brings it
        back, and without probes nothing would. ``read_lists_for(model)``: the model lists
        read again for a model none names, what to wait on (``ModelLister.read_again_for``);
        a request waits for it up to ``list_wait_seconds``. ``read_list_of(address)``: that
        endpoint's model list read again at once (``ModelLister.unpolled``), after it
        answered 404 to a model its list named (an adapter unloaded since)."""
        self.router = router
        self._read_lists_for = read_lists_for if list_wait_seconds > 0 else None
        self._list_wait_seconds = list_wait_seconds
        self._read_list_of = read_list_of
        self._list_read_after_404: dict[str, float] = {}  # endpoint -> when (router clock)
        self.config = config
        self._takes_out = probes
        self.observer = observer
        self._progress = progress or (lambda: None)
        self.tracer = tracer or DecisionTracer(None)
        routing = router.config
        self._block_tokens = routing.block_size_bytes / routing.bytes_per_token
        self._full_duplex_default = config.body_mode == "full_duplex_streamed"
        # Full-duplex body bytes held by every stream together (max_held_body_bytes): Envoy
        # applies no body limit in that mode, and a body is held until it is whole.
        self.held_body_bytes = 0

    # -- building the decision ----------------------------------------------------------
    def _destination(self, decision: Decision) -> str:
        if self.config.single_destination or not decision.fallbacks:
            return decision.endpoint or ""
        return ",".join([decision.endpoint or "", *decision.fallbacks])

    def _decision_parts(
        self, decision: Decision, span: Any = None
    ) -> tuple[ext_pb.CommonResponse, struct_pb2.Struct]:
        value = self._destination(decision)
        # The decision, plus the trace context that makes the model server's spans children
        # of this decision's span.
        headers = {self.config.header_name: value, **self.tracer.inject(span)}
        common = ext_pb.CommonResponse(
            header_mutation=ext_pb.HeaderMutation(
                set_headers=[
                    base_pb2.HeaderValueOption(
                        header=base_pb2.HeaderValue(key=name, raw_value=text.encode()),
                        append_action=_OVERWRITE,
                    )
                    for name, text in headers.items()
                ]
            ),
            clear_route_cache=True,
        )
        metadata = struct_pb2.Struct()
        metadata.get_or_create_struct(self.config.metadata_namespace)[self.config.header_name] = (
            value
        )
        return common, metadata

    def _decide(self, ex: _Exchange) -> ext_pb.ProcessingResponse | tuple | None:
        """Route the buffered body. Returns an ImmediateResponse, or (common, metadata)
        for a decision, () for a pass-through, or None when the request is to wait for the
        model lists read again (``ex.waiting``; then it is called again)."""
        started = time.perf_counter()
        outcome = ex.outcome
        request = ex.request
        if request is None:
            body = b"".join(ex.chunks) if len(ex.chunks) != 1 else ex.chunks[0]
            ex.chunks = [body] if body else []
            outcome.body_bytes = len(body)
            outcome.api = ex.routable_api or ""
        try:
            if request is None:
                if ex.size > self.config.max_body_bytes:
                    raise NotRoutable("body_too_large")
                request = parse_request(ex.routable_api or "", body)
                outcome.model = request.model
                outcome.prompt_bytes = len(request.prompt)
                ex.waiting = self._lists_read_for(request.model, ex.subset)
                if ex.waiting is not None:
                    ex.request = request
                    outcome.decide_seconds = time.perf_counter() - started
                    return None
            decision = self.router.route(request, allowed=ex.subset, defer_record=True)
        except NotRoutable as exc:
            outcome.kind, outcome.detail = "pass_through", exc.kind
            outcome.decide_seconds += time.perf_counter() - started
            return ()
        except Exception as exc:  # a fault of the router's: the request goes on undecided
            # Raised out of the stream, it failed: Envoy fails open in buffered mode, but in
            # full-duplex mode, with the body handed over, it can only answer 500.
            log.exception("routing failed; the request goes on without a decision")
            outcome.kind, outcome.detail = "error", type(exc).__name__
            outcome.decide_seconds += time.perf_counter() - started
            return ()
        outcome.decide_seconds += time.perf_counter() - started
        no_endpoint = decision.rule == RULE_NO_ENDPOINT or decision.endpoint is None
        if no_endpoint and not self.router.endpoints_known and ex.subset is None:
            # Discovery has not answered yet (a worker just started while its siblings
            # serve): "none" would be a false 503; the request goes on unrouted. (Not for
            # a GAIE gateway, which sends a subset hint: its picker must name an endpoint
            # or answer an error, and the gateway does not route a request without one.)
            outcome.kind, outcome.detail = "pass_through", "endpoints_unknown"
            return ()
        outcome.decision = decision
        ex.decided_at = self.router.clock()
        if no_endpoint:
            outcome.kind = "no_endpoint"
            return immediate_response(503, "no ready endpoint for this request")
        outcome.kind = "routed"
        return self._decision_parts(decision, ex.span)

    def _lists_read_for(
        self, model: str, subset: frozenset[str] | None
    ) -> asyncio.Future[None] | None:
        """What a request naming ``model`` waits on before it is routed: the model lists
        read again, when no list names it (an adapter loaded at run time); else None (also
        when a gateway's subset hint leaves at most one endpoint: nothing to choose)."""
        read = self._read_lists_for
        if read is None or (subset is not None and len(subset) <= 1):
            return None
        if not self.router.models.unlisted(model, self.router.clock()):
            return None
        return read(model)

    async def _after_the_lists(self, ex: _Exchange) -> list:
        """Wait (bounded) for the model lists read again, then answer the held message."""
        waiting, resume = ex.waiting, ex.resume
        assert waiting is not None and resume is not None
        ex.waiting = ex.resume = None
        started = time.perf_counter()
        outcome = ex.outcome
        try:
            done, _ = await asyncio.wait({waiting}, timeout=self._list_wait_seconds)
        except asyncio.CancelledError:  # Envoy ended the stream (the client left)
            outcome.list_wait, outcome.detail = "cancelled", "cancelled_waiting_for_lists"
            outcome.list_wait_seconds = time.perf_counter() - started
            raise
        outcome.list_wait_seconds = time.perf_counter() - started
        if not done:
            outcome.list_wait = "timeout"
        elif self.router.models.unlisted(outcome.model, self.router.clock()):
            outcome.list_wait = "not_listed"
        else:
            outcome.list_wait = "listed"
        return resume()

    # -- the stream ---------------------------------------------------------------------
    async def Process(
        self,
        request_iterator: AsyncIterator[ext_pb.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[ext_pb.ProcessingResponse]:
        ex = _Exchange(full_duplex=self._full_duplex_default)
        if self.tracer.tracer is not None:
            ex.call_metadata = {
                k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)
            }
        try:
            async for request in request_iterator:
                responses = self._handle(ex, request)
                if ex.waiting is not None:  # its model is in no list: they are read again
                    responses = await self._after_the_lists(ex)
                self._progress()  # (here: this generator resumes after the others' work)
                for response in responses:
                    yield response
                    # grpc.aio has written the answer before it resumes this generator:
                    # the index update is off the time Envoy waits (Router.record).
                    self._record(ex)
        except Exception as exc:  # never let one request take the service down
            ex.outcome.kind, ex.outcome.detail = "error", type(exc).__name__
            log.exception("ext_proc stream failed; Envoy fails open for this request")
            raise
        finally:
            self._release(ex)  # a stream that ended with its body still held
            self._record(ex)  # a stream closed at its answer, or before it went out
            if ex.outcome.decision is not None:
                # Envoy ends a full-duplex processing stream at the response headers: for an
                # event stream that is before its prefill, so its charge must outlive it.
                prefill_over = not (ex.full_duplex and ex.event_stream)
                self.router.finish(ex.outcome.decision, prefill_over=prefill_over)
            self.tracer.finish(ex.span, ex.outcome, self._block_tokens)
            if self.observer is not None:
                self.observer(ex.outcome)

    def _record(self, ex: _Exchange) -> None:
        if ex.outcome.decision is not None:
            self.router.record(ex.outcome.decision)

    def _handle(self, ex: _Exchange, request: ext_pb.ProcessingRequest) -> list:
        kind = request.WhichOneof("request")
        if kind == "request_headers":
            return self._on_request_headers(ex, request)
        if kind == "request_body":
            return self._on_request_body(ex, request.request_body)
        if kind == "request_trailers":
            return self._on_request_trailers(ex)
        if kind == "response_headers":
            self._on_response_headers(ex, request)
            return [_EMPTY_RESPONSE_HEADERS]
        if kind == "response_body":
            return [_EMPTY_RESPONSE_BODY]
        if kind == "response_trailers":
            return [_EMPTY_RESPONSE_TRAILERS]
        return []

    def _out_of_order(self, ex: _Exchange, what: str) -> None:
        """A message Envoy never sends in this position: no decision for this request
        (one already made stands, and is released when the stream ends)."""
        if not ex.passing_through and not ex.decided:
            ex.outcome.kind, ex.outcome.detail = "pass_through", "out_of_order"
        ex.passing_through = True
        log.debug("ext_proc message out of order (%s); passing the request through", what)

    def _on_request_headers(self, ex: _Exchange, request: ext_pb.ProcessingRequest) -> list:
        if ex.headers_seen:
            self._out_of_order(ex, "request headers again")
            return [_EMPTY_REQUEST_HEADERS]
        ex.headers_seen = True
        if request.HasField("protocol_config"):
            ex.full_duplex = request.protocol_config.request_body_mode == FULL_DUPLEX
        headers = _header_map(request.request_headers)
        ex.outcome.headers = headers
        ex.span = self.tracer.start(headers, ex.call_metadata)
        api = api_for_path(headers.get(":path", ""))
        method = headers.get(":method", "")
        ex.subset = _subset_hint(request)
        reason = ""
        if method != "POST":
            reason = "method"
        elif api is None or api not in self._routable_apis():
            reason = "path"
        elif request.request_headers.end_of_stream:
            reason = "empty_body"
        elif headers.get("content-encoding", "identity").lower() != "identity":
            reason = "content_encoding"
        elif _content_length(headers) > self.config.max_body_bytes:
            reason = "body_too_large"
        if reason:
            ex.passing_through = True
            ex.outcome.kind, ex.outcome.detail = "pass_through", reason
            # In full-duplex mode the body still streams through us; echo it unchanged.
            return [_EMPTY_REQUEST_HEADERS if ex.full_duplex else _SKIP_BODY]
        ex.routable_api = api
        ex.outcome.api = api
        if ex.full_duplex:
            return []  # held until the body has arrived and the decision is made
        return [_EMPTY_REQUEST_HEADERS]

    def _routable_apis(self) -> set[str]:
        return {a for a in (api_for_path(p) for p in self.config.routable_paths) if a}

    def _on_request_body(self, ex: _Exchange, body: ext_pb.HttpBody) -> list:
        if not ex.headers_seen:
            self._out_of_order(ex, "body before headers")
        if ex.passing_through or ex.decided:
            if ex.full_duplex:
                return [_echo(body.body, body.end_of_stream)]
            return [ext_pb.ProcessingResponse(request_body=ext_pb.BodyResponse())]
        ex.chunks.append(body.body)
        ex.size += len(body.body)
        if ex.full_duplex:
            if ex.size > self.config.max_body_bytes:
                return self._give_up_full_duplex(ex, body.end_of_stream, "body_too_large")
            if self.held_body_bytes + len(body.body) > self.config.max_held_body_bytes:
                return self._give_up_full_duplex(ex, body.end_of_stream, "held_bodies_too_large")
            ex.held += len(body.body)
            self.held_body_bytes += len(body.body)
            if not body.end_of_stream:
                return []
            return self._finish_full_duplex(ex, end_of_stream=True)
        # BUFFERED: Envoy sends the whole body in one message.
        ex.decided = True
        return self._answer_buffered(ex)

    def _answer_buffered(self, ex: _Exchange) -> list:
        result = self._decide(ex)
        if result is None:
            ex.resume = lambda: self._answer_buffered(ex)
            return []
        if isinstance(result, ext_pb.ProcessingResponse):
            return [result]
        if not result:
            return [ext_pb.ProcessingResponse(request_body=ext_pb.BodyResponse())]
        common, metadata = result
        return [
            ext_pb.ProcessingResponse(
                request_body=ext_pb.BodyResponse(response=common), dynamic_metadata=metadata
            )
        ]

    def _on_request_trailers(self, ex: _Exchange) -> list:
        responses = []
        if ex.full_duplex and ex.routable_api and not ex.decided and not ex.passing_through:
            responses = self._finish_full_duplex(ex, end_of_stream=False)
            if ex.waiting is not None:
                ex.resume = lambda: [
                    *self._finish_full_duplex(ex, end_of_stream=False),
                    _EMPTY_REQUEST_TRAILERS,
                ]
                return []
        return [*responses, _EMPTY_REQUEST_TRAILERS]

    def _finish_full_duplex(self, ex: _Exchange, end_of_stream: bool) -> list:
        ex.decided = True
        result = self._decide(ex)
        if result is None:
            ex.resume = lambda: self._finish_full_duplex(ex, end_of_stream)
            return []
        if isinstance(result, ext_pb.ProcessingResponse):
            return [result]
        if result:
            common, metadata = result
            first = ext_pb.ProcessingResponse(
                request_headers=ext_pb.HeadersResponse(response=common), dynamic_metadata=metadata
            )
        else:
            first = _EMPTY_REQUEST_HEADERS
        echoes = _echo_all(ex.chunks, end_of_stream)
        ex.chunks = []
        self._release(ex)
        return [first, *echoes]

    def _give_up_full_duplex(self, ex: _Exchange, end_of_stream: bool, reason: str) -> list:
        """A body over a limit: release the headers with no decision and echo what we hold."""
        ex.decided = ex.passing_through = True
        ex.outcome.kind, ex.outcome.detail = "pass_through", reason
        chunks, ex.chunks = ex.chunks, []
        self._release(ex)
        return [_EMPTY_REQUEST_HEADERS, *_echo_all(chunks, end_of_stream)]

    def _release(self, ex: _Exchange) -> None:
        self.held_body_bytes -= ex.held
        ex.held = 0

    def _on_response_headers(self, ex: _Exchange, request: ext_pb.ProcessingRequest) -> None:
        headers = _header_map(request.response_headers)
        ex.outcome.status = headers.get(":status", "")
        attributes = _response_attributes(request)
        # Envoy's own attributes first: a gateway forwards a replica's response headers.
        address = attributes.get(SERVED_ATTRIBUTE)
        if isinstance(address, str) and address:
            served = address
        else:
            served = headers.get(self.config.served_header_name, "")
        ex.outcome.served = served
        decision = ex.outcome.decision
        if decision is not None:
            if served:
                self.router.served(decision, served)
                if ex.outcome.status == "404":
                    self._not_found(served, ex.outcome.model)
            ex.event_stream = _is_event_stream(ex.outcome.status, headers)
            if not ex.event_stream:
                self.router.prefill_done(decision)
        flags = _finite(attributes.get(FLAGS_ATTRIBUTE))
        if flags is not None and flags >= 0:
            unreachable = unreachable_by_flags(int(flags))
        else:
            unreachable = bool(headers.get(UPSTREAM_FAILURE_HEADER))
        if not self._takes_out or not served:
            return
        if unreachable:
            # Envoy could not reach the endpoint (its local reply carries the response flags):
            # stop picking it now rather than at the next failed probe; a passing probe
            # brings it back.
            self._take_out(served)
        if decision is not None:
            for address in self._failed_attempts(decision, served, attributes):
                if not self.router.probe_passed_since(address, ex.decided_at):
                    self._take_out(address)

    def _not_found(self, address: str, model: str) -> None:
        """A 404 from an endpoint whose list named the request's model (vLLM's answer to a
        model it does not serve: an adapter unloaded since the last read): its list is
        read again at once, so that the next requests go to the servers that still have
        it, not until the next round (``models.interval_seconds``). At most once a second
        per endpoint (a server that answers 404 to a model its list names, all the time,
        is not read ten times a second)."""
        if self._read_list_of is None or not self.router.lists_model(address, model):
            return
        now = self.router.clock()
        if now - self._list_read_after_404.get(address, -math.inf) >= 1.0:
            if len(self._list_read_after_404) > 4 * len(self.router.endpoints):
                self._list_read_after_404.clear()  # (endpoints that left)
            self._list_read_after_404[address] = now
            log.info(
                "%s answered 404 for %r, which its list named: reading it again", address, model
            )
            self._read_list_of(address)

    def _take_out(self, address: str) -> None:
        """Out until its next passing probe, unless that would leave fewer than half of the
        endpoints to pick (as Envoy's outlier detection caps its ejections): a burst of
        failures on every replica, a 503 each, must not empty the pool on one report each;
        past that, the probes decide."""
        healthy = self.router.healthy_endpoints()
        if address in healthy and 2 * (len(healthy) - 1) < len(self.router.endpoints):
            log.warning(
                "Envoy reports %s failed; left to its probes (half the endpoints are out)",
                address,
            )
            return
        self.router.set_health(address, False)

    def _failed_attempts(
        self, decision: Decision, served: str, attributes: dict[str, Any]
    ) -> list[str]:
        """The endpoints that failed an attempt before ``served`` answered (see above; also
        when ``served`` failed the last attempt too: its flags say so); none where the
        attempts cannot be matched to the list (an entry Envoy skipped, a list used up:
        attempts went on by round robin, as with ``routing.fallbacks`` 0)."""
        attempts = _finite(attributes.get(ATTEMPTS_ATTRIBUTE))
        if attempts is None or attempts <= 1:
            return []
        if decision.endpoint is None or served == decision.endpoint:
            return []
        if self.config.single_destination:
            return [decision.endpoint]  # original-dst: attempt 1 is exactly the pick
        tried = [decision.endpoint, *decision.fallbacks]
        n = int(attempts)
        if n <= len(tried) and tried[n - 1] == served:
            return tried[: n - 1]
        return []


def _finite(value: Any) -> float | None:
    """A numeric attribute's value (Struct numbers are floats), or None: absent, another
    type, NaN or infinite."""
    return value if isinstance(value, float) and math.isfinite(value) else None


def _response_attributes(request: ext_pb.ProcessingRequest) -> dict[str, Any]:
    """The attributes Envoy sends with the response headers (the ext_proc filter's
    ``response_attributes``), by name; {} when none are configured."""
    if not request.attributes:
        return {}
    attributes = request.attributes.get(EXT_PROC_FILTER)
    # (protobuf's Struct gives Python values; the callers check their types)
    return {} if attributes is None else dict(attributes.items())


def _echo(data: bytes, end_of_stream: bool) -> ext_pb.ProcessingResponse:
    return ext_pb.ProcessingResponse(
        request_body=ext_pb.BodyResponse(
            response=ext_pb.CommonResponse(
                body_mutation=ext_pb.BodyMutation(
                    streamed_response=ext_pb.StreamedBodyResponse(
                        body=data, end_of_stream=end_of_stream
                    )
                )
            )
        )
    )


def _echo_all(chunks: list[bytes], end_of_stream: bool) -> list[ext_pb.ProcessingResponse]:
    data = b"".join(chunks)
    pieces = [data[i : i + ECHO_CHUNK_BYTES] for i in range(0, len(data), ECHO_CHUNK_BYTES)]
    if not pieces and end_of_stream:
        pieces = [b""]  # answers an empty last body message; trailers alone need no echo
    last = len(pieces) - 1
    return [_echo(piece, end_of_stream and i == last) for i, piece in enumerate(pieces)]
