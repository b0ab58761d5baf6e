"""A KV cache of another dtype than the model's (``--kv-cache-dtype``) on the CPU paths.

store_kv rounds fp32 keys and values to the cache's 16-bit type on write; the two CPU
attention paths (the vectorised reference and the numba kernel) widen the stored values to
fp32 and compute in fp32, so each is held to the specification at the fp32 attention
tolerance (the specification widens the same stored values), NaN-filled unused slots included.
"""

import pytest
import torch

from pagedserve.kernels import paged_attention_ref, store_kv_ref
from pagedserve.kernels.cpu.paged_attention import paged_attention_cpu, paged_attention_numba
from pagedserve.kernels.paged_attention_literal import paged_attention_literal
from pagedserve.kernels.testing import make_paged_batch

PATHS = {"ref": paged_attention_ref, "numba": paged_attention_numba, "cpu": paged_attention_cpu}
STEPS = {  # (seq_len, q_len): decodes, chunks over a cached prefix, a prompt past NUMBA_MAX_Q_LEN
    "decode": [(1, 1), (33, 1), (100, 1)],
    "mixed": [(9, 1), (40, 17), (30, 5), (77, 1), (24, 24)],
}


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", [(9, 3), (8, 1)], ids=["smollm2", "mqa"])
@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("path", list(PATHS))
def test_fp32_query_over_a_16bit_cache_matches_the_specification(path, step, heads, cache_dtype):
    batch = make_paged_batch(STEPS[step], *heads, 64, 16, seed=9, cache_dtype=cache_dtype)
    out = PATHS[path](*batch.args())
    assert out.dtype == torch.float32 and not out.isnan().any()
    torch.testing.assert_close(out, paged_attention_literal(*batch.args()), atol=1e-4, rtol=1.3e-6)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_store_kv_rounds_to_the_cache_dtype_on_write(cache_dtype):
    key, value = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    k_cache = torch.full((3, 4, 2, 8), float("nan"), dtype=cache_dtype)
    v_cache = k_cache.clone()
    slots = torch.tensor([0, 5, -1, 11, 2])
    store_kv_ref(key, value, k_cache, v_cache, slots)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(k_cache[s // 4, s % 4], key[t].to(cache_dtype))
            assert torch.equal(v_cache[s // 4, s % 4], value[t].to(cache_dtype))
    assert k_cache.view(-1, 2, 8)[1].isnan().all()  # slot 1 was never written
