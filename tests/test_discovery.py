"""Endpoint discovery: Kubernetes list/watch against a local fake API server, DNS, factory.

The fake API server (aiohttp on 127.0.0.1) speaks the list/watch protocol of
/apis/discovery.k8s.io/v1/namespaces/NS/endpointslices: a list answers an EndpointSliceList,
a watch (?watch=1&resourceVersion=RV) streams newline-delimited JSON events. Its data in
tests/data/k8s/ has the exact shape of API-server output (list items without kind/apiVersion,
watch objects with them, managedFields, targetRefs, a dual-stack IPv6 slice, a Status for 410).
"""

from __future__ import annotations

import asyncio
import copy
import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from extproc import discovery
from extproc.config import DiscoveryConfig, EndpointConfig, RoutingConfig
from extproc.discovery import (
    DiscoveryError,
    DnsSource,
    KubernetesSource,
    StaticSource,
    getaddrinfo_resolver,
    ready_addresses,
    slice_addresses,
    slice_port,
    source_from_config,
)

DATA = Path(__file__).parent / "data" / "k8s"
LIST = json.loads((DATA / "endpointslices-list.json").read_text())
EVENTS = [
    json.loads(line) for line in (DATA / "endpointslices-watch.jsonl").read_text().splitlines()
]
GONE = json.loads((DATA / "status-410-expired.json").read_text())

# Ready in the recorded list: 1.5 and 2.7 (ready), 1.8 (conditions not set -> ready).
# Not ready: 3.9 (starting), 2.11 (terminating). IPv6 twins of 1.5/2.7 are the same pods.
INITIAL = ["10.244.1.5:8000", "10.244.1.8:8000", "10.244.2.7:8000"]
PATH = "/apis/discovery.k8s.io/v1/namespaces/llm/endpointslices"

Script = list[dict[str, Any]] | int | str  # events then close | HTTP status | "hang"


class FakeApiServer:
    """Scripted API server: one list body (or status) per list call, one script per watch."""

    def __init__(self, lists: list[dict[str, Any] | int], watches: list[Script]) -> None:
        self.lists = lists
        self.watches = watches
        self.requests: list[dict[str, str]] = []
        self.auth: list[str | None] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        query = dict(request.query)
        self.requests.append(query)
        self.auth.append(request.headers.get("Authorization"))
        if query.get("labelSelector") != "kubernetes.io/service-name=vllm":
            return web.json_response({"kind": "Status", "code": 400}, status=400)
        if query.get("watch") not in ("1", "true"):
            body = self.lists.pop(0) if len(self.lists) > 1 else self.lists[0]
            if isinstance(body, int):
                return web.json_response({"kind": "Status", "code": body}, status=body)
            return web.json_response(body)
        script = self.watches.pop(0) if self.watches else "hang"
        if isinstance(script, int):
            return web.json_response(GONE if script == 410 else {"code": script}, status=script)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        if script == "hang":  # an open watch with nothing happening
            await asyncio.sleep(3600)
        for event in script:  # type: ignore[union-attr]
            await response.write(orjson.dumps(event) + b"\n")
            await asyncio.sleep(0.01)
        await response.write_eof()
        return response

    def lists_made(self) -> int:
        return sum(1 for q in self.requests if "watch" not in q)

    def watch_versions(self) -> list[str]:
        return [q["resourceVersion"] for q in self.requests if "watch" in q]

    async def __aenter__(self) -> FakeApiServer:
        app = web.Application()
        app.router.add_get(PATH, self.handle)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()


class Recorder:
    """Each publication's ready endpoints (``calls``) and not-ready members (``held``)."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.held: list[list[str]] = []

    def __call__(self, endpoints: list[EndpointConfig]) -> None:
        self.calls.append([e.address for e in endpoints if e.ready])
        self.held.append([e.address for e in endpoints if not e.ready])

    @property
    def last(self) -> list[str] | None:
        return self.calls[-1] if self.calls else None


async def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


def k8s_config(tmp_path: Path, **overrides: Any) -> DiscoveryConfig:
    token = tmp_path / "token"
    token.write_text("test-token\n")
    values: dict[str, Any] = {
        "kind": "kubernetes",
        "namespace": "llm",
        "service": "vllm",
        "port": "http",
        "token_file": str(token),
        "ca_file": str(tmp_path / "no-ca.crt"),
        "backoff_initial_seconds": 0.01,
        "backoff_max_seconds": 0.05,
    }
    values.update(overrides)
    return DiscoveryConfig(**values)


async def run_source(source: Any, recorder: Recorder) -> asyncio.Task[None]:
    return asyncio.create_task(source.run(recorder))


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


# --------------------------------------------------------------------------- pure parsing


def test_ready_addresses_from_recorded_list() -> None:
    assert sorted(ready_addresses(LIST["items"], "http")) == INITIAL
    assert sorted(ready_addresses(LIST["items"], 8000)) == INITIAL
    assert sorted(ready_addresses(LIST["items"], "metrics")) == [
        a.replace(":8000", ":9090") for a in INITIAL
    ]
    # Only the IPv6 slice: the pods with an IPv6 address that are ready.
    assert sorted(ready_addresses(LIST["items"], "http", "ipv6")) == [
        "[fd00:10:244:1::5]:8000",
        "[fd00:10:244:2::7]:8000",
    ]
    assert ready_addresses(LIST["items"], "grpc") == set()
    assert ready_addresses(LIST["items"], 1234) == set()


def test_not_ready_endpoints_are_members_and_terminating_ones_are_gone() -> None:
    """A pod failing its readiness probe (stalled, overloaded, restarting in place) stays a
    member the router does not pick, so its index can outlive the stall; a terminating one
    (being deleted) is gone. Ready in any slice is ready."""
    assert slice_addresses(LIST["items"], "http") == {
        "10.244.1.5:8000": True,
        "10.244.1.8:8000": True,
        "10.244.2.7:8000": True,
        "10.244.3.9:8000": False,  # starting
    }
    (one, _) = copy.deepcopy(LIST["items"])
    twin = copy.deepcopy(one)
    twin["endpoints"][3]["conditions"] = {"ready": True}
    assert slice_addresses([one, twin], "http")["10.244.3.9:8000"] is True


def test_slice_port_rules() -> None:
    one = {"ports": [{"name": "", "port": 8000, "protocol": "TCP"}]}
    two = {"ports": [{"name": "http", "port": 8000}, {"name": "metrics", "port": 9090}]}
    assert slice_port(one, None) == 8000
    assert slice_port(two, None) is None  # ambiguous: configure discovery.port
    assert slice_port(two, "metrics") == 9090
    assert slice_port({"ports": [{"name": "all", "port": None}]}, "all") is None
    assert slice_port({"ports": None}, None) is None


def test_fqdn_slices_and_endpoints_without_addresses_are_skipped() -> None:
    fqdn = {
        "addressType": "FQDN",
        "endpoints": [{"addresses": ["vllm.example.com"]}],
        "ports": [{"name": "http", "port": 8000}],
    }
    empty = {
        "addressType": "IPv4",
        "endpoints": [{"addresses": [], "conditions": {"ready": True}}],
        "ports": [{"name": "http", "port": 8000}],
    }
    assert ready_addresses([fqdn, empty], "http") == set()


# --------------------------------------------------------------------------- Kubernetes


async def test_list_then_watch_events(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(discovery, "SETTLE_SECONDS", 0.001)  # each event published alone
    async with FakeApiServer([LIST], [EVENTS]) as server:
        source = KubernetesSource(k8s_config(tmp_path, api_url=server.url))
        recorder = Recorder()
        task = await run_source(source, recorder)
        try:
            await wait_for(lambda: source.watches >= 2)  # the scripted watch ended: re-watch
            await wait_for(lambda: len(recorder.calls) >= 4)
        finally:
            await stop(task)
    assert recorder.calls == [
        INITIAL,  # list
        ["10.244.1.5:8000", "10.244.1.8:8000"],  # 9k4lm terminating (not ready)
        ["10.244.1.5:8000", "10.244.1.8:8000", "10.244.4.2:8000"],  # ADDED slice
        ["10.244.1.5:8000", "10.244.1.8:8000"],  # DELETED slice
    ]
    # 3.9 is starting (not ready, not terminating): a member not picked; the terminating
    # ones (2.11 throughout, 2.7 once it terminates) are gone.
    assert recorder.held == [["10.244.3.9:8000"]] * 4
    assert server.auth[0] == "Bearer test-token"
    # Watch from the list's version, then, after the server closed the stream, from the
    # last event's version (the DELETED object's), without listing again.
    assert server.watch_versions()[:2] == ["48213", "48400"]
    assert server.lists_made() == 1
    first_watch = next(q for q in server.requests if "watch" in q)
    assert first_watch["allowWatchBookmarks"] == "true"
    assert int(first_watch["timeoutSeconds"]) == 300


@pytest.mark.parametrize("settle", [discovery.SETTLE_SECONDS, 0.001])
async def test_a_pod_moved_to_another_slice_is_never_published_as_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, settle: float
) -> None:
    """The EndpointSlice controller moves a pod from one slice to another with two updates:
    one slice loses it, then the other gains it. Published apart, the pod was removed for a
    moment (its index and in-flight count dropped, a new incarnation); events that come
    together are published together. (Control: published one by one, it is dropped.)"""
    monkeypatch.setattr(discovery, "SETTLE_SECONDS", settle)
    (slice_a, _) = copy.deepcopy(LIST["items"])
    moved = slice_a["endpoints"].pop(0)
    assert moved["addresses"] == ["10.244.1.5"]
    lost = {
        "type": "MODIFIED",
        "object": {**slice_a, "metadata": {**slice_a["metadata"], "resourceVersion": "48300"}},
    }
    slice_b = copy.deepcopy(slice_a)
    slice_b["metadata"] = {
        **slice_a["metadata"],
        "name": "vllm-b",
        "uid": "b",
        "resourceVersion": "48301",
    }
    slice_b["endpoints"] = [moved]
    gained = {"type": "ADDED", "object": slice_b}
    async with FakeApiServer([LIST], [[lost, gained]]) as server:
        source = KubernetesSource(k8s_config(tmp_path, api_url=server.url))
        recorder = Recorder()
        task = await run_source(source, recorder)
        try:
            await wait_for(lambda: source.watches >= 2)
        finally:
            await stop(task)
    if settle > 0.001:
        assert recorder.calls == [INITIAL]
    else:
        assert recorder.calls[1] == ["10.244.1.8:8000", "10.244.2.7:8000"]
        assert recorder.calls[-1] == INITIAL


async def test_bookmark_moves_the_resource_version(tmp_path: Path) -> None:
    bookmark = [e for e in EVENTS if e["type"] == "BOOKMARK"]
    async with FakeApiServer([LIST], [bookmark]) as server:
        source = KubernetesSource(k8s_config(tmp_path, api_url=server.url))
        recorder = Recorder()
        task = await run_source(source, recorder)
        try:
            await wait_for(lambda: len(server.watch_versions()) >= 2)
        finally:
            await stop(task)
    assert server.watch_versions()[:2] == ["48213", "48300"]
    assert recorder.calls == [INITIAL]


@pytest.mark.parametrize("how", ["http-410", "error-event-410"])
async def test_410_gone_relists(tmp_path: Path, how: str) -> None:
    relisted = copy.deepcopy(LIST)
    relisted["metadata"]["resourceVersion"] = "48977"
    relisted["items"][0]["endpoints"][0]["conditions"]["ready"] = False  # 1.5 went away
    gone: Script = 410 if how == "http-410" else [EVENTS[0], {"type": "ERROR", "object": GONE}]
    async with FakeApiServer([LIST, relisted], [gone]) as server:
        source = KubernetesSource(k8s_config(tmp_path, api_url=server.url))
        recorder = Recorder()
        task = await run_source(source, recorder)
        try:
            await wait_for(lambda: server.lists_made() >= 2 and len(server.watch_versions()) >= 2)
            await wait_for(lambda: recorder.last == ["10.244.1.8:8000", "10.244.2.7:8000"])
        finally:
            await stop(task)
    assert server.watch_versions()[:2] == ["48213", "48977"]
    assert recorder.calls[0] == INITIAL


async def test_errors_back_off_and_recover(tmp_path: Path) -> None:
    async with FakeApiServer([500, 403, LIST], [503]) as server:
        source = KubernetesSource(k8s_config(tmp_path, api_url=server.url))
        recorder = Recorder()
        task = await run_source(source, recorder)
        try:
            # list 500, list 403, list OK + watch 503 -> relist OK + watch (hangs)
            await wait_for(lambda: server.lists_made() >= 4)
            await wait_for(lambda: len(server.watch_versions()) >= 2)
        finally:
            await stop(task)
    assert recorder.calls == [INITIAL]  # published once: the repeat list changed nothing


async def test_unreachable_api_server_keeps_retrying(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connection refused
    source = KubernetesSource(k8s_config(tmp_path, api_url=f"http://127.0.0.1:{port}"))
    recorder = Recorder()
    task = await run_source(source, recorder)
    await asyncio.sleep(0.3)
    assert not task.done()  # never raises out
    await stop(task)
    assert recorder.calls == []


async def test_removed_endpoints_leave_the_router_index(tmp_path: Path) -> None:
    """Discovery -> Router.set_endpoints: a vanished endpoint's index entries are dropped."""
    from extproc.prompt import parse_request
    from extproc.router import Router

    router = Router(RoutingConfig(), [])
    seen = Recorder()
    before: dict[str, int] = {}

    def on_change(endpoints: list[EndpointConfig]) -> None:
        seen(endpoints)
        router.set_endpoints(endpoints)
        if len(seen.calls) == 1:  # route some conversations while all three are there
            for i in range(40):
                body = {"model": "m", "messages": [{"role": "user", "content": f"q{i} " * 40}]}
                router.finish(router.route(parse_request("chat", orjson.dumps(body))))
            before.update(router.index.entries_by_endpoint())

    async with FakeApiServer([LIST], [[EVENTS[0]]]) as server:
        source = KubernetesSource(k8s_config(tmp_path, api_url=server.url))
        task = asyncio.create_task(source.run(on_change))
        try:
            await wait_for(lambda: len(seen.calls) >= 2)
        finally:
            await stop(task)
    assert before.get("10.244.2.7:8000", 0) > 0  # it did hold blocks
    assert router.endpoints == ["10.244.1.5:8000", "10.244.1.8:8000", "10.244.3.9:8000"]
    assert router.healthy_endpoints() == ["10.244.1.5:8000", "10.244.1.8:8000"]  # 3.9 starting
    assert before.get("10.244.3.9:8000", 0) == 0  # (never picked)
    after = router.index.entries_by_endpoint()
    assert after.get("10.244.2.7:8000", 0) == 0
    for address in router.healthy_endpoints():  # the survivors keep theirs
        assert after.get(address, 0) == before.get(address, 0)


def test_in_cluster_defaults(tmp_path: Path) -> None:
    (tmp_path / "namespace").write_text("inference\n")
    config = DiscoveryConfig(kind="kubernetes", service="vllm", token_file=str(tmp_path / "token"))
    source = KubernetesSource(
        config, environ={"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    )
    assert source.api_url == "https://10.96.0.1:443"
    assert source.namespace == "inference"
    assert source.path == (
        "/apis/discovery.k8s.io/v1/namespaces/inference/endpointslices"
        "?labelSelector=kubernetes.io%2Fservice-name%3Dvllm"
    )
    v6 = KubernetesSource(config, environ={"KUBERNETES_SERVICE_HOST": "fd00::1"})
    assert v6.api_url == "https://[fd00::1]:443"
    with pytest.raises(ValueError, match="KUBERNETES_SERVICE_HOST"):
        KubernetesSource(config, environ={})


# --------------------------------------------------------------------------- DNS


async def test_getaddrinfo_resolves_localhost() -> None:
    addresses = await getaddrinfo_resolver("localhost", 8000)
    assert "127.0.0.1:8000" in addresses
    assert set(addresses) <= {"127.0.0.1:8000", "[::1]:8000"}


async def test_dns_source_with_the_system_resolver() -> None:
    config = DiscoveryConfig(
        kind="dns",
        dns_name="localhost",
        dns_port=8001,
        address_family="ipv4",
        interval_seconds=0.05,
    )
    recorder = Recorder()
    task = await run_source(DnsSource(config), recorder)
    try:
        await wait_for(lambda: recorder.calls != [])
    finally:
        await stop(task)
    assert recorder.calls == [["127.0.0.1:8001"]]


async def test_dns_changes_failures_and_dedup() -> None:
    answers: list[list[str] | Exception] = [
        ["10.0.0.2:8000", "10.0.0.1:8000", "10.0.0.1:8000"],
        ["10.0.0.1:8000", "10.0.0.2:8000"],  # same set: no call
        socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"),
        ["10.0.0.1:8000", "10.0.0.3:8000", "[fd00::1]:8000"],
        [],
    ]
    calls: list[tuple[str, int]] = []

    async def resolver(name: str, port: int) -> list[str]:
        calls.append((name, port))
        answer = answers.pop(0) if answers else []
        if isinstance(answer, Exception):
            raise answer
        return answer

    config = DiscoveryConfig(
        kind="dns",
        dns_name="vllm.llm.svc.cluster.local",
        dns_port=8000,
        interval_seconds=0.01,
        backoff_initial_seconds=0.01,
        capacity_tokens=4096,
    )
    received: list[list[EndpointConfig]] = []
    task = asyncio.create_task(DnsSource(config, resolver=resolver).run(received.append))
    try:
        await wait_for(lambda: len(received) >= 3)
    finally:
        await stop(task)
    assert [[e.address for e in r] for r in received] == [
        ["10.0.0.1:8000", "10.0.0.2:8000"],
        ["10.0.0.1:8000", "10.0.0.3:8000", "[fd00::1]:8000"],  # the failure kept the old list
        [],
    ]
    assert received[0][0].capacity_tokens == 4096
    assert calls[0] == ("vllm.llm.svc.cluster.local", 8000)


async def test_one_empty_dns_answer_is_asked_again_before_it_empties_the_set() -> None:
    """An NXDOMAIN while the records are rewritten read as no endpoints: the set and every
    endpoint's index were emptied, and requests got 503 for an interval. One empty answer
    is now held for an interval; two in a row empty the set."""
    answers = [["10.0.0.1:8000"], [], ["10.0.0.1:8000"], [], []]

    async def resolver(name: str, port: int) -> list[str]:
        return answers.pop(0) if answers else []

    config = DiscoveryConfig(kind="dns", dns_name="vllm.llm", dns_port=8000, interval_seconds=0.01)
    received = Recorder()
    task = asyncio.create_task(DnsSource(config, resolver=resolver).run(received))
    try:
        await wait_for(lambda: not answers and received.last == [])
    finally:
        await stop(task)
    assert received.calls == [["10.0.0.1:8000"], []]


async def test_dns_srv_records() -> None:
    async def srv(name: str) -> list[tuple[str, int]]:
        assert name == "_http._tcp.vllm.llm.svc.cluster.local"
        return [("vllm-0.vllm.llm.svc.cluster.local", 8000), ("vllm-1.vllm", 8001)]

    hosts = {"vllm-0.vllm.llm.svc.cluster.local": "10.0.0.5", "vllm-1.vllm": "10.0.0.6"}

    async def resolver(name: str, port: int) -> list[str]:
        return [f"{hosts[name]}:{port}"]

    config = DiscoveryConfig(
        kind="dns", dns_name="_http._tcp.vllm.llm.svc.cluster.local", srv=True, interval_seconds=1
    )
    source = DnsSource(config, resolver=resolver, srv_resolver=srv)
    assert await source.lookup() == {"10.0.0.5:8000", "10.0.0.6:8001"}
    # A target that does not resolve (a stale record) is left out, the others still read;
    # when none resolves, the lookup fails (the last list is kept).
    del hosts["vllm-1.vllm"]

    async def flaky(name: str, port: int) -> list[str]:
        if name not in hosts:
            raise OSError(f"{name}: no address")
        return [f"{hosts[name]}:{port}"]

    source = DnsSource(config, resolver=flaky, srv_resolver=srv)
    assert await source.lookup() == {"10.0.0.5:8000"}
    hosts.clear()
    with pytest.raises(DiscoveryError):
        await source.lookup()


async def test_dnspython_srv_resolver_is_importable() -> None:
    import dns.asyncresolver  # noqa: F401  (dnspython is a runtime dependency)


async def test_on_change_errors_do_not_stop_the_source() -> None:
    def broken(endpoints: list[EndpointConfig]) -> None:
        raise RuntimeError("handler bug")

    async def resolver(name: str, port: int) -> list[str]:
        return ["10.0.0.1:8000"]

    config = DiscoveryConfig(kind="dns", dns_name="x", dns_port=8000, interval_seconds=0.01)
    task = asyncio.create_task(DnsSource(config, resolver=resolver).run(broken))
    await asyncio.sleep(0.1)
    assert not task.done()
    await stop(task)


# --------------------------------------------------------------------------- static, factory


async def test_static_source_publishes_once_sorted() -> None:
    endpoints = [EndpointConfig(address=a) for a in ("10.0.0.10:80", "10.0.0.9:80")]
    recorder = Recorder()
    task = await run_source(StaticSource(endpoints), recorder)
    await wait_for(lambda: recorder.calls != [])
    await asyncio.sleep(0.05)
    await stop(task)
    assert recorder.calls == [["10.0.0.9:80", "10.0.0.10:80"]]


def test_source_from_config(tmp_path: Path) -> None:
    static = source_from_config(DiscoveryConfig(), [EndpointConfig(address="10.0.0.1:80")])
    assert isinstance(static, StaticSource)
    dns_source = source_from_config(DiscoveryConfig(kind="dns", dns_name="a", dns_port=1))
    assert isinstance(dns_source, DnsSource)
    k8s = source_from_config(k8s_config(tmp_path, api_url="http://127.0.0.1:1"))
    assert isinstance(k8s, KubernetesSource) and k8s.api_url == "http://127.0.0.1:1"


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"kind": "kubernetes"}, "service"),
        ({"kind": "dns", "dns_port": 80}, "dns_name"),
        ({"kind": "dns", "dns_name": "a"}, "dns_port"),
        ({"kind": "dns", "dns_name": "a", "srv": True, "dns_port": 80}, "dns_port"),
        ({"kind": "kubernetes", "service": "Bad_Name"}, "service"),
        ({"kind": "kubernetes", "service": "s", "port": 70000}, "port"),
        ({"kind": "kubernetes", "service": "s", "port": "no_underscores"}, "port"),
        ({"kind": "kubernetes", "service": "s", "api_url": "127.0.0.1:6443"}, "api_url"),
        ({"kind": "consul"}, "kind"),
    ],
)
def test_config_errors_name_the_field(values: dict[str, Any], field: str) -> None:
    from extproc.config import ConfigError, load_config

    env = {f"PREFIX_ROUTER_DISCOVERY__{k.upper()}": str(v) for k, v in values.items()}
    with pytest.raises(ConfigError) as caught:
        load_config(environ=env)
    assert field in str(caught.value)


def test_config_from_env() -> None:
    from extproc.config import load_config

    cfg = load_config(
        environ={
            "PREFIX_ROUTER_DISCOVERY__KIND": "kubernetes",
            "PREFIX_ROUTER_DISCOVERY__SERVICE": "vllm",
            "PREFIX_ROUTER_DISCOVERY__PORT": "8000",
        }
    )
    assert cfg.discovery.port == 8000 and cfg.discovery.namespace is None
    assert load_config(environ={}).discovery.kind == "static"


async def test_discovery_failures_are_counted_in_the_metrics(tmp_path: Path) -> None:
    """A source that keeps failing keeps the last list and said so only in the log; the
    failures are counted (prefix_router_discovery_failures_total) for an alert."""
    from extproc.config import load_config
    from extproc.serve import RouterService
    from extproc.stack import free_port

    token = tmp_path / "token"
    token.write_text("t\n")
    config = load_config(
        overrides={
            "server.listen": "127.0.0.1:0",
            "server.admin_listen": "",
            "health.enabled": False,
            "signals.enabled": False,
            "discovery.kind": "kubernetes",
            "discovery.namespace": "llm",
            "discovery.service": "vllm",
            "discovery.port": "http",
            "discovery.api_url": f"http://127.0.0.1:{free_port()}",  # nothing listens
            "discovery.token_file": str(token),
            "discovery.ca_file": str(tmp_path / "no-ca.crt"),
            "discovery.backoff_initial_seconds": 0.01,
            "discovery.backoff_max_seconds": 0.05,
        },
        environ={},
    )
    service = RouterService(config)
    counted = service.metrics.discovery_failures
    before = counted._value.get()
    await service.start()
    try:
        await wait_for(lambda: counted._value.get() - before >= 2, timeout=10)
    finally:
        await service.stop(0)
