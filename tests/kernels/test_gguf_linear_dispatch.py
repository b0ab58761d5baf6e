"""On CPU, a GGUF linear layer multiplies from its blocks with numba (cpu/gguf_linear.py) for
fp32 activations, decode rows and prefill rows alike; 16-bit activations, and any call when
the references are forced, take the reference (a whole dequantization, one GEMM)."""

import torch

from pagedserve.kernels.cpu import gguf_linear as cpu
from pagedserve.kernels.gguf_dequant import GGUF_TYPE_IDS
from pagedserve.kernels.gguf_linear import gguf_linear, gguf_linear_ref
from pagedserve.kernels.testing import random_gguf_rows


def test_fp32_rows_take_numba_and_the_rest_the_reference(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("PAGEDSERVE_KERNELS", raising=False)
    calls, inner = [], cpu.gguf_linear_numba
    monkeypatch.setattr(
        cpu, "gguf_linear_numba", lambda x, *a: calls.append(x.shape) or inner(x, *a)
    )
    qtype = GGUF_TYPE_IDS["Q4_K"]
    qweight, bias = random_gguf_rows(qtype, 24, 256), torch.randn(24)
    for rows in (1, cpu.MAX_ROWS + 1):
        x = torch.randn(rows, 256) / 64
        torch.testing.assert_close(
            gguf_linear(x, qweight, qtype, bias), gguf_linear_ref(x, qweight, qtype, bias),
            atol=1e-4, rtol=1e-5,
        )  # fmt: skip
    gguf_linear(torch.randn(2, 256).half(), qweight, qtype)
    assert calls == [(1, 256), (cpu.MAX_ROWS + 1, 256)]
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "ref")
    gguf_linear(torch.randn(1, 256), qweight, qtype)
    assert len(calls) == 2
