"""Weight-only quantization applied at load time: ``--quantization int8`` or ``fp8``.

These are the "on the fly" methods (vLLM's ``--quantization fp8`` on an unquantized
checkpoint, BitsAndBytes' 8-bit loading): the checkpoint is an ordinary one, each linear
layer loads its weight as usual, and once it is loaded the weight is replaced by 8-bit values
and one fp32 scale per output channel (symmetric: the scale maps the row's largest magnitude
onto 127 for int8, onto 448 for fp8 e4m3). Activations, the KV cache, embeddings, norms and
the LM head stay in the model's dtype, as in vLLM; only the decoder layers' projections
(qkv, o, gate_up, down; GPT-2's c_attn, c_proj, c_fc) are quantized.

An on-the-fly method creates and loads exactly the weights the unquantized method does, so
the loader builds the model unquantized and attaches the method after loading, layer by
layer, through the linear-method seam (``process_weights_after_loading``, then ``apply``).
A checkpoint-format method (AWQ, GPTQ, GGUF blocks) has parameters of its own shape and must
instead be handed to the layers when they are built (their ``linear_method=`` argument).

Under tensor parallelism each rank quantizes its own shard: column-parallel shards hold
whole output rows, so their scales are the unsharded ones; a row-parallel shard's scale is
taken over that rank's slice of the row (a finer grouping, never a coarser one).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels.dispatch import kernel_path
from pagedserve.kernels.weight_only_linear import (
    WeightFormat,
    quantize_per_channel,
    weight_only_linear,
)
from pagedserve.models.config import QUANTIZATION_METHODS, ModelConfig, ModelLoadError
from pagedserve.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedserve.models.layers.linear_method import LinearMethodFactory, UnquantizedLinearMethod
from pagedserve.models.quantization_fp8 import fp8_method_factory
from pagedserve.models.quantization_int4 import Int4LinearMethod, int4_method_factory
from pagedserve.models.registry import ARCHITECTURES


class WeightOnly8BitLinearMethod(UnquantizedLinearMethod):
    """Created and loaded as unquantized; after loading, ``layer.weight`` becomes
    ``layer.qweight`` (int8 or float8_e4m3fn, ``[out, in]``) and ``layer.weight_scale`` (fp32,
    ``[out]``), and ``apply`` runs the weight-only kernel on them."""

    def __init__(self, fmt: WeightFormat) -> None:
        self.fmt = fmt

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        qweight, scale = quantize_per_channel(layer.weight.data, self.fmt)
        del layer.weight  # the full-precision weight is freed here
        layer.qweight = nn.Parameter(qweight, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return weight_only_linear(x, layer.qweight, layer.weight_scale, bias)


def quantize_linear_layers(model: nn.Module, method: WeightFormat) -> int:
    """Attach ``method`` to every decoder-layer projection of a loaded model and quantize its
    weight; returns how many layers were quantized (the LM head is an embedding-like layer,
    not one of these, and stays as it is)."""
    count = 0
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear | RowParallelLinear):
            module.linear_method = WeightOnly8BitLinearMethod(method)
            module.linear_method.process_weights_after_loading(module)
            count += 1
    if count == 0:
        raise ModelLoadError(f"--quantization {method}: the model has no linear layers to quantize")
    return count


# What a pre-quantized checkpoint's quant_method is built with. Which architectures load
# which formats is the registry's ``quantized`` (architectures whose loaders split or transpose
# fused checkpoint tensors, GPT-2's Conv1D c_attn and Phi-3's fused qkv, would cut packed
# tensors wrongly, so declare none).
CHECKPOINT_METHOD_FACTORIES = {
    "awq": int4_method_factory,
    "gptq": int4_method_factory,
    "fp8": fp8_method_factory,
}


def checkpoint_linear_methods(config: ModelConfig) -> LinearMethodFactory | None:
    """The linear method to build the model's projections with when its checkpoint is stored
    quantized (AWQ, GPTQ, fp8), else None; a ModelLoadError for what cannot be served."""
    qc = config.checkpoint_quantization
    if qc is None:
        return None
    method = qc["quant_method"]
    if method not in ARCHITECTURES[config.hf_architecture].quantized:
        served = [name for name, a in ARCHITECTURES.items() if method in a.quantized]
        raise ModelLoadError(
            f"{config.model}: {method} checkpoints of {config.hf_architecture} are not "
            f"supported (pre-quantized {method} checkpoints load for {', '.join(served)})"
        )
    try:
        return CHECKPOINT_METHOD_FACTORIES[method](qc)
    except ModelLoadError as e:
        raise ModelLoadError(f"{config.model}/config.json: {e}") from e


def process_weights_after_loading(model: nn.Module) -> None:
    """Let every linear layer's method repack what it loaded (checkpoint-format methods)."""
    methods = set()
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear | RowParallelLinear):
            module.linear_method.process_weights_after_loading(module)
            methods.add(type(module.linear_method))
    cpu = all(p.device.type == "cpu" for p in model.parameters())
    if Int4LinearMethod in methods and cpu and kernel_path(torch.empty(0), True) == "numba":
        from pagedserve.kernels.cpu.gguf_linear import warm_up

        warm_up()  # numba compiles the GEMM of the 4-bit rows now, not in the first request


__all__ = [
    "QUANTIZATION_METHODS",
    "WeightOnly8BitLinearMethod",
    "checkpoint_linear_methods",
    "process_weights_after_loading",
    "quantize_linear_layers",
]
