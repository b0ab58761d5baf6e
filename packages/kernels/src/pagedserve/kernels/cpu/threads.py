"""How many threads a parallel numba kernel runs on: torch's count, so the engine's one setting
(``num_cpu_threads``, engine/cpu_threads.py) sizes both pools.

numba's pool is created once, at its first parallel call, with ``NUMBA_NUM_THREADS`` workers
(default: every core); ``numba.set_num_threads`` can only lower the number in use below that.
The number in use is numba's per-thread state, set here and nowhere else in the engine (the
cluster's replica sets the same value at start-up).

Creating numba's OpenMP pool also sets OpenMP's thread count, which is torch's: an engine
started with ``num_cpu_threads=1`` under ``NUMBA_NUM_THREADS=2`` ran both pools on two threads
from its warm-up on. So the first call puts torch's count back.
"""

from __future__ import annotations

import threading

import numba
import torch

# Per thread, like numba's own setting: the torch count last followed and the count it gave.
# Asking numba (``numba.get_num_threads`` takes two locks) on every linear layer of every step
# cost more than the check it guards.
_followed = threading.local()


def follow_torch_threads() -> int:
    """Make numba's parallel regions use ``min(torch threads, NUMBA_NUM_THREADS)`` threads
    (checked on every call: an attribute read when torch's count has not changed since this
    thread last followed it); returns that count."""
    torch_threads = torch.get_num_threads()
    if getattr(_followed, "torch_threads", None) == torch_threads:
        return _followed.threads
    threads = max(1, min(torch_threads, numba.config.NUMBA_NUM_THREADS))
    if numba.get_num_threads() != threads:  # the first call creates numba's pool
        numba.set_num_threads(threads)
    if torch.get_num_threads() != torch_threads:  # which set OpenMP's count: torch's
        torch.set_num_threads(torch_threads)
    _followed.torch_threads, _followed.threads = torch_threads, threads
    return threads
