"""numba's thread count follows torch's, in every thread, also when torch's count changes
between calls (follow_torch_threads remembers, per thread, what it last followed), and
creating numba's pool does not change torch's count."""

import os
import threading

import numba
import torch

from pagedserve.kernels.cpu.threads import follow_torch_threads


def _expected() -> int:
    return max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))


def test_numba_follows_torch_when_torch_changes():
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 1):
            torch.set_num_threads(count)
            assert follow_torch_threads() == _expected()
            assert numba.get_num_threads() == _expected()
    finally:
        torch.set_num_threads(threads)


def test_each_thread_sets_its_own_count():
    """numba's count is per thread: a thread that has never followed torch sets it too."""
    follow_torch_threads()
    seen = []
    worker = threading.Thread(
        target=lambda: seen.append((follow_torch_threads(), numba.get_num_threads()))
    )
    worker.start()
    worker.join()
    assert seen == [(_expected(), _expected())]


def test_starting_numba_keeps_torchs_count(tmp_path):
    """In a fresh process (numba's pool not yet created) with more numba threads than torch
    has: creating the pool sets OpenMP's count, and torch's must come back."""
    import subprocess
    import sys

    script = (
        "import torch; torch.set_num_threads(1)\n"
        "from pagedserve.kernels.cpu.threads import follow_torch_threads\n"
        "print(follow_torch_threads(), torch.get_num_threads())\n"
    )
    env = {**os.environ, "NUMBA_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["1", "1"], out.stderr
