"""Write a 1B-class Llama with random weights: Llama-3.2-1B's shape, the default model's tokenizer.

CPU users serve models of 1B to 8B parameters, and a decode step's cost is reading every
weight: a 135M model on a CPU with a 300 MB cache says little about a 1B one streaming 4 GB
(fp32) or 0.7 GB (Q4_K_M) from memory per token. No checkpoint can be downloaded here, so this
writes one: Llama-3.2-1B's layer shapes (hidden 2048, 16 layers, 32 query heads and 8 KV heads
of 64, MLP 8192, rope theta 500,000, tied embeddings) over SmolLM2's 49,152-token vocabulary
(its tokenizer and chat template copied beside), 1.07B parameters, fp32. The weights are
normal with transformers' initializer range (0.02), norms 1: their text is noise, but every
GEMM, cache read and quantized block is the size a real 1B model's is, which is what the
speed benchmarks (tools/bench_llamacpp.py --gguf, tools/bench_gguf_cpu.py) measure.

    .venv/bin/python tools/make_llama_1b.py --out /tmp/llama-1b     # ~4.3 GB, about a minute
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

LLAMA_1B_SHAPE = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json")  # fmt: skip


def llama_config(tokenizer_dir: Path, **shape) -> dict:
    """Llama-3.2-1B's shape (``shape`` overrides: tests make a small one) with the tokenizer's
    vocabulary and special tokens."""
    source = json.loads((tokenizer_dir / "config.json").read_text())
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "torch_dtype": "float32",
        "vocab_size": source["vocab_size"],
        "bos_token_id": source.get("bos_token_id"),
        "eos_token_id": source.get("eos_token_id"),
        **LLAMA_1B_SHAPE,
    }
    config.update(shape)
    return config


def random_weights(config: dict, seed: int = 0) -> dict:
    """Every tensor transformers' LlamaForCausalLM holds for ``config`` (the head tied), normal
    with std ``initializer_range``, the norms 1."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    h, inter, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}."
        shapes |= {
            layer + "input_layernorm.weight": (h,),
            layer + "post_attention_layernorm.weight": (h,),
            layer + "self_attn.q_proj.weight": (q, h),
            layer + "self_attn.k_proj.weight": (kv, h),
            layer + "self_attn.v_proj.weight": (kv, h),
            layer + "self_attn.o_proj.weight": (h, q),
            layer + "mlp.gate_proj.weight": (inter, h),
            layer + "mlp.up_proj.weight": (inter, h),
            layer + "mlp.down_proj.weight": (h, inter),
        }
    std = config["initializer_range"]
    return {
        name: torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=gen) * std
        for name, shape in shapes.items()
    }


def write_llama(out: Path, tokenizer_dir: Path, seed: int = 0, **shape) -> Path:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = llama_config(tokenizer_dir, **shape)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    save_file(random_weights(config, seed), str(out / "model.safetensors"), {"format": "pt"})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder to write")
    parser.add_argument("--tokenizer", default=None, help="HF folder (default: SmolLM2's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.tokenizer is None:
        from pagedserve.models.default_model import ensure_default_model

        args.tokenizer = str(ensure_default_model())
    print(write_llama(Path(args.out), Path(args.tokenizer), args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
