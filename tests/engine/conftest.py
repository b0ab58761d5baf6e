"""Fixtures of the engine's tests that start ranks in other processes."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """Two cores, two to four ranks: one thread each (rank 0 here, workers inherit it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
