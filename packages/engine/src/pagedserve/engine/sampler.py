"""The sampler: from rows of logits to one next token per row, with every SamplingParams knob.

One pipeline serves every draw the engine makes: the rows a step samples, the first tokens of
an ``n > 1`` request's forks, and the positions a speculative decode verifies (which run stages
1 and 2 below, then the rejection sampler: spec_decode/verify.py). Per row, in vLLM's order:

1. raw logprobs, for the rows that report them: read from the logits as the model gave them
   (vLLM's default), before anything below changes them (``top_logprobs``);
2. logits processors (logits_processors.py), on the rows that have any, in place: the
   structured-output mask, ``allowed_token_ids``, ``bad_words``, ``logit_bias``, the min_tokens
   stop-token mask, the repetition, frequency and presence penalties, and last the thinking
   budget's forced end;
3. the draw: greedy rows (temperature below ``GREEDY_TEMPERATURE``) take the argmax; the
   others the exponential race over temperature, top-k, top-p and min-p (``sample_tokens``)
   with noise from the row's own generator, so a seeded request draws the same tokens in any
   batch, and a greedy row draws nothing.

The logits a step hands in are its own (the model computed them for this step), so stage 2
changes the rows it processes in place: a step with one constrained row among hundreds copies
nothing. A row with nothing to process, greedy and without logprobs, costs only its share of
one argmax, and a batch of such rows builds no per-row metadata at all (``SamplingMetadata``
without states).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedserve.engine.input_batch import SamplingState
from pagedserve.engine.logits_processors import apply_logits_processors
from pagedserve.engine.outputs import Logprob
from pagedserve.kernels.sampling import sample_tokens


class SamplingMetadata:
    """Per-row inputs of one sampling call: row i belongs to ``states[i]``.

    ``states`` None: every row is plain (greedy, nothing to process, no logprobs), so the
    call is one argmax. ``generators[i]`` replaces the state's generator (a fork draws with
    its own); ``histories[i]`` replaces the state's output tokens as what the penalties and
    the min_tokens mask read (a verified position sees the proposals before it). The batch's
    flags are found once, on the first stage that asks.
    """

    def __init__(
        self,
        states: list[SamplingState] | None,
        generators: list[torch.Generator] | None = None,
        histories: list[list[int]] | None = None,
    ) -> None:
        self.states = states
        self.generators = generators or (None if states is None else [s.generator for s in states])
        self.histories = histories
        self._greedy: list[bool] | None = None

    @property
    def greedy(self) -> list[bool]:
        if self._greedy is None:
            self._greedy = [s.greedy for s in self.states]
        return self._greedy

    @property
    def all_greedy(self) -> bool:
        return self.states is None or all(self.greedy)

    def history(self, row: int) -> list[int]:
        return self.states[row].history() if self.histories is None else self.histories[row]

    def processed_rows(self) -> list[int]:
        """The rows that a logits processor changes."""
        if self.states is None:
            return []
        return [row for row, state in enumerate(self.states) if state.processed]

    def logprob_rows(self) -> list[int]:
        """The rows that report logprobs of their draw."""
        if self.states is None:
            return []
        return [row for row, s in enumerate(self.states) if s.params.logprobs is not None]

    def column(self, name: str, device: torch.device) -> torch.Tensor:
        """``[B]`` float32 of one SamplingParams field, in one transfer."""
        values = [getattr(s.params, name) for s in self.states]
        return torch.tensor(values, dtype=torch.float32).to(device)


@dataclass(slots=True)
class SamplerOutput:
    """``token_ids [B]`` (on the logits' device), and per row that reports logprobs its
    ``{token: logprob}`` (its top N, then the drawn token)."""

    token_ids: torch.Tensor
    logprobs: dict[int, dict[int, Logprob]]


class Sampler:
    """The pipeline of the module docstring; stateless (the randomness is the rows')."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Next token ids ``[B]`` for ``logits [B, V]`` (float32, changed in place)."""
        if meta.states is None:
            return SamplerOutput(logits.argmax(dim=-1), {})
        logprob_rows = meta.logprob_rows()
        raw = logits[logprob_rows].float() if logprob_rows else None
        self.process(logits, meta)
        tokens = self.draw(logits, meta)
        logprobs = {}
        if raw is not None:
            nums = [meta.states[row].params.logprobs for row in logprob_rows]
            drawn = tokens[logprob_rows].tolist()
            entries = top_logprobs(torch.log_softmax(raw, dim=-1), drawn, nums)
            logprobs = dict(zip(logprob_rows, entries))
        return SamplerOutput(tokens, logprobs)

    @staticmethod
    def process(logits: torch.Tensor, meta: SamplingMetadata) -> None:
        """Stage 2 on the rows that have a processor, in place."""
        rows = meta.processed_rows()
        if not rows:
            return
        whole = len(rows) == logits.shape[0]
        part = logits if whole else logits[rows]
        states = [meta.states[row] for row in rows]
        histories = [meta.history(row) for row in rows]
        penalised = apply_logits_processors(part, states, histories)
        if not whole:
            logits[rows] = penalised
        elif penalised is not logits:
            logits.copy_(penalised)

    @staticmethod
    def draw(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Stage 3: one token per row."""
        if meta.all_greedy:
            return logits.argmax(dim=-1)
        device = logits.device
        temperature, top_k, top_p, min_p = sampling_columns(meta, device)
        noise = exponential_noise(logits, meta.generators, meta.greedy)
        return sample_tokens(logits, temperature, top_k, top_p, min_p, noise)


def sampling_columns(
    meta: SamplingMetadata, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """temperature, top_k (int32), top_p, min_p per row, as the sampling kernels take them."""
    table = torch.tensor(
        [
            (p.temperature, p.top_k, p.top_p, p.min_p)
            for p in (state.params for state in meta.states)
        ],
        dtype=torch.float32,
    ).to(device)
    temperature, top_k, top_p, min_p = table.unbind(1)
    return temperature, top_k.int(), top_p, min_p


def exponential_noise(
    logits: torch.Tensor, generators: Sequence[torch.Generator], greedy: Sequence[bool]
) -> torch.Tensor:
    """Exp(1) noise like ``logits``: row i drawn from ``generators[i]`` only (greedy rows: ones,
    drawing nothing, so a greedy step does not move a generator)."""
    noise = torch.ones_like(logits)
    for row, (generator, is_greedy) in enumerate(zip(generators, greedy, strict=True)):
        if not is_greedy:
            noise[row].exponential_(generator=generator)
    return noise


def top_logprobs(
    logprobs: torch.Tensor, token_ids: Sequence[int], nums: Sequence[int]
) -> list[dict[int, Logprob]]:
    """Row i of ``logprobs [R, V]`` as ``{token: Logprob}``: its top ``nums[i]`` (ranks 1 to
    ``nums[i]``), then ``token_ids[i]`` (the drawn or the actual token) if not among them, with
    its rank: the number of tokens at least as likely (vLLM's). Every kind of logprobs the
    engine reports (sampled, verified, prompt) is made here, in one transfer each."""
    top = logprobs.topk(max(max(nums, default=0), 1), dim=-1)
    top_ids, top_values = top.indices.tolist(), top.values.tolist()
    index = torch.tensor(token_ids, dtype=torch.long, device=logprobs.device)
    actual = logprobs.gather(1, index[:, None])
    ranks = (logprobs >= actual).sum(dim=-1).tolist()
    entries = []
    for ids, values, token, value, rank, num in zip(
        top_ids, top_values, token_ids, actual.squeeze(1).tolist(), ranks, nums
    ):
        entry = {t: Logprob(v, r) for r, (t, v) in enumerate(zip(ids[:num], values[:num]), 1)}
        if token not in entry:
            entry[token] = Logprob(value, rank)
        entries.append(entry)
    return entries
