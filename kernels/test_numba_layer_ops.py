"""The CPU engine's numba paths for a decoder layer's small ops, each held to its PyTorch
reference: RMSNorm (with and without the residual add), rotary embedding (neox and GPT-J pairs,
partial rotary, strided views of a fused qkv output), store_kv (slot -1 skipped, stale slots
untouched) and silu_and_mul (wide gates included: exp's range ends)."""

import pytest
import torch
from tolerances import assert_close

from pagedserve.kernels.cpu import layer_ops as ops
from pagedserve.kernels.rms_norm import rms_norm_ref
from pagedserve.kernels.rotary_embedding import rotary_embedding_ref
from pagedserve.kernels.silu_and_mul import silu_and_mul_ref
from pagedserve.kernels.store_kv import store_kv_ref


@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_matches_reference(tokens, residual):
    g = torch.Generator().manual_seed(tokens)
    x, res = (torch.randn(tokens, 576, generator=g) * 3 for _ in range(2))
    weight = torch.randn(576, generator=g)
    got = ops.rms_norm_numba(x, weight, 1e-5, res if residual else None)
    expected = rms_norm_ref(x, weight, 1e-5, res if residual else None)
    for actual, wanted in zip(got if residual else [got], expected if residual else [expected]):
        assert_close(actual, wanted)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_dim", [64, 32])
@pytest.mark.parametrize("positions_dtype", [torch.int64, torch.int32])
def test_rotary_matches_reference_on_views_of_a_fused_qkv(is_neox, rot_dim, positions_dtype):
    tokens, hq, hkv, d = 4, 9, 3, 64
    g = torch.Generator().manual_seed(rot_dim)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=g)
    cos_sin = torch.randn(50, rot_dim, generator=g)
    positions = torch.tensor([0, 7, 49, 7], dtype=positions_dtype)
    fused = qkv.clone()
    q, k, _ = fused.split([hq * d, hkv * d, hkv * d], dim=-1)
    q, k = q.view(tokens, hq, d), k.view(tokens, hkv, d)  # strided, as llama passes them
    q_ref, k_ref = (t.clone() for t in (q, k))
    ops.rotary_embedding_numba(positions, q, k, cos_sin, is_neox)
    rotary_embedding_ref(positions, q_ref, k_ref, cos_sin, is_neox)
    assert_close(q, q_ref)
    assert_close(k, k_ref)
    assert torch.equal(fused[:, (hq + hkv) * d :], qkv[:, (hq + hkv) * d :])  # v untouched


@pytest.mark.parametrize(
    "cache_dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]
)
def test_store_kv_matches_reference_and_skips_padding_slots(cache_dtype):
    """Exact for every cache dtype: a 16-bit cache gets the reference's rounding (``.to()``),
    an fp8 one its saturation at ±448, keys wide enough to reach fp16's subnormals and its
    overflow included."""
    g = torch.Generator().manual_seed(0)
    key, value = (torch.randn(5, 3, 64, generator=g) for _ in range(2))
    key[0, 0, :8] = torch.tensor([1e-6, -3e-8, 6e-5, 65519.0, 65520.0, -1e6, 0.0, -0.0])
    slots = torch.tensor([17, -1, 0, 40, -1], dtype=torch.int64)
    caches = [torch.full((4, 16, 3, 64), float("nan")).to(cache_dtype) for _ in range(4)]
    ops.store_kv_numba(key, value, caches[0], caches[1], slots)
    store_kv_ref(key, value, caches[2], caches[3], slots)
    for got, expected in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))  # exact, NaN kept
    stored = caches[0].view(-1, 3, 64)[17].float()
    if cache_dtype == torch.float8_e4m3fn:  # saturated, not NaN
        assert stored[0, 3] == 448.0 and stored[0, 5] == -448.0 and stored[0, 1] == 0.0
    else:
        assert torch.equal(stored, key[0].to(cache_dtype).float())


def test_supports_only_what_the_kernels_compute():
    x, weight = torch.zeros(4, 8), torch.zeros(8, 8)
    assert ops.supports(x, weight) and not ops.supports(x, weight.bfloat16())


def test_rms_norm_takes_a_strided_input():
    x = torch.randn(3, 1152)[:, ::2]
    weight = torch.randn(576)
    assert_close(ops.rms_norm_numba(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6))


def test_rms_norm_of_heads_keeps_their_shape():
    """Qwen3 normalises each head of a [T, H, D] view of the fused qkv output."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 4 * 64 + 64, generator=g)[:, :256].view(3, 4, 64)
    res = torch.randn(3, 4, 64, generator=g)
    weight = torch.randn(64, generator=g)
    out, new_residual = ops.rms_norm_numba(x, weight, 1e-6, res)
    want, want_residual = rms_norm_ref(x, weight, 1e-6, res)
    assert out.shape == new_residual.shape == (3, 4, 64)
    assert_close(out, want)
    assert_close(new_residual, want_residual)


@pytest.mark.parametrize("shape", [(1, 2 * 1536), (5, 2 * 40), (2, 3, 2 * 8)])
def test_silu_and_mul_matches_reference(shape):
    g = torch.Generator().manual_seed(shape[-1])
    x = torch.randn(shape, generator=g) * 4
    x.view(-1)[:6] = torch.tensor([-200.0, -90.0, -30.0, 30.0, 90.0, 0.0])  # exp's range ends
    got = ops.silu_and_mul_numba(x)
    assert got.shape == (*shape[:-1], shape[-1] // 2)
    assert_close(got, silu_and_mul_ref(x))
    strided = torch.zeros(*shape[:-1], 2 * shape[-1])[..., ::2]
    strided.copy_(x)
    assert torch.equal(ops.silu_and_mul_numba(strided), got)
    with pytest.raises(ValueError, match="even"):
        ops.silu_and_mul_numba(torch.zeros(2, 7))
