"""On CPU, dispatch sends the decoder layer's small ops to their numba paths (fp32), and to the
references when told to or when a dtype has no numba path; either way the results agree."""

import pytest
import torch

from pagedserve.kernels import rms_norm, rotary_embedding, silu_and_mul, store_kv
from pagedserve.kernels.cpu import layer_ops as ops


@pytest.fixture
def cpu_dispatch(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("PAGEDSERVE_KERNELS", raising=False)
    return monkeypatch


def _calls(monkeypatch, module, name: str) -> list:
    calls, inner = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: calls.append(1) or inner(*a, **k))
    return calls


def test_small_ops_take_numba_in_fp32_and_the_reference_otherwise(cpu_dispatch):
    norm = _calls(cpu_dispatch, ops, "rms_norm_numba")
    rot = _calls(cpu_dispatch, ops, "rotary_embedding_numba")
    store = _calls(cpu_dispatch, ops, "store_kv_numba")
    silu = _calls(cpu_dispatch, ops, "silu_and_mul_numba")
    x, w = torch.randn(2, 16), torch.randn(16)
    out, new_residual = rms_norm(x, w, 1e-6, x.clone())
    torch.testing.assert_close(new_residual, 2 * x)
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    rotary_embedding(torch.tensor([0, 1]), q, k, torch.randn(4, 8))
    cache = torch.zeros(2, 4, 1, 8)
    store_kv(k, k, cache, cache.clone(), torch.tensor([5, -1]))
    gate_up = torch.randn(2, 32)
    activated = silu_and_mul(gate_up)
    silu_and_mul(gate_up.double())  # no numba path for fp64: the reference
    assert torch.equal(cache[1, 1], k[0]) and (norm, rot, store, silu) == ([1], [1], [1], [1])
    rms_norm(x.bfloat16(), w.bfloat16(), 1e-6)  # no numba path for 16-bit: the reference
    cpu_dispatch.setenv("PAGEDSERVE_KERNELS", "ref")
    expected = rms_norm(x, w, 1e-6, x.clone())[0]
    torch.testing.assert_close(silu_and_mul(gate_up), activated)
    assert norm == [1] and silu == [1]
    torch.testing.assert_close(out, expected)
