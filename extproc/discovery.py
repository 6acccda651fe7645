"""Endpoint discovery: the replica set from a static list, DNS, or Kubernetes EndpointSlices.

Every source has one coroutine, ``run(on_change)``, that runs until cancelled and calls
``on_change`` with the full current list of endpoints (deduplicated, sorted) whenever that
list changes. It never raises: failures are logged and retried with exponential backoff, and
the last good list stays in force meanwhile (a DNS or API-server hiccup must not empty the
replica set). Nothing is published before the first successful lookup, so the router keeps its
start-up list until then.

* ``StaticSource``: the configured list, once.
* ``DnsSource``: A/AAAA records via ``loop.getaddrinfo`` (port from the config) or SRV records
  via dnspython (port from each record), polled every ``interval_seconds``.
* ``KubernetesSource``: list + watch of the EndpointSlices labelled
  ``kubernetes.io/service-name=<service>`` through the REST API (aiohttp; in-cluster token and
  CA from the service-account mount). Endpoints count when ``conditions.ready`` is true or
  absent (the API says to treat a missing value as ready); one not ready and not terminating
  (a pod failing its readiness probe: stalled, overloaded, or its container restarting in
  place) stays a member that is not picked (``EndpointConfig.ready``), so its index can
  outlive the stall; a terminating one is gone. Their first address is used with the slice's
  port matching ``port`` (name or number). A watch that ends (server-side expiry) is re-opened from the last resourceVersion;
  ``410 Gone``, as an HTTP status or as an ERROR event, triggers a fresh list. Events that
  come within ``SETTLE_SECONDS`` of each other are published together (a pod moved between
  slices is two updates, and must not read as removed in between).

``Router.set_endpoints`` drops the index entries and load of endpoints that disappear.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import random
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol
from urllib.parse import quote

import aiohttp
import orjson

from .config import (
    SERVICE_ACCOUNT_DIR,
    DiscoveryConfig,
    EndpointConfig,
    format_host_port,
)

log = logging.getLogger(__name__)

OnChange = Callable[[list[EndpointConfig]], None]
# (name, port) -> "ip:port" strings; the DNS source's pluggable lookups (tests mock them).
AddressResolver = Callable[[str, int], Awaitable[list[str]]]
SrvResolver = Callable[[str], Awaitable[list[tuple[str, int]]]]

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
# A watch's events are published once none has come for this long (one change of the
# endpoint set can take several EndpointSlice updates).
SETTLE_SECONDS = 0.2


class EndpointSource(Protocol):
    failures: int  # lookups or watches that failed so far (the metrics count them)

    async def run(self, on_change: OnChange) -> None:
        """Call ``on_change(full list)`` on every change until cancelled; never raise."""
        ...


class DiscoveryError(RuntimeError):
    """A lookup failed; the source logs it and retries."""


def _address_key(address: str) -> tuple[int, int, int]:
    host, _, port = address.rpartition(":")
    ip = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    return (ip.version, int(ip), int(port))


class _Publisher:
    """Turns address sets into sorted EndpointConfig lists and calls on_change on change."""

    def __init__(self, on_change: OnChange, config: DiscoveryConfig) -> None:
        self._on_change = on_change
        self._capacity = config.capacity_tokens
        self._weight = config.weight
        self.current: list[str] | None = None

    def publish(self, addresses: Iterable[str], not_ready: Iterable[str] = ()) -> bool:
        """``not_ready``: members not to be picked (Kubernetes' not-ready endpoints)."""
        held = set(not_ready)
        ordered = sorted(set(addresses) | held, key=_address_key)
        current = [f"{a} (not ready)" if a in held else a for a in ordered]
        if current == self.current:
            return False
        self.current = current
        endpoints = [
            EndpointConfig(
                address=a, capacity_tokens=self._capacity, weight=self._weight, ready=a not in held
            )
            for a in ordered
        ]
        log.info("endpoints now (%d): %s", len(ordered), ", ".join(current) or "none")
        try:
            self._on_change(endpoints)
        except Exception:
            log.exception("endpoint change handler failed")
        return True


class _Backoff:
    def __init__(self, config: DiscoveryConfig) -> None:
        self.initial = config.backoff_initial_seconds
        self.maximum = config.backoff_max_seconds
        self.delay = self.initial

    def reset(self) -> None:
        self.delay = self.initial

    async def sleep(self) -> None:
        # Full jitter keeps a fleet of router pods from reconnecting in lock step.
        await asyncio.sleep(self.delay * (0.5 + random.random() / 2))
        self.delay = min(self.maximum, self.delay * 2)


# --------------------------------------------------------------------------- static


class StaticSource:
    def __init__(self, endpoints: Sequence[EndpointConfig]) -> None:
        self.endpoints = list(endpoints)
        self.failures = 0

    async def run(self, on_change: OnChange) -> None:
        try:
            on_change(sorted(self.endpoints, key=lambda e: _address_key(e.address)))
        except Exception:
            log.exception("endpoint change handler failed")
        await asyncio.Event().wait()  # nothing ever changes

    def __repr__(self) -> str:
        return f"StaticSource({len(self.endpoints)} endpoints)"


# --------------------------------------------------------------------------- DNS


def _family(config: DiscoveryConfig) -> int:
    return {"ipv4": socket.AF_INET, "ipv6": socket.AF_INET6}.get(
        config.address_family, socket.AF_UNSPEC
    )


async def getaddrinfo_resolver(name: str, port: int, family: int = socket.AF_UNSPEC) -> list[str]:
    """A/AAAA lookup through the system resolver (same answers as every other process)."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        name, port, family=family, type=socket.SOCK_STREAM
    )
    return [
        format_host_port(str(ipaddress.ip_address(sockaddr[0])), port)
        for fam, _type, _proto, _canon, sockaddr in infos
        if fam in (socket.AF_INET, socket.AF_INET6)
    ]


async def dnspython_srv_resolver(name: str) -> list[tuple[str, int]]:
    """SRV lookup with dnspython: (target, port) pairs; weights/priorities are not used."""
    import dns.asyncresolver
    import dns.resolver

    try:
        answer = await dns.asyncresolver.resolve(name, "SRV")
    except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
        return []
    return [(record.target.to_text(omit_final_dot=True), int(record.port)) for record in answer]


class DnsSource:
    """Polls DNS; an empty answer empties the list when the next is empty too (one alone is a
    blip: records being rewritten), a failed lookup keeps the last one
    (an A/AAAA name without records reads as failed: getaddrinfo does not tell the two
    apart). An SRV target that does not resolve is left out while the others are read: one
    stale target held every other change back."""

    def __init__(
        self,
        config: DiscoveryConfig,
        resolver: AddressResolver | None = None,
        srv_resolver: SrvResolver | None = None,
    ) -> None:
        assert config.dns_name is not None
        self.config = config
        family = _family(config)
        self._resolve = resolver or (lambda n, p: getaddrinfo_resolver(n, p, family))
        self._resolve_srv = srv_resolver or dnspython_srv_resolver
        self._unresolved: set[str] = set()  # SRV targets the last lookup left out
        self.failures = 0

    async def lookup(self) -> set[str]:
        name = self.config.dns_name
        assert name is not None
        try:
            if not self.config.srv:
                assert self.config.dns_port is not None
                return set(await self._resolve(name, self.config.dns_port))
            targets = sorted(set(await self._resolve_srv(name)))
            answers = await asyncio.gather(
                *(self._resolve(t, p) for t, p in targets), return_exceptions=True
            )
        except (OSError, ValueError) as exc:  # socket.gaierror is an OSError
            raise DiscoveryError(f"DNS lookup of {name} failed: {exc!r}") from exc
        failed = [
            (t, a) for (t, _), a in zip(targets, answers, strict=True) if isinstance(a, Exception)
        ]
        for target, exc in failed:
            if not isinstance(exc, OSError | ValueError):
                raise exc
            if target not in self._unresolved:  # once, until it resolves again
                log.warning(
                    "SRV target %s of %s does not resolve (%s); left out", target, name, exc
                )
        self._unresolved = {target for target, _ in failed}
        if targets and len(failed) == len(targets):
            raise DiscoveryError(f"DNS lookup of {name} failed: no SRV target resolves")
        return {
            a for addresses in answers if not isinstance(addresses, Exception) for a in addresses
        }

    async def run(self, on_change: OnChange) -> None:
        publisher = _Publisher(on_change, self.config)
        backoff = _Backoff(self.config)
        held_empty = False
        while True:
            try:
                addresses = await self.lookup()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.failures += 1
                log.warning("%s; keeping the last endpoint list", exc)
                await backoff.sleep()
                continue
            backoff.reset()
            if not addresses and publisher.current and not held_empty:
                # One empty answer is held for one interval (an NXDOMAIN while the records
                # are rewritten had emptied the set, and every endpoint's index with it).
                log.warning("%s answered no endpoints; asking again before acting", self)
                held_empty = True
            else:
                held_empty = False
                publisher.publish(addresses)
            await asyncio.sleep(self.config.interval_seconds)

    def __repr__(self) -> str:
        kind = "SRV" if self.config.srv else f"A/AAAA port {self.config.dns_port}"
        return f"DnsSource({self.config.dns_name} {kind})"


# --------------------------------------------------------------------------- Kubernetes


def slice_port(slice_object: Mapping[str, Any], wanted: int | str | None) -> int | None:
    """The port of one EndpointSlice that matches ``wanted`` (name, number, or the only one)."""
    ports = [p for p in slice_object.get("ports") or [] if p.get("port") is not None]
    if wanted is None:
        return int(ports[0]["port"]) if len(ports) == 1 else None
    for port in ports:
        if isinstance(wanted, int) and int(port["port"]) == wanted:
            return wanted
        if isinstance(wanted, str) and port.get("name", "") == wanted:
            return int(port["port"])
    return None


def ready_addresses(
    slices: Iterable[Mapping[str, Any]],
    wanted_port: int | str | None,
    family: str = "any",
) -> set[str]:
    """ip:port of every ready endpoint in the slices (``slice_addresses``)."""
    return {a for a, ready in slice_addresses(slices, wanted_port, family).items() if ready}


def slice_addresses(
    slices: Iterable[Mapping[str, Any]],
    wanted_port: int | str | None,
    family: str = "any",
) -> dict[str, bool]:
    """ip:port of every endpoint in the slices that is not terminating -> whether it is
    ready (FQDN slices are skipped).

    A dual-stack Service has IPv4 and IPv6 slices naming the same pods. One family is used
    for the whole set, so a pod is one endpoint and its address never flips between families
    (which would lose its index): "any" takes IPv4 when there is an IPv4 slice.
    """
    slices = [s for s in slices if s.get("addressType") in ("IPv4", "IPv6")]
    if family == "any":
        has_v4 = any(s.get("addressType") == "IPv4" for s in slices)
        family = "ipv4" if has_v4 else "ipv6"
    wanted_type = "IPv4" if family == "ipv4" else "IPv6"
    found: dict[str, bool] = {}
    for item in slices:
        if item.get("addressType") != wanted_type:
            continue
        port = slice_port(item, wanted_port)
        if port is None:
            continue
        for endpoint in item.get("endpoints") or []:
            conditions = endpoint.get("conditions") or {}
            if conditions.get("terminating") is True:
                continue  # (its pod is being deleted: gone for good)
            # "ready ... nil should be interpreted as true".
            ready = conditions.get("ready") is not False
            addresses = endpoint.get("addresses") or []
            if not addresses:
                continue
            # Addresses of one endpoint are fungible; clients may use only the first.
            try:
                ip = ipaddress.ip_address(addresses[0])
            except ValueError:
                continue
            address = format_host_port(str(ip), port)
            found[address] = found.get(address, False) or ready  # (ready in any slice)
    return found


class _Gone(Exception):
    """410: the resourceVersion is too old; list again."""


class KubernetesSource:
    """List + watch of a Service's EndpointSlices through the Kubernetes REST API."""

    def __init__(
        self,
        config: DiscoveryConfig,
        api_url: str | None = None,
        namespace: str | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        assert config.service is not None
        self.config = config
        env = os.environ if environ is None else environ
        self.api_url = api_url or config.api_url or _in_cluster_url(env)
        self.namespace = namespace or config.namespace or _pod_namespace(config)
        self.service = config.service
        self.slices: dict[str, dict[str, Any]] = {}
        self.resource_version = ""
        self.lists = 0  # how many times we (re)listed, for logs and tests
        self.watches = 0
        self.failures = 0

    # -- HTTP ---------------------------------------------------------------------------
    @property
    def path(self) -> str:
        return (
            f"/apis/discovery.k8s.io/v1/namespaces/{quote(self.namespace)}/endpointslices"
            f"?labelSelector={quote(f'{SERVICE_NAME_LABEL}={self.service}', safe='')}"
        )

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        # Bound service-account tokens rotate: read the file on every request.
        with contextlib.suppress(OSError):
            with open(self.config.token_file, encoding="utf-8") as f:
                token = f.read().strip()
            if token:
                headers["Authorization"] = f"Bearer {token}"
        return headers

    def _ssl(self) -> ssl.SSLContext | None:
        if not self.api_url.startswith("https://"):
            return None
        if os.path.exists(self.config.ca_file):
            return ssl.create_default_context(cafile=self.config.ca_file)
        return ssl.create_default_context()

    async def _list(self, session: aiohttp.ClientSession) -> None:
        async with session.get(
            self.api_url + self.path, headers=self._headers(), ssl=self._ssl()
        ) as response:
            if response.status != 200:
                text = (await response.text())[:300]
                raise DiscoveryError(f"list endpointslices: HTTP {response.status}: {text}")
            body = orjson.loads(await response.read())
        if body.get("kind") != "EndpointSliceList":
            raise DiscoveryError(f"list endpointslices: unexpected kind {body.get('kind')!r}")
        self.slices = {_slice_key(item): item for item in body.get("items") or []}
        self.resource_version = (body.get("metadata") or {}).get("resourceVersion", "")
        self.lists += 1

    async def _watch(self, session: aiohttp.ClientSession, publisher: _Publisher) -> None:
        """One watch request; returns when the server ends it, raises _Gone on 410."""
        timeout = self.config.watch_timeout_seconds
        url = (
            f"{self.api_url}{self.path}&watch=1&allowWatchBookmarks=true"
            f"&resourceVersion={quote(self.resource_version)}&timeoutSeconds={timeout}"
        )
        # No total timeout: the server ends the watch after timeoutSeconds. sock_read guards
        # against a silently dead connection (bookmarks arrive about once a minute).
        client_timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=timeout + 30)
        async with session.get(
            url, headers=self._headers(), ssl=self._ssl(), timeout=client_timeout
        ) as response:
            if response.status == 410:
                raise _Gone("watch: HTTP 410 Gone")
            if response.status != 200:
                text = (await response.text())[:300]
                raise DiscoveryError(f"watch endpointslices: HTTP {response.status}: {text}")
            self.watches += 1
            buffer, unpublished = b"", False
            while True:
                # Events that come together are published together: moving a pod from
                # one slice to another is two events (one slice loses it, the other gains
                # it), and publishing the first alone dropped its index and load.
                try:
                    chunk = await asyncio.wait_for(
                        response.content.readany(), SETTLE_SECONDS if unpublished else None
                    )
                except TimeoutError:
                    self._publish(publisher)
                    unpublished = False
                    continue
                if not chunk:
                    break
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.strip():
                        self._apply(orjson.loads(line))
                        unpublished = True
            if buffer.strip():
                self._apply(orjson.loads(buffer))
            self._publish(publisher)

    def _apply(self, event: Mapping[str, Any]) -> None:
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            code = obj.get("code")
            if code == 410:
                raise _Gone(f"watch: {obj.get('message', '410 Gone')}")
            raise DiscoveryError(f"watch error event: {code} {obj.get('message', '')}")
        version = (obj.get("metadata") or {}).get("resourceVersion")
        if kind in ("ADDED", "MODIFIED"):
            self.slices[_slice_key(obj)] = obj
        elif kind == "DELETED":
            self.slices.pop(_slice_key(obj), None)
        elif kind != "BOOKMARK":
            log.debug("ignoring watch event type %r", kind)
            return
        if version:
            self.resource_version = version

    def addresses(self) -> dict[str, bool]:
        """Every member -> whether it is ready."""
        return slice_addresses(self.slices.values(), self.config.port, self.config.address_family)

    def _publish(self, publisher: _Publisher) -> None:
        members = self.addresses()
        publisher.publish(
            [a for a, ready in members.items() if ready],
            [a for a, ready in members.items() if not ready],
        )

    # -- loop ---------------------------------------------------------------------------
    async def run(self, on_change: OnChange) -> None:
        publisher = _Publisher(on_change, self.config)
        backoff = _Backoff(self.config)
        need_list = True
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=60)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                try:
                    if need_list:
                        await self._list(session)
                        need_list = False
                        self._publish(publisher)
                    started = asyncio.get_running_loop().time()
                    await self._watch(session, publisher)
                    # The watch ended normally (server-side expiry): watch again from the last
                    # resourceVersion. A server that keeps closing at once gets backoff.
                    if asyncio.get_running_loop().time() - started < 1.0:
                        await backoff.sleep()
                    else:
                        backoff.reset()
                except asyncio.CancelledError:
                    raise
                except _Gone as exc:
                    log.info("%s; listing endpointslices again", exc)
                    need_list = True
                except Exception as exc:
                    self.failures += 1
                    log.warning(
                        "endpointslices of %s/%s: %s; retrying in ~%.1fs",
                        self.namespace,
                        self.service,
                        exc or type(exc).__name__,
                        backoff.delay,
                    )
                    need_list = True
                    await backoff.sleep()

    def __repr__(self) -> str:
        return f"KubernetesSource({self.namespace}/{self.service} via {self.api_url})"


def _slice_key(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return str(meta.get("uid") or meta.get("name") or "")


def _in_cluster_url(env: Mapping[str, str]) -> str:
    host = env.get("KUBERNETES_SERVICE_HOST")
    port = env.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise ValueError(
            "discovery.api_url is not set and KUBERNETES_SERVICE_HOST is not in the environment "
            "(not running in a pod?)"
        )
    if ":" in host:
        host = f"[{host}]"
    return f"https://{host}:{port}"


def _pod_namespace(config: DiscoveryConfig) -> str:
    path = os.path.join(os.path.dirname(config.token_file) or SERVICE_ACCOUNT_DIR, "namespace")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


# --------------------------------------------------------------------------- factory


def source_from_config(
    config: DiscoveryConfig, endpoints: Sequence[EndpointConfig] = ()
) -> EndpointSource:
    """The source for ``config.kind``; ``endpoints`` is the static list (kind=static)."""
    if config.kind == "dns":
        return DnsSource(config)
    if config.kind == "kubernetes":
        return KubernetesSource(config)
    return StaticSource(endpoints)
