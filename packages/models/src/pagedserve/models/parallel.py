"""The parallel context a model is built with: its tensor-parallel shard and pipeline stage.

A model never talks to torch.distributed itself: it receives this context, which says which
shard it holds, how to combine partial results, and which layers its pipeline stage holds.
With one rank (the default) the collectives are absent and the layers are plain. The engine's
``distributed`` package builds a context whose callables are torch.distributed collectives over
the stage's tensor-parallel group, and the point-to-point sends between stages.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.models.pipeline import IntermediateTensors, PipelineStage


@dataclass
class ParallelContext:
    """This rank's place in the tensor-parallel group and the collectives its layers call.

    ``all_reduce(x)`` sums ``x`` over the ranks (row-parallel outputs, the vocab-parallel
    embedding); ``gather(x)`` concatenates every rank's ``x`` along the last dimension, in rank
    order (the LM head's vocabulary slices); ``reduce_min(n)`` is the smallest ``n`` over the
    ranks (the KV blocks that fit on every rank, every stage's included). All three are
    collectives: every rank calls them at the same point, in the same order.

    ``stage``: the pipeline stage this rank's model holds (all layers by default).
    ``send_to_next_stage(t)`` and ``receive_from_previous_stage(num_tokens)`` move a step's
    ``IntermediateTensors`` between the stages; the runner calls them, never the model.
    """

    tp_rank: int = 0
    tp_size: int = 1
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None
    reduce_min: Callable[[int], int] | None = None
    stage: PipelineStage = PipelineStage()
    send_to_next_stage: Callable[[IntermediateTensors], None] | None = None
    receive_from_previous_stage: Callable[[int], IntermediateTensors] | None = None

    def shard_args(self) -> dict[str, int]:
        return {"tp_rank": self.tp_rank, "tp_size": self.tp_size}

    def min_over_ranks(self, value: int) -> int:
        """The smallest ``value`` any rank holds (``value`` itself with one rank)."""
        if self.reduce_min is None:
            return value
        return self.reduce_min(value)


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads one rank holds: an even share, or one replicated head when heads < ranks.

    With fewer KV heads than ranks each KV head is replicated on ``tp_size // num_kv_heads``
    ranks (grouped-query attention keeps every query head next to its KV head), so that case
    needs ``tp_size % num_kv_heads == 0``; otherwise ``num_kv_heads % tp_size == 0``.
    """
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(f"{num_kv_heads} KV heads cannot be split over {tp_size} ranks")
        return num_kv_heads // tp_size
    if tp_size % num_kv_heads:
        raise ValueError(
            f"{tp_size} ranks cannot share {num_kv_heads} KV heads evenly "
            f"(use a tensor_parallel_size that divides or is a multiple of {num_kv_heads})"
        )
    return 1
