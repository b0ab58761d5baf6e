"""Incremental detokenization: text deltas as tokens arrive, and stop strings.

Decoding token by token is wrong for byte-level BPE (a multi-byte character can be split over
tokens) and for tokenizers whose pieces depend on their neighbours. So we decode a short window
of recent tokens, compare with the window without the newest token, and emit only the new
suffix, holding back text that ends in an incomplete UTF-8 character (decoded as U+FFFD).

Each of those decodes goes through the tokenizer's decode wrapper, which costs microseconds per
call: at hundreds of running sequences that is milliseconds a step. For byte-level BPE tokenizers
(GPT-2, SmolLM2, Llama-3, Qwen) a window's text is a pure function of its tokens' bytes, so a
token id -> bytes table built once per tokenizer (``ByteLevelDecodeTable``, byte_level_decode.py)
gives the very same string from a join and one UTF-8 decode. Tokenizers the table cannot
represent (SentencePiece, byte fallback, WordPiece clean-up) keep the wrapper.

With the table, the output's text is simply the UTF-8 decode of its tokens' bytes, so no window
is needed at all: ``ByteLevelDetokenizer`` feeds each new token's bytes to one incremental
UTF-8 decoder (about a microsecond a token, where two window decodes cost several). It emits
text at the same points as the window: when the bytes so far end on a whole character that is
not U+FFFD. Most tokens are whole characters on their own; with nothing pending, such a token's
text (the table's ``texts``) is appended without a decode at all. ``detokenizer_for`` picks it
for a table tokenizer, ``IncrementalDetokenizer`` otherwise.
"""

from __future__ import annotations

from codecs import utf_8_decode as _utf_8_decode

from pagedserve.engine.byte_level_decode import (
    ByteLevelDecodeTable,
    byte_level_table,
    decode_bytes,
)

__all__ = [
    "ByteLevelDecodeTable",
    "ByteLevelDetokenizer",
    "FinalTextDetokenizer",
    "IncrementalDetokenizer",
    "byte_level_table",
    "detokenizer_for",
    "find_stop_string",
]

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
        table = byte_level_table(tokenizer)
        self._table = None if table is None else table.tables[skip_special_tokens]
        self.token_ids: list[int] = list(prompt_token_ids[-_WINDOW:])  # context, then outputs
        self.prefix_offset = 0  # start of the decode window (in self.token_ids)
        self.read_offset = len(self.token_ids)  # tokens whose text has been emitted
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        if self._table is not None:
            text = decode_bytes(self._table, ids)
            if text is not None:
                return text
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


class ByteLevelDetokenizer:
    """The output's text for a tokenizer with a ``ByteLevelDecodeTable``: one incremental
    UTF-8 decode over the output tokens' bytes (vLLM's FastIncrementalDetokenizer idea, with
    the table in place of the tokenizers library's DecodeStream).

    The decoder is ``codecs.getincrementaldecoder("utf-8")("replace")`` without its Python
    wrapper: ``codecs.utf_8_decode(pending + bytes, "replace", final)`` is what that decoder
    runs, and ``_pending`` is its buffer (the bytes of an unfinished character).

    Invariant, as ``IncrementalDetokenizer``'s: ``text`` is the decode of the output tokens
    added so far, less what is held back: bytes of an unfinished character, or a trailing
    U+FFFD (the window holds it back too, since it cannot tell an invalid byte from an
    unfinished character); ``flush`` adds it at the end. Unlike the window, no prompt tokens
    are read: a byte-level decode does not depend on what precedes a token, except a prompt
    that ends inside a character (possible only with raw prompt token ids), whose completion
    in the first output token decodes as U+FFFD here, as the tokenizer's decode of the output
    alone gives it.
    """

    __slots__ = (
        "tokenizer",
        "skip_special_tokens",
        "text",
        "_table",
        "whole_texts",
        "_pending",
        "_held",
    )

    def __init__(
        self,
        tokenizer,
        table: list[bytes | None],
        skip_special_tokens: bool,
        texts: list[str | None] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self._table = table
        self.whole_texts = _whole_texts_of(tokenizer, table) if texts is None else texts
        self._pending = b""  # the decoder's buffer: bytes of an unfinished character
        self._held = ""  # decoded text not yet emitted: it ends in U+FFFD, or bytes are pending

    def _token_bytes(self, token_id: int) -> bytes:
        try:
            piece = self._table[token_id]
        except IndexError:
            piece = None
        if piece is None:  # an id outside the vocabulary: the wrapper's text of it
            text = self.tokenizer.decode([token_id], skip_special_tokens=self.skip_special_tokens)
            piece = text.encode("utf-8")
        return piece

    def add_token(self, token_id: int) -> str:
        """Append a token; return the newly complete text (possibly empty). This runs for
        every running sequence at every step: the table lookup and the append are inline.

        The whole-text path: with nothing pending or held, a token whose bytes are whole
        characters (``whole_texts``) is what the decode would emit, so it is appended as it is.
        """
        if not self._pending and not self._held:
            try:
                whole = self.whole_texts[token_id]
            except IndexError:
                whole = None
            if whole is not None:
                text = self.text  # grown in place, as in ``_append``
                self.text = ""
                text += whole
                self.text = text
                return whole
        try:
            data = self._table[token_id]
        except IndexError:
            data = None
        if data is None:
            data = self._token_bytes(token_id)
        if self._pending:
            data = self._pending + data
        decoded, consumed = _utf_8_decode(data, "replace", False)
        if consumed != len(data):
            self._pending = data[consumed:]
        elif self._pending:
            self._pending = b""
        if self._held:
            decoded = self._held + decoded
        if not decoded or decoded[-1] == "\ufffd" or self._pending:
            self._held = decoded
            return ""
        self._held = ""
        text = self.text  # grown in place, as in ``_append``
        self.text = ""
        text += decoded
        self.text = text
        return decoded

    def add_tokens(self, token_ids: list[int]) -> None:
        """Append several tokens at once, in one decode; the text then holds back what
        ``add_token`` of the last one would (an ``add_tokens`` then ``flush`` gives exactly
        what adding them one by one and flushing gives: one decode of the same bytes)."""
        data = self._pending + b"".join([self._token_bytes(t) for t in token_ids])
        decoded, consumed = _utf_8_decode(data, "replace", False)
        self._pending = data[consumed:]
        self._held += decoded
        if self._held and self._held[-1] != "\ufffd" and not self._pending:
            self._append(self._held)
            self._held = ""

    def _append(self, delta: str) -> None:
        # ``text`` is dropped from the object while it grows, so that CPython extends it in
        # place (a string with one reference): amortised O(len(delta)), not O(len(text)).
        text = self.text
        self.text = ""
        text += delta
        self.text = text

    def flush(self) -> str:
        """At the end, emit what is held back (an unfinished character decodes as U+FFFD)."""
        delta = self._held + _utf_8_decode(self._pending, "replace", True)[0]
        self._pending, self._held = b"", ""
        self._append(delta)
        return delta


def _whole_texts_of(tokenizer, table: list[bytes | None]) -> list[str | None]:
    """The whole-text table that goes with ``table`` when it is the tokenizer's own (the
    usual case); else none (every token takes the decode)."""
    own = byte_level_table(tokenizer)
    if own is not None:
        for skip, candidate in own.tables.items():
            if candidate is table:
                return own.texts[skip]
    return []


class FinalTextDetokenizer:
    """A byte-level detokenizer whose text nobody reads before the request ends (FINAL_ONLY,
    no stop strings): tokens are only recorded, and decoded together when ``text`` is read.

    Exact: after ``flush`` the recorded tokens go through ``ByteLevelDetokenizer.add_tokens``
    then its ``flush``, one decode of the same bytes as adding them one by one; without a
    flush (a request aborted while it ran) they are added one by one, as they would have been.
    ``add_token`` and ``flush`` return "" (no text is made before it is read)."""

    __slots__ = ("tokenizer", "_inner", "_ids", "_flushed")

    def __init__(self, inner: ByteLevelDetokenizer) -> None:
        self.tokenizer = inner.tokenizer
        self._inner = inner
        self._ids: list[int] = []
        self._flushed = False

    def add_token(self, token_id: int) -> str:
        self._ids.append(token_id)
        return ""

    def flush(self) -> str:
        self._flushed = True
        return ""

    @property
    def text(self) -> str:
        if self._ids or self._flushed:
            self._catch_up()
        return self._inner.text

    @text.setter
    def text(self, value: str) -> None:
        self._catch_up()
        self._inner.text = value

    def _catch_up(self) -> None:
        ids, self._ids = self._ids, []
        if self._flushed:
            self._flushed = False
            self._inner.add_tokens(ids)
            self._inner.flush()
        else:
            for token_id in ids:
                self._inner.add_token(token_id)


def detokenizer_for(
    tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True, final_text=False
) -> ByteLevelDetokenizer | FinalTextDetokenizer | IncrementalDetokenizer:
    """The fastest exact detokenizer for ``tokenizer``: the byte-level one where the
    tokenizer has a decode table (``final_text``: one whose text is read only at the end),
    else the windowed ``IncrementalDetokenizer``."""
    table = byte_level_table(tokenizer)
    if table is None:
        return IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
    detok = ByteLevelDetokenizer(
        tokenizer,
        table.tables[skip_special_tokens],
        skip_special_tokens,
        table.texts[skip_special_tokens],
    )
    return FinalTextDetokenizer(detok) if final_text else detok


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
