"""Paged attention with attention sinks (gpt-oss: a learned logit per query head in every row's
softmax denominator), alone and beside a sliding window or a soft cap, against the literal
specification; the specification against a dense attention with the sink as one more score;
and every implementation held to it: the Triton kernel (or --impl), its forced KV splits (the
sink must enter the merged sum once), the fp16 tensor-core branch, the vectorised reference
and the numba kernel (decode, short chunks and its own KV splits).
"""

import contracts
import pytest
import torch
from suite_grid import DEVICE, DTYPES
from tolerances import assert_close

from pagedserve.kernels.cpu.paged_attention import paged_attention_cpu, paged_attention_numba
from pagedserve.kernels.dispatch import taken_as_cuda
from pagedserve.kernels.paged_attention import paged_attention_ref, paged_attention_triton
from pagedserve.kernels.paged_attention_literal import paged_attention_literal
from pagedserve.kernels.testing import make_paged_batch

contract = pytest.mark.contract("paged_attention")
BS = 16
# decodes, a chunk over a cached prefix, a whole prompt longer than the numba path's chunks
SEQS = [(70, 1), (5, 1), (40, 9), (33, 33)]


def _sinks(n_heads: int, seed: int = 0) -> torch.Tensor:
    """Sinks on the scores' scale and beyond: some heads' sink outweighs every key, some
    barely counts (a sink of 0 would change little; -inf none)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n_heads, generator=gen) * 3.0).to(DEVICE)


def _dense(batch, sinks, window=None):
    """Attention per sequence over its contiguous keys, the sink one more score per head."""
    out = torch.zeros_like(batch.query, dtype=torch.float32)
    starts = batch.query_start_loc.tolist()
    for b, (k, v) in enumerate(zip(batch.keys, batch.values, strict=True)):
        q = batch.query[starts[b] : starts[b + 1]].float().cpu()
        seq_len, q_len, group = k.shape[0], q.shape[0], q.shape[1] // k.shape[1]
        k, v = (
            k.float().cpu().repeat_interleave(group, 1),
            v.float().cpu().repeat_interleave(group, 1),
        )
        scores = torch.einsum("qhd,khd->hqk", q, k) * batch.scale
        i = torch.arange(seq_len - q_len, seq_len)[:, None]
        j = torch.arange(seq_len)[None, :]
        seen = (j <= i) & ((j > i - window) if window else True)
        scores = scores.masked_fill(~seen, float("-inf"))
        weights = scores.exp() / (
            scores.exp().sum(-1, keepdim=True) + sinks.cpu().exp()[:, None, None]
        )
        out[starts[b] : starts[b + 1]] = torch.einsum("hqk,khd->qhd", weights, v).to(out.device)
    return out.to(batch.query.dtype)


@pytest.mark.parametrize("window", [None, 19], ids=["global", "window19"])
def test_specification_is_a_softmax_with_the_sink_in_its_denominator(window):
    batch = make_paged_batch(SEQS, 4, 2, 32, BS, seed=1, sliding_window=window)
    sinks = _sinks(4).cpu()
    spec = paged_attention_literal(*batch.args(), sliding_window=window, sinks=sinks)
    assert_close(spec, _dense(batch, sinks, window), attention=True)
    plain = paged_attention_literal(*batch.args(), sliding_window=window)
    assert not torch.allclose(spec, plain, atol=1e-3)  # the sinks weigh in this test


@contract
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "window_cap", [(None, None), (19, None), (None, 1.5)], ids=["global", "window19", "cap1.5"]
)
def test_sinks(window_cap, dtype):
    window, cap = window_cap
    batch = make_paged_batch(SEQS, 8, 2, 32, BS, dtype, DEVICE, seed=2, sliding_window=window)
    args = dict(sliding_window=window, logits_soft_cap=cap, sinks=_sinks(8, seed=3))
    out = contracts.implementation("paged_attention")(*batch.args(), **args)
    assert_close(out, paged_attention_literal(*batch.args(), **args), attention=True)


@contract
def test_forced_kv_splits_count_the_sink_once():
    contracts.own_wrapper_only("paged_attention")
    batch = make_paged_batch([(100, 1), (41, 1), (3, 1)], 4, 2, 32, BS, device=DEVICE, seed=4)
    sinks = _sinks(4, seed=5)
    out = paged_attention_triton(*batch.args(), num_kv_splits=3, sinks=sinks)
    assert_close(out, paged_attention_literal(*batch.args(), sinks=sinks), attention=True)


@contract
def test_tensor_core_branch_in_fp16_with_sinks_and_window():
    contracts.own_wrapper_only("paged_attention")
    batch = make_paged_batch(SEQS, 8, 2, 64, BS, torch.float16, DEVICE, seed=6, sliding_window=24)
    args = dict(sliding_window=24, sinks=_sinks(8, seed=7))
    with taken_as_cuda(multi_processor_count=16):
        out = paged_attention_triton(*batch.args(), **args)
    assert_close(out, paged_attention_literal(*batch.args(), **args), attention=True)


CPU_PATHS = {
    "ref": paged_attention_ref,
    "numba": paged_attention_numba,
    "numba+sdpa": paged_attention_cpu,  # the prompt of 33 goes to the reference's SDPA
    "numba-splits": lambda *a, **kw: paged_attention_numba(*a, num_kv_splits=3, **kw),
}


@pytest.mark.parametrize("cap", [None, 1.5], ids=["uncapped", "cap1.5"])
@pytest.mark.parametrize("window", [None, 19], ids=["global", "window19"])
@pytest.mark.parametrize("path", list(CPU_PATHS))
def test_cpu_paths_with_sinks(path, window, cap):
    seqs = [(600, 1), *SEQS] if path == "numba-splits" else SEQS  # splits need 512 positions
    batch = make_paged_batch(seqs, 9, 3, 32, BS, seed=8, sliding_window=window)
    args = dict(sliding_window=window, logits_soft_cap=cap, sinks=_sinks(9, seed=9).cpu())
    out = CPU_PATHS[path](*batch.args(), **args)
    assert_close(out, paged_attention_literal(*batch.args(), **args), attention=True)


def test_sinks_of_the_wrong_shape_are_refused():
    batch = make_paged_batch(SEQS, 4, 2, 32, BS, seed=10)
    with pytest.raises(ValueError, match="sinks"):
        paged_attention_ref(*batch.args(), sinks=torch.zeros(2))
