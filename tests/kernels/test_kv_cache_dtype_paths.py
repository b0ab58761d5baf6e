"""A KV cache of another dtype than the model's (``--kv-cache-dtype``) on the CPU paths.

store_kv rounds fp32 keys and values to the cache's 16-bit or fp8 type on write (fp8
saturated at ±448); the two CPU
attention paths (the vectorised reference and the numba kernel) widen the stored values to
fp32 and compute in fp32, so each is held to the specification at the fp32 attention
tolerance (the specification widens the same stored values), NaN-filled unused slots included.
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from pagedserve.kernels import paged_attention_ref, store_kv_ref
from pagedserve.kernels.cpu.paged_attention import paged_attention_cpu, paged_attention_numba
from pagedserve.kernels.kv_q8 import widened
from pagedserve.kernels.paged_attention_literal import paged_attention_literal
from pagedserve.kernels.testing import make_paged_batch

PATHS = {"ref": paged_attention_ref, "numba": paged_attention_numba, "cpu": paged_attention_cpu}
STEPS = {  # (seq_len, q_len): decodes, chunks over a cached prefix, a prompt past NUMBA_MAX_Q_LEN
    "decode": [(1, 1), (33, 1), (100, 1)],
    "mixed": [(9, 1), (40, 17), (30, 5), (77, 1), (24, 24)],
}


NARROW = [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8]  # int8: q8_0 rows


@pytest.mark.parametrize("cache_dtype", NARROW, ids=str)
@pytest.mark.parametrize("heads", [(9, 3), (8, 1)], ids=["smollm2", "mqa"])
@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("path", list(PATHS))
def test_fp32_query_over_a_narrower_cache_matches_the_specification(path, step, heads, cache_dtype):
    batch = make_paged_batch(STEPS[step], *heads, 64, 16, seed=9, cache_dtype=cache_dtype)
    out = PATHS[path](*batch.args())
    assert out.dtype == torch.float32 and not out.isnan().any()
    torch.testing.assert_close(out, paged_attention_literal(*batch.args()), atol=1e-4, rtol=1.3e-6)


def _rounded(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the cache holds it, as bytes: fp8 saturated at ±448 first, q8_0 rows as
    gguf's Q8_0 blocks hold them (each group's scale moved after the row's elements)."""
    if cache_dtype == torch.float8_e4m3fn:
        return x.clamp(-448, 448).to(cache_dtype).view(torch.uint8)
    if cache_dtype == torch.int8:
        blocks = quants.quantize(x.numpy(), GGMLQuantizationType.Q8_0).reshape(
            *x.shape[:-1], -1, 34
        )
        elements, scales = blocks[..., 2:], blocks[..., :2]
        flat = (*x.shape[:-1], -1)
        return torch.from_numpy(np.concatenate([elements.reshape(flat), scales.reshape(flat)], -1))
    return x.to(cache_dtype).view(torch.uint8)


@pytest.mark.parametrize("cache_dtype", NARROW, ids=str)
def test_store_kv_rounds_to_the_cache_dtype_on_write(cache_dtype):
    key, value = torch.randn(5, 2, 32) * 300, torch.randn(5, 2, 32)  # some keys past fp8's 448
    k_cache = _nan_cache(cache_dtype)
    v_cache = k_cache.clone()
    slots = torch.tensor([0, 5, -1, 11, 2])
    store_kv_ref(key, value, k_cache, v_cache, slots)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(
                k_cache[s // 4, s % 4].view(torch.uint8), _rounded(key[t], cache_dtype)
            )
            assert torch.equal(
                v_cache[s // 4, s % 4].view(torch.uint8), _rounded(value[t], cache_dtype)
            )
    assert widened(k_cache.view(-1, *k_cache.shape[2:])[1]).isnan().all()  # slot 1: never written
    assert widened(k_cache).isfinite().sum() == 4 * 2 * 32  # every stored key finite, saturated


def _nan_cache(cache_dtype: torch.dtype) -> torch.Tensor:
    """Three blocks of four slots, two heads of 32, every element NaN (q8_0: NaN scales)."""
    return make_paged_batch([], 2, 2, 32, 4, spare_blocks=3, cache_dtype=cache_dtype).k_cache
