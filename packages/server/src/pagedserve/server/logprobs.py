"""Logprobs in the two shapes OpenAI uses: the legacy completions one and the chat one.

The engine gives, per generated token, a dict ``token id -> logprob`` holding the sampled token
and the requested number of most likely ones (a value may be a float or an object with a
``.logprob``, as vLLM's ``Logprob``). Token strings are each id decoded alone, as OpenAI shows
them (" the", not the BPE piece "Ġthe").
"""

from __future__ import annotations

from pagedserve.server.protocol import (
    ChatChoiceLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)


def _value(entry) -> float:
    value = entry if isinstance(entry, int | float) else entry.logprob
    return max(float(value), -9999.0)  # -inf is not JSON; OpenAI clamps the same way


def _top(entries: dict, k: int) -> list[tuple[int, float]]:
    ranked = sorted(((t, _value(v)) for t, v in entries.items()), key=lambda tv: -tv[1])
    return ranked[:k]


def _by_text(tokenizer, ranked: list[tuple[int, float]]) -> dict[str, float]:
    """The legacy format keys top logprobs by text; two ids may decode alike (byte pieces of one
    character both show as U+FFFD), and the more likely one keeps the key."""
    out: dict[str, float] = {}
    for token, value in ranked:
        out.setdefault(tokenizer.decode([token]), value)
    return out


def completion_logprobs(
    tokenizer,
    token_ids: list[int],
    logprobs: list[dict] | None,
    k: int,
    text_offset: int,
) -> CompletionLogprobs | None:
    """Parallel lists for ``token_ids``; offsets count from ``text_offset`` (the echoed prompt)."""
    if logprobs is None:
        return None
    out = CompletionLogprobs()
    offset = text_offset
    for token, entries in zip(token_ids, logprobs):
        text = tokenizer.decode([token])
        out.tokens.append(text)
        out.token_logprobs.append(_value(entries[token]) if token in entries else None)
        out.top_logprobs.append(_by_text(tokenizer, _top(entries, k)) if k else None)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def chat_logprobs(
    tokenizer, token_ids: list[int], logprobs: list[dict] | None, k: int
) -> ChatChoiceLogprobs | None:
    if logprobs is None:
        return None
    content = []
    for token, entries in zip(token_ids, logprobs):
        text = tokenizer.decode([token])
        top = [
            TopLogprob(token=(s := tokenizer.decode([t])), logprob=v, bytes=list(s.encode()))
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
