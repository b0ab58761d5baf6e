"""A GGUF file's metadata as the Hugging Face config.json that pagedserve reads everywhere else.

``pagedserve serve model.gguf`` reads the file with the ``gguf`` package and nothing is
converted to disk: the architecture, sizes, rope settings, norm epsilon and special token ids
come from the ``general.*``, ``{arch}.*`` and ``tokenizer.ggml.*`` keys, in the names
transformers' own GGUF loader gives them, so the model classes take a GGUF's config as they
take a folder's. What pagedserve cannot serve faithfully is refused here, at load, with the
file named: an architecture outside the Llama family, a tensor type without a kernel, a
rope scaling we do not implement, a file that is truncated or not GGUF at all.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import numpy as np

from pagedserve.models.config import ModelLoadError

# GGUF's general.architecture -> (transformers' class, whether llama.cpp permuted Q and K)
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}
# The tensor types pagedserve holds and multiplies in their blocks (pagedserve.kernels.gguf_*).
# Every type a common llama.cpp file holds: its Q4_K_M and Q5_K_M fall back to Q5_0 / Q5_1 / Q8_0
# for rows whose width is not a multiple of 256.
SUPPORTED_TENSOR_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS",
)  # fmt: skip


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
        if t.tensor_type.name not in SUPPORTED_TENSOR_TYPES:
            raise ModelLoadError(
                f"{path}: tensor {t.name!r} is of type {t.tensor_type.name}, which pagedserve "
                f"does not serve; supported GGUF types: {', '.join(SUPPORTED_TENSOR_TYPES)}"
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


def gguf_architecture(reader, path: Path) -> tuple[str, str, bool]:
    """(GGUF arch name, transformers class, Q/K permuted?) or an error naming what we serve."""
    arch = field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported; pagedserve serves GGUF "
            f"files of {sorted(GGUF_ARCHITECTURES)}"
        )
    return (arch, *GGUF_ARCHITECTURES[arch])


def gguf_hf_config(reader, path: Path) -> dict[str, Any]:
    """config.json's fields for the model in ``reader`` (transformers' GGUF mapping)."""
    arch, class_name, _ = gguf_architecture(reader, path)
    names = {t.name for t in reader.tensors}

    def key(name: str, default: Any = None) -> Any:
        return field(reader, f"{arch}.{name}", default)

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    tokens = field(reader, "tokenizer.ggml.tokens") or []
    config: dict[str, Any] = {
        "architectures": [class_name],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(key("context_length", 2048)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": int(key("vocab_size", len(tokens))),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",  # what "auto" picks on a GPU (on a CPU: float32)
        "attention_bias": arch == "llama" and "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
    }
    for name, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id")):
        value = field(reader, f"tokenizer.ggml.{gguf_key}")
        if value is not None:
            config[name] = int(value)
    config.update(_rope(reader, arch, path, config))
    return config


def _rope(reader, arch: str, path: Path, config: dict[str, Any]) -> dict[str, Any]:
    """rope_theta, and rope_scaling from ``rope.scaling.*`` or Llama 3's ``rope_freqs``."""
    theta = float(field(reader, f"{arch}.rope.freq_base", 10000.0))
    out: dict[str, Any] = {"rope_theta": theta}
    kind = field(reader, f"{arch}.rope.scaling.type")
    factor = field(reader, f"{arch}.rope.scaling.factor")
    if kind == "linear" and factor:
        out["rope_scaling"] = {"rope_type": "linear", "factor": float(factor)}
    elif kind not in (None, "none", "linear"):
        raise ModelLoadError(f"{path}: rope scaling {kind!r} is not supported (linear is)")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        out["rope_scaling"] = _llama3_scaling(
            np.asarray(freqs.data, np.float32), theta, config, path
        )
    return out


def _llama3_scaling(freqs: np.ndarray, theta: float, config: dict[str, Any], path: Path) -> dict:
    """Llama 3.1+ GGUFs store the rope scaling as its per-frequency divisors. We recognise
    the parameters Meta ships (low 1, high 4, original length 8192, factor 8 or 32) by
    recomputing their divisors; anything else is refused rather than served wrongly."""
    dim = config["head_dim"]
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
    raise ModelLoadError(f"{path}: its rope_freqs tensor matches no Llama 3 rope scaling we know")
