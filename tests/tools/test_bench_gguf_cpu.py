"""bench_gguf_cpu: each type covers the projections whose rows are whole blocks of it, and a
tiny run prints one row per type and batch with its options' times and ratios."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import bench_gguf_cpu  # noqa: E402

from pagedserve.kernels.gguf_dequant import GGUF_TYPE_IDS  # noqa: E402


def test_a_type_covers_the_projections_that_are_whole_blocks_of_it():
    k_quant = bench_gguf_cpu.make_layers("smollm2-135m", GGUF_TYPE_IDS["Q4_K"], layers=1)
    assert [w.shape for _, w in k_quant] == [(576, 1536)]  # down only: 576 is not 256s
    legacy = bench_gguf_cpu.make_layers("smollm2-135m", GGUF_TYPE_IDS["Q5_0"], layers=2)
    assert [tuple(w.shape) for _, w in legacy][:4] == list(
        bench_gguf_cpu.projections("smollm2-135m").values()
    )
    assert len(legacy) == 8 and not legacy[0][1].equal(legacy[4][1])  # each layer its own


def test_a_tiny_run_prints_each_type_and_batch_with_its_ratios(capsys):
    bench_gguf_cpu.main(["--model", "tiny", "--types", "Q4_0", "Q6_K", "--rows", "1", "17",
                         "--rounds", "1", "--layers", "1"])  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("tiny: 1 layers of qkv 512x256")
    assert "fp32/blocks" in lines[1] and "dequant/blocks" in lines[1]
    rows = [line.split() for line in lines[2:]]
    assert [(r[0], r[1]) for r in rows] == [("Q4_0", "1"), ("Q4_0", "17"), ("Q6_K", "1"),
                                            ("Q6_K", "17")]  # fmt: skip
    assert all(float(r[-1]) > 0 and float(r[-2]) > 0 for r in rows)
