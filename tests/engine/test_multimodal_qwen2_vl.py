"""Qwen2-VL and Qwen2.5-VL through the engine, against transformers token for token (fp32,
greedy): images of different sizes (so of different token counts), text-only prompts beside
image prompts in one step, a prompt chunked through its images, preemption, n > 1 and ngram
speculative decoding (whose proposals need M-RoPE positions past the prompt)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve.engine import LLM, SamplingParams
from pagedserve.models.testing_multimodal import (
    make_tiny_qwen2_vl_checkpoint,
    tiny_test_images,
    transformers_qwen2_vl_greedy,
)

MAX_TOKENS = 32
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
ONE = f"User: {IMAGE}What is in the picture? Assistant:"
TWO = f"User: {IMAGE} and {IMAGE}Compare them. Assistant:"
TEXT = "User: Say something about pictures. Assistant:"
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def folder(request, tmp_path_factory) -> Path:
    return make_tiny_qwen2_vl_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def images():
    return tiny_test_images()


def engine(folder: Path, **kw) -> LLM:
    kw.setdefault("max_model_len", 512)
    return LLM(model=str(folder), dtype="float32", **kw)


def request_of(prompt: str, pictures: list) -> dict:
    if not pictures:
        return {"prompt": prompt}
    return {"prompt": prompt, "multi_modal_data": {"image": pictures}}


def test_images_of_other_sizes_and_text_in_one_batch_equal_transformers(folder, images):
    cases = [(ONE, images[:1]), (TWO, images[1:3]), (TEXT, []), (ONE, images[2:3])]
    expected = [transformers_qwen2_vl_greedy(folder, p, pics, MAX_TOKENS) for p, pics in cases]
    counts = {len(ids) for ids, _ in expected[:2]}
    assert len(counts) == 2  # pictures of other sizes take other numbers of tokens
    outs = engine(folder).generate(
        [request_of(p, pics) for p, pics in cases], GREEDY, use_tqdm=False
    )
    for out, (expected_prompt, expected_tokens) in zip(outs, expected, strict=True):
        assert out.prompt_token_ids == expected_prompt  # expanded as the processor expands
        assert list(out.outputs[0].token_ids) == expected_tokens


def test_a_prompt_chunked_through_its_images_equals_transformers(folder, images):
    llm = engine(folder, max_num_batched_tokens=8, long_prefill_token_threshold=8)
    expected_prompt, expected = transformers_qwen2_vl_greedy(folder, TWO, images[:2], MAX_TOKENS)
    assert len(expected_prompt) > 3 * 8
    (out,) = llm.generate(request_of(TWO, images[:2]), GREEDY, use_tqdm=False)
    assert list(out.outputs[0].token_ids) == expected
    assert llm.engine.get_stats().encoder_cache_encoded == 2  # once per picture, not per chunk


def test_prefix_hits_keep_m_rope_positions(folder, images):
    llm = engine(folder, enable_prefix_caching=True)
    _, expected = transformers_qwen2_vl_greedy(folder, ONE, images[1:2], MAX_TOKENS)
    first, again = (
        llm.generate(request_of(ONE, [images[1].copy()]), GREEDY, use_tqdm=False)[0]
        for _ in range(2)
    )
    assert again.num_cached_tokens > 0
    assert list(first.outputs[0].token_ids) == list(again.outputs[0].token_ids) == expected


def test_preemption_n_and_ngram_speculation_equal_transformers(folder, images):
    _, expected = transformers_qwen2_vl_greedy(folder, ONE, images[:1], MAX_TOKENS)
    llm = engine(folder, num_gpu_blocks_override=12, block_size=8, max_num_seqs=4)
    two = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)
    outs = llm.generate([request_of(ONE, images[:1])] * 3, two, use_tqdm=False)
    assert llm.engine.get_stats().num_preemptions > 0
    assert all(list(c.token_ids) == expected for o in outs for c in o.outputs)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = engine(folder, speculative_config=ngram)
    (out,) = llm.generate(request_of(ONE, images[:1]), GREEDY, use_tqdm=False)
    assert list(out.outputs[0].token_ids) == expected
    assert llm.engine.get_stats().spec_decode_num_accepted_tokens > 0


def test_beam_search_forks_keep_their_m_rope_positions(folder, images):
    """Beams fork from the prompt's blocks and carry its images, so every beam's positions
    past the prompt are its sequence positions plus the prompt's shift: the best beam of width
    one is the greedy answer, and wider beams are distinct."""
    _, expected = transformers_qwen2_vl_greedy(folder, ONE, images[:1], 6)
    llm = engine(folder)
    width_one = SamplingParams(
        n=1, best_of=1, use_beam_search=True, temperature=0, max_tokens=6, ignore_eos=True
    )
    (out,) = llm.generate(request_of(ONE, images[:1]), width_one, use_tqdm=False)
    assert list(out.outputs[0].token_ids) == expected
    beams = SamplingParams(
        n=2, best_of=2, use_beam_search=True, temperature=0, max_tokens=4, ignore_eos=True
    )
    (out,) = llm.generate(request_of(ONE, images[:1]), beams, use_tqdm=False)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 2


def test_mm_processor_kwargs_cap_an_images_tokens_as_the_processor_would(folder, images, tmp_path):
    """``--mm-processor-kwargs '{"max_pixels": 1024}'`` (vLLM's way to bound Qwen2-VL's tokens
    an image): the 64 x 64 picture takes 16 tokens, not 36, and the answer equals transformers
    over a folder whose processor is configured so."""
    import json
    import shutil

    capped = Path(shutil.copytree(folder, tmp_path / "capped"))
    config = json.loads((capped / "preprocessor_config.json").read_text())
    config["size"]["longest_edge"] = 1024
    (capped / "preprocessor_config.json").write_text(json.dumps(config))
    expected_prompt, expected = transformers_qwen2_vl_greedy(capped, ONE, images[1:2], MAX_TOKENS)
    llm = engine(folder, mm_processor_kwargs={"max_pixels": 1024})
    assert llm.engine.image_processor.max_image_tokens == 16
    (out,) = llm.generate(request_of(ONE, images[1:2]), GREEDY, use_tqdm=False)
    assert out.prompt_token_ids == expected_prompt
    assert list(out.outputs[0].token_ids) == expected


def test_mm_processor_kwargs_the_processor_or_the_tower_cannot_take_are_refused(folder, tmp_path):
    from pagedserve.models.testing import make_tiny_checkpoint

    for kwargs, words in [
        ({"max_pixel": 1024}, "mm_processor_kwargs.max_pixel: not a setting"),
        ({"patch_size": 8}, "mm_processor_kwargs.patch_size: the model's tower is built for"),
    ]:
        with pytest.raises(ValueError, match=words):
            engine(folder, mm_processor_kwargs=kwargs)
    text_model = make_tiny_checkpoint("llama", tmp_path / "text")
    with pytest.raises(ValueError, match="mm_processor_kwargs: .* is a text model"):
        engine(text_model, mm_processor_kwargs={"max_pixels": 1024})
