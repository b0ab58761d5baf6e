"""The sampler: from a batch of logits to one next token per sequence.

Randomness comes from each request's own torch.Generator (seeded when the request gives a
seed), drawn as exponential noise over the vocabulary: ``argmax(p / noise)`` samples from ``p``
(the exponential race). So a seeded request draws the same tokens alone or in any batch.
"""

from __future__ import annotations

import torch

from pagedserve.engine.sampling_params import SamplingParams


class Sampler:
    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator],
    ) -> torch.Tensor:
        """Next token ids ``[B]`` for ``logits [B, V]`` (float32)."""
        greedy = torch.tensor([p.is_greedy for p in params], device=logits.device)
        greedy_tokens = logits.argmax(dim=-1)
        if bool(greedy.all()):
            return greedy_tokens
        temperature = torch.tensor(
            [max(p.temperature, 1e-5) for p in params], dtype=torch.float32, device=logits.device
        )
        probs = torch.softmax(logits / temperature.unsqueeze(1), dim=-1)
        noise = torch.stack(
            [
                torch.empty(logits.shape[1], device=logits.device).exponential_(generator=g)
                for g in generators
            ]
        )
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, greedy_tokens, sampled)
