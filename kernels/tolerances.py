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


def on_the_activation_grid(rows: int, k: int, seed: int) -> torch.Tensor:
    """Activations the CPU's integer dots round to themselves (cpu/integer_dot.py): integers
    times ``2^-20``, each 32-group's first ``ACTIVATION_MAX`` of them, so every group's step is
    ``2^-20`` whatever group the type rounds under (32 or 256)."""
    from pagedserve.kernels.cpu.integer_dot import ACTIVATION_MAX, GROUP

    generator = torch.Generator().manual_seed(seed)
    grid = torch.randint(-ACTIVATION_MAX, ACTIVATION_MAX + 1, (rows, k), generator=generator)
    grid[:, ::GROUP] = ACTIVATION_MAX
    return grid.float() * 2.0**-20


def assert_within_rounding(out, want, x, weights, group: int) -> None:
    """``out`` within ``want`` (the exact product ``x @ weights.T``) plus what rounding ``x`` to
    16 bits per ``group`` allows: each activation is within half its group's step
    (``max |x| / ACTIVATION_MAX``), so an output is within ``sum |w| * step / 2``, plus the GEMM
    tolerance."""
    from pagedserve.kernels.cpu.integer_dot import ACTIVATION_MAX

    x2 = x.reshape(-1, x.shape[-1])
    steps = x2.abs().view(x2.shape[0], -1, group).amax(-1) / ACTIVATION_MAX
    bound = (steps.repeat_interleave(group, -1) / 2) @ weights.abs().T
    atol, rtol = tolerance(torch.float32, gemm=True)
    error = (out.reshape(bound.shape) - want.reshape(bound.shape)).abs()
    assert (error <= bound + atol + rtol * want.reshape(bound.shape).abs()).all()
