"""The architectures pagedserve serves: Hugging Face's class name -> our family, what it is,
and what it can be served with.

The one list: ``ModelConfig`` maps a config.json's ``architectures`` through it (and names it in
the error for anything else), ``loader.MODEL_CLASSES`` builds each family, and the README's
table of supported architectures is generated from it (``python tools/architecture_table.py``;
a test holds the README to it).

Each entry also declares what its model can be served with beyond its Hugging Face folder, and
each declaration is the one the engine checks when it loads (so the table cannot say yes where
loading says no):

- ``gguf``: the ``general.architecture`` of its llama.cpp GGUF files (gguf_config.py accepts a
  file when some entry names its architecture; Mistral's and Mixtral's files say ``llama``);
- ``quantized``: the ``quantization_config.quant_method`` values of the pre-quantized
  checkpoints it loads (quantization.py; for a format of experts only, gpt-oss's MXFP4,
  config.py's check and the model's own loader);
- ``lora``: LoRA adapters on its projections (lora/model.py);
- ``tensor_parallel``: split over ranks (the engine's executor, before any rank starts);
- ``pipeline_parallel``: its decoder layers cut into pipeline stages (models/pipeline.py);
- ``cpu_fused``: on a CPU, the runner runs its decoder layers as one numba call each for small
  steps (engine/cpu_runner.py; its layers must also be fusable, which tests hold it to);
- ``images``: its prompts take images, each the rows of its vision tower in place of its
  placeholder tokens (the model's ``embed_images``: llava.py, qwen2_vl.py, gemma3_mm.py).
"""

from __future__ import annotations

from dataclasses import dataclass

INT4_AND_FP8 = ("awq", "gptq", "fp8")
INT4 = ("awq", "gptq")
# An MoE's AWQ / GPTQ experts are held dequantized (moe_quantized.py); the rest runs 4-bit.
_INT4_EXPERTS = "; AWQ/GPTQ experts dequantized at load"


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
    gguf: str | None = None  # GGUF general.architecture of its files; None: no GGUF
    quantized: tuple[str, ...] = ()  # pre-quantized checkpoint formats (quant_method)
    lora: bool = False  # LoRA adapters
    tensor_parallel: bool = True  # tensor_parallel_size > 1
    pipeline_parallel: bool = False  # pipeline_parallel_size > 1 (its model is LlamaModel)
    cpu_fused: bool = False  # the CPU runner's fused decoder layers
    images: bool = False  # images in prompts (embed_images)


def _decoder_classifier(base: str, examples: str) -> Architecture:
    return Architecture(
        "llama", examples, "the decoder's last token through a score head", "classify", base,
        quantized=INT4_AND_FP8, tensor_parallel=False,
    )  # fmt: skip


def _encoder(family: str, examples: str, notes: str, task: str) -> Architecture:
    return Architecture(family, examples, notes, task, encoder=True, tensor_parallel=False)


_LLAMA_LIKE = dict(quantized=INT4_AND_FP8, lora=True, pipeline_parallel=True)

ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(
        "llama", "Llama 2/3/3.1/3.2, SmolLM2", "GQA, Llama 3.1 and linear RoPE scaling",
        gguf="llama", cpu_fused=True, **_LLAMA_LIKE,
    ),
    "MistralForCausalLM": Architecture(
        "llama", "Mistral 7B", "sliding-window attention", gguf="llama", cpu_fused=True,
        **_LLAMA_LIKE,
    ),
    "Qwen2ForCausalLM": Architecture(
        "llama", "Qwen2, Qwen2.5", "qkv bias; sliding window from max_window_layers on",
        gguf="qwen2", cpu_fused=True, **_LLAMA_LIKE,
    ),
    "Qwen3ForCausalLM": Architecture(
        "llama", "Qwen3 (dense)", "per-head q/k RMSNorm", gguf="qwen3", cpu_fused=True,
        **_LLAMA_LIKE,
    ),
    "Gemma2ForCausalLM": Architecture(
        "gemma",
        "Gemma 2",
        "GeGLU, (1 + w) RMSNorm, alternating local/global layers, attention and final "
        "logit soft-capping",
        gguf="gemma2", quantized=INT4_AND_FP8,
    ),
    "Gemma3ForCausalLM": Architecture(
        "gemma",
        "Gemma 3 (text: 1B, or a text-only export)",
        "q/k RMSNorm, a rope base per layer type, 5 local : 1 global layers",
        gguf="gemma3", quantized=INT4_AND_FP8,
    ),
    "Phi3ForCausalLM": Architecture(
        "phi3", "Phi-3, Phi-3.5 mini", "fused qkv and gate_up, LongRoPE, sliding window",
        gguf="phi3", cpu_fused=True, pipeline_parallel=True,
    ),
    "MixtralForCausalLM": Architecture(
        "mixtral", "Mixtral 8x7B, 8x22B",
        "top-2 of 8 experts, renormalised; fused MoE kernel" + _INT4_EXPERTS,
        gguf="llama", quantized=INT4, pipeline_parallel=True,
    ),
    "Qwen3MoeForCausalLM": Architecture(
        "qwen3_moe",
        "Qwen3-30B-A3B, Qwen3-235B-A22B",
        "top-8 of 128 experts (norm_topk_prob), q/k RMSNorm; fused MoE kernel" + _INT4_EXPERTS
        + "; CPU fused: its dense layers (mlp_only_layers) only",
        gguf="qwen3moe", quantized=INT4, pipeline_parallel=True, cpu_fused=True,
    ),
    "Qwen2MoeForCausalLM": Architecture(
        "qwen2_moe",
        "Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B",
        "top-k of 60/64 experts plus a sigmoid-gated shared expert, qkv bias; fused MoE kernel"
        + _INT4_EXPERTS,
        gguf="qwen2moe", quantized=INT4, pipeline_parallel=True,
    ),
    "DeepseekV2ForCausalLM": Architecture(
        "deepseek_v2",
        "DeepSeek-V2, V2-Lite, V2.5, DeepSeek-Coder-V2",
        "multi-head latent attention over a paged latent cache (576 values a token and layer), "
        "absorbed decode kernel, YaRN; shared experts, group-limited top-k; fused MoE kernel",
        gguf="deepseek2", pipeline_parallel=True,
    ),
    "DeepseekV3ForCausalLM": Architecture(
        "deepseek_v3",
        "DeepSeek-V3, R1 (bf16 weights)",
        "V2's latent attention; sigmoid routing with the correction bias (noaux_tc), top-4 of "
        "8 groups; first 3 layers dense",
        gguf="deepseek2", pipeline_parallel=True,
    ),
    "GptOssForCausalLM": Architecture(
        "gpt_oss",
        "gpt-oss-20b, gpt-oss-120b",
        "attention sinks, alternating 128-token sliding-window and full layers, YaRN; "
        "biased experts with a clamped SwiGLU (fused MoE kernel); MXFP4 experts dequantized "
        "at load",
        gguf="gpt-oss", quantized=("mxfp4",), pipeline_parallel=True,
    ),
    "GPT2LMHeadModel": Architecture(
        "gpt2", "GPT-2", "learned positions, LayerNorm, GELU, Conv1D weights", gguf="gpt2",
        lora=True,
    ),
    "LlavaForConditionalGeneration": Architecture(
        "llava", "LLaVA-1.5 7B, 13B (llava-hf)",
        "images in: a CLIP vision tower's features (vision_feature_layer, default or full "
        "strategy) through a 2-layer projector into a Llama/Mistral decoder",
        tensor_parallel=False, images=True, cpu_fused=True,
    ),
    "Qwen2VLForConditionalGeneration": Architecture(
        "qwen2_vl", "Qwen2-VL-2B/7B-Instruct",
        "images in at their own resolution (2x2-merged patches of a ViT with 2-D rotary); "
        "M-RoPE positions in a Qwen2 decoder",
        tensor_parallel=False, images=True,
    ),
    "Qwen2_5_VLForConditionalGeneration": Architecture(
        "qwen2_vl", "Qwen2.5-VL-3B/7B-Instruct",
        "Qwen2-VL's design; the tower's windowed attention, RMSNorm and gated MLP",
        tensor_parallel=False, images=True,
    ),
    "Gemma3ForConditionalGeneration": Architecture(
        "gemma3_mm", "Gemma 3 4B/12B/27B (-it)",
        "images in: a SigLIP tower's rows average-pooled to mm_tokens_per_image (256), "
        "RMSNorm and a projection into the Gemma 3 decoder; image tokens attend both ways",
        tensor_parallel=False, images=True,
    ),
    # pooling models (--runner pooling: /v1/embeddings, /classify, /score, /rerank)
    "BertModel": _encoder(
        "bert", "all-MiniLM-L6-v2, bge-*-en-v1.5, e5",
        "embeddings; pooling from the sentence-transformers config", "embed",
    ),
    "RobertaModel": _encoder(
        "bert", "all-roberta-large-v1", "embeddings (BERT's code, RoBERTa's names)", "embed"
    ),
    "XLMRobertaModel": _encoder(
        "bert", "bge-m3, multilingual-e5", "embeddings (BERT's code, RoBERTa's names)", "embed"
    ),
    "BertForSequenceClassification": _encoder(
        "bert_classifier", "ms-marco-MiniLM-L6-v2 (cross-encoder)",
        "scores and classes: [CLS] through the classifier head", "classify",
    ),
    "XLMRobertaForSequenceClassification": _encoder(
        "bert_classifier", "bge-reranker-v2-m3 (cross-encoder)", "as BERT's", "classify"
    ),
    "LlamaForSequenceClassification": _decoder_classifier("LlamaForCausalLM", "Llama reward models"),
    "Qwen2ForSequenceClassification": _decoder_classifier("Qwen2ForCausalLM", "Qwen2 classifiers"),
    "Qwen3ForSequenceClassification": _decoder_classifier("Qwen3ForCausalLM", "Qwen3 classifiers"),
}  # fmt: skip

SUPPORTED_ARCHITECTURES: dict[str, str] = {n: a.family for n, a in ARCHITECTURES.items()}
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")

README_START = (
    "<!-- supported-architectures:start (generated: python tools/architecture_table.py) -->"
)
README_END = "<!-- supported-architectures:end -->"
_QUANT_NAMES = {"awq": "AWQ", "gptq": "GPTQ", "fp8": "fp8", "mxfp4": "MXFP4 (experts)"}


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def _capabilities(a: Architecture) -> list[str]:
    """HF folder, GGUF, quantized checkpoints, LoRA, tensor and pipeline parallel, CPU fused,
    images: the cells."""
    gguf = f"yes (`{a.gguf}`)" if a.gguf else "no"
    quantized = ", ".join(_QUANT_NAMES[q] for q in a.quantized) or "no"
    return ["yes", gguf, quantized, _yes_no(a.lora), _yes_no(a.tensor_parallel),
            _yes_no(a.pipeline_parallel), _yes_no(a.cpu_fused), _yes_no(a.images)]  # fmt: skip


def supported_architectures_table() -> str:
    """The README's table, between its two markers: each architecture, what it is, and what
    it is served with, every cell from its ``Architecture`` entry."""
    head = ["`architectures` in config.json", "Models", "HF folder", "GGUF", "Quantized",
            "LoRA", "Tensor parallel", "Pipeline parallel", "CPU fused", "Images",
            "Notes"]  # fmt: skip
    rows = [README_START, "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, a in ARCHITECTURES.items():
        cells = [f"`{name}`", a.examples, *_capabilities(a), a.notes]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join([*rows, README_END])


def replace_readme_table(readme: str) -> str:
    """``readme`` with its generated block rewritten from the registry."""
    start, end = readme.index(README_START), readme.index(README_END) + len(README_END)
    return readme[:start] + supported_architectures_table() + readme[end:]
