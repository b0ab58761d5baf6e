"""An MoE's AWQ or GPTQ experts, dequantized at load.

AWQ and GPTQ checkpoints of Mixtral, Qwen2-MoE and Qwen3-MoE (AutoAWQ, AutoGPTQ/gptqmodel,
the Qwen team's own GPTQ releases) store every expert projection the way they store a dense
one: ``qweight``, ``qzeros``, ``scales`` and GPTQ's ``g_idx`` under
``...experts.{e}.{w1|w2|w3|gate_proj|up_proj|down_proj}``. The dense projections around them
(attention, a shared expert, the dense layers) load into the 4-bit linear method and run the
4-bit kernel. The experts are held unquantized instead, in the model's dtype, and run the
fused MoE kernel as an unquantized MoE does: the same choice as for gpt-oss's MXFP4 experts
(docs/gpt_oss.md). It costs memory (an expert takes eight times its 4-bit bytes in fp32) and
keeps one MoE kernel; a grouped 4-bit MoE GEMM is the step that would keep them packed.

The stored tensors of one projection arrive in whatever order the checkpoint's files list
them, interleaved with everything else; ``Int4Experts.take`` keeps each projection's parts
until the last one comes, then hands back the dequantized weight under the projection's
``.weight`` name, which the MoE block loads like any other expert weight.
"""

from __future__ import annotations

import re

import torch

from pagedserve.models.config import ModelConfig, ModelLoadError
from pagedserve.models.quantization_int4 import Int4Config, dequantize_int4, parse_int4_config
from pagedserve.models.weights import CheckpointTensor

# One stored part of one expert projection: (the projection's name, which part).
EXPERT_PART = re.compile(r"^(.*\.experts\.\d+\.\w+)\.(qweight|qzeros|scales|g_idx)$")


class Int4Experts:
    """Gathers each expert projection's stored 4-bit tensors and dequantizes it once all are
    in (see the module docstring)."""

    def __init__(self, config: Int4Config) -> None:
        self.config = config
        gptq = config.method == "gptq"
        self.parts = {"qweight", "qzeros", "scales", *(("g_idx",) if gptq else ())}
        self.pending: dict[str, dict[str, torch.Tensor]] = {}

    @classmethod
    def of(cls, config: ModelConfig | None) -> Int4Experts | None:
        """For a model whose checkpoint is AWQ or GPTQ; None otherwise."""
        qc = config.checkpoint_quantization if config is not None else None
        if qc is None or qc.get("quant_method") not in ("awq", "gptq"):
            return None
        return cls(parse_int4_config(qc))

    def take(self, part_name: re.Match, tensor) -> tuple[str, torch.Tensor] | None:
        """The tensor ``part_name`` (an ``EXPERT_PART`` match) names, kept; ``(the projection's
        weight name, its fp32 weight)`` when it was the projection's last missing part."""
        projection, part = part_name.group(1), part_name.group(2)
        parts = self.pending.setdefault(projection, {})
        parts[part] = tensor.read() if isinstance(tensor, CheckpointTensor) else tensor
        if not self.parts <= parts.keys():
            return None
        del self.pending[projection]
        return f"{projection}.weight", dequantize_int4(parts, self.config)

    def check_complete(self) -> None:
        """Every expert projection that began arriving ended: else the checkpoint lacks parts."""
        if self.pending:
            first = next(iter(self.pending))
            missing = sorted(self.parts - self.pending[first].keys())
            raise ModelLoadError(
                f"checkpoint is missing {missing} of {len(self.pending)} expert projections "
                f"({self.config.describe()}), e.g. {first}"
            )
