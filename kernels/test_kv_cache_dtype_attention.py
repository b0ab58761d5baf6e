"""Paged attention over a KV cache of another dtype than the query (``--kv-cache-dtype``).

A 16-bit, fp8 e4m3 or q8_0 cache under an fp32 model: the kernel widens what it reads to fp32 and
computes in fp32, so against the specification (which widens the same stored values) it is held to the
fp32 attention tolerance, not the 16-bit one. And the tensor-core branch a GPU takes for a
16-bit query over a cache of another width, taken through the wrapper as a GPU would take it.
The batches are make_paged_batch's: shuffled block tables, NaN in every slot no one owns.
"""

import contracts
import pytest
import torch
from suite_grid import DEVICE
from tolerances import assert_close

from pagedserve.kernels.dispatch import taken_as_cuda
from pagedserve.kernels.paged_attention import paged_attention_triton
from pagedserve.kernels.paged_attention_literal import paged_attention_literal
from pagedserve.kernels.testing import make_paged_batch

contract = pytest.mark.contract("paged_attention")
# bf16 has no numpy arithmetic under the interpreter: a bf16 cache runs on CUDA only. An fp8
# cache is read as its bytes, decoded with integer arithmetic (kv_fp8.py), a q8_0 cache as int8
# rows with their groups' scales (kv_q8.py, torch.int8): on both.
NARROW_CACHES = [torch.float16, torch.float8_e4m3fn, torch.int8] + (
    [torch.bfloat16] if DEVICE == "cuda" else []
)
STEPS = {
    "decode": [(33, 1), (1, 1), (17, 1)],
    "mixed": [(18, 1), (40, 23), (35, 6), (1, 1)],
}


@contract
@pytest.mark.parametrize("cache_dtype", NARROW_CACHES, ids=str)
@pytest.mark.parametrize("heads", [(9, 3), (8, 1)], ids=["smollm2-gqa3", "mqa"])
@pytest.mark.parametrize("step", list(STEPS))
def test_fp32_query_over_a_narrower_cache(step, heads, cache_dtype):
    batch = make_paged_batch(
        STEPS[step], *heads, 32, 16, torch.float32, DEVICE, seed=7, cache_dtype=cache_dtype
    )
    assert batch.k_cache.dtype == cache_dtype and batch.query.dtype == torch.float32
    out = contracts.implementation("paged_attention")(*batch.args())
    assert_close(out, paged_attention_literal(*batch.args()), attention=True)


@contract
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn, torch.int8], ids=str)
@pytest.mark.parametrize("step", list(STEPS))
def test_tensor_core_branch_over_a_cache_of_another_dtype(step, cache_dtype):
    """fp16 query, fp32, fp8 or q8_0 (int8) cache, as a GPU takes it (tl.dot on fp16
    operands): the cache tile is taken as the query's type (exact for fp8's values), so the
    kernel compiles and stays within fp16 tolerance."""
    contracts.own_wrapper_only("paged_attention")
    batch = make_paged_batch(
        STEPS[step], 9, 3, 64, 16, torch.float16, DEVICE, seed=8, cache_dtype=cache_dtype
    )
    with taken_as_cuda(multi_processor_count=16):
        out = paged_attention_triton(*batch.args())
    assert_close(out, paged_attention_literal(*batch.args()), attention=True)


@contract
@pytest.mark.parametrize("step", list(STEPS))
def test_q8_0_cache_with_heads_narrower_than_the_tile(step):
    """Heads of 96 in a tile of 128: the lanes past the head would address the next head's row
    for their scales (or past the cache's end), so their loads are masked like the elements'."""
    batch = make_paged_batch(
        STEPS[step], 6, 2, 96, 16, torch.float32, DEVICE, seed=9, cache_dtype=torch.int8
    )
    assert batch.k_cache.shape[-1] == 96 + 6
    out = contracts.implementation("paged_attention")(*batch.args())
    assert_close(out, paged_attention_literal(*batch.args()), attention=True)
