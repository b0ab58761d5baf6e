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
