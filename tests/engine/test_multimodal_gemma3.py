"""Gemma 3's vision-language model through the engine, against transformers token for token
(fp32, greedy): its image tokens attend to each other both ways (the attention kernels' key
limits), each image is read in one chunk however small the chunks, prompts cross the local
layers' sliding window, and each ``<start_of_image>`` is expanded as the processor expands it
in text (newlines merged at the seams)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve.engine import LLM, SamplingParams
from pagedserve.models.testing_gemma3 import make_tiny_gemma3_checkpoint, transformers_gemma3_greedy
from pagedserve.models.testing_multimodal import tiny_test_images

MAX_TOKENS = 24
ONE = "User: <start_of_image>What is in the picture? Assistant:"
TWO = "User:\n<start_of_image> and\n\n<start_of_image>\nCompare them. Assistant:"
TEXT = "User: Say something about pictures and colours, at some length. Assistant:"
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_tiny_gemma3_checkpoint(tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def images():
    return tiny_test_images()


def engine(folder: Path, **kw) -> LLM:
    kw.setdefault("max_model_len", 256)
    return LLM(model=str(folder), dtype="float32", **kw)


def request_of(prompt: str, pictures: list) -> dict:
    if not pictures:
        return {"prompt": prompt}
    return {"prompt": prompt, "multi_modal_data": {"image": pictures}}


def test_images_and_text_in_one_batch_equal_transformers(folder, images):
    cases = [(ONE, images[:1]), (TWO, images[1:3]), (TEXT, [])]
    expected = [transformers_gemma3_greedy(folder, p, pics, MAX_TOKENS) for p, pics in cases]
    outs = engine(folder).generate(
        [request_of(p, pics) for p, pics in cases], GREEDY, use_tqdm=False
    )
    for out, (expected_prompt, expected_tokens) in zip(outs, expected, strict=True):
        assert out.prompt_token_ids == expected_prompt  # newlines merged as in the text
        assert list(out.outputs[0].token_ids) == expected_tokens
    assert len(expected[1][0]) > 16 + 2 * 16  # the prompt crosses the local layers' window


def test_small_chunks_read_each_image_whole_and_equal_transformers(folder, images):
    llm = engine(folder, max_num_batched_tokens=20, long_prefill_token_threshold=6)
    expected_prompt, expected = transformers_gemma3_greedy(folder, TWO, images[:2], MAX_TOKENS)
    (out,) = llm.generate(request_of(TWO, images[:2]), GREEDY, use_tqdm=False)
    assert list(out.outputs[0].token_ids) == expected
    assert llm.engine.get_stats().encoder_cache_encoded == 2


def test_prefix_hits_preemption_and_n_equal_transformers(folder, images):
    _, expected = transformers_gemma3_greedy(folder, ONE, images[:1], MAX_TOKENS)
    llm = engine(folder, enable_prefix_caching=True, block_size=8)
    first, again = (
        llm.generate(request_of(ONE, [images[0].copy()]), GREEDY, use_tqdm=False)[0]
        for _ in range(2)
    )
    assert again.num_cached_tokens > 0
    assert list(first.outputs[0].token_ids) == list(again.outputs[0].token_ids) == expected
    llm = engine(folder, num_gpu_blocks_override=14, block_size=8, max_num_seqs=4)
    two = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)
    outs = llm.generate([request_of(ONE, images[:1])] * 3, two, use_tqdm=False)
    assert llm.engine.get_stats().num_preemptions > 0
    assert all(list(c.token_ids) == expected for o in outs for c in o.outputs)


def test_a_step_budget_smaller_than_an_image_is_refused_at_load(folder):
    with pytest.raises(ValueError, match="max_num_batched_tokens 12 is less than one image"):
        engine(folder, max_num_batched_tokens=12, encoder_cache_size=16)


def test_a_marker_without_an_image_is_refused_by_name(folder):
    from pagedserve.engine.errors import InvalidRequestError

    llm = engine(folder)
    with pytest.raises(InvalidRequestError) as e:
        llm.generate({"prompt": ONE}, GREEDY, use_tqdm=False)
    assert e.value.param == "multi_modal_data" and "<start_of_image>" in str(e.value)
    assert not llm.engine.has_unfinished_requests()


def test_a_processor_that_cuts_pan_and_scan_crops_is_refused_at_load(folder, tmp_path):
    import json
    import shutil

    copy = Path(shutil.copytree(folder, tmp_path / "pan-and-scan"))
    config = json.loads((copy / "processor_config.json").read_text())
    config["image_processor"]["do_pan_and_scan"] = True
    (copy / "processor_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="do_pan_and_scan"):
        engine(copy)


def test_ngram_speculation_and_beams_read_image_prompts(folder, images):
    _, expected = transformers_gemma3_greedy(folder, TWO, images[:2], MAX_TOKENS)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = engine(folder, speculative_config=ngram)
    (out,) = llm.generate(request_of(TWO, images[:2]), GREEDY, use_tqdm=False)
    assert list(out.outputs[0].token_ids) == expected
    assert llm.engine.get_stats().spec_decode_num_accepted_tokens > 0
    beams = SamplingParams(
        n=2, best_of=2, use_beam_search=True, temperature=0, max_tokens=4, ignore_eos=True
    )
    (out,) = engine(folder).generate(request_of(ONE, images[:1]), beams, use_tqdm=False)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 2


def test_a_prefix_hit_that_ends_inside_an_image_equals_transformers(folder, images):
    """The same picture under a new question: the hit's last block ends inside the image, so
    the rest of the image is computed in one chunk (its rows see the cached rows before them
    and each other both ways) and the answer is still transformers'."""
    other = "User: <start_of_image>Describe the colours. Assistant:"
    llm = engine(folder, enable_prefix_caching=True, block_size=16)
    llm.generate(request_of(ONE, images[:1]), GREEDY, use_tqdm=False)
    (out,) = llm.generate(request_of(other, [images[0].copy()]), GREEDY, use_tqdm=False)
    row_token = llm.engine.model_config.image_token_id  # <image_soft_token>
    rows = [i for i, token in enumerate(out.prompt_token_ids) if token == row_token]
    assert rows[0] < out.num_cached_tokens < rows[-1] + 1  # the hit ends inside the image
    assert (
        list(out.outputs[0].token_ids)
        == transformers_gemma3_greedy(folder, other, images[:1], MAX_TOKENS)[1]
    )
