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
"""

from __future__ import annotations

import logging
import math
import os
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
