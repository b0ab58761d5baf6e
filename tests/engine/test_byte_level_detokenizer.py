"""ByteLevelDetokenizer (one incremental UTF-8 decoder over each token's bytes) gives the text of
today's windowed IncrementalDetokenizer, delta for delta, and the tokenizer's own decode of the
whole output, over random streams that split multi-byte characters, hold invalid bytes and
special tokens, with skip_special_tokens on and off."""

from __future__ import annotations

import random

import pytest
from test_detokenizer import TEXT, metaspace_tokenizer

from pagedserve.engine.detokenizer import (
    ByteLevelDetokenizer,
    FinalTextDetokenizer,
    IncrementalDetokenizer,
    byte_level_table,
    detokenizer_for,
)
from pagedserve.models import load_tokenizer


@pytest.fixture(scope="module", params=["smollm2", "gpt2"])
def tokenizer(request, tiny_checkpoint, default_model_path):
    if request.param == "smollm2":
        return load_tokenizer(default_model_path)
    return load_tokenizer(tiny_checkpoint(request.param))


def deltas(detok, outputs: list[int]) -> list[str]:
    return [*[detok.add_token(t) for t in outputs], detok.flush(), detok.text]


def random_stream(tokenizer, partial: list[int], rng: random.Random) -> list[int]:
    """Random ids, special tokens, pieces of multi-byte characters (alone they are invalid
    UTF-8) and runs of real text, in random order."""
    size = len(tokenizer)
    text_ids = tokenizer.encode(TEXT)
    pools = [
        lambda: rng.randrange(size),
        lambda: rng.choice(tokenizer.all_special_ids),
        lambda: rng.choice(partial),
        lambda: rng.choice(text_ids),
    ]
    return [rng.choice(pools)() for _ in range(rng.randrange(1, 48))]


def test_streams_equal_the_windowed_detokenizer_and_the_whole_decode(tokenizer):
    partial = [i for i in range(len(tokenizer)) if "\ufffd" in tokenizer.decode([i])]
    assert len(partial) > 10
    table = byte_level_table(tokenizer)
    assert table is not None
    rng = random.Random(5)
    for n in range(300):
        skip = bool(n % 2)
        prompt = tokenizer.encode(TEXT[: rng.randrange(len(TEXT))])  # whole characters
        outputs = random_stream(tokenizer, partial, rng)
        fast = ByteLevelDetokenizer(tokenizer, table.tables[skip], skip)
        got = deltas(fast, outputs)
        assert got == deltas(IncrementalDetokenizer(tokenizer, prompt, skip), outputs)
        assert got[-1] == tokenizer.decode(outputs, skip_special_tokens=skip)


def test_every_split_character_waits_for_its_last_byte(tokenizer):
    ids = tokenizer.encode(TEXT)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    detok = detokenizer_for(tokenizer, [], True)
    assert isinstance(detok, ByteLevelDetokenizer)
    got = deltas(detok, ids)
    assert not any("\ufffd" in d for d in got)
    assert "".join(got[:-1]) == got[-1] == TEXT


def test_held_invalid_bytes_and_ids_beyond_the_table(tokenizer):
    """A trailing U+FFFD (an invalid byte) waits for the next token, as in the window; at the
    end it is flushed. An id the table lacks takes the wrapper's text of it."""
    invalid = next(i for i in range(len(tokenizer)) if tokenizer.decode([i]) == "\ufffd")
    plain = tokenizer.encode(" ok")
    detok = detokenizer_for(tokenizer, [], True)
    assert detok.add_token(invalid) == ""
    assert detok.add_token(plain[0]) == "\ufffd" + tokenizer.decode(plain[:1])
    assert detok.add_token(invalid) == "" and detok.flush() == "\ufffd"
    beyond = len(byte_level_table(tokenizer).tables[True])
    detok = detokenizer_for(tokenizer, [], True)
    assert detok.add_token(beyond) == tokenizer.decode([beyond])


def test_a_prompt_that_ends_inside_a_character_reads_as_the_output_alone(tokenizer):
    """Raw prompt ids may end inside a character: the output is decoded on its own, as the
    tokenizer decodes it (the window would take the prompt's unfinished bytes into account)."""
    ids = tokenizer.encode("🙂🙂")
    split = next(k for k in range(1, len(ids)) if "\ufffd" in tokenizer.decode(ids[:k]))
    detok = detokenizer_for(tokenizer, ids[:split], True)
    assert deltas(detok, ids[split:])[-1] == tokenizer.decode(ids[split:])


def test_tokenizers_without_a_table_keep_the_windowed_detokenizer():
    tokenizer = metaspace_tokenizer()
    assert isinstance(detokenizer_for(tokenizer, [1], True), IncrementalDetokenizer)


def test_final_text_is_the_incremental_text_whether_flushed_or_not(tokenizer):
    """FINAL_ONLY's deferred decode: one decode at the end, or (unflushed, as an aborted
    request leaves it) token by token, gives the incremental detokenizer's text."""
    partial = [i for i in range(len(tokenizer)) if "\ufffd" in tokenizer.decode([i])]
    rng = random.Random(8)
    for n in range(100):
        skip, flush = bool(n % 2), bool(n % 3)
        outputs = random_stream(tokenizer, partial, rng)
        eager = detokenizer_for(tokenizer, [], skip)
        deferred = detokenizer_for(tokenizer, [], skip, final_text=True)
        assert isinstance(deferred, FinalTextDetokenizer)
        cut = rng.randrange(len(outputs) + 1)  # text read midway, then more tokens
        for detok in (eager, deferred):
            for t in outputs[:cut]:
                detok.add_token(t)
        assert deferred.text == eager.text
        for detok in (eager, deferred):
            for t in outputs[cut:]:
                detok.add_token(t)
            if flush:
                detok.flush()
        assert deferred.text == eager.text


def test_the_whole_text_path_emits_what_the_decode_emits(tokenizer):
    """A token whose bytes are whole characters is appended as its text, without a decode,
    when nothing is pending: the same random streams with that path off (no whole texts) give
    the same deltas, held-back bytes and split characters included."""
    partial = [i for i in range(len(tokenizer)) if "\ufffd" in tokenizer.decode([i])]
    table = byte_level_table(tokenizer)
    assert sum(t is not None for t in table.texts[True]) > len(tokenizer) // 2  # most tokens
    assert all(table.texts[True][i] is None for i in partial)
    rng = random.Random(9)
    for n in range(200):
        skip = bool(n % 2)
        outputs = random_stream(tokenizer, partial, rng)
        fast = ByteLevelDetokenizer(tokenizer, table.tables[skip], skip)
        assert fast.whole_texts is table.texts[skip]  # the path is on
        slow = ByteLevelDetokenizer(tokenizer, table.tables[skip], skip, texts=[])
        assert deltas(fast, outputs) == deltas(slow, outputs)
