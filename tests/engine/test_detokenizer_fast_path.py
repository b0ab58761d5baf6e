"""The byte-level decode table gives exactly the tokenizer's own decode, token for token."""

from __future__ import annotations

import random

import pytest
from test_detokenizer import TEXT, metaspace_tokenizer

from pagedserve.engine import detokenizer as detok_module
from pagedserve.engine.detokenizer import ByteLevelDecodeTable, IncrementalDetokenizer
from pagedserve.models import load_tokenizer


@pytest.fixture(scope="module", params=["smollm2", "llama", "gpt2"])
def tokenizer(request, tiny_checkpoint, default_model_path):
    if request.param == "smollm2":
        return load_tokenizer(default_model_path)
    return load_tokenizer(tiny_checkpoint(request.param))


def slow_stream(tokenizer, prompt, outputs, skip, monkeypatch) -> list[str]:
    with monkeypatch.context() as m:
        m.setattr(detok_module, "byte_level_table", lambda tok: None)
        return stream(tokenizer, prompt, outputs, skip)


def stream(tokenizer, prompt, outputs, skip) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip)
    deltas = [detok.add_token(t) for t in outputs]
    return [*deltas, detok.flush(), detok.text]


def test_every_token_decodes_as_the_tokenizer_decodes_it(tokenizer):
    table = ByteLevelDecodeTable.build(tokenizer)
    assert table is not None
    size = len(table.tables[False])
    assert size == len(tokenizer)
    for skip in (False, True):
        got = [table.decode([i], skip) for i in range(size)]
        want = tokenizer.batch_decode([[i] for i in range(size)], skip_special_tokens=skip)
        assert got == want
    specials = tokenizer.all_special_ids
    assert specials and all(table.decode([i], True) == "" for i in specials)
    assert any(table.decode([i], False) != "" for i in specials)


def test_random_windows_decode_as_the_tokenizer_decodes_them(tokenizer):
    table = ByteLevelDecodeTable.build(tokenizer)
    size, rng = len(tokenizer), random.Random(1)
    specials = tokenizer.all_special_ids
    multibyte = [i for i in range(size) if "\ufffd" in tokenizer.decode([i])]
    assert multibyte  # the windows cut UTF-8 characters
    for n in range(400):
        pool = [*specials, *multibyte] if n % 3 == 0 else range(size)
        ids = [rng.choice(pool) if n % 3 == 0 else rng.randrange(size) for _ in range(1 + n % 9)]
        skip = bool(n % 2)
        assert table.decode(ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert table.decode([size], False) is None  # beyond the vocabulary: the wrapper decides


@pytest.mark.parametrize("skip", [True, False])
def test_streams_equal_the_wrapper_path_delta_for_delta(tokenizer, skip, monkeypatch):
    rng = random.Random(2)
    text_ids = tokenizer.encode(TEXT)
    specials = tokenizer.all_special_ids
    for _ in range(20):
        prompt = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 9))]
        outputs = [
            rng.choice([rng.randrange(len(tokenizer)), rng.choice(specials), rng.choice(text_ids)])
            for _ in range(rng.randrange(1, 40))
        ]
        fast = stream(tokenizer, prompt, outputs, skip)
        assert fast == slow_stream(tokenizer, prompt, outputs, skip, monkeypatch)


def test_tokenizers_the_table_cannot_describe_keep_their_own_decode():
    tokenizer = metaspace_tokenizer()
    assert ByteLevelDecodeTable.build(tokenizer) is None
    assert IncrementalDetokenizer(tokenizer, [1])._table is None
