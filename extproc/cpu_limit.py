"""A CPU limit on a set of processes, as Kubernetes' ``limits.cpu`` sets one: the CFS quota
of a cgroup the processes are moved into (cgroup v2 ``cpu.max``, or v1
``cpu.cfs_quota_us``), per 100 ms period as the kubelet sets it. A process over its quota is
stopped until the next period (throttled), whatever the machine's idle cores: how a router
pod with a CPU limit answers late. For benchmarks; needs a writable cgroup hierarchy (root
on most machines)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

PERIOD_US = 100_000
V2_ROOT = Path("/sys/fs/cgroup")
V1_ROOT = Path("/sys/fs/cgroup/cpu")


class CpuLimitUnavailable(RuntimeError):
    pass


class CpuLimit:
    """One cgroup of its own; ``set(None)`` lifts the limit, ``close`` moves the processes
    to the hierarchy's root (not to where they came from: they are about to be stopped)
    and removes the group."""

    def __init__(self, name: str) -> None:
        self.v2 = (V2_ROOT / "cgroup.controllers").exists()
        parent = V2_ROOT if self.v2 else V1_ROOT
        self.path = parent / f"{name}-{os.getpid()}"
        try:
            if self.v2:
                controls = (parent / "cgroup.subtree_control").read_text().split()
                if "cpu" not in controls:
                    (parent / "cgroup.subtree_control").write_text("+cpu")
            self.path.mkdir()
        except OSError as exc:
            raise CpuLimitUnavailable(
                f"cannot create a cgroup with the cpu controller under {parent} ({exc}): a "
                "CPU limit needs a writable cgroup hierarchy (root; on cgroup v2 inside a "
                "container the cpu controller may not be delegated)"
            ) from exc
        self._parent = parent

    def set(self, cores: float | None) -> None:
        quota = None if cores is None else max(1000, int(cores * PERIOD_US))
        if self.v2:
            (self.path / "cpu.max").write_text(f"{quota or 'max'} {PERIOD_US}")
        else:
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota or -1))

    def add(self, pids: Iterable[int]) -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, FileNotFoundError):
                (self.path / "cgroup.procs").write_text(str(pid))

    def throttled(self) -> tuple[int, float]:
        """(periods throttled, seconds throttled) so far."""
        stat = dict(
            line.split() for line in (self.path / "cpu.stat").read_text().splitlines() if line
        )
        if self.v2:
            return int(stat.get("nr_throttled", 0)), int(stat.get("throttled_usec", 0)) / 1e6
        return int(stat.get("nr_throttled", 0)), int(stat.get("throttled_time", 0)) / 1e9

    def close(self) -> None:
        with contextlib.suppress(OSError):
            for pid in (self.path / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (self._parent / "cgroup.procs").write_text(pid)
            self.path.rmdir()
