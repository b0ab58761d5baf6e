"""Rotary position embedding: the cos/sin cache, with the RoPE scalings models configure.

The cache is computed once, in float32, as ``[max_position, rotary_dim]`` with cos in the first
half of the columns and sin in the second (the layout ``pagedserve.kernels.rotary_embedding``
reads). Frequencies follow transformers' arithmetic exactly, so fp32 logits match it bit for bit
where the rest of the model does.
"""

from __future__ import annotations

import json
import math
import weakref
from typing import Any

import torch
from torch import nn

from pagedserve.kernels import rotary_embedding


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """RoPE settings from either spelling: transformers 5's ``rope_parameters`` or the older
    ``rope_theta`` + ``rope_scaling``."""
    params = dict(hf_config.get("rope_parameters") or {})
    scaling = hf_config.get("rope_scaling") or {}
    for key, value in scaling.items():
        params.setdefault(key, value)
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if hf_config.get("original_max_position_embeddings"):  # Phi-3 keeps it outside, and wins
        params["original_max_position_embeddings"] = hf_config["original_max_position_embeddings"]
    return params


def _base_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's scaling: long wavelengths slowed by ``factor``, short ones kept, a smooth
    blend between them."""
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _longrope_cache(rotary_dim: int, max_position: int, params: dict[str, Any]) -> torch.Tensor:
    """Phi-3's LongRoPE ("su"): per-frequency rescaling, ``short_factor`` for positions below
    ``original_max_position_embeddings`` and ``long_factor`` from there on, cos and sin scaled
    by ``sqrt(1 + ln(factor) / ln(original))`` (factor: max over original positions).

    Per position, as vLLM does. transformers picks one set per forward from its longest
    position, so the two agree whenever no single forward straddles the original length (a
    prompt within it, decoding past it); a prompt that straddles it gets the long factors for
    all its positions there, here only for those past it."""
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor") or max_position / original
    scaling = params.get("attention_factor")
    if scaling is None:
        scaling = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    base = float(params["rope_theta"]) ** exponents
    positions = torch.arange(max_position, dtype=torch.int64).to(torch.float32)
    caches = []
    for name, span in (
        ("short_factor", positions[:original]),
        ("long_factor", positions[original:]),
    ):
        inv_freq = 1.0 / (torch.tensor(params[name], dtype=torch.float32) * base)
        freqs = torch.outer(span, inv_freq)
        caches.append(torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1))
    return torch.cat(caches)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched ``factor`` times: ``0.1 * mscale *
    ln(factor) + 1`` (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_cache(rotary_dim: int, max_position: int, params: dict[str, Any]) -> torch.Tensor:
    """YaRN (DeepSeek-V2/V3, Qwen long contexts): each frequency blends its interpolated
    (``/ factor``) and original value by how many turns it makes over the original context
    (a linear ramp between ``beta_fast`` and ``beta_slow`` turns), and cos and sin are scaled
    by the attention factor: ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` when
    a config gives both (DeepSeek's), else ``mscale(factor)``."""
    base, original = float(params["rope_theta"]), int(params["original_max_position_embeddings"])
    factor = params.get("factor") or max_position / original
    scaling = params.get("attention_factor")
    if scaling is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            scaling = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            scaling = yarn_mscale(factor)

    def correction_dim(turns: float) -> float:  # the dimension that turns ``turns`` times
        return rotary_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(params.get("beta_fast") or 32)
    high = correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # how much of its original frequency each pair keeps
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    pos_freqs = base**exponents
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep
    positions = torch.arange(max_position, dtype=torch.int64).to(torch.float32)
    freqs = torch.outer(positions, inv_freq)
    return torch.cat([freqs.cos() * scaling, freqs.sin() * scaling], dim=-1)


def build_cos_sin_cache(rotary_dim: int, max_position: int, params: dict[str, Any]) -> torch.Tensor:
    rope_type = params["rope_type"]
    if rope_type == "mrope":  # older Qwen2-VL configs: default frequencies, turned per section
        rope_type = "default"
    if rope_type in ("longrope", "su"):
        return _longrope_cache(rotary_dim, max_position, params)
    if rope_type == "yarn":
        return _yarn_cache(rotary_dim, max_position, params)
    inv_freq = _base_inv_freq(rotary_dim, float(params["rope_theta"]))
    positions = torch.arange(max_position, dtype=torch.int64).to(torch.float32)
    if rope_type == "linear":
        positions = positions / float(params["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, params)
    elif rope_type != "default":
        raise ValueError(
            f"rope type {rope_type!r} is not supported (default, linear, llama3, longrope, "
            "yarn are)"
        )
    freqs = torch.outer(positions, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


# The layers of a model (and models in one process) with the same rotary settings share one
# cos/sin cache: each layer holding its own would take ``[max_position, rotary_dim]`` fp32 per
# layer (SmolLM2's 30 layers: 60 MB; a 128K-position, 32-layer model: 2 GB). Held weakly, so
# the last model using a cache frees it. Nothing writes into a cache once built.
_SHARED_CACHES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def shared_cos_sin_cache(rotary_dim: int, max_position: int, params: dict[str, Any]):
    """``build_cos_sin_cache``'s tensor on the current default device, built once per setting."""
    device = torch.get_default_device()
    key = (rotary_dim, max_position, json.dumps(params, sort_keys=True, default=str), str(device))
    cache = _SHARED_CACHES.get(key)
    if cache is None:
        cache = build_cos_sin_cache(rotary_dim, max_position, params)
        _SHARED_CACHES[key] = cache
    return cache


class RotaryEmbedding(nn.Module):
    """Applies RoPE to query and key at the given positions (neox / rotate-half style).

    With ``mrope_section`` in the settings (Qwen2-VL's M-RoPE) positions are ``[3, T]``:
    a temporal, a height and a width position per token, and each section of the rotary pairs
    turns by its own row (text tokens have the three equal, so they turn as plain RoPE;
    ``[T]`` positions are taken as such text)."""

    def __init__(
        self, head_dim: int, max_position: int, params: dict[str, Any], is_neox: bool = True
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.is_neox = is_neox
        rotary_dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
        cache = shared_cos_sin_cache(rotary_dim, max_position, params)
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        section = params.get("mrope_section")
        self.mrope_section = tuple(int(s) for s in section) if section else None

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        if self.mrope_section is None:
            return rotary_embedding(positions, query, key, self.cos_sin_cache, self.is_neox)
        if positions.dim() == 1:
            positions = positions.expand(len(self.mrope_section), -1)
        return rotary_embedding(
            positions, query, key, self.cos_sin_cache, self.is_neox,
            mrope_section=self.mrope_section,
        )  # fmt: skip
