"""GGUF files made here from the tiny random checkpoints (testing.py), for tests: no download.

``write_gguf(folder, path, recipe)`` writes a Hugging Face Llama or Qwen2 folder as llama.cpp's
converter would: its metadata keys, its tensor names, Llama's Q/K rows permuted, its
tokenizer as ``tokenizer.ggml.*`` (a byte-level BPE: the ``gpt2`` tokenizer model) with the
chat template, and each tensor in the type ``recipe(name)`` picks. The block types gguf can
encode (F16, BF16, Q8_0, Q4_0, Q4_1) are encoded by ``gguf.quants.quantize``; for Q4_K and
Q6_K, which it only decodes, ``quantize_q4_k`` / ``quantize_q6_k`` here round to nearest
(llama.cpp searches for better scales; any valid blocks do for a test, and the tests prove
these against gguf's own decoder).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    stem, kind = hf_name.rsplit(".", 1)
    if stem in top:
        return f"{top[stem]}.{kind}"
    _, _, layer, rest = stem.split(".", 3)
    return f"blk.{layer}.{_LAYER_NAMES[rest]}.{kind}"


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """``[N, K]`` fp32 -> Q4_K rows: per 32-weight sub-block ``w ~ scale * q - min`` (q 0..15,
    min >= 0), the eight scales and mins in 6 bits under the super-block's fp16 ``d``/``dmin``."""
    x = w.astype(np.float32).reshape(-1, 8, 32)
    lo, hi = np.minimum(x.min(-1), 0.0), x.max(-1)
    d = _fp16(np.maximum((hi - lo).max(-1) / 15 / 63, 1e-8))
    dmin = _fp16(np.maximum((-lo).max(-1) / 63, 1e-8))
    sc = np.clip(np.round((hi - lo) / 15 / d[:, None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / dmin[:, None]), 0, 63).astype(np.uint8)
    step = (d[:, None] * sc)[..., None]
    q = np.clip(np.round((x + (dmin[:, None] * mn)[..., None]) / step), 0, 15).astype(np.uint8)
    scales = np.concatenate(
        [sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
         (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)], axis=-1,
    )  # fmt: skip
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)
    halves = np.stack([d, dmin], -1).astype(np.float16).view(np.uint8)
    return np.concatenate([halves, scales, qs], -1).reshape(w.shape[0], -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """``[N, K]`` fp32 -> Q6_K rows: per 16 weights an int8 scale under the block's fp16 ``d``,
    6-bit ``q - 32`` split into 4 low bits (ql) and 2 high bits (qh)."""
    x = w.astype(np.float32).reshape(-1, 16, 16)
    d = _fp16(np.maximum(np.abs(x).max((-1, -2)) / 31 / 127, 1e-8))
    sc = np.clip(np.round(np.abs(x).max(-1) / 31 / d[:, None]), 1, 127).astype(np.int8)
    step = (d[:, None] * sc)[..., None]
    u = (np.clip(np.round(x / step), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    low, high = u & 0xF, u >> 4  # [block, half, g, lane]
    ql = np.concatenate(
        [low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], -1
    )
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    tail = [sc.view(np.uint8), d.astype(np.float16).view(np.uint8).reshape(-1, 2)]
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), *tail], -1).reshape(
        w.shape[0], -1
    )


def encode(w: np.ndarray, type_name: str) -> tuple[np.ndarray, object]:
    """(data for GGUFWriter.add_tensor, raw_dtype) of ``w`` in ``type_name``."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[type_name]
    if type_name == "F32":
        return w.astype(np.float32), None
    if type_name == "Q4_K":
        return quantize_q4_k(w), qtype
    if type_name == "Q6_K":
        return quantize_q6_k(w), qtype
    return quants.quantize(w.astype(np.float32), qtype), qtype


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order: per head, the rotary halves interleaved."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _write_tokenizer(writer, folder: Path) -> None:
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([3 if t in special else 1 for t, _ in vocab])  # control / normal
    merges = tok["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    template = cfg.get("chat_template") or (folder / "chat_template.jinja").read_text()
    writer.add_chat_template(template)


def _write_metadata(writer, config: dict) -> None:
    heads = config["num_attention_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    writer.add_rope_freq_base(float(config.get("rope_theta") or 10000.0))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])


def write_gguf(folder: str | Path, path: str | Path, recipe: Callable[[str], str]) -> Path:
    """Write the checkpoint in ``folder`` as a GGUF file at ``path``; ``recipe(gguf_name)``
    gives each 2-D tensor's type (vectors are F32, as llama.cpp keeps them)."""
    import gguf
    from safetensors.numpy import load_file

    folder, path = Path(folder), Path(path)
    config = json.loads((folder / "config.json").read_text())
    arch = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}[config["architectures"][0]]
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, config)
    _write_tokenizer(writer, folder)
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for name, w in load_file(folder / "model.safetensors").items():
        if name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue
        kind = name.split(".")[-2]
        if arch == "llama" and kind in heads:
            w = llama_cpp_permute(w, heads[kind])
        target = gguf_name(name)
        data, raw_dtype = encode(w, recipe(target)) if w.ndim == 2 else (w.astype(np.float32), None)
        writer.add_tensor(target, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
