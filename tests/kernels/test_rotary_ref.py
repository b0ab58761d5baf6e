"""rotary_embedding_ref against transformers' Llama (rotate_half) and GPT-J (every-two) RoPE,
and its M-RoPE (``mrope_section``) against Qwen2-VL's multimodal text rotary and its vision
tower's 2-D rotary."""

import pytest
import torch
from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb as gptj_rope
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rope
from transformers.models.qwen2_vl.configuration_qwen2_vl import (
    Qwen2VLTextConfig,
    Qwen2VLVisionConfig,
)
from transformers.models.qwen2_vl.modeling_qwen2_vl import (
    Qwen2VLRotaryEmbedding,
    Qwen2VLVisionRotaryEmbedding,
    apply_rotary_pos_emb_vision,
)
from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb as qwen2_vl_rope

from pagedserve.kernels import rotary_embedding, rotary_embedding_ref

FP32 = dict(atol=1e-5, rtol=1.3e-6)


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


def _mrope_positions(sections: int, n_tokens: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 32, (sections, n_tokens), generator=torch.Generator().manual_seed(seed))


def test_mrope_is_qwen2_vl_multimodal_text_rotary():
    """cos/sin from transformers' Qwen2VLRotaryEmbedding (its section recomposition) and its
    rotate_half: an independent reference for the per-pair gather."""
    _, query, key = _inputs(16, seed=3)
    positions = _mrope_positions(3, 6, seed=3)
    config = Qwen2VLTextConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        rope_parameters={"rope_type": "mrope", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
    )  # fmt: skip
    cos, sin = Qwen2VLRotaryEmbedding(config)(query, positions[:, None])  # [1, T, 16]
    expect_q, expect_k = qwen2_vl_rope(
        query.transpose(0, 1)[None], key.transpose(0, 1)[None], cos, sin
    )
    out_q, out_k = rotary_embedding_ref(
        positions, query.clone(), key.clone(), _cos_sin_cache(32, 16), mrope_section=(2, 3, 3)
    )
    torch.testing.assert_close(out_q, expect_q[0].transpose(0, 1), **FP32)
    torch.testing.assert_close(out_k, expect_k[0].transpose(0, 1), **FP32)


def test_two_sections_are_qwen2_vl_vision_2d_rotary():
    """The vision tower's (h, w) rotary: sections of head_dim/4 pairs each, over a cache whose
    frequency columns repeat (cat(f, f), f the tower's head_dim/4 inverse frequencies)."""
    _, query, key = _inputs(16, seed=4)
    rotary = Qwen2VLVisionRotaryEmbedding(Qwen2VLVisionConfig(embed_dim=64, num_heads=4))
    hw = _mrope_positions(2, 6, seed=4).T.contiguous()  # [T, 2], as the tower holds them
    expect_q, expect_k = apply_rotary_pos_emb_vision(query, key, *rotary(query, hw))
    f = rotary.inv_freq
    freqs = torch.outer(torch.arange(32).float(), torch.cat((f, f)))
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
    out_q, out_k = rotary_embedding_ref(
        hw.T, query.clone(), key.clone(), cache, True, mrope_section=(4, 4)
    )
    torch.testing.assert_close(out_q, expect_q, **FP32)
    torch.testing.assert_close(out_k, expect_k, **FP32)


@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize(
    "rot_dim,mrope_section", [(16, (2, 3, 3)), (16, (4, 4)), (8, (1, 2, 1)), (16, (0, 8, 0))]
)
def test_mrope_with_equal_rows_is_plain_rope_exactly(rot_dim, mrope_section, is_neox):
    positions, query, key = _inputs(16, seed=5)
    cache = _cos_sin_cache(32, rot_dim)
    rows = positions.expand(len(mrope_section), -1)
    out = rotary_embedding_ref(
        rows, query.clone(), key.clone(), cache, is_neox, mrope_section=mrope_section
    )
    expect = rotary_embedding_ref(positions, query.clone(), key.clone(), cache, is_neox)
    assert torch.equal(out[0], expect[0]) and torch.equal(out[1], expect[1])


def test_the_dispatch_runs_mrope_on_cpu_whatever_path_is_forced(monkeypatch):
    """numba has no M-RoPE: the dispatch falls back to the reference, not to plain RoPE."""
    _, query, key = _inputs(16, seed=6)
    positions, cache = _mrope_positions(3, 6, seed=6), _cos_sin_cache(32, 16)
    expect = rotary_embedding_ref(
        positions, query.clone(), key.clone(), cache, mrope_section=(2, 3, 3)
    )
    for forced in ("", "numba", "ref"):
        monkeypatch.setenv("PAGEDSERVE_KERNELS", forced)
        out = rotary_embedding(
            positions, query.clone(), key.clone(), cache, mrope_section=(2, 3, 3)
        )
        assert torch.equal(out[0], expect[0]) and torch.equal(out[1], expect[1])


@pytest.mark.parametrize(
    "positions_shape,mrope_section,message",
    [
        ((6,), (2, 3, 3), "M-RoPE positions"),
        ((2, 6), (2, 3, 3), "M-RoPE positions"),
        ((3, 5), (2, 3, 3), "M-RoPE positions"),
        ((3, 6), (2, 3, 2), "sums to 7, not rot_dim/2 = 8"),
        ((1, 6), (8,), "2 or 3"),
        ((4, 6), (2, 2, 2, 2), "2 or 3"),
        ((3, 6), None, r"!= \(T,\)"),
    ],
)
def test_mrope_rejects_bad_positions_and_sections(positions_shape, mrope_section, message):
    _, query, key = _inputs(16)
    positions = torch.zeros(positions_shape, dtype=torch.long)
    with pytest.raises(ValueError, match=message):
        rotary_embedding_ref(
            positions, query, key, _cos_sin_cache(32, 16), mrope_section=mrope_section
        )
