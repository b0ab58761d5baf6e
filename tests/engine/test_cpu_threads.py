"""num_cpu_threads: the engine sizes torch's pool once, and says when numba's cannot follow."""

from __future__ import annotations

import logging

import numba
import pytest
import torch

from pagedserve.engine import EngineArgs
from pagedserve.engine.cpu_threads import set_cpu_threads


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_sets_torch_threads_and_none_leaves_them():
    assert set_cpu_threads(1) == 1 and torch.get_num_threads() == 1
    assert set_cpu_threads(None) == 1


def test_warns_when_numba_pool_is_smaller(monkeypatch, caplog):
    monkeypatch.setattr(numba.config, "NUMBA_NUM_THREADS", 1)
    with caplog.at_level(logging.WARNING, logger="pagedserve.engine"):
        set_cpu_threads(2)
    assert "NUMBA_NUM_THREADS=1 caps the numba attention kernel" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="pagedserve.engine"):
        set_cpu_threads(1)
    assert "caps" not in caplog.text


def test_rejects_zero_and_is_an_engine_option():
    with pytest.raises(ValueError, match="num_cpu_threads must be >= 1"):
        set_cpu_threads(0)
    assert EngineArgs(model="unused", num_cpu_threads=2).num_cpu_threads == 2


def _cgroup(root, path: str, **files: str) -> None:
    folder = root / path
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("_", ".", 1)).write_text(text)


def test_available_cpus_follow_the_affinity_and_the_cgroup_quota(tmp_path, monkeypatch):
    """docker --cpus 1.5 on a 4-CPU affinity mask: 2 threads (v2, the quota on a parent); a v1
    quota of 1 CPU: 1; no quota ("max", -1): the mask's 4."""
    from pagedserve.engine.cpu_threads import available_cpus

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
    v2 = tmp_path / "v2"
    _cgroup(v2, "kubepods/pod", cpu_max="max 100000\n")
    _cgroup(v2, "kubepods", cpu_max="150000 100000\n")
    assert available_cpus(v2, "0::/kubepods/pod\n") == 2
    v1 = tmp_path / "v1"
    _cgroup(v1, "cpu,cpuacct/docker/abc", cpu_cfs_quota_us="100000", cpu_cfs_period_us="100000")
    assert available_cpus(v1, "3:cpu,cpuacct:/docker/abc\n1:memory:/docker/abc\n") == 1
    _cgroup(v1, "cpu,cpuacct/free", cpu_cfs_quota_us="-1", cpu_cfs_period_us="100000")
    assert available_cpus(v1, "3:cpu,cpuacct:/free\n") == 4
    assert available_cpus(tmp_path / "none", "0::/\n") == 4


def test_unset_threads_stay_within_what_the_process_may_use(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("pagedserve.engine.cpu_threads.available_cpus", lambda: 1)
    torch.set_num_threads(2)
    assert set_cpu_threads(None) == 1 and torch.get_num_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the operator's own count is kept
    torch.set_num_threads(2)
    assert set_cpu_threads(None) == 2


def _stat(per_cpu: dict[int, tuple[int, ...]]) -> str:
    """A /proc/stat text: the aggregate line (which must not be counted twice) and one line per
    CPU of user nice system idle iowait irq softirq steal ticks."""
    lines = ["cpu  " + " ".join(["999999"] * 8)]
    lines += [f"cpu{n} " + " ".join(map(str, ticks)) + " 0 0" for n, ticks in per_cpu.items()]
    return "\n".join(lines + ["intr 12345 0 0", "ctxt 42"])


def test_busy_ticks_count_what_keeps_the_engine_off_its_cpus():
    """user + system + irq + softirq + steal of the CPUs the process may use; not the nice
    column (a lower-priority process yields), nor idle or iowait, nor other CPUs."""
    from pagedserve.engine.cpu_threads import busy_ticks

    stat = _stat({0: (10, 500, 20, 900, 40, 1, 2, 3), 1: (7, 0, 0, 0, 0, 0, 0, 0)})
    assert busy_ticks(stat, {0}) == 10 + 20 + 1 + 2 + 3
    assert busy_ticks(stat, {0, 1}) == 36 + 7
    assert busy_ticks(stat, {5}) == 0


class _Machine:
    """Two CPUs whose /proc/stat the test advances: the engine's own busy time and its
    neighbours' (at equal priority, or niced), one reading per second."""

    def __init__(self):
        self.now, self.own, self.user, self.nice = 0.0, 0.0, 0, 0

    def advance(self, own_cores: float, neighbour_cores: float, niced: bool = False):
        self.now += 1.0
        self.own += own_cores
        busy = int(round(100 * neighbour_cores))  # SC_CLK_TCK is 100 on Linux
        self.user += int(round(100 * own_cores)) + (0 if niced else busy)
        self.nice += busy if niced else 0

    def stat(self) -> str:
        return _stat({0: (self.user, self.nice, 0, 0, 0, 0, 0, 0), 1: (0,) * 8})


def test_threads_follow_the_cores_neighbours_leave_free(monkeypatch):
    from pagedserve.engine.cpu_threads import AdaptiveCpuThreads

    monkeypatch.setattr("os.sysconf", lambda name: 100)
    m = _Machine()
    governor = AdaptiveCpuThreads(
        2, cpus={0, 1}, interval=0.5, read_stat=m.stat, own_seconds=lambda: m.own,
        clock=lambda: m.now,
    )  # fmt: skip
    counts = []
    for own, neighbour, niced in [
        (2.0, 0.0, False),  # quiet: both cores
        (1.0, 1.0, False),  # a busy neighbour: one reading is not yet a change
        (1.0, 1.0, False),  # the second agrees: one thread
        (1.0, 0.1, False),  # it pauses once: kept
        (1.0, 1.0, False),
        (1.0, 0.0, False),  # it is gone ...
        (2.0, 0.0, False),  # ... for two readings: both cores again
        (2.0, 1.0, True),  # a niced neighbour takes only idle time: never counted
        (2.0, 1.0, True),
        (1.5, 0.5, False),  # busy half the time at equal priority: one thread
        (1.5, 0.5, False),
        (1.8, 0.2, False),  # a fifth of a core (a hypervisor's steal): both again
        (1.8, 0.2, False),
    ]:
        m.advance(own, neighbour, niced)
        counts.append(governor.before_step())
        assert torch.get_num_threads() == counts[-1]  # torch's pool (numba's follows it)
    assert counts == [2, 2, 1, 1, 1, 1, 2, 2, 2, 2, 1, 1, 2]


def test_only_an_unset_thread_count_adapts(monkeypatch):
    from pagedserve.engine.cpu_threads import adaptive_cpu_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert adaptive_cpu_threads(None) is None  # the operator's count is kept
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert adaptive_cpu_threads(2) is None
    torch.set_num_threads(1)
    assert adaptive_cpu_threads(None) is None  # one thread: nothing to adapt
    torch.set_num_threads(2)
    governor = adaptive_cpu_threads(None)
    assert governor is not None and governor.ceiling == 2


def test_an_engine_beside_a_busy_neighbour_runs_on_the_core_it_leaves(tiny_checkpoint, monkeypatch):
    """End to end on this machine: a process spinning at the engine's priority on a
    two-thread engine's machine, and within a few seconds of steps the engine runs one
    thread (torch's pool, which numba's follows)."""
    import os
    import subprocess
    import sys
    import time

    from pagedserve.engine import LLMEngine, SamplingParams

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: nothing to adapt")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(2)
    engine = LLMEngine(EngineArgs(model=tiny_checkpoint("llama"), max_num_seqs=4))
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        deadline, threads, n = time.monotonic() + 20, 2, 0
        while time.monotonic() < deadline and threads == 2:
            if not engine.has_unfinished_requests():
                engine.add_request(f"r{n}", [1, 2, 3, 4], params)
                n += 1
            engine.step()
            threads = torch.get_num_threads()
    finally:
        neighbour.kill()
        engine.shutdown()
    assert threads == 1
