"""Scoring text pairs (vLLM's ``LLM.score`` and /score, /rerank): how pairs are formed and
scored, shared by the offline ``LLM`` and the server.

Pairs: one text against one (1:1), one against many (1:N), or two equal lists zipped (N:N).
A cross-encoder (a classifier) reads each pair as one prompt, ``[CLS] a [SEP] b [SEP]`` with
token types 0 then 1 (its tokenizer's pair encoding), and its one class, through the
sigmoid, is the score. An embedding model embeds each text once and a pair's score is the
cosine of its two embeddings.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedserve.engine.errors import InvalidRequestError


def score_pairs(
    data_1: str | Sequence[str], data_2: str | Sequence[str], names: tuple[str, str]
) -> list[tuple[str, str]]:
    """The (first, second) text pairs of a score request (``names``: the two fields, for the
    error a mismatch gets)."""
    first = [data_1] if isinstance(data_1, str) else list(data_1)
    second = [data_2] if isinstance(data_2, str) else list(data_2)
    if not first or not second:
        raise InvalidRequestError(f"{names[0]} and {names[1]} must not be empty", names[1])
    if len(first) == 1:
        return [(first[0], text) for text in second]
    if len(first) != len(second):
        raise InvalidRequestError(
            f"{names[0]} has {len(first)} texts and {names[1]} {len(second)}: give one "
            f"{names[0]} text, or as many as {names[1]} (they are paired in order)",
            names[1],
        )
    return list(zip(first, second, strict=True))


def pair_prompt(
    tokenizer, first: str, second: str, truncate_prompt_tokens: int | None, max_model_len: int
) -> tuple[list[int], list[int] | None]:
    """A cross-encoder's prompt for one pair: its token ids and token types (None when the
    tokenizer gives none), truncated by the tokenizer (the longer text first) when asked."""
    kwargs = {}
    if truncate_prompt_tokens is not None:
        limit = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        kwargs = dict(truncation="longest_first", max_length=limit)
    encoded = tokenizer(first, second, **kwargs)
    return list(encoded["input_ids"]), encoded.get("token_type_ids")


def text_prompt(
    tokenizer, text: str, truncate_prompt_tokens: int | None, max_model_len: int,
    add_special_tokens: bool = True,
) -> list[int]:  # fmt: skip
    """A pooling prompt's token ids; ``truncate_prompt_tokens`` cuts it with the tokenizer's
    own truncation, which keeps its special tokens (-1: to ``max_model_len``)."""
    if truncate_prompt_tokens is None:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    limit = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    return tokenizer.encode(
        text, add_special_tokens=add_special_tokens, truncation=True, max_length=limit
    )


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=0))
