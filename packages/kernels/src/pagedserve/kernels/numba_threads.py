"""How many threads a parallel numba kernel runs on: torch's count, so the engine's one setting
(``num_cpu_threads``, engine/cpu_threads.py) sizes both pools.

numba's pool is created once, at its first parallel call, with ``NUMBA_NUM_THREADS`` workers
(default: every core); ``numba.set_num_threads`` can only lower the number in use below that,
and the number it sets holds for the calling thread only.
"""

from __future__ import annotations

import threading

import numba
import torch

# The count this module last gave numba in each thread: asking numba costs ~1.4 us, and the
# decode step's numba kernels ask ~150 times a step.
_set_here = threading.local()


def follow_torch_threads() -> int:
    """Make numba's parallel regions in this thread use ``min(torch threads,
    NUMBA_NUM_THREADS)`` threads (checked on every call; set only when torch's count has
    changed); returns that count."""
    threads = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if getattr(_set_here, "threads", None) != threads:
        numba.set_num_threads(threads)
        _set_here.threads = threads
    return threads
