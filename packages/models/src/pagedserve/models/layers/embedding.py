"""Vocabulary-parallel embedding and LM head.

With tensor parallelism each rank holds a contiguous slice of ``ceil(vocab / tp_size)`` rows
of the vocabulary; when the vocabulary does not divide evenly, the last rank's slice is padded
with zero rows (and a rank past the end holds padding only). The embedding looks up the tokens
in its slice (zeros elsewhere) and an all-reduce sums the slices; the LM head computes its
slice of the logits, a gather concatenates the slices in rank order and the padding columns are
cut off. With one rank both are plain.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels.linear import linear
from pagedserve.models.config import ModelLoadError
from pagedserve.models.layers.batch_invariance import building_batch_invariant
from pagedserve.models.weights import CheckpointTensor, copy_shard


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype = torch.float32,
        tp_rank: int = 0,
        tp_size: int = 1,
        all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.vocab_per_rank = -(-vocab_size // tp_size)
        self.vocab_start = min(vocab_size, tp_rank * self.vocab_per_rank)
        self.vocab_end = min(vocab_size, self.vocab_start + self.vocab_per_rank)
        self.tp_size = tp_size
        self.all_reduce = all_reduce
        self.weight = nn.Parameter(
            torch.zeros(self.vocab_per_rank, hidden_size, dtype=dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor | CheckpointTensor) -> None:
        if loaded.dim() != 2 or loaded.shape[0] != self.vocab_size:
            raise ModelLoadError(
                f"embedding checkpoint tensor has shape {tuple(loaded.shape)}; expected "
                f"{self.vocab_size} rows (the vocabulary)"
            )
        rows = self.vocab_end - self.vocab_start
        copy_shard(param.data[:rows], loaded.narrow(0, self.vocab_start, rows), "vocabulary slice")

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(token_ids, self.weight)
        in_shard = (token_ids >= self.vocab_start) & (token_ids < self.vocab_end)
        local = torch.where(in_shard, token_ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight) * in_shard.unsqueeze(-1).to(self.weight.dtype)
        return self.all_reduce(out) if self.all_reduce is not None else out


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden states -> logits over this rank's vocabulary slice, gathered to the whole vocab."""

    def __init__(
        self, *args, gather: Callable[[torch.Tensor], torch.Tensor] | None = None, **kw
    ) -> None:
        super().__init__(*args, **kw)
        self.gather = gather
        self.batch_invariant = building_batch_invariant()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.weight, batch_invariant=self.batch_invariant)
        if self.tp_size > 1 and self.gather is not None:
            logits = self.gather(logits)
        return logits[..., : self.vocab_size]
