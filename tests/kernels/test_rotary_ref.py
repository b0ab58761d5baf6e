"""rotary_embedding_ref against transformers' Llama (rotate_half) and GPT-J (every-two) RoPE."""

import pytest
import torch
from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj_rope
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rope

from pagedserve.kernels import rotary_embedding_ref


def _cos_sin_cache(max_position: int, rot_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2).float() / rot_dim)
    freqs = torch.outer(torch.arange(max_position).float(), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _inputs(head_dim: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    positions = torch.tensor([0, 5, 3, 17, 17, 30])
    query = torch.randn(6, 4, head_dim, generator=gen)
    key = torch.randn(6, 2, head_dim, generator=gen)
    return positions, query, key


def test_neox_is_llama_rotate_half():
    positions, query, key = _inputs(16)
    cache = _cos_sin_cache(32, 16)
    cos, sin = cache[positions].chunk(2, dim=-1)
    cos, sin = torch.cat((cos, cos), -1)[None], torch.cat((sin, sin), -1)[None]
    expect_q, expect_k = llama_rope(
        query.transpose(0, 1)[None], key.transpose(0, 1)[None], cos, sin
    )
    out_q, out_k = rotary_embedding_ref(positions, query.clone(), key.clone(), cache, is_neox=True)
    torch.testing.assert_close(out_q, expect_q[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out_k, expect_k[0].transpose(0, 1), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("rot_dim", [16, 8])
def test_gptj_is_rotate_every_two_on_the_first_rot_dims(rot_dim):
    positions, query, key = _inputs(16, seed=1)
    cache = _cos_sin_cache(32, rot_dim)
    cos, sin = cache[positions].chunk(2, dim=-1)
    out_q, out_k = rotary_embedding_ref(positions, query.clone(), key.clone(), cache, is_neox=False)
    for out, x in ((out_q, query), (out_k, key)):
        expect = gptj_rope(x[None, :, :, :rot_dim], sin[None], cos[None])[0]
        torch.testing.assert_close(out[..., :rot_dim], expect, atol=1e-6, rtol=1e-6)
        assert torch.equal(out[..., rot_dim:], x[..., rot_dim:])


def test_partial_neox_rotates_only_rot_dims_and_works_in_place_on_views():
    positions, query, key = _inputs(16, seed=2)
    qkv = torch.cat((query, key), dim=1)
    q_view, k_view = qkv[:, :4], qkv[:, 4:]
    cache = _cos_sin_cache(32, 8)
    out_q, _ = rotary_embedding_ref(positions, q_view, k_view, cache, is_neox=True)
    assert out_q.data_ptr() == qkv.data_ptr()
    assert torch.equal(qkv[:, :4, 8:], query[..., 8:])
    full = rotary_embedding_ref(positions, query[..., :8].clone(), key[..., :8].clone(), cache)
    assert torch.equal(qkv[:, :4, :8], full[0])
