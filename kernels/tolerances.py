"""The suite's one tolerance table (PyTorch's allclose defaults, as vLLM uses them).

Attention in fp32 gets atol 1e-4: its online softmax sums in a different order than the
reference; so do GEMMs (weight-only linear layers), which get the same. Exact kernels
(store_kv, copy_blocks, sampling tokens) are compared exactly.
"""

from __future__ import annotations

import torch

TOLERANCES = {  # dtype: (atol, rtol)
    torch.float32: (1e-5, 1.3e-6),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1e-2, 1.6e-2),
}
ATTENTION_FP32_ATOL = 1e-4
GEMM_FP32_ATOL = 1e-4  # a K-long dot product summed in tiles, against one BLAS call


def tolerance(
    dtype: torch.dtype, attention: bool = False, gemm: bool = False
) -> tuple[float, float]:
    atol, rtol = TOLERANCES[dtype]
    if attention and dtype == torch.float32:
        atol = ATTENTION_FP32_ATOL
    if gemm and dtype == torch.float32:
        atol = GEMM_FP32_ATOL
    return atol, rtol


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, attention: bool = False, gemm: bool = False
) -> None:
    """Same dtype, NaN nowhere, values within the table's tolerance for that dtype."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert not actual.isnan().any(), "NaN in the kernel's output"
    atol, rtol = tolerance(expected.dtype, attention, gemm)
    torch.testing.assert_close(actual.cpu(), expected.cpu(), atol=atol, rtol=rtol)


def table_lines() -> list[str]:
    lines = ["tolerances (atol, rtol):"]
    for dtype, (atol, rtol) in TOLERANCES.items():
        extra = f"; attention and GEMM atol {ATTENTION_FP32_ATOL}" if dtype == torch.float32 else ""
        lines.append(f"  {str(dtype).removeprefix('torch.'):>8}: {atol:g}, {rtol:g}{extra}")
    return lines


def assert_rows_invariant(multiply, x: torch.Tensor) -> None:
    """``multiply(x)`` (a CPU GEMM of ``x``'s rows) gives each row the same bits whether the row
    comes alone or among the others, on one thread or on two: the batch invariance the CPU's
    decode GEMMs promise (cpu/gguf_linear.py)."""
    results, before = [], torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            together = multiply(x)
            for start in range(x.shape[0]):
                alone = multiply(x[start : start + 1].clone())
                assert torch.equal(alone, together[start : start + 1]), (count, start)
            results.append(together)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[1])
