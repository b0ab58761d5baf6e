"""What pagedserve needs to know about a model, read from its Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagedserve.models.generation_config import (
    GenerationConfigError,
    GenerationDefaults,
    load_generation_defaults,
)
from pagedserve.models.multimodal_config import read_nested_configs
from pagedserve.models.registry import ARCHITECTURES, CONVERTS, RUNNERS, SUPPORTED_ARCHITECTURES

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


# Weight-only methods applied at load time (quantization.py); "int8" and "fp8" (e4m3).
QUANTIZATION_METHODS = ("int8", "fp8")
# Methods a checkpoint's config.json names in ``quantization_config.quant_method`` that
# pagedserve loads as they are stored (quantization_int4.py, quantization_fp8.py).
CHECKPOINT_QUANTIZATION_METHODS = ("awq", "gptq", "fp8")
# Formats in which only an architecture's experts are stored, dequantized by its own loader at
# load: its linear layers are unquantized (gpt-oss's MXFP4 experts, mxfp4.py). Which
# architectures load one is the registry's ``quantized``.
EXPERT_QUANTIZATION_METHODS = ("mxfp4",)


class ModelLoadError(ValueError):
    """The model folder is missing, malformed, or holds an architecture we do not support."""


def check_quantization(method: str | None, hf_config: dict) -> str | None:
    """The quantization to serve with, or an error at load time for what pagedserve would
    otherwise load wrongly: an unknown method, a pre-quantized format it does not read, or a
    ``--quantization`` that disagrees with the checkpoint. A quantized checkpoint's own
    method is used when none is asked for (as vLLM does)."""
    stored = (hf_config.get("quantization_config") or {}).get("quant_method")
    if stored in EXPERT_QUANTIZATION_METHODS:
        owners = [name for name, a in ARCHITECTURES.items() if stored in a.quantized]
        if not set(owners) & set(hf_config.get("architectures") or []):
            raise ModelLoadError(
                f"quantization_config.quant_method = {stored!r} is the format of the experts "
                f"of {', '.join(owners)}; pagedserve does not load it for "
                f"{hf_config.get('architectures')}"
            )
        stored = None  # the experts are dequantized at load; the linear layers are as stored
    known = sorted(set(QUANTIZATION_METHODS + CHECKPOINT_QUANTIZATION_METHODS))
    if method is not None and method not in known:
        raise ModelLoadError(
            f"quantization {method!r} is not supported; one of {known} (int8 and fp8 quantize "
            "an unquantized checkpoint at load time; awq, gptq and fp8 also load checkpoints "
            "stored in those formats)"
        )
    if stored is None:
        if method is not None and method not in QUANTIZATION_METHODS:
            raise ModelLoadError(
                f"--quantization {method} needs a checkpoint stored as {method} (config.json "
                f"with quantization_config.quant_method = {method!r}); this one is not "
                f"quantized. Quantize it at load time with one of {list(QUANTIZATION_METHODS)}."
            )
        return method
    if stored not in CHECKPOINT_QUANTIZATION_METHODS:
        raise ModelLoadError(
            f"this checkpoint is quantized with quantization_config.quant_method = {stored!r}, "
            f"which pagedserve does not load; it loads {list(CHECKPOINT_QUANTIZATION_METHODS)} "
            "checkpoints, or an unquantized one with --quantization int8 or fp8."
        )
    if method is not None and method != stored:
        raise ModelLoadError(
            f"--quantization {method} disagrees with the checkpoint, which is quantized with "
            f"{stored!r} (quantization_config.quant_method in config.json): pass "
            f"--quantization {stored} or leave it out"
        )
    return stored


MODEL_FOLDER_LAYOUT = (
    "config.json; model.safetensors (or model-0000k-of-0000n.safetensors shards with "
    "model.safetensors.index.json, or pytorch_model.bin); tokenizer.json and "
    "tokenizer_config.json; optionally generation_config.json"
)


def _not_a_model_folder(model: str) -> str:
    """What to tell a user whose ``model`` is not a folder we can read: for something shaped
    like a hub id (``org/name``, no such folder here), how to get the folder, since pagedserve
    never downloads."""
    parts = model.split("/")
    looks_like_hub_id = len(parts) == 2 and all(parts) and not Path(model).exists()
    if looks_like_hub_id and not model.startswith((".", "~")):
        return (
            f"{model!r} looks like a Hugging Face hub id, and pagedserve does not download "
            "models: download it first (e.g. `huggingface-cli download "
            f"{model} --local-dir ./{parts[1]}`) and pass the folder. It must hold: "
            f"{MODEL_FOLDER_LAYOUT}"
        )
    return f"{model!r} is not a model folder: no config.json in it (a folder holds: {MODEL_FOLDER_LAYOUT})"


def _read_config_json(model: str) -> dict[str, Any]:
    config_file = Path(model) / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(_not_a_model_folder(model))
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{config_file} is not valid JSON: {e}") from e


def resolve_runner(architecture: str, runner: str, convert: str) -> tuple[str, str | None]:
    """(runner type, pooling task) as vLLM resolves ``--runner`` and ``--convert``: a pooling
    architecture pools with its own task; a generative one generates, or pools once
    converted (``--runner pooling`` alone converts to ``embed``)."""
    if runner not in RUNNERS:
        raise ModelLoadError(f"runner {runner!r}: one of {list(RUNNERS)}")
    if convert not in CONVERTS:
        raise ModelLoadError(f"convert {convert!r}: one of {list(CONVERTS)}")
    own_task = ARCHITECTURES[architecture].task
    if own_task is not None:
        if runner == "generate":
            raise ModelLoadError(
                f"{architecture} is a pooling model ({own_task}): it cannot --runner generate"
            )
        if convert not in ("auto", "none", own_task):
            raise ModelLoadError(
                f"{architecture} is already a pooling model ({own_task}); --convert {convert} "
                "applies to generative models"
            )
        return "pooling", own_task
    if convert in ("embed", "classify"):
        if runner == "generate":
            raise ModelLoadError(f"--convert {convert} makes a pooling model: --runner pooling")
        return "pooling", convert
    if runner == "pooling":
        if convert == "none":
            raise ModelLoadError(
                f"{architecture} is generative: --runner pooling needs --convert embed or classify"
            )
        return "pooling", "embed"
    return "generate", None


def resolve_dtype(
    dtype: str | torch.dtype, config_dtype: str | None, device: torch.device
) -> torch.dtype:
    """``auto`` means the checkpoint's dtype on a GPU and float32 on CPU (CPU half math is slow)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu" or config_dtype is None:
            return torch.float32
        return _DTYPES.get(str(config_dtype), torch.float32)
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return _DTYPES[dtype]


@dataclass
class ModelConfig:
    """The model to serve and how: its folder, dtype, device and maximum sequence length.

    ``hf_config`` is the parsed config.json; ``arch`` the family we map it onto;
    ``generation_defaults`` what generation_config.json adds (``generation_config``: ``auto``,
    ``vllm`` or a folder, as vLLM's ``--generation-config``; generation_config.py).

    ``runner`` and ``convert`` are vLLM's ``--runner`` and ``--convert``: a pooling
    architecture (BertModel, ``*ForSequenceClassification``) runs as a pooling model, a
    generative one generates unless converted (``embed`` or ``classify``: pooling.py,
    adapters.py). ``runner_type`` and ``pooling_task`` are what they resolve to.
    ``batch_invariant``: build the model's layers to compute each row in an order that does
    not depend on the other rows of a step (layers/batch_invariance.py).
    ``architecture`` is the class the family code builds (a decoder classifier's causal-LM
    class); ``hf_architecture`` the checkpoint's own. ``text_config``: what every decoder size
    below reads, ``hf_config`` itself or a multimodal model's nested decoder config (LLaVA's;
    ``image_token_id`` its image placeholder, None for text; multimodal_config.py).
    """

    model: str
    dtype: str | torch.dtype = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    quantization: str | None = None
    generation_config: str = "auto"
    runner: str = "auto"
    convert: str = "auto"
    batch_invariant: bool = False
    hf_config: dict[str, Any] = field(init=False)
    text_config: dict[str, Any] = field(init=False)
    image_token_id: int | None = field(init=False)
    architecture: str = field(init=False)
    hf_architecture: str = field(init=False)
    runner_type: str = field(init=False)
    pooling_task: str | None = field(init=False)
    arch: str = field(init=False)
    torch_dtype: torch.dtype = field(init=False)
    torch_device: torch.device = field(init=False)
    generation_defaults: GenerationDefaults = field(init=False)
    gguf_file: Path | None = field(init=False, default=None)  # a .gguf served as it is

    def __post_init__(self) -> None:
        path = Path(self.model)
        if path.suffix == ".gguf":
            from pagedserve.models.gguf_config import gguf_hf_config, open_gguf

            self.gguf_file = path
            self.hf_config = gguf_hf_config(open_gguf(path), path)
        else:
            self.hf_config = _read_config_json(self.model)
        archs = self.hf_config.get("architectures") or []
        known = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
        if not known:
            raise ModelLoadError(
                f"unsupported architecture {archs}; pagedserve serves {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        self.quantization = check_quantization(self.quantization, self.hf_config)
        self.hf_config, self.text_config, self.image_token_id = read_nested_configs(self.hf_config)
        self.hf_architecture = known[0]
        self.architecture = ARCHITECTURES[known[0]].base or known[0]
        self.arch = SUPPORTED_ARCHITECTURES[self.hf_architecture]
        self.runner_type, self.pooling_task = resolve_runner(
            self.hf_architecture, self.runner, self.convert
        )
        if self.device == "auto":
            self.torch_device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            try:
                self.torch_device = torch.device(self.device)
            except RuntimeError as e:
                raise ModelLoadError(f"device {self.device!r} is not a device: {e}") from e
            if self.torch_device.type == "cuda" and not torch.cuda.is_available():
                raise ModelLoadError(
                    f"device {self.device!r} was asked for, but this machine has no CUDA device "
                    "usable by torch (use --device cpu, or auto)"
                )
        self.torch_dtype = resolve_dtype(
            self.dtype,
            self.hf_config.get("torch_dtype") or self.hf_config.get("dtype"),
            self.torch_device,
        )
        try:
            self.generation_defaults = load_generation_defaults(path, self.generation_config)
        except GenerationConfigError as e:
            raise ModelLoadError(str(e)) from e
        limit = self.max_len_limit
        if self.max_model_len is None:
            self.max_model_len = limit
        elif self.max_model_len > limit:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's limit of {limit} positions"
            )

    @property
    def checkpoint_quantization(self) -> dict[str, Any] | None:
        """config.json's ``quantization_config`` when the checkpoint's linear layers are stored
        quantized (not when only its experts are: EXPERT_QUANTIZATION_METHODS)."""
        qc = self.hf_config.get("quantization_config") or None
        return None if qc and qc.get("quant_method") in EXPERT_QUANTIZATION_METHODS else qc

    @property
    def max_position_embeddings(self) -> int:
        c = self.text_config
        return int(c.get("max_position_embeddings") or c.get("n_positions") or 2048)

    @property
    def max_len_limit(self) -> int:
        """The longest sequence the model takes: its positions, less RoBERTa's padding rows;
        for a sentence-transformers model no more than its ``max_seq_length`` (what it was
        trained to read, sentence_bert_config.json), as vLLM caps it."""
        c, limit = self.hf_config, self.max_position_embeddings
        if "Roberta" in self.hf_architecture:
            limit -= int(c.get("pad_token_id", 1)) + 1
        st_config = Path(self.model) / "sentence_bert_config.json"
        if self.runner_type == "pooling" and st_config.is_file():
            max_seq_length = json.loads(st_config.read_text()).get("max_seq_length")
            limit = min(limit, int(max_seq_length or limit))
        return limit

    @property
    def is_encoder_only(self) -> bool:
        """Bidirectional attention and no KV cache (the BERT family): each prompt is read
        whole in one step, so it is never chunked and never served from the prefix cache."""
        return ARCHITECTURES[self.hf_architecture].encoder

    @property
    def matryoshka_dimensions(self) -> list[int] | None:
        """The output sizes a Matryoshka embedder was trained to be cut to (config.json's
        ``matryoshka_dimensions``; ``is_matryoshka`` alone allows any); None for a model
        whose embeddings must not be cut."""
        c = self.hf_config
        if c.get("matryoshka_dimensions"):
            return [int(d) for d in c["matryoshka_dimensions"]]
        if c.get("is_matryoshka"):
            return list(range(1, self.hidden_size + 1))
        return None

    @property
    def vocab_size(self) -> int:
        return int(self.text_config["vocab_size"])

    def _hf_int(self, name: str, gpt2_name: str) -> int:
        """A size that Llama-style configs and GPT-2's spell differently (``n_layer``, ...)."""
        return int(self.text_config.get(name) or self.text_config[gpt2_name])

    @property
    def num_layers(self) -> int:
        return self._hf_int("num_hidden_layers", "n_layer")

    @property
    def num_attention_heads(self) -> int:
        return self._hf_int("num_attention_heads", "n_head")

    @property
    def num_kv_heads(self) -> int:
        return int(self.text_config.get("num_key_value_heads") or self.num_attention_heads)

    @property
    def hidden_size(self) -> int:
        return self._hf_int("hidden_size", "n_embd")

    @property
    def head_dim(self) -> int:
        return int(self.text_config.get("head_dim") or self.hidden_size // self.num_attention_heads)

    @property
    def layer_types(self) -> list[str]:
        """Each layer's kind, ``sliding_attention`` or ``full_attention``: transformers'
        ``layer_types`` where the config lists them, else the family's rule (Qwen2/3:
        ``use_sliding_window`` from ``max_window_layers`` on; Gemma 2: every other layer;
        Gemma 3: all but every ``sliding_window_pattern``-th; Mistral and Phi-3: every layer
        when ``sliding_window`` is set). Gemma 3's kind also picks its rope base."""
        c, n = self.text_config, self.num_layers
        if c.get("layer_types"):
            sliding = [t == "sliding_attention" for t in c["layer_types"]]
        elif self.architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM"):
            first = int(c.get("max_window_layers") or 0)
            sliding = [bool(c.get("use_sliding_window")) and i >= first for i in range(n)]
        elif self.architecture == "Gemma2ForCausalLM":
            sliding = [i % 2 == 0 for i in range(n)]
        elif self.architecture == "Gemma3ForCausalLM":
            pattern = int(c.get("sliding_window_pattern") or 6)
            sliding = [(i + 1) % pattern != 0 for i in range(n)]
        else:
            sliding = [bool(c.get("sliding_window"))] * n
        return ["sliding_attention" if s else "full_attention" for s in sliding]

    @property
    def sliding_windows(self) -> list[int | None]:
        """Each layer's attention window (positions a token sees, its own included), None for
        a global layer. A window that covers ``max_model_len`` is no window."""
        window = self.text_config.get("sliding_window")
        if not window or window >= (self.max_model_len or self.max_position_embeddings):
            return [None] * self.num_layers
        return [int(window) if t == "sliding_attention" else None for t in self.layer_types]

    @property
    def attention_logits_soft_cap(self) -> float | None:
        """Gemma 2's cap on attention scores (``attn_logit_softcapping``), None elsewhere."""
        cap = self.text_config.get("attn_logit_softcapping")
        return float(cap) if cap else None

    @property
    def has_attention_sinks(self) -> bool:
        """Whether every layer's softmax has a learned logit per head in its denominator
        (gpt-oss's ``sinks``; the kernels' ``sinks`` argument)."""
        return self.architecture == "GptOssForCausalLM"

    @property
    def kv_cache_window(self) -> int | None:
        """The window the block manager may free blocks behind: every layer's, when every
        layer has one (the widest); None when any layer is global (its cache keeps all)."""
        windows = self.sliding_windows
        return None if None in windows else max(windows)

    @property
    def eos_token_ids(self) -> list[int]:
        """config.json's end ids, then generation_config.json's (its list is the one chat
        models fill with their end-of-turn ids)."""
        eos = self.text_config.get("eos_token_id")
        ids = [] if eos is None else (list(eos) if isinstance(eos, list) else [int(eos)])
        return ids + [i for i in self.generation_defaults.eos_token_ids if i not in ids]
