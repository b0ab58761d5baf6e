"""silu_and_mul_ref, gelu_tanh_ref and quick_gelu_ref against the formulas the model code would
write."""

import torch
import torch.nn.functional as F
from transformers.activations import NewGELUActivation, QuickGELUActivation

from pagedserve.kernels import gelu_tanh_ref, quick_gelu_ref, silu_and_mul_ref


def test_silu_and_mul_is_gate_first():
    x = torch.randn(3, 2, 20)
    gate, up = x[..., :10], x[..., 10:]
    assert torch.equal(silu_and_mul_ref(x), F.silu(gate) * up)


def test_silu_and_mul_fp32_writes_a_new_tensor():
    """The fp32 path multiplies in place into silu's result, never into its input."""
    x = torch.randn(4, 64)[:, ::2]  # a strided view, as a fused projection's half could be
    before = x.clone()
    out = silu_and_mul_ref(x)
    assert torch.equal(x, before)
    assert torch.equal(out, F.silu(before[:, :16]) * before[:, 16:])
    assert out.data_ptr() != x.data_ptr()


def test_silu_and_mul_half_precision_is_close_to_fp32():
    x = torch.randn(4, 32)
    out = silu_and_mul_ref(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.shape == (4, 16)
    torch.testing.assert_close(out.float(), silu_and_mul_ref(x), atol=1e-2, rtol=1.6e-2)


def test_gelu_tanh_is_gpt2_gelu_new():
    x = torch.linspace(-8, 8, 257)
    torch.testing.assert_close(gelu_tanh_ref(x), NewGELUActivation()(x), atol=1e-6, rtol=1e-6)
    half = gelu_tanh_ref(x.to(torch.bfloat16))
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), NewGELUActivation()(x), atol=1e-2, rtol=1.6e-2)


def test_quick_gelu_is_clips_activation():
    """In fp32 the reference is transformers' QuickGELUActivation bit for bit (CLIP towers are
    compared with transformers exactly); in bf16 it rounds once, from fp32."""
    x = torch.linspace(-8, 8, 257)
    assert torch.equal(quick_gelu_ref(x), QuickGELUActivation()(x))
    assert torch.equal(quick_gelu_ref(x), x * torch.sigmoid(1.702 * x))
    half = quick_gelu_ref(x.to(torch.bfloat16))
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), QuickGELUActivation()(x), atol=1e-2, rtol=1.6e-2)
