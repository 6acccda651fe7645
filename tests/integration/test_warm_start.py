"""A router that starts takes an index: from the file its predecessor wrote, or from a peer
(warm_start.py), behind a real Envoy over stand-in vLLM replicas.

The conversations are placed where a fresh router would not send them: the router that
places them knows only replica X, the one that takes over knows X and Y, and only those
conversations whose rendezvous pick among (X, Y) is Y are used. Their second turns reach X
only if the new router was handed where they were placed; without it they go to Y.
"""

from __future__ import annotations

import os
import re
import signal
import time

from extproc.stack import LOOPBACK, Stack, free_port, router_args_for

from ..router_gauges import models_known
from ..waiting import wait_until
from .conftest import request
from .test_observability import samples
from .test_router_replicas import FAST, ROUTER_ARGS, conversations_picking

SERVED = "x-gateway-destination-endpoint-served"


def _taken(admin_port: int, source: str) -> float:
    return samples(admin_port).get(
        ("prefix_router_warm_start_blocks_total", (("source", source),)), 0.0
    )


def _wait_for(condition, what: str, timeout: float = 15.0) -> None:
    assert wait_until(condition, timeout), what


def _lists_read(admin_port: int, endpoints: list[str]) -> None:
    """Until a router has read an endpoint's model list it sends the model's requests to
    those whose lists it has read: wait for every one."""
    wanted = {(e, "demo-model") for e in endpoints}
    _wait_for(lambda: wanted <= models_known(admin_port), "the model lists were never read")


def _first_turns_on_x(stack: Stack, args: list[str]):
    """Two replicas X and Y, a router started with ``args`` knowing only X behind Envoy,
    and the first turns of conversations whose rendezvous pick is Y sent, all to X:
    (x, y, the conversations, the router's port, the router, Envoy's port)."""
    x, y = stack.start_replicas(2, FAST)
    conversations = conversations_picking(x, y)
    address, router = stack.start_router([x], extra_args=args, ready=True)
    envoy_port, _ = stack.start_proxy("override-host", [x, y], address)
    for first, _ in conversations:
        response = request(envoy_port, first)
        assert response.status == 200 and response.headers[SERVED] == x
    return x, y, conversations, int(address.rsplit(":", 1)[1]), router, envoy_port


def test_a_restarted_router_takes_its_predecessors_index_from_the_file(tmp_path):
    snapshot = tmp_path / "index.snapshot"
    snapshot.write_bytes(b"left by something else")  # not a snapshot: started empty
    args = [
        *ROUTER_ARGS,
        *router_args_for("override-host"),
        *["--set", f"warm_start.path={snapshot}", "--set", "warm_start.interval_seconds=0"],
    ]
    with Stack(workdir=tmp_path) as stack:
        x, y, conversations, port, first_router, envoy_port = _first_turns_on_x(stack, args)
        stack.stop(first_router)  # SIGTERM: drains, then writes the file
        assert snapshot.stat().st_size > 1000

        # Its successor, on the same port and knowing X and Y, sends the second turns to X.
        _, second_router = stack.start_router([x, y], port=port, extra_args=args, ready=True)
        admin = stack.router_admin_ports["router"]
        _wait_for(lambda: _taken(admin, "file") > 0, "the file's index was never taken")
        _lists_read(admin, [x, y])
        for _, second in conversations[:2]:
            response = request(envoy_port, second)
            assert response.status == 200 and response.headers[SERVED] == x
        stack.stop(second_router)

        # X restarted while no router ran: its cache is empty and the file says otherwise;
        # the router that starts next does not take X's part (X's start time differs).
        replica_x = next(p for p in stack.processes if p.name == "replica-1")
        stack.stop(replica_x)
        stack.respawn(replica_x, int(x.rsplit(":", 1)[1]))
        _, third_router = stack.start_router([x, y], port=port, extra_args=args, ready=True)
        _wait_for(
            lambda: "its server restarted since" in third_router.log_tail(200),
            "the router never compared X's server with the snapshot's",
        )
        assert _taken(admin, "file") == 0
        _lists_read(admin, [x, y])
        for _, second in conversations[2:]:
            response = request(envoy_port, second)
            assert response.status == 200 and response.headers[SERVED] == y


def test_workers_each_keep_an_index_file_of_their_own(tmp_path):
    """With --workers 2 each worker writes its own file at its stop (warm_start.path +
    '.worker-K'), each holding every conversation (the other worker's placements reach it
    through the supervisor): the workers started next each take their own, as many blocks
    each, and the second turns go to X off the new router's own order. A worker killed is
    started again in its slot and takes that slot's file, written since (by a router that
    knew both replicas: two endpoints)."""
    snapshot = tmp_path / "index.snapshot"
    args = [
        *ROUTER_ARGS,
        *router_args_for("override-host"),
        *["--workers", "2", "--set", f"warm_start.path={snapshot}"],
        *["--set", "warm_start.interval_seconds=0"],
    ]
    with Stack(workdir=tmp_path) as stack:
        x, y, conversations, port, first_router, envoy_port = _first_turns_on_x(stack, args)
        admin = stack.router_admin_ports["router"]
        _wait_for(
            lambda: _peer_placements(admin) >= len(conversations),
            "the other worker never had the placements",
        )
        stack.stop(first_router)  # SIGTERM: each worker drains, then writes its file
        files = sorted(path.name for path in tmp_path.glob("index.snapshot*"))
        assert files == ["index.snapshot.worker-0", "index.snapshot.worker-1"], files

        again = [*args, "--set", "warm_start.interval_seconds=0.5"]
        _, second_router = stack.start_router([x, y], port=port, extra_args=again, ready=True)

        def taken() -> list[tuple[int, int, int, int]]:
            """(pid, slot, endpoints, blocks) of each index a worker took, in order."""
            return [
                tuple(map(int, found))
                for found in re.findall(
                    rf"\[(\d+)\]: warm start: file {re.escape(str(snapshot))}\.worker-(\d)'s "
                    r"index taken for (\d+) endpoint\(s\) \((\d+) blocks\)",
                    second_router.log_tail(2000),
                )
            ]

        _wait_for(lambda: len(taken()) == 2, "the workers never took their files' index")
        (pid_a, slot_a, ends_a, blocks_a), (pid_b, slot_b, ends_b, blocks_b) = taken()
        assert {slot_a, slot_b} == {0, 1} and ends_a == ends_b == 1
        assert blocks_a == blocks_b > 0  # (each file had what both workers placed)
        _lists_read(admin, [x, y])
        time.sleep(1.5)  # (the gauge is either worker's: the other's lists, within a second)
        for _, second in conversations:
            response = request(envoy_port, second)
            assert response.status == 200 and response.headers[SERVED] == x

        written = time.time()
        second_file = tmp_path / "index.snapshot.worker-1"
        _wait_for(lambda: second_file.stat().st_mtime > written, "worker 1 never wrote again")
        os.kill(pid_a if slot_a == 1 else pid_b, signal.SIGKILL)
        _wait_for(lambda: len(taken()) == 3, "the worker started again took no file", 30.0)
        pid_c, slot_c, ends_c, _ = taken()[2]
        assert pid_c not in (pid_a, pid_b) and slot_c == 1 and ends_c == 2


def _peer_placements(admin_port: int) -> float:
    return samples(admin_port).get(("prefix_router_peer_placements_total", ()), 0.0)


def test_a_router_starting_beside_a_peer_takes_its_index(tmp_path):
    """Router B starts after A has placed conversations on X. B reads no placements from
    A (share_placements off, so only the handover can tell it) and lists its own admin port
    among its peers, as a DNS name resolving to every replica would: it must skip its own
    index and take A's."""
    with Stack(workdir=tmp_path) as stack:
        x, y = stack.start_replicas(2, FAST)
        conversations = conversations_picking(x, y, 2)
        peer_args = ["--set", "peers.interval_seconds=0.2", "--set", "peers.share_placements=false"]
        common = [*ROUTER_ARGS, *router_args_for("override-host"), *peer_args]
        # (A starting router answers its peers 503 for warm_start.from_peers_seconds: its
        # index is young. A's is set short, so that B need not wait 30 s.)
        b_admin = free_port()
        a_args = [*common, "--set", "warm_start.from_peers_seconds=1"]
        a_args += ["--set", f"peers.addresses={LOOPBACK}:{b_admin}"]  # (it serves its index)
        address_a, _ = stack.start_router([x], name="router-a", extra_args=a_args, ready=True)
        envoy_a, _ = stack.start_proxy("override-host", [x], address_a, name="envoy-a")
        for first, _ in conversations:
            response = request(envoy_a, first)
            assert response.status == 200 and response.headers[SERVED] == x
        admin = stack.router_admin_ports
        stack.router_admin_ports["router-b"] = b_admin
        peers = f"{LOOPBACK}:{admin['router-a']},{LOOPBACK}:{b_admin}"
        address_b, router_b = stack.start_router(
            [x, y],
            name="router-b",
            extra_args=[*common, "--set", f"peers.addresses={peers}"],
            ready=True,
        )
        envoy_b, _ = stack.start_proxy("override-host", [x, y], address_b, name="envoy-b")
        _wait_for(lambda: _taken(b_admin, "peer") > 0, "B never took A's index")
        _lists_read(b_admin, [x, y])
        assert f"peer {LOOPBACK}:{admin['router-a']}" in router_b.log_tail(200)
        for _, second in conversations:
            response = request(envoy_b, second)
            assert response.status == 200 and response.headers[SERVED] == x
