"""Fixtures that run the real thing: stand-in replicas, the router and a real Envoy binary."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from extproc.stack import LOOPBACK, ManagedProcess, Stack, router_args_for

COMBINATIONS = [
    ("override-host", "buffered"),
    ("override-host", "full_duplex_streamed"),
    ("original-dst", "buffered"),
    ("original-dst", "full_duplex_streamed"),
]


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def replica(self) -> str:
        return self.headers.get("x-replica-name", "")


def request(
    port: int,
    body: bytes | None,
    path: str = "/v1/chat/completions",
    method: str = "POST",
    headers: list[tuple[str, str]] | None = None,
    timeout: float = 30.0,
) -> Response:
    conn = http.client.HTTPConnection(LOOPBACK, port, timeout=timeout)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        sent = {"content-type": "application/json"}
        for name, value in headers or []:
            conn.putheader(name, value)
        for name, value in sent.items():
            conn.putheader(name, value)
        if body is not None:
            conn.putheader("content-length", str(len(body)))
        conn.endheaders(body)
        response = conn.getresponse()
        data = response.read()
        return Response(response.status, {k.lower(): v for k, v in response.getheaders()}, data)
    finally:
        conn.close()


def chat_body(*turns: str, system: str = "You are a careful assistant. " * 30, **extra) -> bytes:
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return json.dumps(
        {"model": "demo-model", "messages": messages, "max_tokens": 4, **extra}
    ).encode()


@dataclass
class RoutedStack:
    stack: Stack
    mode: str
    body_mode: str
    replicas: list[str]
    names: dict[str, str]  # address -> replica name
    router_address: str
    router: ManagedProcess
    envoy_port: int
    router_args: list[str]

    def send(self, body: bytes | None, **kwargs) -> Response:
        return request(self.envoy_port, body, **kwargs)

    def restart_router(self) -> None:
        _, self.router = self.stack.start_router(
            self.replicas,
            body_mode=self.body_mode,
            port=int(self.router_address.rsplit(":", 1)[1]),
            extra_args=self.router_args,
        )


def start_routed_stack(
    stack: Stack,
    mode: str,
    body_mode: str,
    replicas: list[str],
    router_args: list[str] | None = None,
    **envoy_options,
) -> RoutedStack:
    args = [*(router_args or []), *router_args_for(mode)]
    router_address, router = stack.start_router(replicas, body_mode=body_mode, extra_args=args)
    port, _ = stack.start_proxy(mode, replicas, router_address, body_mode, **envoy_options)
    names = {address: f"replica-{i + 1}" for i, address in enumerate(replicas)}
    return RoutedStack(stack, mode, body_mode, replicas, names, router_address, router, port, args)


@pytest.fixture(scope="session")
def replica_stack() -> Iterator[tuple[Stack, list[str], str]]:
    """Four member replicas and one live non-member ("intruder") on loopback."""
    with Stack() as stack:
        # Fast prefill so that multi-megabyte prompts answer in well under a second.
        fast = ["--prefill-ms-per-token", "0.0001", "--decode-ms-per-token", "0.1"]
        members = stack.start_replicas(4, fast)
        intruder = stack.start_replicas(1, fast)[0]
        yield stack, members, intruder


@pytest.fixture(scope="module", params=COMBINATIONS, ids=lambda c: f"{c[0]}/{c[1]}")
def routed(request, replica_stack) -> Iterator[RoutedStack]:
    _, members, _ = replica_stack
    mode, body_mode = request.param
    with Stack() as stack:
        yield start_routed_stack(stack, mode, body_mode, members)
