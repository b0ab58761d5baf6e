"""The sampler: from rows of logits to one next token per row, with every SamplingParams knob.

One pipeline serves every draw the engine makes: the rows a step samples, the first tokens of
an ``n > 1`` request's forks, and the positions a speculative decode verifies (which run stages
1 and 2 below, then the rejection sampler: spec_decode/verify.py). Per row, in vLLM's order:

1. raw logprobs, for the rows that report them: read from the logits as the model gave them
   (vLLM's default), before anything below changes them (``top_logprobs``);
2. logits processors, on the rows that have any, in place: the structured-output mask (one
   packed bitmask for the constrained rows), ``logit_bias``, the min_tokens stop-token mask
   (stop tokens may not be drawn before ``min_tokens`` tokens are out, vLLM's rule), then the
   repetition, frequency and presence penalties;
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
from itertools import chain

import torch

from pagedserve.engine.input_batch import SamplingState
from pagedserve.engine.structured_output.manager import grammar_bitmask
from pagedserve.kernels.penalties import apply_penalties
from pagedserve.kernels.sampling import sample_tokens
from pagedserve.kernels.token_bitmask import apply_token_bitmask


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
    logprobs: dict[int, dict[int, float]]


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
        _mask_grammar(part, states)
        _add_logit_bias(part, states)
        _mask_early_stops(part, states, histories)
        penalised = _penalise(part, states, histories)
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
) -> list[dict[int, float]]:
    """Row i of ``logprobs [R, V]`` as ``{token: logprob}``: its top ``nums[i]``, then
    ``token_ids[i]`` (the drawn or the actual token) if not among them. Every kind of logprobs
    the engine reports (sampled, verified, prompt) is made here, in one transfer each."""
    top = logprobs.topk(max(max(nums, default=0), 1), dim=-1)
    top_ids, top_values = top.indices.tolist(), top.values.tolist()
    index = torch.tensor(token_ids, dtype=torch.long, device=logprobs.device)
    actual = logprobs.gather(1, index[:, None]).squeeze(1).tolist()
    entries = []
    for ids, values, token, value, num in zip(top_ids, top_values, token_ids, actual, nums):
        entry = dict(zip(ids[:num], values[:num]))
        entry.setdefault(token, value)
        entries.append(entry)
    return entries


def stop_tokens_masked(num_output: int, min_tokens: int, stop_token_ids: frozenset[int]):
    """The tokens a row may not draw now: its stop tokens while fewer than ``min_tokens``
    tokens are out (vLLM's rule; EOS is among them unless the request ignores it)."""
    return stop_token_ids if num_output < min_tokens else frozenset()


def _mask_grammar(logits: torch.Tensor, states: list[SamplingState]) -> None:
    """Tokens the row's grammar does not allow now to -inf (structured outputs)."""
    found = grammar_bitmask([s.grammar_matcher for s in states], logits.shape[-1])
    if found is None:
        return
    bitmask, rows = found
    device = logits.device
    indices = torch.tensor(rows, dtype=torch.int32, device=device)
    apply_token_bitmask(logits, bitmask.to(device=device), indices)


def _add_logit_bias(logits: torch.Tensor, states: list[SamplingState]) -> None:
    rows, cols, bias = [], [], []
    for row, state in enumerate(states):
        for token, value in (state.params.logit_bias or {}).items():
            rows.append(row)
            cols.append(int(token))
            bias.append(float(value))
    if rows:
        device = logits.device
        index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
        logits.index_put_(index, torch.tensor(bias, dtype=logits.dtype, device=device), True)


def _mask_early_stops(
    logits: torch.Tensor, states: list[SamplingState], histories: list[list[int]]
) -> None:
    masked = [
        (row, token)
        for row, (state, history) in enumerate(zip(states, histories))
        for token in stop_tokens_masked(
            len(history), state.request.min_tokens, state.request.stop_token_ids
        )
    ]
    if masked:
        rows, cols = zip(*masked, strict=True)
        device = logits.device
        logits[torch.tensor(rows, device=device), torch.tensor(cols, device=device)] = float("-inf")


def _penalise(
    logits: torch.Tensor, states: list[SamplingState], histories: list[list[int]]
) -> torch.Tensor:
    """Repetition, frequency and presence penalties (the logits as they are when no row has
    any)."""
    params = [s.params for s in states]
    if all(
        p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
        for p in params
    ):
        return logits
    batch, vocab = logits.shape
    device = logits.device
    prompt_mask = torch.zeros(batch, vocab, dtype=torch.bool, device=device)
    prompt_mask[_scatter_index([s.request.prompt_token_ids for s in states], device)] = True
    output_counts = torch.zeros(batch, vocab, dtype=torch.int32, device=device)
    rows, tokens = _scatter_index(histories, device)
    ones = torch.ones_like(tokens, dtype=torch.int32)
    output_counts.index_put_((rows, tokens), ones, accumulate=True)
    table = torch.tensor(
        [(p.repetition_penalty, p.presence_penalty, p.frequency_penalty) for p in params],
        dtype=torch.float32,
    ).to(device)
    repetition, presence, frequency = table.unbind(1)
    return apply_penalties(logits, prompt_mask, output_counts, repetition, presence, frequency)


def _scatter_index(token_lists: list[list[int]], device: torch.device):
    """(row, token) index tensors of every token of every row, built in one pass."""
    lengths = torch.tensor([len(ids) for ids in token_lists], dtype=torch.long)
    tokens = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    return rows.to(device), tokens.to(device)
