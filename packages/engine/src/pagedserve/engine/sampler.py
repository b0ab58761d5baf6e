"""The sampler: from a batch of logits to one next token per row, with every SamplingParams knob.

Per row, in vLLM's order:

1. logit processors: ``logit_bias`` is added; while a request has fewer than ``min_tokens``
   output tokens its stop tokens (EOS included unless ``ignore_eos``) are masked to -inf;
2. penalties (repetition on every token seen in prompt or output, then frequency and presence
   on output tokens), through ``pagedserve.kernels.apply_penalties``;
3. temperature, top-k, top-p, min-p and the draw, through ``pagedserve.kernels.sample_tokens``
   (the Triton kernels on a GPU, their references on CPU).

Randomness comes from each request's own torch.Generator, drawn as exponential noise over the
vocabulary (the exponential race: ``argmax(x - log(noise))`` samples from ``softmax(x)``). A row
draws its noise only from its own generator, so a seeded request draws the same tokens alone or
in any batch.

Logprobs are those of the model's raw distribution (log_softmax of the logits before any
processing; vLLM's default ``raw_logprobs``): the sampled token's, and the top-N.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.kernels.penalties import apply_penalties
from pagedserve.kernels.sampling import sample_tokens


@dataclass
class SamplingMetadata:
    """Per-row inputs of one sampling step. Row i of the logits belongs to entry i of each list.

    ``masked_token_ids[i]``: tokens that row i must not pick now (stop tokens under min_tokens).
    """

    params: list[SamplingParams]
    generators: list[torch.Generator]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    masked_token_ids: list[frozenset[int] | set[int]]


@dataclass
class SamplerOutput:
    """``token_ids [B]``; when any row asked for logprobs: the sampled tokens' raw logprobs
    ``[B]`` and the top-``K`` ``[B, K]`` (K = the largest ``logprobs`` in the batch)."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    top_token_ids: torch.Tensor | None = None

    def row_logprobs(self, row: int, num: int) -> dict[int, float]:
        """Row ``row``'s logprobs as {token id: logprob}: its top ``num``, then the sampled token."""
        assert self.logprobs is not None and self.top_logprobs is not None
        result = {
            int(t): float(v)
            for t, v in zip(self.top_token_ids[row, :num], self.top_logprobs[row, :num])
        }
        result.setdefault(int(self.token_ids[row]), float(self.logprobs[row]))
        return result


def apply_logit_processors(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """logit_bias and the min_tokens stop-token mask, on a copy of ``logits``."""
    rows, cols, bias = [], [], []
    for row, params in enumerate(meta.params):
        for token, value in (params.logit_bias or {}).items():
            rows.append(row)
            cols.append(int(token))
            bias.append(float(value))
    masked = [(row, t) for row, ids in enumerate(meta.masked_token_ids) for t in ids]
    if not rows and not masked:
        return logits
    logits = logits.clone()
    if rows:
        index = (torch.tensor(rows), torch.tensor(cols))
        values = torch.tensor(bias, dtype=logits.dtype)
        logits.index_put_(tuple(i.to(logits.device) for i in index), values.to(logits.device), True)
    if masked:
        r, c = zip(*masked, strict=True)
        logits[torch.tensor(r, device=logits.device), torch.tensor(c, device=logits.device)] = (
            float("-inf")
        )
    return logits


def penalise(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition, frequency and presence penalties (skipped when no row uses any)."""
    params = meta.params
    if all(
        p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
        for p in params
    ):
        return logits
    batch, vocab = logits.shape
    device = logits.device
    prompt_mask = torch.zeros(batch, vocab, dtype=torch.bool, device=device)
    output_counts = torch.zeros(batch, vocab, dtype=torch.int32, device=device)
    for row in range(batch):
        if meta.prompt_token_ids[row]:
            prompt_mask[row, torch.tensor(meta.prompt_token_ids[row], device=device)] = True
        if meta.output_token_ids[row]:
            ids = torch.tensor(meta.output_token_ids[row], device=device)
            output_counts[row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    def column(name: str) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32, device=device)

    return apply_penalties(
        logits,
        prompt_mask,
        output_counts,
        column("repetition_penalty"),
        column("presence_penalty"),
        column("frequency_penalty"),
    )


def exponential_noise(
    logits: torch.Tensor, generators: list[torch.Generator], greedy: list[bool]
) -> torch.Tensor:
    """Exp(1) noise like ``logits``: row i drawn from ``generators[i]`` only (greedy rows: ones,
    drawing nothing, so a greedy step does not move a generator)."""
    noise = torch.ones_like(logits)
    for row, (generator, is_greedy) in enumerate(zip(generators, greedy, strict=True)):
        if not is_greedy:
            noise[row].exponential_(generator=generator)
    return noise


class Sampler:
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Next token ids ``[B]`` (and logprobs) for ``logits [B, V]`` (float32)."""
        raw = logits
        logits = penalise(apply_logit_processors(logits, meta), meta)
        params = meta.params
        device = logits.device
        greedy = [p.is_greedy for p in params]
        if all(greedy):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = sample_tokens(
                logits,
                torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
                torch.tensor([p.top_k for p in params], dtype=torch.int32, device=device),
                torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
                torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
                exponential_noise(logits, meta.generators, greedy),
            )
        return self._with_logprobs(raw, tokens, params)

    @staticmethod
    def _with_logprobs(
        raw: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]
    ) -> SamplerOutput:
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        if not wanted:
            return SamplerOutput(tokens)
        logprobs = torch.log_softmax(raw.float(), dim=-1)
        top = logprobs.topk(max(max(wanted), 1), dim=-1)
        return SamplerOutput(
            token_ids=tokens,
            logprobs=logprobs.gather(1, tokens[:, None]).squeeze(1),
            top_logprobs=top.values,
            top_token_ids=top.indices,
        )
