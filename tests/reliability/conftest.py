"""Shared helpers of the reliability suite: a bounded aiohttp load generator with fault
events, router/Envoy metrics, and a report of the figures (docs/reliability.md).

Set RELIABILITY_REPORT=FILE to append every test's figures to FILE as JSON lines; they are
also printed (visible with ``pytest -s``).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc import envoyconf
from extproc.stack import LOOPBACK, ManagedProcess, Stack, free_port

from ..waiting import settled, wait_until  # noqa: F401 (the reliability tests import them here)

FAST = ["--prefill-ms-per-token", "0.0001", "--decode-ms-per-token", "0.1"]
REQUEST_TIMEOUT = 30.0  # per request: nothing may hang


def report(test: str, **figures) -> None:
    line = json.dumps({"test": test, **figures}, sort_keys=True)
    print(f"\nRELIABILITY {line}")
    path = os.environ.get("RELIABILITY_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(line + "\n")


def chat(conversation: int, turn: int, system: str = "You answer briefly. " * 12) -> bytes:
    messages = [{"role": "system", "content": system}]
    messages.append({"role": "user", "content": f"Conversation {conversation}: " + "tell me " * 30})
    for t in range(turn):
        messages += [
            {"role": "assistant", "content": f"answer {t}"},
            {"role": "user", "content": f"follow-up {t} of {conversation}"},
        ]
    return json.dumps({"model": "demo-model", "messages": messages, "max_tokens": 2}).encode()


@dataclass
class Result:
    index: int
    status: int  # 0: no HTTP answer (connection error or timeout)
    replica: str
    started: float
    seconds: float
    error: str = ""


@dataclass
class LoadRun:
    results: list[Result] = field(default_factory=list)
    events: dict[str, float] = field(default_factory=dict)  # event name -> time (monotonic)
    started: float = 0.0
    wall: float = 0.0

    @property
    def failed(self) -> list[Result]:
        return [r for r in self.results if r.status != 200]

    def statuses(self) -> dict[str, int]:
        return {str(k): v for k, v in sorted(Counter(r.status for r in self.results).items())}

    def between(self, start: str | None, end: str | None) -> list[Result]:
        lo = self.events[start] if start else float("-inf")
        hi = self.events[end] if end else float("inf")
        return [r for r in self.results if lo <= r.started < hi]

    def latency_ms(self, results: list[Result] | None = None, q: float = 0.99) -> float:
        values = sorted(r.seconds for r in (self.results if results is None else results))
        if not values:
            return 0.0
        return round(1000 * values[min(len(values) - 1, int(q * len(values)))], 1)

    def summary(self) -> dict:
        return {
            "sent": len(self.results),
            "failed": len(self.failed),
            "statuses": self.statuses(),
            "p50_ms": self.latency_ms(q=0.5),
            "p99_ms": self.latency_ms(q=0.99),
            "max_ms": self.latency_ms(q=1.0),
            "wall_s": round(self.wall, 2),
        }


Event = tuple[int, str, Callable[[], None]]  # (after this many completed, name, blocking action)


async def _load(
    port: int,
    total: int,
    concurrency: int,
    body: Callable[[int], bytes],
    events: list[Event],
    gate: float,
    path: str,
    rate: float | None,
) -> LoadRun:
    run = LoadRun(started=time.monotonic())
    done = 0
    progress = asyncio.Condition()
    events_done = asyncio.Event()
    next_index = 0
    gate_index = int(total * gate)

    failures: list[BaseException] = []

    async def fire() -> None:
        try:
            for after, name, action in events:
                async with progress:
                    await progress.wait_for(lambda after=after: done >= after)
                run.events[name] = time.monotonic()
                await asyncio.to_thread(action)
                run.events[name + ":done"] = time.monotonic()
        except BaseException as exc:  # reported after the load, never a stuck gate
            failures.append(exc)
        finally:
            events_done.set()

    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT)
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def worker() -> None:
            nonlocal done, next_index
            while next_index < total:
                index = next_index
                next_index += 1
                if index >= gate_index:
                    await events_done.wait()  # the tail runs after every fault was handled
                if rate:  # paced: request i starts no earlier than i / rate
                    await asyncio.sleep(max(0.0, run.started + index / rate - time.monotonic()))
                started = time.monotonic()
                try:
                    async with session.post(
                        f"http://{LOOPBACK}:{port}{path}",
                        data=body(index),
                        headers={"content-type": "application/json"},
                    ) as response:
                        await response.read()
                        result = Result(
                            index,
                            response.status,
                            response.headers.get("x-replica-name", ""),
                            started,
                            time.monotonic() - started,
                        )
                except (aiohttp.ClientError, TimeoutError) as exc:
                    result = Result(index, 0, "", started, time.monotonic() - started, repr(exc))
                run.results.append(result)
                async with progress:
                    done += 1
                    progress.notify_all()

        firing = asyncio.create_task(fire())
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        await firing
    run.wall = time.monotonic() - run.started
    if failures:
        raise failures[0]
    return run


def run_load(
    port: int,
    total: int,
    concurrency: int = 32,
    body: Callable[[int], bytes] | None = None,
    events: list[Event] | None = None,
    gate: float = 0.8,
    path: str = "/v1/chat/completions",
    rate: float | None = None,
) -> LoadRun:
    """``total`` requests at ``concurrency``; each event's blocking action runs in a thread
    once ``after`` requests completed, while the load goes on. Requests from ``gate`` x total
    on wait until every event is done, so some traffic always follows the last fault.
    ``rate``: start at most this many requests per second (a closed loop otherwise: then
    requests that fail fast make the client send faster)."""
    body = body or (lambda i: chat(i % 64, (i // 64) % 4))
    return asyncio.run(_load(port, total, concurrency, body, events or [], gate, path, rate))


# -- metrics ------------------------------------------------------------------------------


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def router_samples(admin_port: int) -> dict[tuple[str, tuple], float]:
    _, text = http_get(f"http://{LOOPBACK}:{admin_port}/metrics")
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples, name: str, **labels) -> float:
    return sum(
        v
        for (n, lbls), v in samples.items()
        if n == name and all(dict(lbls).get(k) == val for k, val in labels.items())
    )


def requests_by_outcome(admin_port: int) -> Counter:
    counts: Counter = Counter()
    for (name, labels), value in router_samples(admin_port).items():
        if name == "prefix_router_requests_total":
            d = dict(labels)
            counts[(d["outcome"], d["reason"])] += int(value)
    return counts


def routed_count(admin_port: int) -> int:
    return sum(n for (kind, _), n in requests_by_outcome(admin_port).items() if kind == "routed")


def envoy_stats(admin_port: int, contains: str = "ext_proc") -> dict[str, int]:
    _, text = http_get(f"http://{LOOPBACK}:{admin_port}/stats?filter={contains}")
    out = {}
    for line in text.decode().splitlines():
        name, sep, value = line.partition(": ")
        if sep and value.strip().lstrip("-").isdigit():
            out[name] = int(value)
    return out


@pytest.fixture(scope="module")
def replicas() -> Iterator[tuple[Stack, list[str]]]:
    """Four fast stand-in replicas shared by a module's tests."""
    with Stack() as stack:
        yield stack, stack.start_replicas(4, FAST)


# -- a routed stack that also exposes Envoy's admin port ---------------------------------


@dataclass
class Rig:
    stack: Stack
    mode: str
    body_mode: str
    replicas: list[str]
    router_address: str
    router: ManagedProcess
    router_args: list[str]
    envoy_port: int
    envoy_admin: int
    envoy: ManagedProcess
    options: envoyconf.EnvoyOptions
    router_name: str = "router"

    @property
    def router_admin(self) -> int:
        return self.stack.router_admin_ports[self.router_name]

    def restart_router(self, ready: bool = True) -> None:
        _, self.router = self.stack.start_router(
            self.replicas,
            body_mode=self.body_mode,
            port=int(self.router_address.rsplit(":", 1)[1]),
            extra_args=self.router_args,
            ready=ready,
            name=self.router_name,
        )

    def send(self, body: bytes | None, **kwargs):
        from tests.integration.conftest import request

        kwargs.setdefault("timeout", REQUEST_TIMEOUT)
        return request(self.envoy_port, body, **kwargs)

    def envoy_router_healthy(self) -> bool:
        """Envoy's view of the router cluster (its gRPC health check)."""
        _, text = http_get(f"http://{LOOPBACK}:{self.envoy_admin}/clusters")
        lines = [ln for ln in text.decode().splitlines() if ln.startswith("prefix_router::")]
        flags = [ln for ln in lines if "::health_flags::" in ln]
        return bool(flags) and all(ln.endswith("::healthy") for ln in flags)

    def wait_routing(self, timeout: float = 15.0) -> float | None:
        """Send probes until one is routed again; seconds it took (None: never).

        Envoy's /clusters can show the router healthy a while before its worker threads
        route through it again (measured up to ~1 s after a restart under load)."""
        started = time.monotonic()
        i = 0
        while time.monotonic() - started < timeout:
            before = routed_count(self.router_admin)
            self.send(chat(90_000 + i, 0))
            i += 1
            if wait_until(lambda b=before: routed_count(self.router_admin) > b, 0.3, 0.02):
                return time.monotonic() - started
        return None

    def routing_works(self, tag: str = "probe", turns: int = 4) -> Probe:
        """A conversation's turns all land on one replica and the router counted them.

        The answer is falsy on failure and its repr says why (pytest prints it)."""
        before = routed_count(self.router_admin)
        probe = Probe(tag)
        for turn in range(turns):
            response = self.send(chat(hash(tag) % 10_000, turn, system=f"{tag} " * 40))
            probe.statuses.append(response.status)
            probe.replicas.append(response.replica)
            if response.status != 200:
                break
        # The router counts a request when its stream ends, just after the response.
        probe.counted = wait_until(
            lambda: routed_count(self.router_admin) >= before + turns, 5, 0.05
        )
        if not probe:
            probe.routed = routed_count(self.router_admin) - before
            probe.decisions = _recent_decisions(self.router_admin, turns + 2)
        return probe


@dataclass
class Probe:
    """What ``Rig.routing_works`` saw: one conversation's turns through Envoy."""

    tag: str
    statuses: list[int] = field(default_factory=list)
    replicas: list[str] = field(default_factory=list)
    counted: bool = False
    routed: int | None = None  # on failure: requests the router counted meanwhile
    decisions: list[dict] = field(default_factory=list)  # on failure: its latest records

    def __bool__(self) -> bool:
        return (
            bool(self.statuses)
            and all(status == 200 for status in self.statuses)
            and len(set(self.replicas)) == 1
            and self.counted
        )


def _recent_decisions(admin_port: int, limit: int) -> list[dict]:
    """The router's latest decision records, trimmed to what explains a probe's failure."""
    try:
        _, text = http_get(f"http://{LOOPBACK}:{admin_port}/debug/decisions?limit={limit}")
        records = json.loads(text)["decisions"]
    except (OSError, ValueError, KeyError) as error:
        return [{"error": repr(error)}]
    keep = ("time", "outcome", "reason", "prompt_bytes", "decision_ms", "served", "status")
    out = []
    for record in records:
        brief = {key: record.get(key) for key in keep}
        decision = record.get("decision") or {}
        brief["decision"] = {k: v for k, v in decision.items() if k != "candidates"}
        brief["candidates"] = decision.get("candidates")
        out.append(brief)
    return out


def start_rig(
    stack: Stack,
    mode: str,
    body_mode: str,
    replicas: list[str],
    router_args: list[str] | None = None,
    name: str = "",
    **envoy_options,
) -> Rig:
    """Router + Envoy; ``name`` tells several rigs of one Stack apart."""
    args = list(router_args or [])
    if mode == "original-dst":
        args += ["--set", "server.single_destination=true"]
    router_name = f"router-{name}" if name else "router"
    router_address, router = stack.start_router(
        replicas, body_mode=body_mode, extra_args=args, name=router_name
    )
    port, admin = free_port(), free_port()
    options = envoyconf.EnvoyOptions(
        mode=mode,
        endpoints=replicas,
        listen=f"{LOOPBACK}:{port}",
        admin=f"{LOOPBACK}:{admin}",
        router=envoy_options.pop("router", router_address),
        body_mode=body_mode,
        **envoy_options,
    )
    _, envoy = stack.start_envoy(options, name=f"envoy-{mode}-{body_mode}{name}")
    rig = Rig(stack, mode, body_mode, replicas, router_address, router, args, port, admin, envoy,
              options, router_name)  # fmt: skip
    wait_until(rig.envoy_router_healthy, 10)
    return rig
