"""Paged attention with a sliding window and with soft-capped scores, against the literal
specification (and the specification against a dense masked attention that knows nothing of
paging). Every implementation is held to it: the Triton kernel (or --impl), the vectorised
reference and the numba kernel.

Blocks wholly before a sequence's first new token's window are "freed" as the block manager
frees them: their block-table entries point at an all-NaN block (make_paged_batch), so an
implementation that reads out of the window fails loudly.
"""

import contracts
import pytest
import torch
from suite_grid import DEVICE, DTYPES, pick
from tolerances import assert_close

from pagedserve.kernels.cpu.paged_attention import paged_attention_numba
from pagedserve.kernels.dispatch import taken_as_cuda
from pagedserve.kernels.paged_attention import paged_attention_ref, paged_attention_triton
from pagedserve.kernels.paged_attention_literal import paged_attention_literal
from pagedserve.kernels.testing import make_paged_batch

contract = pytest.mark.contract("paged_attention")
BS = 16


def window_case(name: str) -> tuple[int, list[tuple[int, int]]]:
    """(window, (seq_len, q_len) per sequence) with block size 16."""
    return {
        # a window inside one block: decodes far past it, a chunk, a short prompt
        "smaller-than-block": (5, [(70, 1), (3, 1), (40, 9), (12, 12)]),
        # a window of several blocks: the first blocks of long sequences are freed
        "larger-than-block": (40, [(100, 1), (41, 1), (90, 30), (39, 39)]),
        # windows whose edge falls mid-block, and exactly on a block edge
        "crossing-block-edges": (BS + 3, [(4 * BS + 7, 1), (2 * BS + 2, 5), (3 * BS, BS + 1)]),
        "one-block": (BS, [(4 * BS, 1), (4 * BS + 1, 1), (3 * BS, 2 * BS)]),
        # a prefill chunk whose first rows see the window's start and whose last rows do not
        "chunk-across-window-edge": (32, [(80, 40), (64, 33), (33, 2)]),
        # a window wider than every sequence: the same as global attention
        "wider-than-sequences": (500, [(70, 1), (40, 9), (30, 30)]),
    }[name]


CASES = [
    "smaller-than-block", "larger-than-block", "crossing-block-edges", "one-block",
    "chunk-across-window-edge", "wider-than-sequences",
]  # fmt: skip


def _batch(seqs, window, dtype=torch.float32, heads=(4, 2), head_dim=32, seed=0):
    return make_paged_batch(
        seqs, *heads, head_dim, BS, dtype, DEVICE, seed=seed, sliding_window=window
    )


def _dense(batch, window, cap):
    """Attention per sequence over its contiguous keys: a mask from positions alone."""
    out = torch.zeros_like(batch.query, dtype=torch.float32)
    starts = batch.query_start_loc.tolist()
    for b, (k, v) in enumerate(zip(batch.keys, batch.values, strict=True)):
        q = batch.query[starts[b] : starts[b + 1]].float()
        seq_len, q_len, group = k.shape[0], q.shape[0], q.shape[1] // k.shape[1]
        k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * batch.scale
        if cap is not None:
            scores = cap * torch.tanh(scores / cap)
        i = torch.arange(seq_len - q_len, seq_len)[:, None]
        j = torch.arange(seq_len)[None, :]
        seen = (j <= i) & ((j > i - window) if window else True)
        probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        out[starts[b] : starts[b + 1]] = torch.einsum("hqk,khd->qhd", probs, v)
    return out.to(batch.query.dtype)


@pytest.mark.parametrize("cap", [None, 2.0], ids=["uncapped", "cap2"])
@pytest.mark.parametrize("case", CASES)
def test_specification_is_dense_masked_attention(case, cap):
    """The spec itself, on a batch whose out-of-window blocks hold NaN: it reads none."""
    window, seqs = window_case(case)
    batch = _batch(seqs, window)
    spec = paged_attention_literal(*batch.args(), sliding_window=window, logits_soft_cap=cap)
    assert_close(spec, _dense(batch, window, cap), attention=True)


@contract
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES)
def test_sliding_window(case, dtype):
    window, seqs = window_case(case)
    batch = _batch(seqs, window, dtype, heads=pick((4, 2), (8, 2)), seed=1)
    out = contracts.implementation("paged_attention")(*batch.args(), sliding_window=window)
    assert_close(out, paged_attention_literal(*batch.args(), sliding_window=window), attention=True)


@contract
@pytest.mark.parametrize("window", [None, 19], ids=["global", "window19"])
def test_soft_cap(window):
    """Gemma 2's attention soft-capping, alone and beside a window; a cap small enough that
    most scores are bent by it."""
    seqs = [(50, 1), (40, 9), (20, 20)]
    batch = _batch(seqs, window, seed=2)
    args = dict(sliding_window=window, logits_soft_cap=1.5)
    out = contracts.implementation("paged_attention")(*batch.args(), **args)
    assert_close(out, paged_attention_literal(*batch.args(), **args), attention=True)


CPU_PATHS = {"ref": paged_attention_ref, "numba": paged_attention_numba}


@pytest.mark.parametrize("cap", [None, 1.5], ids=["uncapped", "cap1.5"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("path", list(CPU_PATHS))
def test_cpu_paths_with_windows(path, case, cap):
    window, seqs = window_case(case)
    batch = make_paged_batch(seqs, 9, 3, 32, BS, seed=3, sliding_window=window)
    args = dict(sliding_window=window, logits_soft_cap=cap)
    out = CPU_PATHS[path](*batch.args(), **args)
    assert_close(out, paged_attention_literal(*batch.args(), **args), attention=True)


@contract
def test_forced_kv_splits_under_a_window():
    """The wrapper never splits a windowed decode by itself; forced, splits that lie wholly
    before the window see nothing, and the merge must drop them."""
    contracts.own_wrapper_only("paged_attention")
    window, seqs = window_case("larger-than-block")
    batch = _batch(seqs, window, seed=4)
    out = paged_attention_triton(*batch.args(), num_kv_splits=3, sliding_window=window)
    assert_close(out, paged_attention_literal(*batch.args(), sliding_window=window), attention=True)


@contract
@pytest.mark.parametrize("case", ["crossing-block-edges", "chunk-across-window-edge"])
def test_tensor_core_branch_in_fp16_with_window(case):
    """The fp16 tensor-core branch a GPU takes, with a window and a soft cap."""
    contracts.own_wrapper_only("paged_attention")
    window, seqs = window_case(case)
    batch = make_paged_batch(
        seqs, 8, 2, 64, BS, torch.float16, DEVICE, seed=5, sliding_window=window
    )
    args = dict(sliding_window=window, logits_soft_cap=30.0)
    with taken_as_cuda(multi_processor_count=16):
        out = paged_attention_triton(*batch.args(), **args)
    assert_close(out, paged_attention_literal(*batch.args(), **args), attention=True)
