"""Tiny random-weight checkpoints of every supported architecture, for tests and tutorials.

Each is built from transformers' own config and model classes (no download) and saved as a normal
Hugging Face folder with a small byte-level BPE tokenizer trained on the spot, so pagedserve loads
it exactly as it loads a real model, and transformers can run the same weights as the reference.

Weights are drawn with a larger spread than a real initialisation (``initializer_range``), so the
next-token distribution is peaked and greedy decoding does not sit on near-ties.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

TINY_VOCAB = 512
TINY_ARCHS = (
    "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "mixtral", "qwen3_moe",
    "gpt2", "qwen2_moe", "deepseek_v2", "deepseek_v3", "gpt_oss",
)  # fmt: skip
TINY_WINDOW = 16  # the sliding window of the tiny Gemmas' local layers (prompts go past it)

_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Paged attention reads keys and values through a block table.",
    "Continuous batching admits new requests at every step; finished ones free their blocks at once.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "Prefix caching hashes full blocks as a chain, so a later request with the same prefix reuses them.",
    "Hello, world! Bonjour le monde. Hallo Welt. 你好，世界。 🙂 1234567890",
]


# What every tiny architecture shares: the vocabulary and special ids of build_tiny_tokenizer.
_TINY_SHARED: dict[str, Any] = dict(
    vocab_size=TINY_VOCAB, initializer_range=0.1, bos_token_id=1, eos_token_id=2
)


def _llama_family_config(arch: str, overrides: dict[str, Any]):
    import transformers

    common: dict[str, Any] = dict(
        _TINY_SHARED,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    if arch == "llama":
        cls = transformers.LlamaConfig
    elif arch == "mistral":
        cls, common["sliding_window"] = transformers.MistralConfig, None
    elif arch == "qwen2":
        cls, common["tie_word_embeddings"] = transformers.Qwen2Config, True
    elif arch == "qwen3":
        cls, common["head_dim"] = transformers.Qwen3Config, 32
    elif arch == "mixtral":  # 4 experts, top 2: most prompts leave one expert idle somewhere
        cls = transformers.MixtralConfig
        common.update(num_local_experts=4, num_experts_per_tok=2)
    elif arch == "qwen3_moe":  # 8 experts, top 3, unnormalised; layer 1 sparse, layer 0 dense
        cls = transformers.Qwen3MoeConfig
        common.update(
            head_dim=32, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48,
            norm_topk_prob=False, mlp_only_layers=[0],
        )  # fmt: skip
    elif arch == "qwen2_moe":  # 8 experts, top 3, and the gated shared expert on both layers
        cls = transformers.Qwen2MoeConfig
        common.update(
            num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, norm_topk_prob=False,
        )  # fmt: skip
    elif arch in ("deepseek_v2", "deepseek_v3"):
        cls = _deepseek_config(arch, common)
    elif arch == "gpt_oss":
        cls = _gpt_oss_config(common)
    elif arch in ("gemma2", "gemma3", "phi3"):
        cls = _gemma_phi3_config(arch, common)
    else:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {TINY_ARCHS}")
    common.update(overrides)
    return cls(**common)


def _deepseek_config(arch: str, common: dict[str, Any]):
    """Multi-head latent attention with every size distinct (a 32-value latent, 16 rope and 16
    no-rope query dims, 24 value dims), YaRN (factor 4 over 64 positions; V2 with an attention
    factor other than 1), a dense first layer then MoE: 8 routed experts in 4 groups, 2 groups
    kept, top 2, and shared experts. V2 (as V2-Lite) has no query bottleneck and routes
    group-limited greedy by softmax; V3 has one (q_lora_rank 48) and routes by sigmoid with the
    correction bias (drawn at random in make_tiny_checkpoint: a zero bias would test nothing)."""
    import transformers

    common.update(
        num_key_value_heads=common["num_attention_heads"],  # MLA: one latent, no KV heads
        max_position_embeddings=256, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
        v_head_dim=24, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
        n_group=4, topk_group=2, first_k_dense_replace=1,
    )  # fmt: skip
    yarn = dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
        beta_fast=32, beta_slow=1, mscale=1.0,
    )  # fmt: skip
    if arch == "deepseek_v2":
        common.update(
            q_lora_rank=None, n_shared_experts=2, topk_method="group_limited_greedy",
            routed_scaling_factor=1.5, rope_parameters=dict(yarn, mscale_all_dim=0.5),
        )  # fmt: skip
        return transformers.DeepseekV2Config
    common.update(
        q_lora_rank=48, n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.5,
        rope_parameters=dict(yarn, mscale_all_dim=1.0),
    )  # fmt: skip
    return transformers.DeepseekV3Config


def _gpt_oss_config(common: dict[str, Any]):
    """A windowed layer (TINY_WINDOW) then a full one, both with sinks (drawn wide in
    make_tiny_checkpoint, as the experts' biases: transformers starts those at zero), head_dim
    32 over a hidden size of 64, YaRN without truncation (factor 4 over 64 positions), 8
    experts of 96 (MXFP4 blocks of 32 divide both projections), top 2, and a SwiGLU limit
    of 1 that the tiny activations reach."""
    import transformers

    common.update(
        head_dim=32, intermediate_size=96, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=TINY_WINDOW, layer_types=["sliding_attention", "full_attention"],
        swiglu_limit=1.0, max_position_embeddings=256, attention_bias=True,
        rope_parameters=dict(
            rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0,
            truncate=False, original_max_position_embeddings=64,
        ),
    )  # fmt: skip
    return transformers.GptOssConfig


def _gemma_phi3_config(arch: str, common: dict[str, Any]):
    """Gemma 2/3: a local (windowed) layer then a global one, soft caps small enough to bend
    the tiny model's scores, Gemma 3's two rope bases (the global one linearly scaled). Phi-3:
    a 24-token window on every layer; LongRoPE with an original length of 48: the test prompts fit in it (transformers picks
    one factor set per forward), and 32 greedy tokens decode past it."""
    import transformers

    if arch == "phi3":
        half = 8  # head_dim 16 / 2
        common.update(
            pad_token_id=0,
            sliding_window=24,  # Phi-3-mini-4k's is 2047: every layer windowed
            original_max_position_embeddings=48,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0 + 0.1 * i for i in range(half)],
                "long_factor": [1.0 + 0.5 * i for i in range(half)],
            },
        )
        return transformers.Phi3Config
    common.update(
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=TINY_WINDOW,
        layer_types=["sliding_attention", "full_attention"],
        pad_token_id=0,
        # untied: with the embedding scaled by sqrt(hidden), a tied head mostly echoes the
        # last token, and greedy decoding would test little beyond the embedding
        tie_word_embeddings=False,
    )
    if arch == "gemma2":
        common.update(attn_logit_softcapping=3.0, final_logit_softcapping=10.0)
        return transformers.Gemma2Config
    common["rope_parameters"] = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 2.0},
    }
    return transformers.Gemma3TextConfig


def _gpt2_config(overrides: dict[str, Any]):
    import transformers

    common = dict(_TINY_SHARED, n_positions=512, n_embd=64, n_layer=2, n_head=4)
    common.update(overrides)
    return transformers.GPT2Config(**common)


def build_tiny_tokenizer(out_dir: Path, vocab_size: int = TINY_VOCAB) -> None:
    """A byte-level BPE tokenizer: <unk>=0, <|im_start|>=1 (bos), <|im_end|>=2 (eos and pad)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
    )
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def make_tiny_checkpoint(
    arch: str, out_dir: str | Path, seed: int = 0, dtype: str = "float32", **overrides: Any
) -> Path:
    """Write a random-weight ``arch`` checkpoint (+ tokenizer) to ``out_dir``; returns the path."""
    import torch
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
    config = _gpt2_config(overrides) if arch == "gpt2" else _llama_family_config(arch, overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    with torch.no_grad():  # DeepSeek-V3's routing bias starts at zero; make it choose
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
        for name, param in model.named_parameters():  # gpt-oss's: zeros, or too small to tell
            if name.endswith(("self_attn.sinks", "experts.gate_up_proj_bias", "down_proj_bias")):
                param.normal_(0.0, 1.0)
    model.save_pretrained(out_dir, safe_serialization=True)
    build_tiny_tokenizer(out_dir, config.vocab_size)
    return out_dir


def make_mxfp4_checkpoint(source: str | Path, out_dir: str | Path) -> Path:
    """``source`` (a tiny gpt-oss folder) with its experts' projections stored as OpenAI's
    release stores them: MXFP4 ``_blocks`` and ``_scales`` ``[E, out, ...]``, and
    ``quantization_config.quant_method = "mxfp4"``; everything else as it was."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from pagedserve.models.mxfp4 import quantize_mxfp4

    source, out_dir = Path(source), Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
    shutil.copytree(source, out_dir)
    tensors = load_file(out_dir / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(1, 2))  # [E, out, in]
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head",
        ],
    }  # fmt: skip
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def transformers_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt, never stopping early (EOS included).

    ``generate(min_new_tokens=...)`` would suppress EOS instead, which changes the tokens; this
    loop is plain argmax over transformers' own forward with its own KV cache.
    """
    import torch

    with torch.inference_mode():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        tokens: list[int] = []
        for _ in range(max_new_tokens):
            token = int(out.logits[0, -1].argmax())
            tokens.append(token)
            out = model(
                torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True
            )
    return tokens


def make_peft_adapter(
    base_model: str | Path,
    out_dir: str | Path,
    target_modules: list[str],
    r: int = 8,
    lora_alpha: int = 16,
    seed: int = 0,
    use_rslora: bool = False,
    std: float = 0.1,
) -> Path:
    """A PEFT LoRA adapter for ``base_model``, saved by peft itself, with random A and B.

    peft initialises B to zero (an untrained adapter changes nothing); both are drawn from a
    seeded normal here so that every adapter moves the model's tokens, and a test that served
    the wrong adapter (or none) would see it. Returns ``out_dir``.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out_dir = Path(out_dir)
    if (out_dir / "adapter_config.json").is_file():
        return out_dir
    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    config = LoraConfig(
        r=r, lora_alpha=lora_alpha, target_modules=target_modules, use_rslora=use_rslora
    )
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    peft_model.save_pretrained(out_dir)
    return out_dir


def peft_greedy(
    base_model: str | Path, adapter: str | Path | None, prompt_ids: list[int], max_new_tokens: int
) -> list[int]:
    """transformers + peft running ``adapter`` alone (None: the plain base model), greedy, fp32:
    the reference a LoRA-serving test holds each row of a mixed batch to."""
    return list(
        _peft_greedy(str(base_model), adapter and str(adapter), tuple(prompt_ids), max_new_tokens)
    )


@functools.cache
def _peft_reference_model(base_model: str, adapter: str | None):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    return model.eval()


@functools.cache
def _peft_greedy(base_model: str, adapter: str | None, prompt_ids: tuple, n: int) -> tuple:
    return tuple(
        transformers_greedy(_peft_reference_model(base_model, adapter), list(prompt_ids), n)
    )
