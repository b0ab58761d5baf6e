"""The n-gram proposer (prompt lookup): guess the next tokens from the sequence itself.

Text that repeats its context (code edits, summaries that quote, extraction) often continues
the way an earlier passage did. The proposer takes the sequence's last n tokens (n from
``prompt_lookup_max`` down to ``prompt_lookup_min``, longest first), finds their earliest
earlier occurrence in the prompt + output, and proposes the up-to-k tokens that followed it.
No model runs: a proposal costs a few vectorised comparisons on the host, and its "draft
distribution" is one-hot (the proposer is sure of its guess), which the rejection sampler uses.

``propose_ngram`` is the fast path: for every earlier position e it measures, in one
vectorised pass per suffix offset (at most ``prompt_lookup_max`` passes, never one per token),
how many tokens ending at e match the sequence's suffix; the longest match wins, the earliest
among equals. ``propose_ngram_literal`` is the literal rule, for the tests.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(
    token_ids: np.ndarray, num_tokens: int, lookup_min: int, lookup_max: int
) -> np.ndarray:
    """Up to ``num_tokens`` proposed tokens for ``token_ids`` (1-D int array); empty if none."""
    length = len(token_ids)
    lookup_max = min(lookup_max, length - 1)
    if lookup_max < lookup_min or num_tokens < 1:
        return token_ids[:0]
    # match[t, e]: token e - t equals the suffix's token length - 1 - t (candidates e < length - 1)
    match = np.zeros((lookup_max, length - 1), dtype=bool)
    for t in range(lookup_max):
        match[t, t:] = token_ids[: length - 1 - t] == token_ids[length - 1 - t]
    match_len = np.cumprod(match, axis=0, dtype=np.int32).sum(axis=0)
    best = int(match_len.max())
    if best < lookup_min:
        return token_ids[:0]
    end = int(np.argmax(match_len == best))  # the earliest of the longest matches
    return token_ids[end + 1 : end + 1 + num_tokens]


def propose_ngram_literal(
    token_ids: Sequence[int], num_tokens: int, lookup_min: int, lookup_max: int
) -> list[int]:
    """The rule, literally: longest n first, earliest occurrence, the tokens that followed it."""
    tokens = list(token_ids)
    for n in range(min(lookup_max, len(tokens) - 1), lookup_min - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + num_tokens]
    return []


class NgramProposer:
    """Prompt-lookup proposals for the sequences of a step (see the module docstring)."""

    def __init__(self, num_speculative_tokens: int, lookup_min: int, lookup_max: int) -> None:
        self.k = num_speculative_tokens
        self.lookup_min = lookup_min
        self.lookup_max = lookup_max

    def propose(self, prompt: list[int], output: list[int], max_tokens: int) -> list[int]:
        """At most ``min(k, max_tokens)`` tokens to follow ``prompt + output``."""
        num = min(self.k, max_tokens)
        if num < 1:
            return []
        array = np.concatenate((np.asarray(prompt, dtype=np.int64), np.asarray(output, np.int64)))
        return propose_ngram(array, num, self.lookup_min, self.lookup_max).tolist()
