"""The architectures pagedserve serves: Hugging Face's class name -> our family, and what it is.

The one list: ``ModelConfig`` maps a config.json's ``architectures`` through it (and names it in
the error for anything else), ``loader.MODEL_CLASSES`` builds each family, and the README's
table of supported architectures is generated from it (``python -m
pagedserve.models.registry``; a test holds the README to it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    family: str  # the key of loader.MODEL_CLASSES that builds it
    examples: str  # checkpoints people run under this class name
    notes: str  # what the implementation covers beyond the family's common layers
    # a pooling architecture's own task ("embed", "classify"); None for a generative one
    task: str | None = None
    # a decoder classifier's causal-LM class name, whose layers its family code builds
    base: str | None = None
    encoder: bool = False  # bidirectional attention, no KV cache (BERT family)


def _decoder_classifier(base: str, examples: str) -> Architecture:
    return Architecture(
        "llama", examples, "the decoder's last token through a score head", "classify", base
    )


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(
        "llama", "Llama 2/3/3.1/3.2, SmolLM2", "GQA, Llama 3.1 and linear RoPE scaling"
    ),
    "MistralForCausalLM": Architecture("llama", "Mistral 7B", "sliding-window attention"),
    "Qwen2ForCausalLM": Architecture(
        "llama", "Qwen2, Qwen2.5", "qkv bias; sliding window from max_window_layers on"
    ),
    "Qwen3ForCausalLM": Architecture("llama", "Qwen3 (dense)", "per-head q/k RMSNorm"),
    "Gemma2ForCausalLM": Architecture(
        "gemma",
        "Gemma 2",
        "GeGLU, (1 + w) RMSNorm, alternating local/global layers, attention and final "
        "logit soft-capping",
    ),
    "Gemma3ForCausalLM": Architecture(
        "gemma",
        "Gemma 3 (text: 1B, or a text-only export)",
        "q/k RMSNorm, a rope base per layer type, 5 local : 1 global layers",
    ),
    "Phi3ForCausalLM": Architecture(
        "phi3", "Phi-3, Phi-3.5 mini", "fused qkv and gate_up, LongRoPE, sliding window"
    ),
    "MixtralForCausalLM": Architecture(
        "mixtral", "Mixtral 8x7B, 8x22B", "top-2 of 8 experts, renormalised; fused MoE kernel"
    ),
    "Qwen3MoeForCausalLM": Architecture(
        "qwen3_moe",
        "Qwen3-30B-A3B, Qwen3-235B-A22B",
        "top-8 of 128 experts (norm_topk_prob), q/k RMSNorm; fused MoE kernel",
    ),
    "Qwen2MoeForCausalLM": Architecture(
        "qwen2_moe",
        "Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B",
        "top-k of 60/64 experts plus a sigmoid-gated shared expert, qkv bias; fused MoE kernel",
    ),
    "DeepseekV2ForCausalLM": Architecture(
        "deepseek_v2",
        "DeepSeek-V2, V2-Lite, V2.5, DeepSeek-Coder-V2",
        "multi-head latent attention over a paged latent cache (576 values a token and layer), "
        "absorbed decode kernel, YaRN; shared experts, group-limited top-k; fused MoE kernel",
    ),
    "DeepseekV3ForCausalLM": Architecture(
        "deepseek_v3",
        "DeepSeek-V3, R1 (bf16 weights)",
        "V2's latent attention; sigmoid routing with the correction bias (noaux_tc), top-4 of "
        "8 groups; first 3 layers dense",
    ),
    "GptOssForCausalLM": Architecture(
        "gpt_oss",
        "gpt-oss-20b, gpt-oss-120b",
        "attention sinks, alternating 128-token sliding-window and full layers, YaRN; "
        "biased experts with a clamped SwiGLU (fused MoE kernel); MXFP4 experts dequantized "
        "at load",
    ),
    "GPT2LMHeadModel": Architecture(
        "gpt2", "GPT-2", "learned positions, LayerNorm, GELU, Conv1D weights"
    ),
    # pooling models (--runner pooling: /v1/embeddings, /classify, /score, /rerank)
    "BertModel": Architecture(
        "bert",
        "all-MiniLM-L6-v2, bge-*-en-v1.5, e5",
        "embeddings; pooling from the sentence-transformers config",
        "embed",
        encoder=True,
    ),
    "RobertaModel": Architecture(
        "bert", "all-roberta-large-v1", "embeddings (BERT's code, RoBERTa's names)", "embed",
        encoder=True,
    ),
    "XLMRobertaModel": Architecture(
        "bert", "bge-m3, multilingual-e5", "embeddings (BERT's code, RoBERTa's names)", "embed",
        encoder=True,
    ),
    "BertForSequenceClassification": Architecture(
        "bert_classifier",
        "ms-marco-MiniLM-L6-v2 (cross-encoder)",
        "scores and classes: [CLS] through the classifier head",
        "classify",
        encoder=True,
    ),
    "XLMRobertaForSequenceClassification": Architecture(
        "bert_classifier", "bge-reranker-v2-m3 (cross-encoder)", "as BERT's", "classify",
        encoder=True,
    ),
    "LlamaForSequenceClassification": _decoder_classifier("LlamaForCausalLM", "Llama reward models"),
    "Qwen2ForSequenceClassification": _decoder_classifier("Qwen2ForCausalLM", "Qwen2 classifiers"),
    "Qwen3ForSequenceClassification": _decoder_classifier("Qwen3ForCausalLM", "Qwen3 classifiers"),
}  # fmt: skip

SUPPORTED_ARCHITECTURES: dict[str, str] = {n: a.family for n, a in ARCHITECTURES.items()}
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")

README_START = (
    "<!-- supported-architectures:start (generated: python -m pagedserve.models.registry) -->"
)
README_END = "<!-- supported-architectures:end -->"


def supported_architectures_table() -> str:
    """The README's table, generated from ``ARCHITECTURES``, between its two markers."""
    rows = [
        README_START,
        "| `architectures` in config.json | Models | Notes |",
        "|---|---|---|",
    ]
    rows += [f"| `{name}` | {a.examples} | {a.notes} |" for name, a in ARCHITECTURES.items()]
    return "\n".join([*rows, README_END])


def replace_readme_table(readme: str) -> str:
    """``readme`` with its generated block rewritten from the registry."""
    start, end = readme.index(README_START), readme.index(README_END) + len(README_END)
    return readme[:start] + supported_architectures_table() + readme[end:]


def main(argv: list[str] | None = None) -> int:
    """Print the table, or with ``--write README.md`` rewrite that file's block in place."""
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(description="the README's supported-architecture table")
    parser.add_argument("--write", metavar="README", help="rewrite the table in this file")
    args = parser.parse_args(argv)
    if args.write:
        path = Path(args.write)
        path.write_text(replace_readme_table(path.read_text()))
    else:
        print(supported_architectures_table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
