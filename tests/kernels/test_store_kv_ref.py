"""store_kv_ref against a per-token loop that computes block and offset by hand."""

import pytest
import torch

from pagedserve.kernels import store_kv, store_kv_ref


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_per_token_loop(slot_dtype, dtype):
    num_blocks, block_size, n_heads, head_dim, n_tokens = 5, 4, 2, 8, 7
    key = torch.randn(n_tokens, n_heads, head_dim).to(dtype)
    value = torch.randn(n_tokens, n_heads, head_dim).to(dtype)
    slots = torch.tensor([13, -1, 0, 19, 5, -1, 8], dtype=slot_dtype)
    shape = (num_blocks, block_size, n_heads, head_dim)
    k_cache, v_cache = torch.full(shape, 7.0, dtype=dtype), torch.full(shape, 7.0, dtype=dtype)
    expect_k, expect_v = k_cache.clone(), v_cache.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expect_k[s // block_size, s % block_size] = key[t]
            expect_v[s // block_size, s % block_size] = value[t]
    store_kv_ref(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expect_k) and torch.equal(v_cache, expect_v)


def test_strided_key_view_from_fused_qkv():
    qkv = torch.randn(3, 4 + 2 + 2, 8)
    key, value = qkv[:, 4:6], qkv[:, 6:]
    k_cache, v_cache = torch.zeros(2, 2, 2, 8), torch.zeros(2, 2, 2, 8)
    store_kv(key, value, k_cache, v_cache, torch.tensor([3, 0, 1]))
    assert torch.equal(k_cache.view(-1, 2, 8)[[3, 0, 1]], key)
    assert torch.equal(v_cache.view(-1, 2, 8)[[3, 0, 1]], value)


def test_rejects_mismatched_cache():
    key = torch.randn(2, 2, 8)
    with pytest.raises(ValueError, match="caches"):
        store_kv_ref(key, key, torch.zeros(2, 4, 3, 8), torch.zeros(2, 4, 3, 8), torch.zeros(2))
