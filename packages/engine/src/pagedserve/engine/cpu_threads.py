"""How many threads the engine's CPU work uses, set once, deliberately, at start-up.

Two thread pools do the CPU engine's arithmetic: torch's (OpenMP: the GEMMs, SDPA, the
element-wise ops) and numba's (the paged attention kernel). Left alone, torch takes
``OMP_NUM_THREADS`` or every physical core, and numba every core: a server sharing the machine
with other work then oversubscribes it, and OpenMP workers that spin-wait for a busy core
stall every step. ``num_cpu_threads`` sizes torch's pool; the numba kernel follows torch's
count on every call, up to ``NUMBA_NUM_THREADS`` (numba's pool is sized once, when numba is
first imported, from that variable; default: every core).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("pagedserve.engine")


def set_cpu_threads(num_threads: int | None) -> int:
    """Size torch's thread pool (None: leave it as the environment made it); returns the count
    the engine runs with, and warns when numba's pool cannot follow it."""
    if num_threads is not None:
        if num_threads < 1:
            raise ValueError(f"num_cpu_threads must be >= 1, got {num_threads}")
        torch.set_num_threads(num_threads)
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
