"""The batch-invariant mode at the engine's edge: where it is asked for, and what it refuses.

``--batch-invariant`` (``EngineArgs.batch_invariant``; vLLM's ``VLLM_BATCH_INVARIANT=1`` turns
it on too) builds the model's layers to compute every row in an order that does not depend on
the other rows of a step (models/layers/batch_invariance.py, docs/batch_invariance.md). The
promise holds for the kernel paths that keep it; a configuration that would take another path
is refused here, before anything loads, with what to change.
"""

from __future__ import annotations

import os

import torch

from pagedserve.kernels.dispatch import kernel_path
from pagedserve.models import ModelConfig

ENV = "VLLM_BATCH_INVARIANT"


def batch_invariant_from_env() -> bool:
    """``VLLM_BATCH_INVARIANT`` as vLLM reads it: 1 on, 0 or unset off."""
    raw = os.environ.get(ENV, "").strip()
    if raw in ("", "0"):
        return False
    if raw == "1":
        return True
    raise ValueError(f"{ENV}={raw!r}: expected 1 (batch-invariant mode on) or 0 (off)")


def check_batch_invariant(config: ModelConfig) -> None:
    """Refuse what the mode cannot keep batch invariant (each refusal names the field)."""
    device = config.torch_device
    path = kernel_path(torch.empty(0, device=device), has_numba=True)
    refusals = {
        "quantization": config.quantization is not None or config.gguf_file is not None,
        "kv_lora_rank": path == "triton" and bool(config.hf_config.get("kv_lora_rank")),
        "dtype": device.type == "cpu" and path == "numba" and config.torch_dtype != torch.float32,
        "PAGEDSERVE_KERNELS": path == "ref",
    }
    why = {
        "quantization": "the quantized and GGUF GEMMs pick their tiles by the batch; serve an "
        "unquantized checkpoint",
        "kv_lora_rank": "multi-head latent attention runs batch invariantly on a CPU (numba); on "
        "a GPU the batch-invariant attention's tile cannot hold a latent row (DeepSeek's 576 "
        "values: compiled for sm90 it spills 1,000 bytes in bf16 and needs 198 KB of shared "
        "memory in fp32); serve the model without --batch-invariant",
        "dtype": "on a CPU the batch-invariant GEMM is the fp32 numba kernel; use --dtype "
        "float32 (the CPU's default)",
        "PAGEDSERVE_KERNELS": "the reference kernels batch their matmuls (and numba is needed on "
        "a CPU); unset PAGEDSERVE_KERNELS",
    }
    for field, refused in refusals.items():
        if refused:
            raise ValueError(f"batch_invariant: {field}: {why[field]}")
