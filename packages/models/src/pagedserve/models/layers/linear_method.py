"""How a linear layer holds, loads and applies its weights: one linear method per layer.

The parallel linear layers (linear.py) decide *which* part of a checkpoint tensor this rank
holds and where it goes; the layer's linear method decides *how* it is held. The unquantized
method holds one ``[out, in]`` weight in the model's dtype and applies ``F.linear`` (through
``pagedserve.kernels.linear``, which has a faster CPU path for decode batches). A quantized
method (AWQ, GPTQ, FP8, INT8, GGUF) or a LoRA wrapper implements the same three steps with its
own parameters (packed integers, scales, zero points, adapters): ``create_weights`` registers
them on the layer, ``load_weight`` maps a logical shard onto each of them, ``apply`` computes
``x W^T (+ b)`` from them. The bias is never quantized: the layer keeps and loads it itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.kernels.linear import linear
from pagedserve.models.config import ModelLoadError
from pagedserve.models.layers.batch_invariance import building_batch_invariant
from pagedserve.models.weights import CheckpointTensor, copy_shard

Loaded = torch.Tensor | CheckpointTensor
WeightLoader = Callable[..., None]


@dataclass(frozen=True)
class WeightShard:
    """This rank's part of a checkpoint tensor, in the logical ``[out, in]`` weight's features.

    Features ``[start, start + size)`` along ``dim`` (0: output, 1: input) of a checkpoint
    tensor that must be whole along ``dim`` (``total`` features) go to features
    ``[param_offset, param_offset + size)`` of the parameter (a fused layer stacks its parts
    along the output features).
    """

    dim: int
    start: int
    size: int
    total: int
    what: str
    param_offset: int = 0


def loadable_param(
    shape: tuple[int, ...], dtype: torch.dtype, loader: WeightLoader
) -> nn.Parameter:
    """An inference-only parameter that knows how to copy its shard from a checkpoint tensor."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def load_shard(param: nn.Parameter, loaded: Loaded, shard: WeightShard) -> None:
    """Copy ``shard`` of ``loaded`` into ``param``, laid out as the logical weight (or bias)."""
    if loaded.dim() <= shard.dim or loaded.shape[shard.dim] != shard.total:
        raise ModelLoadError(
            f"checkpoint tensor for the {shard.what} has shape {tuple(loaded.shape)}; expected "
            f"{shard.total} along dimension {shard.dim}"
        )
    copy_shard(
        param.data.narrow(shard.dim, shard.param_offset, shard.size),
        loaded.narrow(shard.dim, shard.start, shard.size),
        shard.what,
    )


class LinearMethodBase(ABC):
    """The three things a linear layer delegates to its method. ``batch_invariant``: whether
    its product keeps each row's bits whatever the other rows (the unquantized method's, when
    the model is built so; layers/batch_invariance.py)."""

    batch_invariant: bool = False

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_rank: int,
        output_sizes_per_rank: list[int],
        dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        """Register the layer's weight parameters, each carrying ``weight_loader`` (the layer's,
        which works out the shard and calls ``load_weight``). ``output_sizes_per_rank`` has one
        entry per fused part (q, k, v; gate, up), so a method can keep per-part scales."""

    @abstractmethod
    def load_weight(self, param: nn.Parameter, loaded: Loaded, shard: WeightShard) -> None:
        """Copy ``shard`` of the checkpoint tensor ``loaded`` into ``param``."""

    @abstractmethod
    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x W^T + bias`` for this rank's weights."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once every shard is in: repack or quantize what was loaded. Most methods
        hold the checkpoint's layout as it is and have nothing to do."""
        return None


class UnquantizedLinearMethod(LinearMethodBase):
    """One ``[out, in]`` weight in the model's dtype, ``layer.weight``; its GEMM batch
    invariant when the model is built so (layers/batch_invariance.py)."""

    def __init__(self) -> None:
        self.batch_invariant = building_batch_invariant()

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_rank: int,
        output_sizes_per_rank: list[int],
        dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        shape = (sum(output_sizes_per_rank), input_size_per_rank)
        layer.weight = loadable_param(shape, dtype, weight_loader)

    def load_weight(self, param: nn.Parameter, loaded: Loaded, shard: WeightShard) -> None:
        load_shard(param, loaded, shard)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return linear(x, layer.weight, bias, self.batch_invariant)


LinearMethodFactory = Callable[[], LinearMethodBase]
# The method the linear layers built inside ``linear_methods_for(...)`` get, like the default
# device of ``with torch.device(...)``: set while a model is constructed, never during a step.
_BUILD_LINEAR_METHOD: ContextVar[LinearMethodFactory | None] = ContextVar(
    "pagedserve_build_linear_method", default=None
)


@contextmanager
def linear_methods_for(factory: LinearMethodFactory | None) -> Iterator[None]:
    """Build every linear layer constructed inside with ``factory()`` as its method (a
    checkpoint-format method, AWQ or GPTQ, whose parameters have their own shapes), so the
    model classes need not thread a quantization config through every constructor."""
    token = _BUILD_LINEAR_METHOD.set(factory)
    try:
        yield
    finally:
        _BUILD_LINEAR_METHOD.reset(token)


def new_linear_method() -> LinearMethodBase:
    """The method for a linear layer built now: the build's factory's, else unquantized."""
    factory = _BUILD_LINEAR_METHOD.get()
    return factory() if factory is not None else UnquantizedLinearMethod()
