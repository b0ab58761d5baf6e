"""The logits processors: what changes a row's logits before its draw, in vLLM's order.

Each takes the rows that have one (a processor that applies to none of them does nothing) and
changes them in place, except the penalties, which return a new tensor:

1. the structured-output mask: tokens the row's grammar does not allow now to -inf (one packed
   bitmask for the constrained rows, filled by each sequence's matcher);
2. ``allowed_token_ids``: every other token to -inf;
3. ``bad_words``: the last token of a bad word to -inf once the tokens before it are out (a
   one-token word always);
4. ``logit_bias``, added;
5. the min_tokens mask: stop tokens to -inf while fewer than ``min_tokens`` tokens are out
   (vLLM's rule; EOS is among them unless the request ignores it);
6. repetition (every token seen in prompt or output), frequency and presence penalties;
7. the thinking budget: once ``thinking_token_budget`` tokens have been written inside the
   thinking, the thinking's end tokens are forced, one per step, whatever else applied.

A row's history (the output tokens that bad words, min_tokens and the penalties read) is its
sequence's output, or for a position a speculative decode verifies, the output plus the
proposals before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import torch

from pagedserve.engine.input_batch import SamplingState
from pagedserve.engine.structured_output.manager import grammar_bitmask
from pagedserve.kernels.penalties import apply_penalties
from pagedserve.kernels.token_bitmask import apply_token_bitmask


def apply_logits_processors(
    logits: torch.Tensor, states: list[SamplingState], histories: list[list[int]]
) -> torch.Tensor:
    """Every processor of the module docstring on ``logits`` (row i: ``states[i]``, with
    ``histories[i]``); the processed logits (``logits`` itself unless a penalty applied)."""
    _mask_grammar(logits, states)
    _keep_allowed_tokens(logits, states)
    _mask_bad_words(logits, states, histories)
    _add_logit_bias(logits, states)
    _mask_early_stops(logits, states, histories)
    logits = _penalise(logits, states, histories)
    _force_thinking_end(logits, states, histories)
    return logits


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


def _keep_allowed_tokens(logits: torch.Tensor, states: list[SamplingState]) -> None:
    for row, state in enumerate(states):
        allowed = state.params.allowed_token_ids
        if allowed is not None:
            keep = logits[row, allowed].clone()
            logits[row] = float("-inf")
            logits[row, allowed] = keep


def _mask_bad_words(
    logits: torch.Tensor, states: list[SamplingState], histories: list[list[int]]
) -> None:
    for row, (state, history) in enumerate(zip(states, histories)):
        for word in state.bad_words_token_ids:
            *before, last = word
            if not before or history[len(history) - len(before) :] == before:
                logits[row, last] = float("-inf")


def bad_words_token_ids(bad_words: Sequence[str], tokenizer) -> list[list[int]]:
    """Each bad word's token ids as it reads at the start of a text and after a space (byte
    BPE tokenizers give the two different tokens), each sequence once."""
    sequences: list[list[int]] = []
    for word in bad_words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


def _force_thinking_end(
    logits: torch.Tensor, states: list[SamplingState], histories: list[list[int]]
) -> None:
    for row, (state, history) in enumerate(zip(states, histories)):
        params = state.params
        if params.thinking_token_budget is None:
            continue
        forced = thinking_end_forced(
            state.request.prompt_token_ids + history,
            params.thinking_token_budget,
            params.thinking_start_token_ids,
            params.thinking_end_token_ids,
        )
        if forced is not None:
            logits[row] = float("-inf")
            logits[row, forced] = 0.0


def thinking_end_forced(
    tokens: list[int], budget: int, start: list[int], end: list[int]
) -> int | None:
    """The token the thinking budget forces next, or None. Inside the thinking (its last start
    comes after its last end, in prompt then output: a chat template may open the thinking in
    the prompt), once ``budget`` tokens follow the start, the end tokens are forced in order."""
    opened = _last_index(tokens, start)
    if opened is None or (_last_index(tokens, end) or -1) > opened:
        return None
    written = len(tokens) - (opened + len(start)) - budget
    return end[written] if 0 <= written < len(end) else None


def _last_index(tokens: list[int], tag: list[int]) -> int | None:
    """Where the last occurrence of ``tag`` starts in ``tokens``, or None."""
    n = len(tag)
    for i in range(len(tokens) - n, -1, -1):
        if tokens[i : i + n] == tag:
            return i
    return None
