"""rms_norm_ref and layer_norm_ref against transformers' and torch's own modules."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from pagedserve.kernels import layer_norm_ref, rms_norm, rms_norm_ref


def _llama_norm(hidden: int, dtype: torch.dtype, eps: float) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(hidden, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden))
    return norm.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_is_transformers_llama_norm(dtype):
    torch.manual_seed(0)
    norm = _llama_norm(48, dtype, 1e-6)
    x = torch.randn(5, 48).to(dtype)
    with torch.no_grad():
        assert torch.equal(rms_norm_ref(x, norm.weight, 1e-6), norm(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_residual_add_is_add_then_norm(dtype):
    torch.manual_seed(1)
    norm = _llama_norm(32, dtype, 1e-5)
    x, residual = torch.randn(3, 2, 32).to(dtype), torch.randn(3, 2, 32).to(dtype)
    out, new_residual = rms_norm_ref(x, norm.weight, 1e-5, residual=residual)
    assert torch.equal(new_residual, residual + x)
    with torch.no_grad():
        assert torch.equal(out, norm(residual + x))


def test_rms_norm_leaves_inputs_alone_and_dispatches_to_ref_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, residual, weight = torch.randn(2, 8), torch.randn(2, 8), torch.randn(8)
    x0, r0 = x.clone(), residual.clone()
    out, new_residual = rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(x, x0) and torch.equal(residual, r0)
    assert torch.equal(new_residual, x0 + r0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_is_fp32_layer_norm(dtype):
    torch.manual_seed(2)
    x, weight, bias = torch.randn(4, 24).to(dtype), torch.randn(24), torch.randn(24)
    mean = x.double().mean(-1, keepdim=True)
    var = x.double().var(-1, unbiased=False, keepdim=True)
    expect = (x.double() - mean) / torch.sqrt(var + 1e-5) * weight.double() + bias.double()
    out = layer_norm_ref(x, weight, bias, 1e-5)
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(out.double(), expect, atol=tol, rtol=tol)
