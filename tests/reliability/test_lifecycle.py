"""Graceful lifecycle: SIGTERM turns the router not-ready (gRPC health and /readyz), keeps
serving for the readiness notice, lets in-flight streams finish, then exits 0; rolling
restarts under load lose no request through Envoy.
"""

from __future__ import annotations

import re
import signal
import threading
import time

import grpc
import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as epg
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc import envoyconf
from extproc.serve import READINESS_NOTICE_SECONDS
from extproc.stack import LOOPBACK, Stack, free_port

from .conftest import (
    chat,
    envoy_stats,
    http_get,
    report,
    routed_count,
    run_load,
    start_rig,
    wait_until,
)

pytestmark = [pytest.mark.envoy]
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _headers(pairs):
    return ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]
            )
        )
    )


def test_sigterm_turns_not_ready_then_drains_in_flight_streams(replicas):
    _, members = replicas
    with Stack() as stack:
        address, router = stack.start_router(members, ready=True)
        admin = stack.router_admin_ports["router"]
        channel = grpc.insecure_channel(address)
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service="readiness"), timeout=30
        )
        assert next(watch).status == SERVING

        # One request in flight: headers and body answered, the stream still open.
        outbox: list = [
            _headers([(":path", "/v1/chat/completions"), (":method", "POST")]),
            ep.ProcessingRequest(request_body=ep.HttpBody(body=chat(1, 0), end_of_stream=True)),
        ]
        release = threading.Event()

        def messages():
            yield from outbox
            release.wait(20)
            yield ep.ProcessingRequest(
                response_headers=ep.HttpHeaders(
                    headers=base_pb2.HeaderMap(
                        headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")]
                    )
                )
            )

        stream = epg.ExternalProcessorStub(channel).Process(messages(), timeout=30)
        next(stream)
        decision = next(stream)
        assert decision.request_body.response.header_mutation.set_headers

        router.signal(signal.SIGTERM)
        sigterm = time.monotonic()
        assert next(watch).status == NOT_SERVING  # the open Watch sees the flip
        not_ready_after = time.monotonic() - sigterm
        watch.cancel()  # an open Watch is an in-flight RPC too: it would hold the drain
        assert wait_until(lambda: http_get(f"http://{LOOPBACK}:{admin}/readyz")[0] == 503, 5, 0.02)
        assert http_get(f"http://{LOOPBACK}:{admin}/healthz")[0] == 200  # alive, not ready
        # New streams are still accepted during the readiness notice...
        probe = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="readiness"), timeout=5
        )
        assert probe.status == NOT_SERVING
        # ...and past it the process waits for the stream we hold.
        time.sleep(READINESS_NOTICE_SECONDS + 0.5)
        assert router.alive()
        release.set()
        rest = list(stream)  # the stream ends normally
        assert [r.WhichOneof("response") for r in rest] == ["response_headers"]
        router.process.wait(10)
        exited_after = time.monotonic() - sigterm
        assert router.process.returncode == 0
        assert exited_after < 9  # well before the 10 s grace: it left once the stream ended
        channel.close()
        log = router.log_path.read_text()
        assert "drained, exiting" in log
        # Start-up's heap was frozen once serving (serve.freeze_start_up_heap).
        assert re.search(r"; [1-9][0-9]{3,} start-up objects frozen", log), log
        report(
            "sigterm_drain",
            not_ready_after_s=round(not_ready_after, 3),
            readiness_notice_s=READINESS_NOTICE_SECONDS,
            exited_after_s=round(exited_after, 2),
            in_flight_stream_completed=True,
        )


def test_stream_outliving_the_grace_still_completes_through_envoy():
    """A response longer than server.grace_seconds: the router cancels the stream at the
    end of the grace and Envoy carries on without it (failure_mode_allow)."""
    with Stack() as stack:
        slow = stack.start_replicas(
            2, ["--decode-ms-per-token", "40", "--max-output-tokens", "512"]
        )
        rig = start_rig(
            stack, "override-host", "buffered", slow, ["--set", "server.grace_seconds=2"]
        )
        result: dict = {}

        def long_request():
            body = orjson.dumps(
                {
                    "model": "demo-model",
                    "messages": [{"role": "user", "content": "x " * 50}],
                    "max_tokens": 100,
                    "stream": True,
                }
            )
            result["response"] = rig.send(body)

        thread = threading.Thread(target=long_request)
        thread.start()
        time.sleep(0.5)  # the request is streaming (about 4 s of tokens)
        rig.router.signal(signal.SIGTERM)
        sigterm = time.monotonic()
        rig.router.process.wait(15)
        exited = time.monotonic() - sigterm
        thread.join(30)
        response = result["response"]
        report(
            "stream_outlives_grace",
            grace_s=2,
            router_exited_after_s=round(exited, 2),
            status=response.status,
            done=b"[DONE]" in response.body,
        )
        assert exited < 6
        assert response.status == 200 and b"[DONE]" in response.body


def _events_restart(stack: Stack, members, names_ports, envoy_admin):
    """SIGTERM each router in turn, wait for its exit, start it again, wait until Envoy
    sees it healthy: a rolling restart of the router cluster."""

    def healthy(port: int) -> bool:
        _, text = http_get(f"http://{LOOPBACK}:{envoy_admin}/clusters")
        key = f"prefix_router::{LOOPBACK}:{port}::health_flags::healthy"
        return key in text.decode()

    def restart(name: str, port: int):
        def action():
            proc = stack.process(name)
            proc.signal(signal.SIGTERM)
            proc.process.wait(30)
            stack.processes.remove(proc)
            stack.start_router(members, port=port, name=name, ready=True)
            assert wait_until(lambda: healthy(port), 10, 0.05)

        return action

    return [(300 * (i + 1), f"restart-{n}", restart(n, p)) for i, (n, p) in enumerate(names_ports)]


@pytest.mark.slow
def test_rolling_restart_of_two_routers_loses_nothing(replicas):
    _, members = replicas
    with Stack() as stack:
        a, _ = stack.start_router(members, name="router-a", ready=True)
        b, _ = stack.start_router(members, name="router-b", ready=True)
        port, admin = free_port(), free_port()
        options = envoyconf.EnvoyOptions(
            endpoints=members,
            listen=f"{LOOPBACK}:{port}",
            admin=f"{LOOPBACK}:{admin}",
            router=f"{a},{b}",
        )
        stack.start_envoy(options)
        names_ports = [
            ("router-a", int(a.rsplit(":", 1)[1])),
            ("router-b", int(b.rsplit(":", 1)[1])),
        ]
        events = _events_restart(stack, members, names_ports, admin)
        assert wait_until(
            lambda: (
                "health_flags::healthy"
                in http_get(f"http://{LOOPBACK}:{admin}/clusters")[1].decode()
            ),
            10,
        )
        run = run_load(port, 2000, 32, events=events, gate=0.85)
        stats = envoy_stats(admin)
        figures = run.summary() | {
            "routers": 2,
            "failed_open": stats.get("http.llm.ext_proc.failure_mode_allowed", 0),
            "streams_started": stats.get("http.llm.ext_proc.streams_started", 0),
            "routed_by_new_routers": sum(
                routed_count(stack.router_admin_ports[n]) for n, _ in names_ports
            ),
            "restart_s": [
                round(run.events[f"restart-{n}:done"] - run.events[f"restart-{n}"], 2)
                for n, _ in names_ports
            ],
        }
        report("rolling_restart_two_routers", **figures)
        assert run.failed == [], run.failed[:5]
        assert figures["routed_by_new_routers"] > 0


@pytest.mark.slow
def test_rolling_restart_on_one_port_with_so_reuseport_loses_nothing(replicas):
    _, members = replicas
    with Stack() as stack:
        rig = start_rig(stack, "override-host", "buffered", members)
        port = int(rig.router_address.rsplit(":", 1)[1])

        def overlap():
            # The new router binds the same port first (SO_REUSEPORT), then the old drains.
            stack.start_router(members, port=port, name="router-new", ready=True)
            rig.router.signal(signal.SIGTERM)
            rig.router.process.wait(30)

        run = run_load(rig.envoy_port, 2000, 32, events=[(400, "overlap", overlap)])
        stats = envoy_stats(rig.envoy_admin)
        wait_until(rig.envoy_router_healthy, 10)
        new_admin = stack.router_admin_ports["router-new"]
        during_load = routed_count(new_admin)
        # Envoy may keep failing open for a while after the swap (its health check can stick
        # to the old process's connection); the new router must take over all the same.
        probes = 0
        while routed_count(new_admin) == 0 and probes < 150:
            rig.send(chat(80_000 + probes, 0))
            probes += 1
            wait_until(lambda: routed_count(new_admin) > 0, 0.1, 0.02)
        figures = run.summary() | {
            "failed_open": stats.get("http.llm.ext_proc.failure_mode_allowed", 0),
            "overlap_s": round(run.events["overlap:done"] - run.events["overlap"], 2),
            "routed_by_new_router_during_load": during_load,
            "probes_until_routed_by_new_router": probes,
        }
        report("rolling_restart_same_port", **figures)
        assert run.failed == [], run.failed[:5]
        assert routed_count(new_admin) > 0
