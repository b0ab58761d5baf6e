"""How many threads the engine's CPU work uses, set once, deliberately, at start-up.

Two thread pools do the CPU engine's arithmetic: torch's (OpenMP: the GEMMs, SDPA, the
element-wise ops) and numba's (the paged attention kernel). Left alone, torch takes
``OMP_NUM_THREADS`` or every physical core, and numba every core: a server sharing the machine
with other work then oversubscribes it, and OpenMP workers that spin-wait for a busy core
stall every step. ``num_cpu_threads`` sizes torch's pool; the numba kernel follows torch's
count on every call, up to ``NUMBA_NUM_THREADS`` (numba's pool is sized once, when numba is
first imported, from that variable; default: every core).

Unset (and no ``OMP_NUM_THREADS``), the count is at most what the process may use
(``available_cpus``): torch counts the machine's cores, not a container's CPU quota, so under
``docker --cpus 2`` on a 64-core host its 64 threads would share two cores' time, each step
waiting on the descheduled ones.

Unset, the count also follows the load the engine sees (``AdaptiveCpuThreads``). A parallel
region ends when its slowest thread does: on a 2-core machine with one busy process of the
same priority beside the engine, each region's second thread waits for the core the neighbour
holds, and a two-thread decode step took 2.4x as long as a one-thread step beside the same
neighbour (docs/benchmarks.md, "GGUF served in its blocks"). So between steps the engine
reads how much of its CPUs' time other processes took lately (``/proc/stat`` less its own
time) and runs on the cores they leave free. A process at a lower priority (``nice``) is not
counted: the kernel gives it only the time the engine leaves idle. A count the user gave
(``--num-cpu-threads``, ``OMP_NUM_THREADS``) is kept as given.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

logger = logging.getLogger("pagedserve.engine")


def set_cpu_threads(num_threads: int | None) -> int:
    """Size torch's thread pool (None: as the environment made it, at most ``available_cpus``
    unless ``OMP_NUM_THREADS`` says otherwise); returns the count the engine runs with, and
    warns when numba's pool cannot follow it."""
    if num_threads is not None:
        if num_threads < 1:
            raise ValueError(f"num_cpu_threads must be >= 1, got {num_threads}")
        torch.set_num_threads(num_threads)
    elif "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(min(torch.get_num_threads(), available_cpus()))
    threads = torch.get_num_threads()
    try:
        import numba
    except ImportError:
        return threads
    if numba.config.NUMBA_NUM_THREADS < threads:
        logger.warning(
            "NUMBA_NUM_THREADS=%d caps the numba attention kernel below torch's %d threads; set "
            "NUMBA_NUM_THREADS=%d (before the process starts) to give it the same cores",
            numba.config.NUMBA_NUM_THREADS,
            threads,
            threads,
        )
    logger.info(
        "CPU threads: torch %d, numba attention %d",
        threads,
        min(threads, numba.config.NUMBA_NUM_THREADS),
    )
    return threads


def available_cpus(cgroup_root: Path = Path("/sys/fs/cgroup"), proc_cgroup: str | None = None):
    """The CPUs this process may use: its affinity mask (``taskset``, a container's cpuset),
    capped by its cgroup's CPU quota rounded up (``docker --cpus``, a Kubernetes CPU limit:
    cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us / cpu.cfs_period_us``, the tightest of the
    process's cgroup and its parents). ``proc_cgroup``: /proc/self/cgroup's text (tests)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return max(1, cpus or 1)
    quotas = [q for d in _cpu_cgroup_dirs(cgroup_root, proc_cgroup) if (q := _quota(d))]
    return max(1, min([cpus or 1, *(math.ceil(q) for q in quotas)]))


def _cpu_cgroup_dirs(root: Path, proc_cgroup: str) -> list[Path]:
    """The process's CPU cgroup directory and its parents (v2: the unified hierarchy; v1: the
    ``cpu`` controller's mount)."""
    dirs = []
    for line in proc_cgroup.splitlines():
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and controllers == "":  # v2 (under "unified" in a hybrid setup)
            mount = root / "unified" if (root / "unified").is_dir() else root
        elif "cpu" in controllers.split(","):
            mount = root / controllers
            mount = mount if mount.is_dir() else root / "cpu"
        else:
            continue
        here = mount / path.lstrip("/")
        dirs += [here, *[p for p in here.parents if mount in (p, *p.parents)]]
    return dirs


def _quota(cgroup: Path) -> float | None:
    """CPUs' worth of time a cgroup directory allows, or None (no limit, no such files)."""
    try:
        if (cgroup / "cpu.max").is_file():
            quota, period = (cgroup / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        quota = int((cgroup / "cpu.cfs_quota_us").read_text())
        period = int((cgroup / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


# /proc/stat's per-CPU columns: user nice system idle iowait irq softirq steal (guest time is
# inside user). Busy at the engine's priority or above: all but nice, idle and iowait.
_BUSY_COLUMNS = (0, 2, 5, 6, 7)


def busy_ticks(stat_text: str, cpus: set[int]) -> int:
    """Clock ticks spent on ``cpus`` by every process not at a lower priority (``nice`` time
    excluded), the hypervisor's steal included: what keeps those cores from the engine."""
    total = 0
    for line in stat_text.splitlines():
        name, *columns = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            total += sum(int(columns[i]) for i in _BUSY_COLUMNS if i < len(columns))
    return total


class AdaptiveCpuThreads:
    """Picks the engine's thread count between steps from what other processes leave free.

    Every ``interval`` seconds (checked at each step: a clock read otherwise) it compares the
    busy time of the CPUs the process may use (``busy_ticks``) with the process's own CPU
    time: the rest is the neighbours', in cores. The engine then runs on the cores left,
    rounded up from 0.7 of one, at least one and at most ``ceiling``: a core busy a third of
    the time or more is given up. (That threshold is set by reasoning, not tuned: the
    measurements are of no neighbour and of one busy core, docs/benchmarks.md.) A new count
    is taken when two readings in a row agree,
    so one burst of a neighbour does not flap the pools.
    """

    def __init__(
        self,
        ceiling: int,
        cpus: set[int] | None = None,
        interval: float = 0.5,
        read_stat: Callable[[], str] = lambda: Path("/proc/stat").read_text(),
        own_seconds: Callable[[], float] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ceiling, self.interval = ceiling, interval
        self.cpus = cpus if cpus is not None else set(os.sched_getaffinity(0))
        self.read_stat, self.clock = read_stat, clock
        self.own_seconds = own_seconds or _own_busy_seconds
        self.ticks_per_second = os.sysconf("SC_CLK_TCK")
        self.threads = self.pending = ceiling
        self._last = self._sample()

    def _sample(self) -> tuple[float, int, float]:
        return self.clock(), busy_ticks(self.read_stat(), self.cpus), self.own_seconds()

    def neighbours_cores(self) -> float | None:
        """Cores' worth of time others took since the last reading (None: too soon)."""
        now = self.clock()
        if now - self._last[0] < self.interval:
            return None
        sample = self._sample()
        (then, ticks, own), self._last = self._last, sample
        others = (sample[1] - ticks) / self.ticks_per_second - (sample[2] - own)
        return max(0.0, others) / (sample[0] - then)

    def before_step(self) -> int:
        """The thread count for the next step, set on torch's pool (which numba's follows)."""
        others = self.neighbours_cores()
        if others is not None:
            free = len(self.cpus) - others
            wanted = max(1, min(self.ceiling, math.floor(free + 0.3)))
            if wanted == self.pending and wanted != self.threads:
                logger.info("CPU threads: %d -> %d (others use %.1f cores)", self.threads,
                            wanted, others)  # fmt: skip
                self.threads = wanted
            self.pending = wanted
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        return self.threads


def _own_busy_seconds() -> float:
    """This process's CPU time that ``busy_ticks`` counts: user and system time, or system
    time alone when the process itself runs at a lower priority (its user time is then in the
    nice column)."""
    times = os.times()
    niced = os.getpriority(os.PRIO_PROCESS, 0) > 0
    return times.system if niced else times.user + times.system


def adaptive_cpu_threads(num_threads: int | None) -> AdaptiveCpuThreads | None:
    """The governor for an engine whose thread count was not given (``--num-cpu-threads``,
    ``OMP_NUM_THREADS``) on a system with ``/proc/stat``; None where the count stays fixed."""
    if num_threads is not None or "OMP_NUM_THREADS" in os.environ:
        return None
    if not hasattr(os, "sched_getaffinity") or not Path("/proc/stat").is_file():
        return None
    ceiling = torch.get_num_threads()
    return AdaptiveCpuThreads(ceiling) if ceiling > 1 else None
