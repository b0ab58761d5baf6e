"""llama.cpp's converter (convert_hf_to_gguf.py) for the architectures pagedserve serves,
written again here for tests, from what the converter does: no download, no llama.cpp build.

``gguf_arch`` is the ``general.architecture`` a folder converts to; ``write_metadata`` writes
the ``{arch}.*`` keys the converter writes for its config.json; ``converted_tensors`` yields
each tensor under the name gguf-py's own ``TensorNameMap`` gives it (the converter's table,
not pagedserve's), changed as the converter changes it: Llama's Q/K rows permuted, Gemma's
norms stored as ``1 + w``, Gemma 3's embedding trimmed to its tokenizer, GPT-2's Conv1D
weights transposed, experts stacked per layer, DeepSeek's ``kv_b_proj`` split into ``k_b``
(per head, transposed) and ``v_b``, Phi-3's LongRoPE factors as tensors, gpt-oss's stacked
experts transposed to ``[E, out, in]`` and its ``gate_up_proj`` split by parity into gate (even
rows) and up (odd rows), biases alike, and its sinks named as weights.

tests/models/test_gguf_architectures.py holds these files to the real converter's output
where llama.cpp's converter is on the machine (tools/llamacpp_build.py fetches it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

GGUF_ARCHS = {
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "MixtralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Qwen2MoeForCausalLM": "qwen2moe",
    "Qwen3MoeForCausalLM": "qwen3moe", "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3", "Phi3ForCausalLM": "phi3", "GPT2LMHeadModel": "gpt2",
    "DeepseekV2ForCausalLM": "deepseek2", "DeepseekV3ForCausalLM": "deepseek2",
    "GptOssForCausalLM": "gpt-oss",
}  # fmt: skip


def gguf_arch(config: dict[str, Any]) -> str:
    return GGUF_ARCHS[config["architectures"][0]]


def _rope(config: dict[str, Any]) -> dict[str, Any]:
    params = dict(config.get("rope_parameters") or {})
    params.update(config.get("rope_scaling") or {})
    params.setdefault("rope_theta", config.get("rope_theta"))
    return params


def _sizes(w, c: dict[str, Any]) -> None:
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])


def _text_model(w, c: dict[str, Any], rope: dict[str, Any]) -> None:
    """The keys every text model's converter writes (its base class)."""
    _sizes(w, c)
    _rope_scaling(w, rope.get("full_attention", rope))
    theta = rope.get("full_attention", rope).get("rope_theta")
    if theta is not None:
        w.add_rope_freq_base(theta)
    if rope.get("sliding_attention", {}).get("rope_theta") is not None:
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    experts = c.get("num_local_experts") or c.get("num_experts") or c.get("n_routed_experts")
    if experts is not None:
        w.add_expert_count(experts)
    if c.get("num_experts_per_tok") is not None:
        w.add_expert_used_count(c["num_experts_per_tok"])
    if c.get("n_group") is not None:
        w.add_expert_group_count(c["n_group"])
    if c.get("topk_group") is not None:
        w.add_expert_group_used_count(c["topk_group"])
    if c.get("head_dim") is not None:
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])


def _rope_scaling(w, rope: dict[str, Any]) -> None:
    import gguf

    kind, factor = rope.get("rope_type"), rope.get("factor")
    if kind == "linear" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(factor)
    elif kind == "yarn" and factor is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if rope.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        if rope.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    elif kind == "longrope":
        w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)


def _gemma2(w, c: dict[str, Any], rope: dict[str, Any]) -> None:
    _sizes(w, c)
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_attn_logit_softcapping(c["attn_logit_softcapping"])
    w.add_final_logit_softcapping(c["final_logit_softcapping"])
    w.add_sliding_window(c["sliding_window"])


def _gemma3(w, c: dict[str, Any], rope: dict[str, Any]) -> None:
    _text_model(w, c, rope)
    if c.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(c["final_logit_softcapping"])
    if c.get("sliding_window_pattern") != 1:
        w.add_sliding_window(c["sliding_window"])


def _phi3(w, c: dict[str, Any], rope: dict[str, Any]) -> None:
    heads, original = c["num_attention_heads"], rope["original_max_position_embeddings"]
    w.add_context_length(c["max_position_embeddings"])
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_head_count(heads)
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_dimension_count(
        int(rope.get("partial_rotary_factor", 1.0) * c["hidden_size"]) // heads
    )
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(c.get("sliding_window") or 0)
    scale = c["max_position_embeddings"] / original
    if rope.get("long_factor"):  # LongRoPE's cos/sin scale, as the converter computes it
        w.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1.0 else 1.0
        )


def _gpt2(w, c: dict[str, Any], rope: dict[str, Any]) -> None:
    w.add_block_count(c["n_layer"])
    w.add_context_length(c.get("n_ctx") or c["n_positions"])
    w.add_embedding_length(c["n_embd"])
    w.add_feed_forward_length(4 * c["n_embd"])
    w.add_head_count(c["n_head"])
    w.add_layer_norm_eps(c["layer_norm_epsilon"])


def _deepseek2(w, c: dict[str, Any], rope: dict[str, Any]) -> None:
    kv_lora, rope_dim = c["kv_lora_rank"], c["qk_rope_head_dim"]
    _text_model(w, dict(c, num_key_value_heads=1, head_dim=None), rope)
    w.add_leading_dense_block_count(c.get("first_k_dense_replace") or 0)
    w.add_vocab_size(c["vocab_size"])
    if c.get("q_lora_rank") is not None:
        w.add_q_lora_rank(c["q_lora_rank"])
    w.add_kv_lora_rank(kv_lora)
    w.add_key_length(kv_lora + rope_dim)
    w.add_value_length(kv_lora)
    w.add_key_length_mla(c["qk_nope_head_dim"] + rope_dim)
    w.add_value_length_mla(c["v_head_dim"])
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_expert_count(c["n_routed_experts"])
    w.add_expert_shared_count(c.get("n_shared_experts", 0))
    if c.get("routed_scaling_factor") is not None:
        w.add_expert_weights_scale(c["routed_scaling_factor"])
    if c.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(rope_dim)
    if rope.get("mscale_all_dim") is not None:
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def write_metadata(w, config: dict[str, Any]) -> None:
    """The converter's ``{arch}.*`` keys for ``config`` (config.json)."""
    arch, rope = gguf_arch(config), _rope(config)
    special = {"gemma2": _gemma2, "gemma3": _gemma3, "phi3": _phi3, "gpt2": _gpt2,
               "deepseek2": _deepseek2}  # fmt: skip
    if arch in special:
        special[arch](w, config, rope)
    else:
        _text_model(w, config, rope)
    if arch == "llama":
        w.add_vocab_size(config["vocab_size"])
        heads = config["num_attention_heads"]
        w.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // heads)
    if arch == "gpt-oss":
        w.add_sliding_window(config["sliding_window"])
        w.add_expert_feed_forward_length(config["intermediate_size"])
    if arch in ("qwen2moe", "qwen3moe"):
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size") is not None:
            w.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order: per head, the rotary halves interleaved."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _stack_experts(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each layer's per-expert tensors as one ``[experts, out, in]`` tensor per projection,
    under the merged name the converter maps (``...experts.w1`` / ``...experts.gate_proj``)."""
    stacked: dict[str, list[tuple[int, np.ndarray]]] = {}
    rest = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            merged = ".".join(parts[: i + 1] + parts[i + 2 : -1])
            stacked.setdefault(merged, []).append((int(parts[i + 1]), t))
        else:
            rest[name] = t
    for merged, experts in stacked.items():
        if ".block_sparse_moe." in merged:  # the converter's own name for Mixtral's
            layer = merged.split(".")[2]
            merged = f"layers.{layer}.feed_forward.experts.{merged.rsplit('.', 1)[1]}"
        rest[merged + ".weight"] = np.stack([t for _, t in sorted(experts, key=lambda x: x[0])])
    return rest


def _gpt_oss_experts(name: str, t: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """gpt-oss's stacked ``experts.{gate_up,down}_proj[_bias]`` under the per-projection names
    the converter maps: weights ``[E, in, out]`` -> ``[E, out, in]``, gate_up's rows (bias
    entries) split by parity, gate even and up odd."""
    module, _, tail = name.rpartition(".")
    kind = "bias" if tail.endswith("_bias") else "weight"
    if kind == "weight":
        t = t.swapaxes(-1, -2)
    if tail.startswith("down_proj"):
        yield f"{module}.down_proj.{kind}", t
        return
    yield f"{module}.gate_proj.{kind}", t[:, 0::2]  # dim 1: the out features, weights or biases
    yield f"{module}.up_proj.{kind}", t[:, 1::2]


def _changed(arch: str, config: dict[str, Any], name: str, t: np.ndarray, folder: Path):
    """One tensor as the converter changes it: yields ``(hf name, array)``."""
    if arch == "gpt-oss" and ".mlp.experts." in name:
        yield from _gpt_oss_experts(name, t)
        return
    if arch == "gpt-oss" and name.endswith("self_attn.sinks"):
        name += ".weight"
    if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
        t = permute_qk(t, config["num_attention_heads"])
    if arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
        t = permute_qk(t, config["num_key_value_heads"])
    if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
        t = t + 1
    if arch == "gemma3" and name.endswith("embed_tokens.weight"):
        tok = json.loads((folder / "tokenizer.json").read_text())
        t = t[: len(tok["model"]["vocab"]) + len(tok["added_tokens"])]
    if arch == "gpt2" and name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
        t = t.T
    if name.endswith("kv_b_proj.weight"):  # split for the absorbed attention, k_b transposed
        heads, nope = config["num_attention_heads"], config["qk_nope_head_dim"]
        kv_b = t.reshape(heads, nope + config["v_head_dim"], t.shape[-1])
        yield name.replace("kv_b_proj", "k_b_proj"), kv_b[:, :nope].transpose(0, 2, 1)
        yield name.replace("kv_b_proj", "v_b_proj"), kv_b[:, nope:]
        return
    yield name.replace("e_score_correction_bias", "e_score_correction.bias"), t


def _skipped(arch: str, config: dict[str, Any], name: str) -> bool:
    tied = config.get("tie_word_embeddings") or arch == "gemma2"  # Gemma 2: always tied
    if name == "lm_head.weight" and tied:
        return True
    if name.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")):
        return True
    layer = name.split(".")[2] if name.startswith("model.layers.") else None
    return arch == "deepseek2" and layer is not None and int(layer) >= config["num_hidden_layers"]


def converted_tensors(
    folder: str | Path, config: dict[str, Any]
) -> Iterator[tuple[str, np.ndarray]]:
    """``(GGUF name, fp32 array)`` for each tensor the converter writes from ``folder``."""
    import gguf
    from safetensors.numpy import load_file

    folder, arch = Path(folder), gguf_arch(config)
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    layers = config.get("num_hidden_layers") or config["n_layer"]
    names = gguf.get_tensor_name_map(model_arch, layers)
    tensors = {k: v.astype(np.float32) for k, v in load_file(folder / "model.safetensors").items()}
    for hf, t in _stack_experts(tensors).items():
        if _skipped(arch, config, hf):
            continue
        for name, data in _changed(arch, config, hf, t, folder):
            gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
            if gguf_name is None:
                raise ValueError(f"the converter maps no GGUF name for {name!r}")
            yield gguf_name, np.ascontiguousarray(data)
    rope = _rope(config)
    if arch == "phi3" and rope.get("long_factor"):
        yield "rope_factors_long.weight", np.asarray(rope["long_factor"], np.float32)
        yield "rope_factors_short.weight", np.asarray(rope["short_factor"], np.float32)
