"""Incremental detokenization: multi-byte characters split over tokens, leading spaces, stops."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pagedserve.engine.detokenizer import IncrementalDetokenizer, find_stop_string
from pagedserve.models import load_tokenizer

TEXT = "Hello, world! 你好，世界。 🙂 party 🎉🚀 日本語のテキスト, ça va? Ünïcödé ∑ 𝄞 done."


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_checkpoint):
    return load_tokenizer(tiny_checkpoint("llama"))


def stream(tokenizer, prompt_ids, output_ids, skip_special_tokens=True):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    deltas = [detok.add_token(t) for t in output_ids]
    deltas.append(detok.flush())
    return detok, deltas


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_emoji_and_cjk_survive_streaming(which, tiny_tokenizer, default_model_path):
    tokenizer = tiny_tokenizer if which == "tiny" else load_tokenizer(default_model_path)
    prompt_ids = tokenizer.encode("Say it:")
    output_ids = tokenizer.encode(TEXT)
    # the test must exercise splits: some token alone is an incomplete UTF-8 sequence
    assert any("\ufffd" in tokenizer.decode([t]) for t in output_ids)
    detok, deltas = stream(tokenizer, prompt_ids, output_ids)
    assert "".join(deltas) == detok.text == tokenizer.decode(output_ids) == TEXT
    assert not any("\ufffd" in d for d in deltas)
    text = ""
    for delta in deltas:  # every partial text is a prefix of the final one
        text += delta
        assert TEXT.startswith(text)


def test_a_character_unfinished_at_the_end_is_flushed_as_replacement(tiny_tokenizer):
    ids = tiny_tokenizer.encode("ok 🎉")
    cut = next(i for i in range(len(ids), 0, -1) if "\ufffd" in tiny_tokenizer.decode(ids[:i]))
    detok, deltas = stream(tiny_tokenizer, [], ids[:cut])
    assert detok.text == tiny_tokenizer.decode(ids[:cut])
    assert "\ufffd" not in "".join(deltas[:-1]) and deltas[-1].endswith("\ufffd")


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style tokenizer: a word-start piece decodes without its space when it
    opens a decode ("▁world" -> "world"), with it after another piece."""
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "▁again": 3, "!": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_first_output_word_keeps_its_leading_space():
    tokenizer = metaspace_tokenizer()
    assert tokenizer.decode([2]) == "world"  # alone, the space is dropped
    detok, deltas = stream(tokenizer, [1], [2, 3, 4])
    assert detok.text == " world again!"
    assert deltas[0] == " world"


def test_stop_string_found_across_deltas():
    text = ""
    checked = 0
    hits = []
    for delta in ["The an", "sw", "er is 4", "2."]:
        text += delta
        hits.append(find_stop_string(text, len(text) - checked, ["answer", "42"]))
        checked = len(text)
    assert hits[:2] == [None, None]
    assert hits[2] == ("answer", 4)  # completed by the third delta, found from its start
    assert find_stop_string("ab42", 3, ["42", "b4"]) == ("b4", 1)  # the earliest start wins
    assert find_stop_string("x42", 1, ["x4"]) is None  # ended before the new text: seen before
