"""What pagedserve needs to know about a model, read from its Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

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

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "GPT2LMHeadModel": "gpt2",
}


class ModelLoadError(ValueError):
    """The model folder is missing, malformed, or holds an architecture we do not support."""


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

    ``hf_config`` is the parsed config.json; ``arch`` the family we map it onto.
    """

    model: str
    dtype: str | torch.dtype = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    hf_config: dict[str, Any] = field(init=False)
    architecture: str = field(init=False)
    arch: str = field(init=False)
    torch_dtype: torch.dtype = field(init=False)
    torch_device: torch.device = field(init=False)

    def __post_init__(self) -> None:
        path = Path(self.model)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ModelLoadError(f"{self.model!r} is not a model folder: no config.json in it")
        try:
            self.hf_config = json.loads(config_file.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{config_file} is not valid JSON: {e}") from e
        archs = self.hf_config.get("architectures") or []
        known = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
        if not known:
            raise ModelLoadError(
                f"unsupported architecture {archs}; pagedserve serves {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        self.architecture = known[0]
        self.arch = SUPPORTED_ARCHITECTURES[self.architecture]
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
        limit = self.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = limit
        elif self.max_model_len > limit:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's limit of {limit} positions"
            )

    @property
    def max_position_embeddings(self) -> int:
        c = self.hf_config
        return int(c.get("max_position_embeddings") or c.get("n_positions") or 2048)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    def _hf_int(self, name: str, gpt2_name: str) -> int:
        """A size that Llama-style configs and GPT-2's spell differently (``n_layer``, ...)."""
        return int(self.hf_config.get(name) or self.hf_config[gpt2_name])

    @property
    def num_layers(self) -> int:
        return self._hf_int("num_hidden_layers", "n_layer")

    @property
    def num_attention_heads(self) -> int:
        return self._hf_int("num_attention_heads", "n_head")

    @property
    def num_kv_heads(self) -> int:
        return int(self.hf_config.get("num_key_value_heads") or self.num_attention_heads)

    @property
    def hidden_size(self) -> int:
        return self._hf_int("hidden_size", "n_embd")

    @property
    def head_dim(self) -> int:
        return int(self.hf_config.get("head_dim") or self.hidden_size // self.num_attention_heads)

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.hf_config.get("eos_token_id")
        if eos is None:
            return []
        return list(eos) if isinstance(eos, list) else [int(eos)]
