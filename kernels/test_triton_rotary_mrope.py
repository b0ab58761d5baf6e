"""M-RoPE (``mrope_section``) in the rotary kernel against the reference: Qwen2-VL's text
rotary (three sections over [3, T] positions) and its vision tower's 2-D rotary (two sections
of head_dim/4 pairs over (h, w) positions), both pair layouts, GQA and MHA heads, on views of a
fused qkv output. The plain path's tests are test_triton_elementwise's test_rotary_embedding."""

import pytest
import torch
from contracts import implementation
from suite_grid import DEVICE, DTYPES, pick
from tolerances import assert_close

from pagedserve.kernels.rotary_embedding import rotary_embedding_ref

# (head_dim, rot_dim, mrope_section): Qwen2-VL's text heads cut down (its full 128 with
# (16, 24, 24) in the full grid), a partial rotary, and the vision tower's head_dim 80, whose
# 40 pairs leave part of the power-of-two block masked.
SHAPES = pick(
    [(32, 32, (4, 6, 6)), (64, 32, (2, 6, 8)), (80, 80, (20, 20)), (32, 32, (8, 8))],
    [(128, 128, (16, 24, 24)), (64, 32, (2, 6, 8)), (80, 80, (20, 20)), (64, 64, (16, 16))],
)


def _cos_sin_cache(max_position: int, rot_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim)
    freqs = torch.outer(torch.arange(max_position).float(), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(DEVICE)


def _positions(sections: int, n_tokens: int) -> torch.Tensor:
    """``[S, T]`` positions; the 2-section (vision) ones a transposed view of ``[T, 2]``."""
    gen = torch.Generator().manual_seed(sections)
    if sections == 2:
        return torch.randint(0, 1024, (n_tokens, 2), generator=gen).to(DEVICE).T
    return torch.randint(0, 1024, (sections, n_tokens), generator=gen).to(DEVICE)


@pytest.mark.contract("rotary_embedding")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=str)
@pytest.mark.parametrize("n_tokens", [1, pick(5, 257)])
def test_mrope_matches_reference(n_tokens, heads, shape, is_neox, dtype):
    (n_q, n_kv), (head_dim, rot_dim, section) = heads, shape
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(n_tokens, n_q + 2 * n_kv, head_dim, generator=gen).to(dtype).to(DEVICE)
    q, k = qkv[:, :n_q], qkv[:, n_q : n_q + n_kv]  # views, as the models pass them
    positions, cache = _positions(len(section), n_tokens), _cos_sin_cache(1024, rot_dim)
    expect = rotary_embedding_ref(positions, q.clone(), k.clone(), cache, is_neox, section)
    out = implementation("rotary_embedding")(positions, q, k, cache, is_neox, mrope_section=section)
    assert out[0].data_ptr() == qkv.data_ptr(), "rotary must work in place on views"
    assert_close(out[0], expect[0])
    assert_close(out[1], expect[1])
    assert torch.equal(out[0][..., rot_dim:], expect[0][..., rot_dim:])
