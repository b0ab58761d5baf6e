"""GGUF files made here from the tiny random checkpoints (testing.py), for tests: no download.

``write_gguf(folder, path, recipe)`` writes a Hugging Face Llama or Qwen2 folder as llama.cpp's
converter would: its metadata keys, its tensor names, Llama's Q/K rows permuted, its
tokenizer as ``tokenizer.ggml.*`` (a byte-level BPE: the ``gpt2`` tokenizer model) with the
chat template, and each tensor in the type ``recipe(name)`` picks. The block types gguf can
encode are encoded by ``gguf.quants.quantize``; the K-quants and IQ4 types, which it only
decodes, by the round-to-nearest encoders of gguf_encode.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from pagedserve.models.gguf_encode import encode

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
