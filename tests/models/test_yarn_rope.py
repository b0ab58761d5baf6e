"""YaRN rope scaling (DeepSeek-V2/V3's long-context configs) against transformers' own: the
cos/sin cache, attention factor included, and the softmax scale's mscale."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedserve.models.layers.mla import mla_softmax_scale
from pagedserve.models.layers.rotary import build_cos_sin_cache, rope_parameters

CASES = {
    # DeepSeek-V3's: factor 40 over 4096 positions, mscale = mscale_all_dim (attention factor 1)
    "v3": dict(factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0),
    # V2's 0.707s, as old configs spell them (rope_scaling with "type")
    "v2": dict(
        factor=40.0, original_max_position_embeddings=4096, mscale=0.707, mscale_all_dim=0.707
    ),  # fmt: skip
    # an attention factor other than 1; no beta_* (their defaults, 32 and 1)
    "uneven": dict(
        factor=4.0, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=0.5
    ),  # fmt: skip
    # no mscale at all: the attention factor is mscale(factor) itself
    "plain": dict(factor=8.0, original_max_position_embeddings=128),
}


def _config(case: str, spelling: str = "rope_parameters"):
    params = dict(rope_type="yarn", rope_theta=10000.0, **CASES[case])
    if case != "uneven":
        params.update(beta_fast=32, beta_slow=1)
    max_pos = int(params["original_max_position_embeddings"] * params["factor"])
    config = transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=64, num_attention_heads=4, qk_rope_head_dim=64,
        qk_nope_head_dim=128, max_position_embeddings=max_pos, rope_parameters=params,
    )  # fmt: skip
    ours = config.to_dict()
    if spelling == "rope_scaling":
        ours.pop("rope_parameters")
        ours["rope_scaling"] = {("type" if k == "rope_type" else k): v for k, v in params.items()}
        ours["rope_theta"] = ours["rope_scaling"].pop("rope_theta")
    return config, ours


@pytest.mark.parametrize("spelling", ["rope_parameters", "rope_scaling"])
@pytest.mark.parametrize("case", list(CASES))
def test_yarn_cache_equals_transformers(case, spelling):
    config, ours = _config(case, spelling)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    positions = torch.arange(5000).float()
    freqs = positions[:, None] * inv_freq[None]
    expected = torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], -1)
    cache = build_cos_sin_cache(64, 5000, rope_parameters(ours))
    torch.testing.assert_close(cache, expected, atol=0, rtol=0)


@pytest.mark.parametrize("case", list(CASES))
def test_softmax_scale_takes_mscale_all_dim_squared(case):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    config, ours = _config(case)
    expected = yarn_apply_mscale(config.rope_parameters, 192**-0.5)
    assert mla_softmax_scale(ours, 192) == pytest.approx(expected, rel=1e-12)
    if case == "plain":
        assert expected == 192**-0.5  # no mscale_all_dim: the plain scale
