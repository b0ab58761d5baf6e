"""Each token's bytes, as a byte-level BPE decoder produces them: ``ByteLevelDecodeTable``.

For byte-level BPE tokenizers (GPT-2, SmolLM2, Llama-3, Qwen) a window's text is a pure function
of its tokens' bytes, so a token id -> bytes table built once per tokenizer gives the very same
string as the tokenizer's decode wrapper from a join and one UTF-8 decode, at a fraction of the
wrapper's cost. Tokenizers the table cannot represent (SentencePiece, byte fallback, WordPiece
clean-up) get no table (``byte_level_table`` returns None) and keep the wrapper. The table is
checked against the wrapper before it is used; the tests compare every token.
"""

from __future__ import annotations

import random
import weakref
from functools import lru_cache

_CHECK_WINDOW = 6  # the longest random window of the self check: IncrementalDetokenizer's
_SELF_CHECK_WINDOWS = 64  # random windows compared with the wrapper before the table is used


@lru_cache(maxsize=1)
def _alphabet_to_latin1() -> dict[int, int]:
    """The inverse of GPT-2's ``bytes_to_unicode`` as a ``str.translate`` table: each char of
    the byte-level alphabet -> the Latin-1 char of its byte. Chars below 256 that are not in the
    alphabet map to U+FFFF, so that a token holding one fails the Latin-1 encode."""
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = byte
        else:
            table[byte] = 0xFFFF
            table[256 + extra] = byte
            extra += 1
    return table


def _token_bytes(token: str, alphabet: dict[int, int]) -> bytes:
    """The byte-level decoder's bytes for one token: its alphabet bytes, else its UTF-8."""
    try:
        return token.translate(alphabet).encode("latin-1")
    except UnicodeEncodeError:
        return token.encode("utf-8")


class ByteLevelDecodeTable:
    """Each token's bytes, as the byte-level decoder produces them, for one tokenizer.

    The decoder maps a token whose every character is in the byte-level alphabet to those
    bytes, and any other token (an added token such as ``<|im_end|>`` with a space in it) to its
    UTF-8; the window's bytes are then decoded with U+FFFD for invalid sequences. Special tokens
    decode to nothing under ``skip_special_tokens``. ``build`` returns None for a tokenizer
    this does not describe exactly, and checks itself against the wrapper before it is used.
    """

    def __init__(self, with_special: list[bytes | None], skip_special: list[bytes | None]):
        self.tables = {False: with_special, True: skip_special}
        # each token's text where its bytes are whole characters on their own (most tokens):
        # ByteLevelDetokenizer appends it without a decode when nothing is pending
        self.texts = {skip: whole_texts(table) for skip, table in self.tables.items()}

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str | None:
        """The window's text, or None for an id the table does not hold (then: the wrapper)."""
        return decode_bytes(self.tables[skip_special_tokens], ids)

    @classmethod
    def build(cls, tokenizer) -> ByteLevelDecodeTable | None:
        from tokenizers import decoders

        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None or not isinstance(backend.decoder, decoders.ByteLevel):
            return None
        if getattr(tokenizer, "clean_up_tokenization_spaces", False) and (
            type(backend.model).__name__ != "BPE"
            or getattr(
                tokenizer,
                "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
                False,
            )
        ):
            return None  # the wrapper would rewrite spaces around punctuation
        alphabet = _alphabet_to_latin1()
        vocab = backend.get_vocab(with_added_tokens=True)
        with_special: list[bytes | None] = [None] * (max(vocab.values(), default=-1) + 1)
        for token, index in vocab.items():
            with_special[index] = _token_bytes(token, alphabet)
        skip_special = list(with_special)
        for index, added in backend.get_added_tokens_decoder().items():
            if added.special and index < len(skip_special):
                skip_special[index] = b""
        table = cls(with_special, skip_special)
        return table if table._agrees_with(tokenizer) else None

    def _agrees_with(self, tokenizer) -> bool:
        """Random windows (special tokens and multi-byte pieces included) decode as the wrapper
        decodes them; the tests compare every token and many more windows."""
        size = len(self.tables[False])
        rng = random.Random(0)
        for n in range(_SELF_CHECK_WINDOWS):
            ids = [rng.randrange(size) for _ in range(1 + n % (_CHECK_WINDOW + 1))]
            skip = bool(n % 2)
            if self.decode(ids, skip) != tokenizer.decode(ids, skip_special_tokens=skip):
                return False
        return True


def whole_texts(table: list[bytes | None]) -> list[str | None]:
    """Per token: its text when its bytes are valid UTF-8 that does not end in U+FFFD (the
    incremental decode emits such a token at once, whole, when nothing is pending), else
    None (a piece of a character, an invalid byte, an id the table lacks)."""
    texts: list[str | None] = [None] * len(table)
    for index, piece in enumerate(table):
        if piece is None:
            continue
        try:
            text = piece.decode("utf-8")
        except UnicodeDecodeError:
            continue
        if not text.endswith("\ufffd"):
            texts[index] = text
    return texts


def decode_bytes(table: list[bytes | None], ids: list[int]) -> str | None:
    """The text of ``ids`` from a token -> bytes table; None for an id it does not hold."""
    try:
        return b"".join([table[i] for i in ids]).decode("utf-8", "replace")
    except (IndexError, TypeError):
        return None


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def byte_level_table(tokenizer) -> ByteLevelDecodeTable | None:
    """The tokenizer's decode table (built on first use, kept as long as the tokenizer), or None
    when the tokenizer needs its own decode."""
    try:
        table = _TABLES[tokenizer]
    except KeyError:
        table = _TABLES[tokenizer] = ByteLevelDecodeTable.build(tokenizer)
    except TypeError:  # not weak-referenceable: build it each time
        table = ByteLevelDecodeTable.build(tokenizer)
    return table
