"""Pre-quantized fp8 checkpoints (``quantization_config.quant_method = "fp8"``), as AutoFP8,
vLLM and llm-compressor's fp8 export write them.

Each decoder-layer projection stores ``weight`` in float8 e4m3 (``F8_E4M3``, ``[out, in]``)
and ``weight_scale`` in fp32: one scalar per tensor (AutoFP8, vLLM's fp8 format) or one per
output channel (``[out]`` or ``[out, 1]``). ``W = weight * weight_scale``. That is the on-the-fly
``--quantization fp8`` layout with per-channel scales, so the same weight-only kernel serves
it: a fused layer's per-tensor scales (one for each of q, k, v) become that part's channels.

``activation_scheme = "static"`` checkpoints also store an ``input_scale`` per layer, for
fp8 activations on GPUs with fp8 tensor cores. pagedserve's kernel keeps activations in the
model's dtype (weight-only, as vLLM does on GPUs without fp8 compute), so the input scale is
read, checked and not applied; block-wise scales (``weight_block_size``) are refused.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from pagedserve.kernels.weight_only_linear import weight_only_linear
from pagedserve.models.config import ModelLoadError
from pagedserve.models.layers.linear_method import (
    LinearMethodBase,
    LinearMethodFactory,
    Loaded,
    WeightLoader,
    WeightShard,
    load_shard,
    loadable_param,
)
from pagedserve.models.weights import materialize

logger = logging.getLogger(__name__)


class Fp8CheckpointLinearMethod(LinearMethodBase):
    """``weight`` (e4m3), ``weight_scale`` (fp32 per output channel after loading), and
    ``input_scale`` when the checkpoint stores one (checked, then dropped)."""

    def __init__(self, static_inputs: bool) -> None:
        self.static_inputs = static_inputs

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_rank: int,
        output_sizes_per_rank: list[int],
        dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        n = sum(output_sizes_per_rank)
        layer.weight = loadable_param((n, input_size_per_rank), torch.float8_e4m3fn, weight_loader)
        layer.weight_scale = loadable_param((n,), torch.float32, weight_loader)
        if self.static_inputs:
            parts = len(output_sizes_per_rank)
            layer.input_scale = loadable_param((parts,), torch.float32, weight_loader)
            layer.input_scale.is_input_scale = True

    def load_weight(self, param: nn.Parameter, loaded: Loaded, shard: WeightShard) -> None:
        if param.dtype == torch.float8_e4m3fn:
            if loaded.dtype != torch.float8_e4m3fn:
                raise ModelLoadError(
                    f"{shard.what} weight is {loaded.dtype}, but quantization_config says fp8: "
                    "expected float8 e4m3 (F8_E4M3) weights"
                )
            load_shard(param, loaded, shard)
        elif getattr(param, "is_input_scale", False):
            self._load_input_scale(param, loaded, shard)
        else:
            self._load_weight_scale(param, loaded, shard)

    def _load_weight_scale(self, param: nn.Parameter, loaded: Loaded, shard: WeightShard) -> None:
        """A scalar fills this part's channels; a per-channel scale is sharded like rows."""
        scale = materialize(loaded).float()  # a scalar, or one per channel: small
        if scale.dim() == 2 and scale.shape[1] == 1:
            scale = scale[:, 0]
        rows = param.data
        if shard.dim == 0:
            rows = rows.narrow(0, shard.param_offset, shard.size)
        if scale.numel() == 1:
            rows.fill_(float(scale.reshape(())))
        elif shard.dim == 0:
            load_shard(param, scale, shard)
        else:  # a row-parallel shard holds every output channel
            load_shard(param, scale, WeightShard(0, 0, rows.shape[0], rows.shape[0], shard.what))

    def _load_input_scale(self, param: nn.Parameter, loaded: Loaded, shard: WeightShard) -> None:
        value = materialize(loaded).float().reshape(-1)
        if value.numel() != 1 or not bool(value[0] > 0) or not bool(value.isfinite().all()):
            raise ModelLoadError(
                f"{shard.what} input_scale must be one positive number, got {value.tolist()[:4]}"
            )
        param.data.fill_(float(value[0]))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        qweight = layer.weight.data
        del layer.weight
        layer.qweight = nn.Parameter(qweight, requires_grad=False)
        if self.static_inputs:
            del layer.input_scale  # weight-only: activations stay in the model's dtype

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return weight_only_linear(x, layer.qweight, layer.weight_scale, bias)


def fp8_method_factory(qc: dict[str, Any]) -> LinearMethodFactory:
    """Parse an fp8 ``quantization_config``: dynamic or static activations (both served
    weight-only), no block-wise scales, no projections left unquantized."""
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    if scheme not in ("dynamic", "static"):
        raise ModelLoadError(
            f"quantization_config.activation_scheme = {scheme!r}: expected dynamic or static"
        )
    if qc.get("weight_block_size"):
        raise ModelLoadError(
            f"quantization_config.weight_block_size = {qc['weight_block_size']}: block-wise "
            "fp8 scales are not supported (per-tensor and per-channel are)"
        )
    ignored = [m for m in qc.get("ignored_layers") or [] if m != "lm_head"]
    if ignored:
        raise ModelLoadError(
            f"quantization_config.ignored_layers = {ignored[:4]}: pagedserve loads fp8 "
            "checkpoints whose every decoder-layer projection is fp8"
        )
    static = scheme == "static"
    if static:
        logger.warning(
            "fp8 checkpoint with static activation scales: served weight-only (activations "
            "stay in the model's dtype; input_scale is checked and not applied)"
        )

    def factory() -> Fp8CheckpointLinearMethod:
        return Fp8CheckpointLinearMethod(static)

    return factory
