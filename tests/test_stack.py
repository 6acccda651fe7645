"""The local process stack the tests and benchmarks run on."""

from __future__ import annotations

import socket

from extproc.stack import LOOPBACK, free_port


def test_free_port_never_hands_out_a_port_twice() -> None:
    """Callers bind the port later (in a child process), so consecutive calls must differ
    even though the kernel may offer an unbound port again (two replicas once got one)."""
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    with socket.socket() as s:  # and each is bindable on loopback
        s.bind((LOOPBACK, ports[-1]))
