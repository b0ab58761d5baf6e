"""bench_host_overhead's ``--logits device-like``: logits of the real shape whose reading stays
small (one window buffer, not ``rows x vocab`` distinct values), still a different token in each
row, and the same "host total" as the default mode."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import bench_host_overhead  # noqa: E402


def test_device_like_logits_are_windows_of_one_small_buffer():
    rows, vocab = 16, 1000
    model = bench_host_overhead.StandInModel(8, vocab, rows, seed=0, logits="device-like")
    hidden = model.forward(torch.zeros(rows, dtype=torch.long), None, None, None)
    assert hidden.shape == (rows, 1)  # the runner's row gather moves a column, not the states
    logits = model.compute_logits(hidden)
    assert logits.shape == (rows, vocab)
    buffer = logits.as_strided((vocab + rows - 1,), (1,))
    assert logits.untyped_storage().nbytes() == (vocab + rows) * 4  # not rows x vocab values
    for row in (0, 5, rows - 1):
        assert torch.equal(logits[row], buffer[row : row + vocab])
    assert len(set(logits.argmax(-1).tolist())) == rows  # greedy picks a token per row
    host = bench_host_overhead.StandInModel(8, vocab, rows, seed=0)
    assert host.logits.is_contiguous() and host.hidden.shape[1] == 8  # the default: unchanged


def test_device_like_mode_measures_the_same_host_total(tiny_checkpoint):
    ms = bench_host_overhead.measure(
        tiny_checkpoint("llama"), 3, steps=3, prompt_len=8, outer=True, logits="device-like"
    )
    host = bench_host_overhead.HOST_TOTAL
    assert 0.0 < ms["  of which sampler"] < ms["step"]
    assert ms[host] == ms["step"] - ms["  of which sampler"]
