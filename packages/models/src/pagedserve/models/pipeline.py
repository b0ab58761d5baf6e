"""Pipeline parallelism, the model's side: which decoder layers a stage holds, what it hands on.

With ``pipeline_parallel_size`` P the decoder layers are cut into P contiguous stages. Stage 0
embeds the tokens and runs the first layers; each later stage takes the previous one's hidden
states and residual stream (``IntermediateTensors``) and runs its own layers; the last stage
also applies the final norm and the LM head. A stage builds only what it runs: the other
layers are ``MissingLayer`` placeholders (no parameters, so no memory), which keep every
layer at its checkpoint index (``model.layers.17`` is layer 17 on whichever stage holds it),
and the loader never reads another stage's tensors (``stage_weights``). Each stage's KV cache
holds its own layers only.

The split is even unless said otherwise (``--pp-layer-partition 10,14``, or vLLM's
``VLLM_PP_LAYER_PARTITION``); an uneven default gives its extra layers to the stages before the
last, which also carries the LM head.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"


@dataclass(frozen=True)
class PipelineStage:
    """This rank's stage: its index of ``count``, and its layers ``[start_layer, end_layer)``
    (``end_layer`` None: to the last layer, as with one stage)."""

    index: int = 0
    count: int = 1
    start_layer: int = 0
    end_layer: int | None = None

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    def layer_range(self, num_layers: int) -> range:
        end = num_layers if self.end_layer is None else self.end_layer
        return range(self.start_layer, end)


@dataclass
class IntermediateTensors:
    """What one stage hands the next: the hidden states after its last layer and the residual
    stream beside them (a pre-norm decoder adds the two at the next layer's norm)."""

    hidden: torch.Tensor
    residual: torch.Tensor


class MissingLayer(nn.Module):
    """Stands in for a module another stage holds: no parameters; calling it is a bug."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module belongs to another pipeline stage")


def partition_layers(num_layers: int, num_stages: int, spec: str | None = None) -> list[range]:
    """Each stage's layers. ``spec``: comma-separated layer counts, one per stage (else the
    environment's ``VLLM_PP_LAYER_PARTITION``, else an even split)."""
    if num_stages < 1:
        raise ValueError(f"pipeline_parallel_size must be >= 1, got {num_stages}")
    spec = spec or os.environ.get(PARTITION_ENV) or None
    if spec is None:
        counts = _even_counts(num_layers, num_stages)
    else:
        counts = _parse_counts(spec, num_layers, num_stages)
    starts = [sum(counts[:i]) for i in range(num_stages)]
    return [range(start, start + count) for start, count in zip(starts, counts, strict=True)]


def _even_counts(num_layers: int, num_stages: int) -> list[int]:
    if num_stages > num_layers:
        raise ValueError(
            f"pipeline_parallel_size {num_stages} is more than the model's {num_layers} layers"
        )
    counts = [num_layers // num_stages] * num_stages
    for i in range(num_layers % num_stages):  # the extras go to the stages before the last
        counts[-2 - i if num_stages > 1 else 0] += 1
    return counts


def _parse_counts(spec: str, num_layers: int, num_stages: int) -> list[int]:
    try:
        counts = [int(part) for part in spec.split(",")]
    except ValueError:
        raise ValueError(
            f"pp_layer_partition {spec!r}: expected comma-separated layer counts, e.g. 12,12"
        ) from None
    if len(counts) != num_stages or min(counts) < 1 or sum(counts) != num_layers:
        raise ValueError(
            f"pp_layer_partition {spec!r} must give each of the {num_stages} stages at least "
            f"one layer and add up to the model's {num_layers} layers"
        )
    return counts


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def stage_weights(weights: Iterable, stage: PipelineStage, num_layers: int) -> Iterator:
    """The checkpoint tensors ``stage`` holds (transformers' decoder names): its layers, the
    embedding on the first stage, the final norm and LM head on the last. A tied LM head is the
    embedding's tensor: the last stage keeps ``model.embed_tokens`` too and loads it as its
    head. Layers past ``num_layers`` (DeepSeek-V3's next-token-prediction layer) pass, for the
    model's own loader to skip."""
    layers = stage.layer_range(num_layers)
    for name, tensor in weights:
        layer = _LAYER.match(name)
        if layer is not None:
            index = int(layer.group(1))
            owned = index in layers or index >= num_layers
        elif name.startswith("model.embed_tokens."):
            owned = stage.is_first or stage.is_last
        elif name.startswith(("model.norm.", "lm_head.")):
            owned = stage.is_last
        else:
            owned = True
        if owned:
            yield name, tensor
