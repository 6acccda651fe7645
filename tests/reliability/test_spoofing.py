"""No spoofing: a client-sent routing header never picks the upstream, whatever the router's
state (up, down, hung), in both Envoy designs and both body modes.

A live non-member server ("intruder") listens on loopback; requests name it (and members)
in every shape a client could try. The intruder must never receive a request, and with the
router up a header naming another member must not move a request off the router's choice.
tests/integration/test_envoy_routing.py covers the router-up/non-member case; this extends it.
"""

from __future__ import annotations

import signal
import time
import urllib.request
from collections.abc import Iterator

import pytest

from extproc.stack import Stack

from .conftest import FAST, chat, report, start_rig, wait_until

pytestmark = [pytest.mark.envoy]
HEADER = "x-gateway-destination-endpoint"

VARIANTS: dict[str, list[tuple[str, str]]] = {
    "plain": [(HEADER, "{intruder}")],
    "case": [("X-Gateway-Destination-Endpoint", "{intruder}")],
    "repeated": [(HEADER, "{intruder}"), (HEADER, "{intruder}")],
    "list": [(HEADER, "{intruder},{member}")],
    "list-spaces": [(HEADER, " {intruder} , {member} ,")],
    "ipv6-loopback": [(HEADER, "[::1]:{port}")],
    "ipv4-mapped-ipv6": [(HEADER, "[::ffff:127.0.0.1]:{port}")],
    "hostname": [(HEADER, "localhost:{port}")],
    "served-header": [(HEADER + "-served", "{intruder}")],
    "both-headers": [(HEADER, "{intruder}"), (HEADER + "-served", "{intruder}")],
    "other-member": [(HEADER, "{member}")],
    "member-list": [(HEADER, "{member},{intruder}")],
}


def served_requests(address: str) -> float:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total")
    )


@pytest.fixture(scope="module")
def pool() -> Iterator[tuple[list[str], str]]:
    with Stack() as stack:
        members = stack.start_replicas(4, FAST)
        intruder = stack.start_replicas(1, FAST)[0]
        yield members, intruder


def _attempts(rig, members, intruder, state: str, body_for, expect=None, stuck_ok=False) -> dict:
    """Send every variant twice; returns the tally. body_for(variant, i) -> body;
    expect(i) -> the replica the router chose for that body (router up), else None."""
    names = {a: f"replica-{i + 1}" for i, a in enumerate(members)}
    port = intruder.rsplit(":", 1)[1]
    before = served_requests(intruder)
    attempts = honoured = on_named_member = named_member_attempts = stuck = 0
    for variant, headers in VARIANTS.items():
        for i in range(2):
            spoofed_member = members[(i + 1) % len(members)]
            if expect is not None:  # name a member the router did not choose
                spoofed_member = next(m for m in members if names[m] != expect(i))
            values = {"intruder": intruder, "member": spoofed_member, "port": port}
            sent = [(k, v.format(**values)) for k, v in headers]
            response = rig.send(body_for(variant, i), headers=sent)
            attempts += 1
            if stuck_ok and response.status == 504 and not response.replica:
                stuck += 1  # full duplex + hung router: Envoy's stream_idle_timeout (a limit)
                continue
            assert response.status == 200, (state, variant, response.status, response.body[:200])
            assert response.replica in names.values(), (state, variant, response.replica)
            if expect is not None:  # the router's choice, not the client's, decided
                assert response.replica == expect(i), (state, variant, response.replica)
            if "{member}" in headers[0][1] and headers[0][1].startswith("{member}"):
                named_member_attempts += 1
                on_named_member += response.replica == names[spoofed_member]
    intruder_hits = served_requests(intruder) - before
    honoured += int(intruder_hits)
    assert intruder_hits == 0, f"{state}: the intruder served {intruder_hits} requests"
    return {
        "attempts": attempts,
        "honoured": honoured,
        "named_member_attempts": named_member_attempts,
        "landed_on_named_member": on_named_member,
        "stuck_504": stuck,
    }


@pytest.mark.parametrize("body_mode", ["buffered", "full_duplex_streamed"])
@pytest.mark.parametrize("mode", ["override-host", "original-dst"])
def test_spoofed_header_never_routes_router_up_down_or_hung(pool, mode, body_mode):
    members, intruder = pool
    names = {a: f"replica-{i + 1}" for i, a in enumerate(members)}
    with Stack() as stack:
        rig = start_rig(stack, mode, body_mode, members, stream_idle_timeout=3)
        figures: dict[str, dict] = {}

        # Router up: the router's choice stands even when the client names another member.
        homes = {}
        for i in range(2):
            body = chat(7000 + i, 0, system=f"spoof home {mode} {body_mode} {i} " * 10)
            homes[i] = (body, rig.send(body).replica)

        def same_body(_variant, i):
            return homes[i][0]

        assert all(homes[i][1] in names.values() for i in homes)
        up = _attempts(rig, members, intruder, "up", same_body, lambda i: homes[i][1])
        assert up["landed_on_named_member"] == 0
        figures["up"] = up

        # Router down (killed): round robin, the header still ignored.
        rig.router.signal(signal.SIGKILL)
        rig.router.process.wait(5)
        assert wait_until(lambda: not rig.envoy_router_healthy(), 10, 0.05)
        time.sleep(0.5)  # the main thread's health verdict reaches the worker thread

        def fresh(variant, i):
            return chat(8000 + hash(variant) % 1000 + i, 0)

        down = _attempts(rig, members, intruder, "down", fresh)
        assert down["landed_on_named_member"] < down["named_member_attempts"]
        figures["down"] = down

        # Router hung (SIGSTOP). BUFFERED: the first requests wait for message_timeout and
        # continue without a decision. Full duplex must not reach a hung router at all
        # (it would wait for stream_idle_timeout): wait for Envoy's health check first.
        rig.restart_router()
        assert wait_until(rig.envoy_router_healthy, 10, 0.05)
        rig.router.signal(signal.SIGSTOP)
        try:
            if body_mode == "full_duplex_streamed":
                assert wait_until(lambda: not rig.envoy_router_healthy(), 10, 0.05)
                time.sleep(0.5)  # the verdict reaches Envoy's worker thread
            started = time.monotonic()
            hung = _attempts(
                rig, members, intruder, "hung", fresh, stuck_ok=body_mode != "buffered"
            )
            hung["seconds"] = round(time.monotonic() - started, 2)
            figures["hung"] = hung
        finally:
            rig.router.signal(signal.SIGCONT)
        assert wait_until(rig.envoy_router_healthy, 10, 0.05)
        report("spoofing", mode=mode, body_mode=body_mode, **figures)
