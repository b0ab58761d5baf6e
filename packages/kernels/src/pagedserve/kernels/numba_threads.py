"""How many threads a parallel numba kernel runs on: torch's count, so the engine's one setting
(``num_cpu_threads``, engine/cpu_threads.py) sizes both pools.

numba's pool is created once, at its first parallel call, with ``NUMBA_NUM_THREADS`` workers
(default: every core); ``numba.set_num_threads`` can only lower the number in use below that.
"""

from __future__ import annotations

import numba
import torch


def follow_torch_threads() -> int:
    """Make numba's parallel regions use ``min(torch threads, NUMBA_NUM_THREADS)`` threads
    (checked on every call: a dictionary read when nothing changed); returns that count."""
    threads = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if numba.get_num_threads() != threads:
        numba.set_num_threads(threads)
    return threads
