"""A GGUF file's metadata as the Hugging Face config.json that pagedserve reads everywhere else.

``pagedserve serve model.gguf`` reads the file with the ``gguf`` package and nothing is
converted to disk: the architecture, sizes, rope settings, norm epsilon and special token ids
come from the ``general.*``, ``{arch}.*`` and ``tokenizer.ggml.*`` keys, in the names
transformers' own GGUF loader gives them, so the model classes take a GGUF's config as they
take a folder's. Which ``general.architecture`` values are served is the registry's ``gguf``
declarations; what each one's keys mean is gguf_arch_configs.py, written from what llama.cpp's
converter writes and what llama.cpp reads back. What pagedserve cannot serve faithfully is
refused here, at load, with the file named: an architecture no registry entry declares, a
tensor type without a kernel, a rope scaling we do not implement, a file that is truncated or
not GGUF at all.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import numpy as np

from pagedserve.models.config import ModelLoadError
from pagedserve.models.registry import ARCHITECTURES

# The tensor types pagedserve holds and multiplies in their blocks (pagedserve.kernels.gguf_*).
# Every type a common llama.cpp file holds: its Q4_K_M and Q5_K_M fall back to Q5_0 / Q5_1 / Q8_0
# for rows whose width is not a multiple of 256.
SUPPORTED_TENSOR_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS",
)  # fmt: skip
# Types no kernel multiplies, decoded into the model's dtype at load, served where the model
# holds plain tensors anyway: a MoE layer's stacked experts (``*_exps``). MXFP4 is what
# llama.cpp's gpt-oss files keep their experts in (mxfp4.py).
EXPERT_ONLY_TENSOR_TYPES = ("MXFP4",)


def open_gguf(path: str | Path):
    """A ``gguf.GGUFReader`` over the file (memory-mapped: nothing is read until a tensor is).

    The reader checks the magic and walks every header and tensor record, so a file cut short
    or written wrongly fails here; its numpy errors are turned into one that says so. Walking
    a real vocabulary's records takes seconds, and the config and the loader both need them:
    the last two files read are kept (keyed by path, size and modification time)."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"the GGUF file {str(path)!r} does not exist")
    stat = path.stat()
    return _read_gguf(path, stat.st_size, stat.st_mtime_ns)


def forget_gguf_readers() -> None:
    """Drop the kept readers (once a model is loaded): a real vocabulary's records are ~150 MB
    of Python objects, and the map they hold keeps every page read in the process's memory."""
    _read_gguf.cache_clear()


@functools.lru_cache(maxsize=2)
def _read_gguf(path: Path, size: int, mtime_ns: int):
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # numpy's reshape / index errors on a short file
        raise ModelLoadError(
            f"{path} is not a readable GGUF file (truncated or corrupt?): {type(e).__name__}: {e}"
        ) from e
    _check_tensor_bytes(reader, path)
    return reader


def _check_tensor_bytes(reader, path: Path) -> None:
    """Every tensor's bytes lie inside the file and are of a type we can serve."""
    size = path.stat().st_size
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind in EXPERT_ONLY_TENSOR_TYPES and "_exps." not in t.name:
            raise ModelLoadError(
                f"{path}: tensor {t.name!r} is of type {kind}, which pagedserve does not serve "
                "outside a MoE layer's stacked experts (decoded at load there); a dense "
                f"{kind} layer would need a {kind} GEMM kernel"
            )
        if kind not in SUPPORTED_TENSOR_TYPES + EXPERT_ONLY_TENSOR_TYPES:
            raise ModelLoadError(
                f"{path}: tensor {t.name!r} is of type {kind}, which pagedserve does not serve; "
                f"supported GGUF types: {', '.join(SUPPORTED_TENSOR_TYPES)} (and "
                f"{', '.join(EXPERT_ONLY_TENSOR_TYPES)} for experts)"
            )
        if t.data_offset + t.n_bytes > size:
            raise ModelLoadError(
                f"{path} is truncated: tensor {t.name!r} ends at byte {t.data_offset + t.n_bytes} "
                f"of a {size}-byte file"
            )


def field(reader, key: str, default: Any = None) -> Any:
    """A metadata value (a number, a string, a list), or ``default`` when the key is absent."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


class GGUFMetadata:
    """One file's metadata, its architecture's keys read without their ``{arch}.`` prefix, and
    its tensors' shapes in PyTorch's order (GGUF lists the fastest dimension first)."""

    def __init__(self, reader, path: str | Path) -> None:
        self.reader, self.path = reader, Path(path)
        self.arch = field(reader, "general.architecture")
        self.shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors}

    def get(self, key: str, default: Any = None) -> Any:
        return field(self.reader, f"{self.arch}.{key}", default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"{self.path}: the GGUF key {self.arch}.{key} is missing")
        return value

    def has(self, tensor: str) -> bool:
        return tensor in self.shapes

    def vector(self, tensor: str) -> np.ndarray:
        """A small float tensor's values (rope factors)."""
        t = next(t for t in self.reader.tensors if t.name == tensor)
        return np.asarray(t.data, np.float32).reshape(-1)


def served_gguf_architectures() -> list[str]:
    """The ``general.architecture`` values some registry entry declares."""
    return sorted({a.gguf for a in ARCHITECTURES.values() if a.gguf})


def gguf_hf_config(reader, path: Path) -> dict[str, Any]:
    """config.json's fields for the model in ``reader``: its architecture's mapping
    (gguf_arch_configs.py), under a transformers class whose registry entry declares it."""
    from pagedserve.models.gguf_arch_configs import ARCH_CONFIGS

    meta = GGUFMetadata(reader, path)
    if meta.arch not in served_gguf_architectures():
        raise ModelLoadError(
            f"{path}: GGUF architecture {meta.arch!r} is not supported; pagedserve serves GGUF "
            f"files of {served_gguf_architectures()}"
        )
    config = ARCH_CONFIGS[meta.arch](meta)
    class_name = config["architectures"][0]
    if ARCHITECTURES[class_name].gguf != meta.arch:
        raise ModelLoadError(f"{path}: a {meta.arch} file of {class_name} is not served")
    config["torch_dtype"] = "bfloat16"  # what "auto" picks on a GPU (on a CPU: float32)
    for name in ("bos_token_id", "eos_token_id"):
        value = field(reader, f"tokenizer.ggml.{name}")
        if value is not None:
            config[name] = int(value)
    return config


def decoder_config(meta: GGUFMetadata, class_name: str, model_type: str) -> dict[str, Any]:
    """The keys every RMSNorm decoder's file has (all but GPT-2's), and its rope."""
    heads = int(meta.require("attention.head_count"))
    hidden = int(meta.require("embedding_length"))
    config: dict[str, Any] = {
        "architectures": [class_name],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": int(meta.require("feed_forward_length")),
        "num_hidden_layers": int(meta.require("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("attention.head_count_kv", heads)),
        "head_dim": int(meta.get("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(meta.get("context_length", 2048)),
        "rms_norm_eps": float(meta.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": vocab_size(meta),
        "tie_word_embeddings": not meta.has("output.weight"),
        "hidden_act": "silu",
    }
    config.update(rope(meta, config["head_dim"]))
    return config


def vocab_size(meta: GGUFMetadata) -> int:
    """The embedding's rows: llama.cpp's vocabulary is the token list, and the embedding must
    have a row for each (Gemma 3's converter trims the padding rows config.json counts)."""
    return meta.shapes["token_embd.weight"][0]


def rope(meta: GGUFMetadata, head_dim: int) -> dict[str, Any]:
    """rope_theta, and rope_scaling from ``rope.scaling.*`` (linear, YaRN) or Llama 3's
    ``rope_freqs`` tensor."""
    theta = float(meta.get("rope.freq_base", 10000.0))
    out: dict[str, Any] = {"rope_theta": theta}
    kind, factor = meta.get("rope.scaling.type"), meta.get("rope.scaling.factor")
    if kind == "linear" and factor:
        out["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    elif kind == "yarn":
        out["rope_scaling"] = _yarn(meta)
    elif kind not in (None, "none", "linear"):
        raise ModelLoadError(f"{meta.path}: rope scaling {kind!r} is not supported (linear is)")
    if meta.has("rope_freqs.weight"):
        out["rope_scaling"] = _llama3_scaling(
            meta.vector("rope_freqs.weight"), theta, head_dim, meta
        )
    return out


def _yarn(meta: GGUFMetadata) -> dict[str, Any]:
    scaling = {
        "rope_type": "yarn",
        "factor": float(meta.require("rope.scaling.factor")),
        "original_max_position_embeddings": int(
            meta.require("rope.scaling.original_context_length")
        ),
        "beta_fast": float(meta.get("rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": float(meta.get("rope.scaling.yarn_beta_slow", 1.0)),
    }
    if meta.get("rope.scaling.yarn_attn_factor") is not None:
        scaling["attention_factor"] = float(meta.get("rope.scaling.yarn_attn_factor"))
    return scaling


def _llama3_scaling(freqs: np.ndarray, theta: float, dim: int, meta: GGUFMetadata) -> dict:
    """Llama 3.1+ GGUFs store the rope scaling as its per-frequency divisors. We recognise
    the parameters Meta ships (low 1, high 4, original length 8192, factor 8 or 32) by
    recomputing their divisors; anything else is refused rather than served wrongly."""
    inv_freq = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    wavelen = 2 * math.pi / inv_freq
    for factor in (8.0, 16.0, 32.0):
        low, high, old = 1.0, 4.0, 8192
        smooth = (old / wavelen - low) / (high - low)
        divisor = np.where(
            wavelen < old / high,
            1.0,
            np.where(wavelen > old / low, factor, 1 / ((1 - smooth) / factor + smooth)),
        )
        if freqs.shape == divisor.shape and np.allclose(freqs, divisor, rtol=1e-3):
            return {
                "rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                "high_freq_factor": high, "original_max_position_embeddings": old,
            }  # fmt: skip
    raise ModelLoadError(
        f"{meta.path}: its rope_freqs tensor matches no Llama 3 rope scaling we know"
    )
