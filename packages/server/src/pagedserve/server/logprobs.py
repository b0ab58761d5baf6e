"""Logprobs in the shapes OpenAI and vLLM use: the legacy completions one, the chat one, and
vLLM's prompt logprobs.

The engine gives, per token, a dict ``token id -> logprob`` holding that token (sampled, or the
prompt's own) and the requested number of most likely ones (a value may be a float or an object
with a ``.logprob``, as vLLM's ``Logprob``). Token strings are each id decoded alone, as OpenAI
shows them (" the", not the BPE piece "Ġthe"), or ``token_id:N`` with vLLM's
``return_tokens_as_token_ids`` (for clients that must map logprobs back to ids exactly, since
two ids can decode alike).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.server.protocol import (
    ChatChoiceLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)


@dataclass(frozen=True)
class TokenNamer:
    """How a token id is shown: its text, or ``token_id:N``."""

    tokenizer: object
    as_ids: bool = False

    def __call__(self, token: int) -> str:
        return f"token_id:{token}" if self.as_ids else self.tokenizer.decode([token])


def _value(entry) -> float:
    value = entry if isinstance(entry, int | float) else entry.logprob
    return max(float(value), -9999.0)  # -inf is not JSON; OpenAI clamps the same way


def _top(entries: dict, k: int) -> list[tuple[int, float]]:
    ranked = sorted(((t, _value(v)) for t, v in entries.items()), key=lambda tv: -tv[1])
    return ranked[:k]


def _legacy_top(name: TokenNamer, token: int, entries: dict, k: int) -> dict[str, float]:
    """The chosen token, then the ``k`` likeliest: "up to logprobs + 1" entries, as OpenAI and
    vLLM return them (so ``logprobs: 0`` still shows the chosen token). Keyed by text, two ids
    may decode alike (byte pieces of one character both show as U+FFFD): the first keeps it."""
    out: dict[str, float] = {}
    if token in entries:
        out[name(token)] = _value(entries[token])
    for other, value in _top(entries, k):
        out.setdefault(name(other), value)
    return out


def completion_logprobs(
    name: TokenNamer,
    token_ids: list[int],
    logprobs: list[dict | None] | None,
    k: int,
    text_offset: int,
) -> CompletionLogprobs | None:
    """Parallel lists for ``token_ids``; offsets count from ``text_offset``. An entry of None
    (the first prompt token, when the prompt is echoed) has no logprob."""
    if logprobs is None:
        return None
    out = CompletionLogprobs()
    offset = text_offset
    for token, entries in zip(token_ids, logprobs):
        text = name(token)
        out.tokens.append(text)
        if entries is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
        else:
            out.token_logprobs.append(_value(entries[token]) if token in entries else None)
            out.top_logprobs.append(_legacy_top(name, token, entries, k))
        out.text_offset.append(offset)
        offset += len(text)
    return out


def chat_logprobs(
    name: TokenNamer, token_ids: list[int], logprobs: list[dict] | None, k: int
) -> ChatChoiceLogprobs | None:
    if logprobs is None:
        return None
    content = []
    for token, entries in zip(token_ids, logprobs):
        text = name(token)
        top = [
            TopLogprob(token=(s := name(t)), logprob=v, bytes=list(s.encode()))
            for t, v in _top(entries, k)
        ]
        content.append(
            ChatTokenLogprob(
                token=text,
                logprob=_value(entries[token]) if token in entries else -9999.0,
                bytes=list(text.encode()),
                top_logprobs=top,
            )
        )
    return ChatChoiceLogprobs(content=content)


def _rank(entry, position_rank: int, k: int) -> int | None:
    """A candidate's rank: the engine's own where it gives one (an entry with ``.rank``, as
    vLLM's ``Logprob``), else its place among the ``k`` likeliest; None for the prompt's own
    token when it is outside them and the engine gave no rank."""
    given = getattr(entry, "rank", None)
    if given is not None:
        return given
    return position_rank + 1 if position_rank < k else None


def prompt_logprobs(
    name: TokenNamer, entries: list[dict | None] | None, k: int
) -> PromptLogprobs | None:
    """vLLM's prompt_logprobs: per prompt position, the ``k`` likeliest tokens with their rank
    (1 = likeliest), and the prompt's own token with its rank (see ``_rank``). With ``k`` the
    whole vocabulary every token is ranked."""
    if entries is None:
        return None
    out: PromptLogprobs = []
    for position in entries:
        if position is None:
            out.append(None)
            continue
        ranked = sorted(position, key=lambda t: -_value(position[t]))
        out.append(
            {
                str(token): PromptLogprob(
                    logprob=_value(position[token]),
                    rank=_rank(position[token], place, k),
                    decoded_token=name(token),
                )
                for place, token in enumerate(ranked)
            }
        )
    return out
