"""q8_0 KV cache rows in Triton (kv_q8.py): store_kv into a q8_0 cache writes the reference's
bytes (each group's int8 elements and fp16 scale, rounded as llama.cpp rounds: the reference
is held to gguf's own quantizer in tests/kernels/test_kv_q8_rows.py), for keys as every model
dtype hands them over, heads of 64 and 128 and one of 96 (three groups in a tile of four),
padding slots skipped. The attention over such a cache: test_kv_cache_dtype_attention.py."""

import pytest
import torch
from contracts import implementation
from suite_grid import DEVICE, DTYPES

from pagedserve.kernels.kv_q8 import row_width
from pagedserve.kernels.store_kv import store_kv_ref
from pagedserve.kernels.testing import e4m3_rounding_inputs


@pytest.mark.contract("store_kv")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_store_kv_into_a_q8_0_cache(dtype, head_dim):
    n_tokens, n_heads, block_size = 9, 3, 8
    x = e4m3_rounding_inputs(n_random=1 << 14)
    x = x[x.isfinite() & (x.abs() < 6e4)][: 2 * n_tokens * n_heads * head_dim]
    key, value = x.view(2, n_tokens, n_heads, head_dim).to(dtype).to(DEVICE)
    key[0, 0] = 0.0  # all-zero groups: scale 0
    slots = torch.tensor([3, -1, 17, 0, 40, -1, 8, 9, 47], device=DEVICE)
    shape = (6, block_size, n_heads, row_width(head_dim))
    caches = [torch.zeros(shape, dtype=torch.int8, device=DEVICE) for _ in range(4)]
    implementation("store_kv")(key, value, caches[0], caches[1], slots)
    store_kv_ref(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert caches[0].view(-1, n_heads, row_width(head_dim))[1].eq(0).all()  # never written
