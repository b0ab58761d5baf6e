"""The tensor-parallel context a model is built with.

A model never talks to torch.distributed itself: it receives this context, which says which
shard it holds and how to combine partial results. With one rank (the default) the collectives
are absent and the layers are plain.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class ParallelContext:
    tp_rank: int = 0
    tp_size: int = 1
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None

    def shard_args(self) -> dict[str, int]:
        return {"tp_rank": self.tp_rank, "tp_size": self.tp_size}
