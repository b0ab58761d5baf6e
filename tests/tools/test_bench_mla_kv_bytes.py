"""tools/bench_mla_kv_bytes.py: the published DeepSeek geometries' bytes per token, and the
row measured from the engine's own latent cache."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import bench_mla_kv_bytes  # noqa: E402


def test_deepseek_v3s_latent_is_71_times_smaller_than_its_expanded_cache():
    v3 = next(g for g in bench_mla_kv_bytes.PUBLISHED if g.name == "DeepSeek-V3")
    assert v3.latent_bytes(torch.bfloat16) == 61 * (512 + 64) * 2
    assert v3.expanded_bytes(torch.bfloat16, tp=1) == 61 * 128 * (128 + 64 + 128) * 2
    assert v3.expanded_bytes(torch.bfloat16, tp=8) == 61 * 16 * (128 + 64 + 128) * 2


def test_the_tool_prints_the_table_with_a_row_measured_from_the_engine(capsys):
    assert bench_mla_kv_bytes.main([]) == 0
    out = capsys.readouterr().out
    assert (
        "DeepSeek-V3                        61   128          70,272         4,997,120   71.1x"
        in out
    )
    measured = next(line for line in out.splitlines() if "measured" in line).split()
    # the tiny model: 2 layers x (32 + 16) latent values x 2 bytes, against 4 heads x 56 each
    assert measured[-4:] == ["4", "192", "896", "4.7x"]
