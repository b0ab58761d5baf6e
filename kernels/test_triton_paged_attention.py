"""paged_attention (the Triton kernel, or the implementation given with --impl) against the
literal specification, ``paged_attention_literal``; the engine's fast CPU path, paged_attention_ref,
against the same specification over the same grid.

Every batch reads K/V through shuffled, non-contiguous block tables padded with -1, and
every cache slot no sequence owns is NaN, so reading past a sequence fails loudly.
"""

import contracts
import pytest
import torch
from suite_grid import DEVICE, DTYPES, FULL, pick
from tolerances import assert_close

from pagedserve.kernels.cpu.paged_attention import paged_attention_numba
from pagedserve.kernels.dispatch import taken_as_cuda
from pagedserve.kernels.paged_attention import paged_attention_ref, paged_attention_triton
from pagedserve.kernels.paged_attention_literal import paged_attention_literal
from pagedserve.kernels.testing import make_paged_batch

contract = pytest.mark.contract("paged_attention")


def batch_case(name: str, bs: int) -> list[tuple[int, int]]:
    """(seq_len, q_len) per sequence; lengths both on and off block boundaries."""
    long = pick(3, 24) * bs
    return {
        "decode": [(2 * bs, 1), (3 * bs + 1, 1), (1, 1), (bs - 1, 1), (long + 5, 1)],
        "chunk": [(3 * bs + 5, 7), (2 * bs, bs), (long, pick(9, 100))],
        "prompt": [(2 * bs, 2 * bs), (bs + 3, bs + 3), (pick(5, long + 3), pick(5, long + 3))],
        "prefix_but_last": [(2 * bs + 1, 1), (3 * bs, 2), (bs + 1, bs)],
        "mixed": [(bs + 2, 1), (2 * bs, 2 * bs), (3 * bs + 1, 6), (1, 1), (long, 1), (bs, bs - 1)],
    }[name]


CASES = ["decode", "chunk", "prompt", "prefix_but_last", "mixed"]
GQA = [(4, 4), (4, 2), (8, 2), (8, 1)]  # (Hq, Hkv): ratios 1, 2, 4, 8 (the last is MQA)
BLOCK_SIZES = [8, 16, 32]


def run(seqs, heads, head_dim, block_size, dtype, splits=None, seed=0):
    batch = make_paged_batch(seqs, *heads, head_dim, block_size, dtype, DEVICE, seed=seed)
    if splits is None:
        out = contracts.implementation("paged_attention")(*batch.args())
    else:
        out = paged_attention_triton(*batch.args(), num_kv_splits=splits)
    assert_close(out, paged_attention_literal(*batch.args()), attention=True)


@contract
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", GQA, ids=lambda h: f"gqa{h[0] // h[1]}")
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("case", CASES)
def test_varlen(case, block_size, heads, dtype):
    run(batch_case(case, block_size), heads, pick(32, 128), block_size, dtype)


CPU_PATHS = {"ref": paged_attention_ref, "numba": paged_attention_numba}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(4, 4), (8, 2), (9, 3)], ids=["mha", "gqa4", "smollm2"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("path", list(CPU_PATHS))
def test_fast_cpu_paths_match_the_specification(path, case, heads, dtype):
    """The CPU engine's paths (the vectorised reference, the numba kernel that reads through the
    block table) are held to the spec like a kernel, NaN-filled unused slots included."""
    batch = make_paged_batch(batch_case(case, 16), *heads, 32, 16, dtype, seed=5)
    out = CPU_PATHS[path](*batch.args())
    assert_close(out, paged_attention_literal(*batch.args()), attention=True)


@contract
@pytest.mark.parametrize("head_dim", pick([16, 64, 128, 256], [32, 64, 80, 128, 256]))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_head_dims(head_dim, dtype):
    run(batch_case("mixed", 16), (4, 2), head_dim, 16, dtype, seed=1)


@contract
@pytest.mark.parametrize("splits", [2, 3, pick(5, 16)])
@pytest.mark.parametrize("heads", [(4, 4), (8, 1)], ids=["mha", "mqa"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_kv_decode(splits, heads, dtype):
    """Flash-decoding: some splits of the short sequences see no positions at all."""
    contracts.own_wrapper_only("paged_attention")
    seqs = [(pick(70, 3000), 1), (1, 1), (17, 1), (pick(41, 1500), 1)]
    run(seqs, heads, pick(32, 128), 16, dtype, splits=splits, seed=2)


@contract
def test_split_kv_is_also_correct_on_non_decode_rows():
    """The split path never assumes q_len == 1; the wrapper merely chooses it for decodes."""
    contracts.own_wrapper_only("paged_attention")
    run(batch_case("mixed", 8), (8, 2), 32, 8, torch.float32, splits=3, seed=3)


@contract
@pytest.mark.parametrize("heads", [(9, 3), (8, 1)], ids=["smollm2-gqa3", "mqa"])
@pytest.mark.parametrize("case", ["decode", "mixed"])
def test_tensor_core_branch_in_fp16(case, heads):
    """The branch a GPU takes for fp16 (tl.dot on fp16 operands, P rounded to fp16 before
    P @ V), which the interpreter's own dispatch never takes: run it through the wrapper as a
    GPU would choose it (taken_as_cuda; 16 SMs, so long decodes also split), at fp16
    tolerance against the spec."""
    contracts.own_wrapper_only("paged_attention")
    seqs = batch_case(case, 16) + [(1100, 1)] * (case == "decode")
    batch = make_paged_batch(seqs, *heads, 64, 16, torch.float16, DEVICE, seed=6)
    with taken_as_cuda(multi_processor_count=16):
        out = paged_attention_triton(*batch.args())
    assert_close(out, paged_attention_literal(*batch.args()), attention=True)


@contract
@pytest.mark.skipif(DEVICE != "cuda" or not FULL, reason="default split choice needs CUDA")
def test_default_split_choice_on_long_decodes():
    run([(8000, 1), (4000, 1)], (32, 8), 128, 16, torch.bfloat16, seed=4)


@contract
def test_padding_rows_and_empty_sequences():
    """Sequences with no new tokens own no rows; rows past the last sequence stay zero."""
    batch = make_paged_batch([(9, 2), (5, 0), (12, 1)], 4, 2, 32, 8, device=DEVICE)
    query = torch.cat([batch.query, torch.randn(2, 4, 32, device=DEVICE)])
    args = (query, *batch.args()[1:])
    out = contracts.implementation("paged_attention")(*args)
    assert_close(out, paged_attention_literal(*args), attention=True)
    assert not out[-2:].any()
