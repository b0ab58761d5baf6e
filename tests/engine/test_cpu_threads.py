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
