"""A no-op Envoy ext_proc processor: the floor any Python ``grpc.aio`` ext_proc service pays.

Answers every ProcessingRequest at once with the matching empty response (request headers →
HeadersResponse, request body → BodyResponse, response headers → HeadersResponse, and the
same for trailers and response bodies) without looking at it: no parsing, no routing, no
metrics. It serves the gRPC health service like the router (Envoy's router cluster health
check asks for ``envoy.service.ext_proc.v3.ExternalProcessor``; without a SERVING answer
Envoy would skip the processor and fail open), with the same server options.

Used by ``prefix-router bench overhead`` (row ``noop_buffered``) to show how much of the
router's cost is Python gRPC itself and how much is the routing work. Full-duplex mode is
not supported: there the processor must echo the body back, which is routing-side work.

Run: ``python -m extproc.noop_processor --host 127.0.0.1 --port 9002``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
MAX_MESSAGE_BYTES = 17 * 1024 * 1024  # as the router: 16 MiB bodies + 1 MiB

_ANSWERS = {
    "request_headers": ext_pb.ProcessingResponse(request_headers=ext_pb.HeadersResponse()),
    "request_body": ext_pb.ProcessingResponse(request_body=ext_pb.BodyResponse()),
    "request_trailers": ext_pb.ProcessingResponse(request_trailers=ext_pb.TrailersResponse()),
    "response_headers": ext_pb.ProcessingResponse(response_headers=ext_pb.HeadersResponse()),
    "response_body": ext_pb.ProcessingResponse(response_body=ext_pb.BodyResponse()),
    "response_trailers": ext_pb.ProcessingResponse(response_trailers=ext_pb.TrailersResponse()),
}


class NoopProcessor(ext_grpc.ExternalProcessorServicer):
    """Every message gets the empty answer of its kind; nothing else happens."""

    def __init__(self) -> None:
        self.streams = 0

    async def Process(
        self,
        request_iterator: AsyncIterator[ext_pb.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[ext_pb.ProcessingResponse]:
        self.streams += 1
        async for request in request_iterator:
            answer = _ANSWERS.get(request.WhichOneof("request") or "")
            if answer is not None:
                yield answer


async def serve(host: str, port: int) -> tuple[grpc.aio.Server, int, NoopProcessor]:
    server = grpc.aio.server(
        options=[
            ("grpc.so_reuseport", 1),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ]
    )
    processor = NoopProcessor()
    ext_grpc.add_ExternalProcessorServicer_to_server(processor, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot listen on {host}:{port}")
    await server.start()
    for name in ("", EXT_PROC_SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, bound, processor


async def _main(host: str, port: int) -> None:
    server, bound, processor = await serve(host, port)
    print(f"noop ext_proc processor on {host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=1.0)
    print(f"noop ext_proc processor stopped after {processor.streams} streams", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m extproc.noop_processor", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9002)
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main(args.host, args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
