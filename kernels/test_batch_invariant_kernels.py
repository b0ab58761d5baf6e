"""The batch-invariant kernels (``--batch-invariant``): each held to its reference at the
suite's tolerance, and each row's result the same bits (``torch.equal``) whatever else the
call holds.

- the fixed-tile Triton GEMM (``linear_triton``), rows alone against the same rows inside a
  75-row call, fp32 and the 16-bit tensor-core branch a GPU takes;
- paged attention with ``batch_invariant=True``, Triton and numba: every position of a
  530-token prompt computed whole equals the same position computed as a decode, inside a
  prefill chunk, beside other sequences and (Triton) by split programs folded afterwards;
  across the first fixed split boundary (512), with a sliding window and a soft cap, and in
  multi-head latent attention's absorbed form (one cache as keys and values);
- the MoE grouped GEMMs with their slots summed in order: a token alone against the same
  token among 40 others routed elsewhere.
"""

import dataclasses

import pytest
import torch
from suite_grid import DEVICE
from tolerances import assert_close

from pagedserve.kernels.cpu.paged_attention import paged_attention_numba
from pagedserve.kernels.dispatch import taken_as_cuda
from pagedserve.kernels.fused_moe import fused_moe_ref, fused_moe_triton
from pagedserve.kernels.linear import linear_ref, linear_triton
from pagedserve.kernels.paged_attention import paged_attention_triton
from pagedserve.kernels.paged_attention_literal import paged_attention_literal
from pagedserve.kernels.testing import PagedBatch, make_paged_batch

HALF = torch.float16


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- the GEMM ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, HALF], ids=str)
@pytest.mark.parametrize("n,k,bias", [(70, 40, False), (130, 96, True)])
def test_linear_rows_are_the_same_bits_in_any_call(dtype, n, k, bias):
    g = _gen(n)
    x = torch.randn(75, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
    whole = linear_triton(x, w, b)
    expected = linear_ref(x.float(), w.float(), None if b is None else b.float())
    assert_close(whole, expected.to(dtype), gemm=True)
    for start, rows in [(0, 1), (7, 1), (40, 3), (10, 33), (74, 1)]:
        part = linear_triton(x[start : start + rows].clone(), w, b)
        assert torch.equal(part, whole[start : start + rows]), (start, rows)


def test_linear_tensor_core_branch_rows_are_the_same_bits():
    """fp16 operands into tl.dot, as a GPU takes them (the interpreter's own dispatch dots
    in fp32)."""
    g = _gen(1)
    x = torch.randn(40, 64, generator=g).to(HALF).to(DEVICE)
    w = torch.randn(72, 64, generator=g).to(HALF).to(DEVICE)
    with taken_as_cuda(multi_processor_count=16):
        whole = linear_triton(x, w)
        alone = [linear_triton(x[i : i + 1].clone(), w) for i in (0, 17, 39)]
    assert_close(whole, linear_ref(x.float(), w.float()).to(HALF), gemm=True)
    for i, row in zip((0, 17, 39), alone, strict=True):
        assert torch.equal(row, whole[i : i + 1])


# ---- paged attention --------------------------------------------------------------------------

PROMPT = 530  # past the first fixed split (512 positions)
POSITIONS = [0, 9, 31, 32, 200, 511, 512, 529]


def _truncated(batch: PagedBatch, position: int, q_len: int) -> PagedBatch:
    """The prompt's sequence cut after ``position``, its last ``q_len`` tokens new: the same
    cache and block table, as a later step would see them."""
    return PagedBatch(
        batch.query[position + 1 - q_len : position + 1], batch.k_cache, batch.v_cache,
        batch.block_tables, torch.tensor([position + 1], dtype=torch.int32, device=DEVICE),
        torch.tensor([0, q_len], dtype=torch.int32, device=DEVICE), batch.scale, [], [],
    )  # fmt: skip


def _beside_others(batch: PagedBatch, position: int) -> PagedBatch:
    """The decode of ``position`` as the middle row of a batch of three decodes (the others
    are earlier positions of the same prompt: any rows will do)."""
    positions = [5, position, 300]
    return PagedBatch(
        batch.query[positions], batch.k_cache, batch.v_cache,
        batch.block_tables.expand(3, -1).contiguous(),
        torch.tensor([p + 1 for p in positions], dtype=torch.int32, device=DEVICE),
        torch.arange(4, dtype=torch.int32, device=DEVICE), batch.scale, [], [],
    )  # fmt: skip


ATTENTION = {
    "triton": lambda b, **kw: paged_attention_triton(*b.args(), batch_invariant=True, **kw),
    "numba": lambda b, num_kv_splits=None, **kw: paged_attention_numba(
        *b.args(), batch_invariant=True, **kw
    ),
}


# gpt-oss's attention sinks, one per query head. Under a window of 17 the decode of 529 sees
# the second fixed split only, while the chunk of 7 ending there starts its walk in the first:
# the sink must enter the fold at the same place for both.
SINKS = torch.tensor([0.5, -1.0, 2.0, 4.0], device=DEVICE)


@pytest.mark.parametrize(
    "layer",
    [{}, {"sliding_window": 40, "logits_soft_cap": 2.0}, {"sinks": SINKS},
     {"sliding_window": 17, "sinks": SINKS}],
    ids=["global", "window-cap", "sinks", "window-sinks"],
)  # fmt: skip
@pytest.mark.parametrize("impl", list(ATTENTION))
def test_attention_rows_are_the_same_bits_in_any_step(impl, layer):
    if impl == "numba" and DEVICE == "cuda":
        pytest.skip("the numba kernel runs on CPU tensors")
    attend = ATTENTION[impl]
    batch = make_paged_batch([(PROMPT, PROMPT)], 4, 2, 32, 16, device=DEVICE, seed=1)
    whole = attend(batch, **layer)
    assert_close(whole, paged_attention_literal(*batch.args(), **layer), attention=True)
    for p in POSITIONS:
        steps = {
            "decode": (attend(_truncated(batch, p, 1), **layer), -1),
            "decode beside others": (attend(_beside_others(batch, p), **layer), 1),
            "split programs": (attend(_truncated(batch, p, 1), num_kv_splits=2, **layer), -1),
        }
        if p >= 6:
            steps["in a chunk of 7"] = (attend(_truncated(batch, p, 7), **layer), -1)
        for name, (out, row) in steps.items():
            assert torch.equal(out[row], whole[p]), (p, name)


@pytest.mark.parametrize("impl", list(ATTENTION))
def test_latent_attention_rows_are_the_same_bits_in_any_step(impl):
    """Multi-head latent attention in the mode (layers/mla.py, ``absorbed_every_row``): the
    absorbed queries of four heads over one cache that is both keys and values, a latent of
    48 values (the tiny DeepSeek's 32 + 16: no power of two), for decode and prefill rows."""
    if impl == "numba" and DEVICE == "cuda":
        pytest.skip("the numba kernel runs on CPU tensors")
    batch = make_paged_batch([(PROMPT, PROMPT)], 4, 1, 48, 16, device=DEVICE, seed=2)
    batch = dataclasses.replace(batch, v_cache=batch.k_cache)
    whole = ATTENTION[impl](batch)
    assert_close(whole, paged_attention_literal(*batch.args()), attention=True)
    for p in POSITIONS:
        decode = ATTENTION[impl](_truncated(batch, p, 1))
        assert torch.equal(decode[-1], whole[p]), p
        beside = ATTENTION[impl](_beside_others(batch, p))
        assert torch.equal(beside[1], whole[p]), p


def test_attention_tensor_core_branch_rows_are_the_same_bits():
    """fp16 dots, as a GPU takes them: a 40-token prompt's rows against its decodes."""
    batch = make_paged_batch([(40, 40)], 8, 2, 64, 16, HALF, DEVICE, seed=2)
    with taken_as_cuda(multi_processor_count=16):
        whole = paged_attention_triton(*batch.args(), batch_invariant=True)
        decodes = {p: paged_attention_triton(*_truncated(batch, p, 1).args(), batch_invariant=True)
                   for p in (0, 15, 39)}  # fmt: skip
    assert_close(whole, paged_attention_literal(*batch.args()), attention=True)
    for p, out in decodes.items():
        assert torch.equal(out[0], whole[p]), p


# ---- MoE --------------------------------------------------------------------------------------


def test_moe_token_is_the_same_bits_among_others():
    g = _gen(3)
    n_experts, top_k, hidden, inter = 8, 3, 64, 48
    x = torch.randn(41, hidden, generator=g).to(DEVICE)
    w13 = (torch.randn(n_experts, 2 * inter, hidden, generator=g) / 8).to(DEVICE)
    w2 = (torch.randn(n_experts, hidden, inter, generator=g) / 8).to(DEVICE)
    weights, ids = torch.randn(41, n_experts, generator=g).softmax(-1).topk(top_k, dim=-1)
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    whole = fused_moe_triton(x, w13, w2, weights, ids, ordered_sum=True)
    assert_close(whole, fused_moe_ref(x, w13, w2, weights, ids), gemm=True)
    for t in (0, 20, 40):
        alone = fused_moe_triton(
            x[t : t + 1], w13, w2, weights[t : t + 1], ids[t : t + 1], ordered_sum=True
        )
        assert torch.equal(alone, whole[t : t + 1]), t


@pytest.mark.parametrize("impl", list(ATTENTION))
def test_attention_under_a_window_reads_nothing_freed(impl):
    """Blocks wholly before a sequence's first new token's window point at an all-NaN block
    (as the block manager frees them): the walk from a multiple of TILE_N below the horizon
    must not read them."""
    if impl == "numba" and DEVICE == "cuda":
        pytest.skip("the numba kernel runs on CPU tensors")
    seqs = [(100, 1), (90, 30), (41, 1), (70, 9)]
    batch = make_paged_batch(seqs, 4, 2, 32, 16, device=DEVICE, seed=4, sliding_window=19)
    out = ATTENTION[impl](batch, sliding_window=19)
    spec = paged_attention_literal(*batch.args(), sliding_window=19)
    assert_close(out, spec, attention=True)
