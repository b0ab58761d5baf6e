"""Multi-head latent attention's kernels: mla_paged_decode (the Triton kernel, or the
implementation given with --impl) and the CPU path, mla_paged_decode_ref, against the literal
specification; store_latent against its reference.

Batches come from ``make_paged_batch`` with one KV head of ``kv_lora_rank + rope_dim``
features (the latent row): shuffled, padded block tables, and every slot no sequence owns is
NaN, so a kernel that reads past a sequence fails loudly.
"""

import contracts
import pytest
import torch
from suite_grid import DEVICE, DTYPES, pick
from tolerances import assert_close

from pagedserve.kernels.dispatch import taken_as_cuda
from pagedserve.kernels.mla_attention_literal import mla_paged_decode_literal
from pagedserve.kernels.mla_decode import mla_paged_decode_ref, mla_paged_decode_triton
from pagedserve.kernels.store_latent import store_latent_ref
from pagedserve.kernels.testing import make_paged_batch

contract = pytest.mark.contract("mla_paged_decode")

# (kv_lora_rank, rope_dim): the tiny test models', one off the powers of two, DeepSeek's own
DIMS = pick([(32, 16), (40, 24)], [(32, 16), (40, 24), (512, 64)])


def decode_args(seq_lens, n_heads, dims, block_size, dtype, seed=0, cache_dtype=None):
    kv_lora_rank, rope_dim = dims
    batch = make_paged_batch(
        [(n, 1) for n in seq_lens], n_heads, 1, kv_lora_rank + rope_dim, block_size, dtype,
        DEVICE, seed=seed, cache_dtype=cache_dtype,
    )  # fmt: skip
    scale = (kv_lora_rank // 4 + rope_dim) ** -0.5  # a qk head dim's, not the latent's
    return batch.query, batch.k_cache, batch.block_tables, batch.seq_lens, scale, kv_lora_rank


def seq_lens_case(block_size: int) -> list[int]:
    return [1, block_size - 1, 2 * block_size, 3 * block_size + 1, pick(3, 20) * block_size + 5]


@contract
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dims", DIMS, ids=str)
@pytest.mark.parametrize("n_heads", [16, 20, pick(4, 128)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_decode_matches_the_specification(block_size, n_heads, dims, dtype):
    args = decode_args(seq_lens_case(block_size), n_heads, dims, block_size, dtype)
    out = contracts.implementation("mla_paged_decode")(*args)
    assert_close(out, mla_paged_decode_literal(*args), attention=True)


@contract
@pytest.mark.parametrize("splits", [2, 3, pick(5, 16)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_kv_decode(splits, dtype):
    """Flash-decoding over the latents: some splits of the short sequences see nothing."""
    contracts.own_wrapper_only("mla_paged_decode")
    args = decode_args([pick(70, 3000), 1, 17, pick(41, 1500)], 16, DIMS[-1], 16, dtype, seed=2)
    out = mla_paged_decode_triton(*args, num_kv_splits=splits)
    assert_close(out, mla_paged_decode_literal(*args), attention=True)


@contract
@pytest.mark.parametrize("n_heads", [16, 24])
def test_tensor_core_branch_in_fp16(n_heads):
    """The branch a GPU takes for fp16 (tl.dot on fp16 operands, P rounded before P @ latent),
    which the interpreter's own dispatch never takes, as a 16-SM GPU would launch it (a long
    context splits): at fp16 tolerance against the spec."""
    contracts.own_wrapper_only("mla_paged_decode")
    seq_lens = seq_lens_case(16) + [1100]
    args = decode_args(seq_lens, n_heads, DIMS[-1], 16, torch.float16, seed=6)
    with taken_as_cuda(multi_processor_count=16):
        out = mla_paged_decode_triton(*args)
    assert_close(out, mla_paged_decode_literal(*args), attention=True)


@contract
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_an_fp32_query_over_a_16_bit_latent_cache(cache_dtype):
    """``--kv-cache-dtype`` under an fp32 model: the latents are widened as they are read."""
    if cache_dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("the interpreter has no bf16 arithmetic")
    args = decode_args(seq_lens_case(16), 16, DIMS[0], 16, torch.float32, 7, cache_dtype)
    out = contracts.implementation("mla_paged_decode")(*args)
    assert_close(out, mla_paged_decode_literal(*args), attention=True)
    assert_close(mla_paged_decode_ref(*args), mla_paged_decode_literal(*args), attention=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dims", DIMS, ids=str)
def test_cpu_path_matches_the_specification(dims, dtype):
    """The CPU engine's path (the vectorised reference) is held to the spec like a kernel."""
    args = decode_args(seq_lens_case(16), 16, dims, 16, dtype, seed=5)
    assert_close(mla_paged_decode_ref(*args), mla_paged_decode_literal(*args), attention=True)


@pytest.mark.contract("store_latent")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dims", DIMS, ids=str)
def test_store_latent(dims, dtype):
    """k_pe comes as the model hands it over, a strided [T, 1, R] view of the kv_a projection;
    padding slots (-1) write nothing; every other slot keeps its NaN."""
    kv_lora_rank, rope_dim = dims
    gen = torch.Generator().manual_seed(3)
    n_tokens, width = 7, kv_lora_rank + rope_dim
    kv_a = torch.randn(n_tokens, width, generator=gen).to(dtype).to(DEVICE)
    kv_c = torch.randn(n_tokens, kv_lora_rank, generator=gen).to(dtype).to(DEVICE)
    k_pe = kv_a[:, kv_lora_rank:].view(n_tokens, 1, rope_dim)
    cache = torch.full((5, 4, 1, width), float("nan"), dtype=dtype, device=DEVICE)
    slots = torch.tensor([3, -1, 17, 0, 9, -1, 12], device=DEVICE)
    expect = cache.clone()
    contracts.implementation("store_latent")(kv_c, k_pe, cache, slots)
    store_latent_ref(kv_c, k_pe, expect, slots)
    torch.testing.assert_close(cache, expect, equal_nan=True, atol=0, rtol=0)
    rows = cache.view(-1, width)[slots[slots >= 0]]
    valid = (slots >= 0).nonzero().flatten()
    assert torch.equal(rows, torch.cat([kv_c, k_pe[:, 0]], dim=-1)[valid])
    assert int(cache.view(-1, width).isnan().all(dim=-1).sum()) == 20 - len(valid)
