"""Incremental detokenization: text deltas as tokens arrive, and stop strings.

Decoding token by token is wrong for byte-level BPE (a multi-byte character can be split over
tokens) and for tokenizers whose pieces depend on their neighbours. So we decode a short window
of recent tokens, compare with the window without the newest token, and emit only the new
suffix, holding back text that ends in an incomplete UTF-8 character (decoded as U+FFFD).
"""

from __future__ import annotations

_WINDOW = 6


class IncrementalDetokenizer:
    """Text of the output tokens, built incrementally.

    The window starts on the last few prompt tokens: tokenizers that drop a word's leading
    space when it starts a decode (SentencePiece) then give the first output word its space.
    Invariant: ``text`` is the decode of the output tokens up to ``read_offset``, less any
    trailing incomplete character, plus what ``flush`` adds at the end.
    """

    def __init__(
        self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids[-_WINDOW:])  # context, then outputs
        self.prefix_offset = 0  # start of the decode window (in self.token_ids)
        self.read_offset = len(self.token_ids)  # tokens whose text has been emitted
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str:
        """Append a token; return the newly complete text (possibly empty)."""
        self.token_ids.append(token_id)
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            return ""  # an incomplete character, or a token with no text (yet)
        delta = full_text[len(prefix_text) :]
        self.read_offset = len(self.token_ids)
        self.prefix_offset = max(0, self.read_offset - _WINDOW)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end, emit whatever is held back (an unfinished character decodes as U+FFFD)."""
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        delta = full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
        self.read_offset = len(self.token_ids)
        self.text += delta
        return delta


def find_stop_string(text: str, new_len: int, stop_strings: list[str]) -> tuple[str, int] | None:
    """The first stop string that ends within the last ``new_len`` characters of ``text``.

    Returns (stop string, index where it starts), so the caller can cut the text there. Only the
    tail is searched, with enough overlap for a stop string split across tokens.
    """
    best: tuple[str, int] | None = None
    for stop in stop_strings:
        start = max(0, len(text) - new_len - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[1]):
            best = (stop, index)
    return best
