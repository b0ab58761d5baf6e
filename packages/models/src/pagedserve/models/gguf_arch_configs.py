"""Each GGUF architecture's metadata as a transformers config: what llama.cpp's converter
(convert_hf_to_gguf.py) writes from a config.json, read back the way llama.cpp reads it.

Where the file is silent, the value is llama.cpp's, not transformers' default, because that
is what every GGUF in circulation was made to run under:

- ``llama`` files are Llama, Mistral (llama.cpp has no Mistral of its own: no sliding window)
  and, with ``expert_count``, Mixtral (experts renormalised).
- ``gemma2`` / ``gemma3``: the attention scale is ``head_dim ** -0.5`` except for the 27B
  models (46 / 62 layers), whose ``query_pre_attn_scalar`` is ``hidden / heads``; local layers
  follow ``attention.sliding_window_pattern`` (a period, or one flag per layer), else every
  2nd (Gemma 2) or 6th (Gemma 3) layer is global; Gemma 2's soft caps default to 50 and 30.
- ``qwen3moe`` renormalises its top-k weights and ``qwen2moe`` does not; every layer is sparse.
- ``deepseek2`` is V3 (sigmoid routing with the correction bias) when its gating function says
  sigmoid, or says nothing and the file has the bias (``exp_probs_b``), else V2. Its rope is
  YaRN with the cos/sin unscaled and the softmax scaled by ``mscale(factor,
  mscale_all_dim) ** 2``, ``mscale_all_dim`` being ``rope.scaling.yarn_log_multiplier / 0.1``.
- ``phi3``: LongRoPE's factors are the ``rope_factors_long`` / ``rope_factors_short`` tensors.
- ``gpt-oss``: a windowed layer then a full one (``sliding_window_pattern`` where the file has
  it, else a period of 2, as llama.cpp reads it); experts of ``expert_feed_forward_length``,
  softmax over the top-k router logits; the clamped SwiGLU's alpha 1.702 and limit 7.0, which no
  key carries (llama.cpp's graph hard-codes both); YaRN as gpt-oss defines it, its correction
  range unrounded (``truncate: false`` in its config.json; llama.cpp rounds it for every model).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedserve.models.config import ModelLoadError
from pagedserve.models.gguf_config import GGUFMetadata, decoder_config, rope, vocab_size


def _full_rotary(meta: GGUFMetadata, config: dict[str, Any]) -> dict[str, Any]:
    dims = meta.get("rope.dimension_count")
    if dims is not None and int(dims) != config["head_dim"]:
        raise ModelLoadError(
            f"{meta.path}: rope over {dims} of {config['head_dim']} head dimensions (partial "
            "rotary) is not supported"
        )
    return config


def _llama(meta: GGUFMetadata) -> dict[str, Any]:
    experts = int(meta.get("expert_count") or 0)
    if experts:
        config = decoder_config(meta, "MixtralForCausalLM", "mixtral")
        config.update(num_local_experts=experts)
        config.update(num_experts_per_tok=int(meta.require("expert_used_count")))
    else:
        config = decoder_config(meta, "LlamaForCausalLM", "llama")
    if meta.get("attention.key_length") is None and meta.get("rope.dimension_count"):
        config["head_dim"] = int(meta.get("rope.dimension_count"))
    config["attention_bias"] = meta.has("blk.0.attn_q.bias")
    config["mlp_bias"] = meta.has("blk.0.ffn_up.bias")
    return _full_rotary(meta, config)


def _qwen2(meta: GGUFMetadata) -> dict[str, Any]:
    return _full_rotary(meta, decoder_config(meta, "Qwen2ForCausalLM", "qwen2"))


def _qwen3(meta: GGUFMetadata) -> dict[str, Any]:
    return _full_rotary(meta, decoder_config(meta, "Qwen3ForCausalLM", "qwen3"))


def _moe(meta: GGUFMetadata, config: dict[str, Any], renormalize: bool) -> dict[str, Any]:
    config.update(
        num_experts=int(meta.require("expert_count")),
        num_experts_per_tok=int(meta.require("expert_used_count")),
        moe_intermediate_size=int(meta.require("expert_feed_forward_length")),
        norm_topk_prob=renormalize, decoder_sparse_step=1, mlp_only_layers=[],
    )  # fmt: skip
    return _full_rotary(meta, config)


def _qwen2moe(meta: GGUFMetadata) -> dict[str, Any]:
    config = decoder_config(meta, "Qwen2MoeForCausalLM", "qwen2_moe")
    config["shared_expert_intermediate_size"] = int(
        meta.require("expert_shared_feed_forward_length")
    )
    config["qkv_bias"] = meta.has("blk.0.attn_q.bias")
    return _moe(meta, config, renormalize=False)


def _qwen3moe(meta: GGUFMetadata) -> dict[str, Any]:
    return _moe(meta, decoder_config(meta, "Qwen3MoeForCausalLM", "qwen3_moe"), True)


def _layer_types(meta: GGUFMetadata, layers: int, period: int) -> list[str]:
    """llama.cpp's ``sliding_window_pattern``: one flag per layer, or a period whose last
    layer is global; ``period`` where the file has neither."""
    pattern = meta.get("attention.sliding_window_pattern", period)
    if isinstance(pattern, list):
        sliding = [bool(p) for p in pattern]
    else:
        sliding = [i % int(pattern) < int(pattern) - 1 for i in range(layers)]
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def _gemma(meta: GGUFMetadata, class_name: str, model_type: str, big: int) -> dict[str, Any]:
    config = decoder_config(meta, class_name, model_type)
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    wide = config["hidden_size"] // heads if layers == big else config["head_dim"]
    config.update(
        query_pre_attn_scalar=wide, hidden_activation="gelu_pytorch_tanh",
        hidden_act="gelu_pytorch_tanh",
    )  # fmt: skip
    return config


def _gemma2(meta: GGUFMetadata) -> dict[str, Any]:
    config = _gemma(meta, "Gemma2ForCausalLM", "gemma2", big=46)
    config.update(
        attn_logit_softcapping=float(meta.get("attn_logit_softcapping", 50.0)),
        final_logit_softcapping=float(meta.get("final_logit_softcapping", 30.0)),
        sliding_window=int(meta.get("attention.sliding_window", 4096)),
        layer_types=_layer_types(meta, config["num_hidden_layers"], 2),
    )  # fmt: skip
    return config


def _gemma3(meta: GGUFMetadata) -> dict[str, Any]:
    config = _gemma(meta, "Gemma3ForCausalLM", "gemma3_text", big=62)
    window = int(meta.get("attention.sliding_window") or 0)
    layers = config["num_hidden_layers"]
    config["layer_types"] = _layer_types(meta, layers, 6) if window else ["full_attention"] * layers
    config["sliding_window"] = window or None
    config["rope_local_base_freq"] = float(meta.get("rope.freq_base_swa", 10000.0))
    cap = meta.get("final_logit_softcapping")
    config["final_logit_softcapping"] = float(cap) if cap else None
    return config


def _phi3(meta: GGUFMetadata) -> dict[str, Any]:
    config = _full_rotary(meta, decoder_config(meta, "Phi3ForCausalLM", "phi3"))
    config["sliding_window"] = int(meta.get("attention.sliding_window") or 0) or None
    if meta.has("rope_factors_long.weight"):
        config["original_max_position_embeddings"] = int(
            meta.require("rope.scaling.original_context_length")
        )
        config["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": meta.vector("rope_factors_long.weight").tolist(),
            "short_factor": meta.vector("rope_factors_short.weight").tolist(),
        }
    return config


def _gpt2(meta: GGUFMetadata) -> dict[str, Any]:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "n_embd": int(meta.require("embedding_length")),
        "n_layer": int(meta.require("block_count")),
        "n_head": int(meta.require("attention.head_count")),
        "n_positions": int(meta.require("context_length")),
        "n_inner": int(meta.require("feed_forward_length")),
        "layer_norm_epsilon": float(meta.get("attention.layer_norm_epsilon", 1e-5)),
        "activation_function": "gelu_new",
        "vocab_size": vocab_size(meta),
        "tie_word_embeddings": True,
    }


def _deepseek2_routing(meta: GGUFMetadata) -> tuple[str, dict[str, Any]]:
    """(transformers class, routing keys): V3 routes by sigmoid with the correction bias."""
    gating = meta.get("expert_gating_func")
    biased = any(name.endswith("exp_probs_b.bias") for name in meta.shapes)
    v3 = gating == 2 or (gating is None and biased)
    groups = int(meta.get("expert_group_count") or 1)
    method = "noaux_tc" if v3 else ("group_limited_greedy" if groups > 1 else "greedy")
    return ("DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"), {
        "n_routed_experts": int(meta.require("expert_count")),
        "num_experts_per_tok": int(meta.require("expert_used_count")),
        "moe_intermediate_size": int(meta.require("expert_feed_forward_length")),
        "n_shared_experts": int(meta.get("expert_shared_count") or 0),
        "first_k_dense_replace": int(meta.get("leading_dense_block_count") or 0),
        "routed_scaling_factor": float(meta.get("expert_weights_scale") or 1.0),
        "norm_topk_prob": bool(meta.get("expert_weights_norm") or False),
        "n_group": groups,
        "topk_group": int(meta.get("expert_group_used_count") or 1),
        "topk_method": method,
    }


def _deepseek2(meta: GGUFMetadata) -> dict[str, Any]:
    class_name, routing = _deepseek2_routing(meta)
    model_type = "deepseek_v3" if class_name == "DeepseekV3ForCausalLM" else "deepseek_v2"
    config = decoder_config(meta, class_name, model_type)
    rope_dim = int(meta.require("rope.dimension_count"))
    mla = meta.get("attention.key_length_mla") is not None  # k and v up-projections apart
    qk = int(meta.require("attention.key_length_mla" if mla else "attention.key_length"))
    v = int(meta.require("attention.value_length_mla" if mla else "attention.value_length"))
    config.update(routing)
    config.update(
        num_key_value_heads=config["num_attention_heads"],
        kv_lora_rank=int(meta.require("attention.kv_lora_rank")),
        q_lora_rank=int(meta.get("attention.q_lora_rank") or 0) or None,
        qk_rope_head_dim=rope_dim, qk_nope_head_dim=qk - rope_dim,
        v_head_dim=v, rope_interleave=True, attention_bias=False,
    )  # fmt: skip
    del config["head_dim"]
    scaling = rope(meta, rope_dim).get("rope_scaling")
    if scaling is not None and scaling["rope_type"] == "yarn":
        mscale = float(meta.get("rope.scaling.yarn_log_multiplier") or 0.0) / 0.1
        scaling.update(attention_factor=1.0, mscale=mscale, mscale_all_dim=mscale)
        config["rope_scaling"] = scaling
    return config


def _gpt_oss(meta: GGUFMetadata) -> dict[str, Any]:
    config = decoder_config(meta, "GptOssForCausalLM", "gpt_oss")
    config.update(
        num_local_experts=int(meta.require("expert_count")),
        num_experts_per_tok=int(meta.require("expert_used_count")),
        intermediate_size=int(meta.require("expert_feed_forward_length")),
        sliding_window=int(meta.require("attention.sliding_window")),
        layer_types=_layer_types(meta, config["num_hidden_layers"], 2),
        attention_bias=True,
        swiglu_alpha=1.702, swiglu_limit=7.0,  # no key: llama.cpp's graph hard-codes both
    )  # fmt: skip
    if config.get("rope_scaling", {}).get("rope_type") == "yarn":  # the model's, not llama.cpp's
        config["rope_scaling"]["truncate"] = False
    return _full_rotary(meta, config)


# GGUF general.architecture -> its config builder; which of these are served is the
# registry's ``gguf`` declarations.
ARCH_CONFIGS: dict[str, Callable[[GGUFMetadata], dict[str, Any]]] = {
    "llama": _llama,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "qwen2moe": _qwen2moe,
    "qwen3moe": _qwen3moe,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": _phi3,
    "gpt2": _gpt2,
    "deepseek2": _deepseek2,
    "gpt-oss": _gpt_oss,
}
