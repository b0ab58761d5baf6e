"""store_kv, rms_norm, layer_norm, rotary_embedding, silu_and_mul, swigluoai_and_mul,
gelu_tanh, gelu, quick_gelu: the Triton kernel (or the implementation given with --impl)
against the reference."""

import pytest
import torch
from contracts import implementation
from suite_grid import DEVICE, DTYPES, pick
from tolerances import assert_close

from pagedserve.kernels.gelu import gelu_ref
from pagedserve.kernels.gelu_tanh import gelu_tanh_ref
from pagedserve.kernels.layer_norm import layer_norm_ref
from pagedserve.kernels.quick_gelu import quick_gelu_ref
from pagedserve.kernels.rms_norm import rms_norm_ref
from pagedserve.kernels.rotary_embedding import rotary_embedding_ref
from pagedserve.kernels.silu_and_mul import silu_and_mul_ref
from pagedserve.kernels.store_kv import store_kv_ref
from pagedserve.kernels.swigluoai_and_mul import swigluoai_and_mul_ref

dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=str)
HIDDEN = pick([64, 100], [64, 100, 2048, 4096, 5120])
TOKENS = pick(5, 257)


def randn(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


@pytest.mark.contract("store_kv")
@dtypes
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize("heads", [(1, 64), (4, 32), (3, 80)], ids=str)
def test_store_kv(heads, slot_dtype, dtype):
    n_heads, head_dim = heads
    num_blocks, block_size, n_tokens = 6, 8, pick(9, 40)
    gen = torch.Generator().manual_seed(0)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:n_tokens]
    slots[::3] = -1
    key, value = (
        randn(n_tokens, n_heads, head_dim, dtype=dtype),
        randn(n_tokens, n_heads, head_dim, dtype=dtype, seed=1),
    )
    caches = [
        torch.full(
            (num_blocks, block_size, n_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE
        )
        for _ in range(4)
    ]
    slots = slots.to(slot_dtype).to(DEVICE)
    implementation("store_kv")(key, value, caches[0], caches[1], slots)
    store_kv_ref(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0].nan_to_num(7.0), caches[2].nan_to_num(7.0))
    assert torch.equal(caches[1].nan_to_num(7.0), caches[3].nan_to_num(7.0))


@pytest.mark.contract("rms_norm")
@dtypes
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("fused_residual", [False, True])
def test_rms_norm(fused_residual, hidden, dtype):
    x, weight = randn(TOKENS, hidden, dtype=dtype), randn(hidden, dtype=dtype, seed=1)
    residual = randn(TOKENS, hidden, dtype=dtype, seed=2) if fused_residual else None
    out = implementation("rms_norm")(x, weight, 1e-6, residual)
    expect = rms_norm_ref(x, weight, 1e-6, residual)
    for a, b in zip(out, expect) if fused_residual else [(out, expect)]:
        assert_close(a, b)


@pytest.mark.contract("rms_norm")
def test_rms_norm_strided_rows():
    x = randn(6, 2 * 64)[:, :64]
    assert_close(
        implementation("rms_norm")(x, randn(64, seed=1), 1e-5),
        rms_norm_ref(x, randn(64, seed=1), 1e-5),
    )


@pytest.mark.contract("layer_norm")
@dtypes
@pytest.mark.parametrize("hidden", HIDDEN)
def test_layer_norm(hidden, dtype):
    x = randn(TOKENS, hidden, dtype=dtype) * 3 + 1
    weight, bias = randn(hidden, dtype=dtype, seed=1), randn(hidden, dtype=dtype, seed=2)
    assert_close(
        implementation("layer_norm")(x, weight, bias, 1e-5), layer_norm_ref(x, weight, bias, 1e-5)
    )


def _cos_sin_cache(max_position, rot_dim):
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim)
    freqs = torch.outer(torch.arange(max_position).float(), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DEVICE)


@pytest.mark.contract("rotary_embedding")
@dtypes
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("head_dim,rot_dim", [(64, 64), (128, 128), (64, 32), (80, 80)])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=str)
def test_rotary_embedding(heads, head_dim, rot_dim, is_neox, dtype):
    n_q, n_kv = heads
    positions = torch.randint(0, 4096, (TOKENS,), generator=torch.Generator().manual_seed(0)).to(
        DEVICE
    )
    qkv = randn(TOKENS, n_q + 2 * n_kv, head_dim, dtype=dtype)  # views, as the model passes them
    cache = _cos_sin_cache(4096, rot_dim)
    q, k = qkv[:, :n_q], qkv[:, n_q : n_q + n_kv]
    expect = rotary_embedding_ref(positions, q.clone(), k.clone(), cache, is_neox)
    out = implementation("rotary_embedding")(positions, q, k, cache, is_neox)
    assert out[0].data_ptr() == qkv.data_ptr(), "rotary must work in place on views"
    assert_close(out[0], expect[0])
    assert_close(out[1], expect[1])


@pytest.mark.contract("silu_and_mul")
@dtypes
@pytest.mark.parametrize("d", pick([64, 100], [128, 1000, 11008, 14336]))
def test_silu_and_mul(d, dtype):
    x = randn(2, TOKENS, 2 * d, dtype=dtype) * 3
    assert_close(implementation("silu_and_mul")(x), silu_and_mul_ref(x))


@pytest.mark.contract("swigluoai_and_mul")
@dtypes
@pytest.mark.parametrize("d", pick([64, 100], [128, 1000, 2880]))
def test_swigluoai_and_mul(d, dtype):
    """gpt-oss's clamped SwiGLU, its inputs spread past the clamp (limit 7) on both sides."""
    x = randn(2, TOKENS, 2 * d, dtype=dtype) * 6
    out = implementation("swigluoai_and_mul")(x, 1.702, 7.0)
    assert_close(out, swigluoai_and_mul_ref(x, 1.702, 7.0))


@pytest.mark.contract("gelu_tanh")
@dtypes
@pytest.mark.parametrize("shape", pick([(5, 100)], [(257, 3072), (4, 50257)]), ids=str)
def test_gelu_tanh(shape, dtype):
    x = randn(*shape, dtype=dtype) * 4
    x[0, :3] = torch.tensor([-30.0, 0.0, 30.0])
    assert_close(implementation("gelu_tanh")(x), gelu_tanh_ref(x))


@pytest.mark.contract("gelu")
@dtypes
@pytest.mark.parametrize("shape", pick([(5, 100)], [(257, 1536), (4, 3072)]), ids=str)
def test_gelu(shape, dtype):
    x = randn(*shape, dtype=dtype) * 4
    x[0, :3] = torch.tensor([-30.0, 0.0, 30.0])
    assert_close(implementation("gelu")(x), gelu_ref(x))


@pytest.mark.contract("quick_gelu")
@dtypes
@pytest.mark.parametrize("shape", pick([(5, 100)], [(577, 4096), (4, 1024)]), ids=str)
def test_quick_gelu(shape, dtype):
    """CLIP's activation, with inputs of +-60, where a plain exp(-1.702 x) would overflow."""
    x = randn(*shape, dtype=dtype) * 4
    x[0, :3] = torch.tensor([-60.0, 0.0, 60.0])
    assert_close(implementation("quick_gelu")(x), quick_gelu_ref(x))
