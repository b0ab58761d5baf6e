"""A LLaVA through the engine, against transformers token for token (fp32, greedy): one image,
several of different sizes, a prompt chunked through its image, preemption, n > 1 and beams;
the encoder cache runs each picture once, and the prefix cache tells pictures apart."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.errors import InvalidRequestError
from pagedserve.models.testing import make_tiny_checkpoint
from pagedserve.models.testing_multimodal import (
    make_tiny_llava_checkpoint,
    tiny_test_images,
    transformers_llava_greedy,
)

MAX_TOKENS = 32
ONE = "USER: <image>\nWhat is in the picture? ASSISTANT:"
TWO = "USER: <image> and <image>\nCompare them. ASSISTANT:"
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def llava(tmp_path_factory) -> Path:
    return make_tiny_llava_checkpoint(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def images():
    return tiny_test_images()


def engine(folder: Path, **kw) -> LLM:
    kw.setdefault("max_model_len", 256)
    return LLM(model=str(folder), dtype="float32", **kw)


def generate(llm: LLM, prompt: str, pictures: list, params=GREEDY):
    (out,) = llm.generate(
        {"prompt": prompt, "multi_modal_data": {"image": pictures}}, params, use_tqdm=False
    )
    return out


def test_one_image_and_two_of_other_sizes_equal_transformers(llava, images):
    llm = engine(llava)
    for prompt, pictures in ((ONE, images[:1]), (TWO, images[1:3])):
        expected_prompt, expected = transformers_llava_greedy(llava, prompt, pictures, MAX_TOKENS)
        out = generate(llm, prompt, pictures)
        assert out.prompt_token_ids == expected_prompt  # placeholders expanded as the processor
        assert list(out.outputs[0].token_ids) == expected


def test_a_prompt_chunked_through_its_images_equals_transformers(llava, images):
    llm = engine(llava, max_num_batched_tokens=8, long_prefill_token_threshold=8)
    expected_prompt, expected = transformers_llava_greedy(llava, TWO, images[1:3], MAX_TOKENS)
    assert len(expected_prompt) > 3 * 8  # read in several chunks, each image split across two
    out = generate(llm, TWO, images[1:3])
    assert list(out.outputs[0].token_ids) == expected
    assert llm.engine.get_stats().encoder_cache_encoded == 2  # once per picture, not per chunk


def test_prefix_cache_and_encoder_cache_key_on_the_picture(llava, images):
    llm = engine(llava, enable_prefix_caching=True)
    cat, dog = images[0], images[1]
    first = generate(llm, ONE, [cat])
    other_picture = generate(llm, ONE, [dog])
    assert other_picture.num_cached_tokens == 0  # same tokens, other image: no block shared
    again = generate(llm, ONE, [cat.copy()])  # the same pixels, another object
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    stats = llm.engine.get_stats()
    assert stats.encoder_cache_encoded == 2  # cat and dog; cat again was not re-encoded


def test_preemption_n_and_beams_keep_the_images(llava, images):
    _, expected = transformers_llava_greedy(llava, ONE, images[:1], MAX_TOKENS)
    llm = engine(llava, num_gpu_blocks_override=12, block_size=8, max_num_seqs=4)
    two = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, n=2)
    outs = llm.generate(
        [{"prompt": ONE, "multi_modal_data": {"image": images[:1]}}] * 3, two, use_tqdm=False
    )
    assert llm.engine.get_stats().num_preemptions > 0
    assert all(list(c.token_ids) == expected for o in outs for c in o.outputs)
    beams = SamplingParams(
        n=2, best_of=2, use_beam_search=True, temperature=0, max_tokens=4, ignore_eos=True
    )
    out = generate(engine(llava), ONE, images[:1], beams)
    beam_tokens = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(beam_tokens)) == 2 and all(len(t) == 4 for t in beam_tokens)


def test_ngram_speculative_decoding_reads_image_prompts(llava, images):
    _, expected = transformers_llava_greedy(llava, TWO, images[:2], MAX_TOKENS)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = engine(llava, speculative_config=ngram)
    out = generate(llm, TWO, images[:2])
    assert list(out.outputs[0].token_ids) == expected
    assert llm.engine.get_stats().spec_decode_num_accepted_tokens > 0  # proposals did run


def test_image_count_limit_and_a_text_model_refuse_by_name(llava, images, tmp_path):
    llm = engine(llava, limit_mm_per_prompt={"image": 1})
    with pytest.raises(InvalidRequestError) as e:
        generate(llm, ONE, images[:2])
    assert e.value.param == "multi_modal_data" and "limit_mm_per_prompt" in str(e.value)
    for prompt, pictures in ((TWO, images[:1]), (ONE, [])):  # placeholders != images
        with pytest.raises(InvalidRequestError) as e:
            generate(llm, prompt, pictures)
        assert e.value.param == "multi_modal_data" and "placeholder" in str(e.value)
    with pytest.raises(InvalidRequestError) as e:
        llm.generate({"prompt": ONE}, GREEDY, use_tqdm=False)  # a placeholder, no image
    assert e.value.param == "multi_modal_data"
    assert not llm.engine.has_unfinished_requests()
    assert generate(llm, ONE, images[:1]).outputs[0].token_ids  # it still serves
    text_model = engine(make_tiny_checkpoint("llama", tmp_path / "text"))
    with pytest.raises(InvalidRequestError) as e:
        generate(text_model, "a prompt", images[:1])
    assert e.value.param == "multi_modal_data" and "text model" in str(e.value)


def test_adjacent_placeholders_and_a_transparent_picture_equal_transformers(llava, images):
    from PIL import Image

    clear = Image.new("RGBA", (30, 30), (0, 0, 0, 0))
    clear.paste((200, 10, 10, 255), (0, 0, 15, 30))  # half red, half transparent
    llm = engine(llava)
    for prompt, pictures in (
        ("USER: <image><image>\nCompare. ASSISTANT:", images[:2]),
        (ONE, [clear]),
    ):
        _, expected = transformers_llava_greedy(llava, prompt, pictures, MAX_TOKENS)
        assert list(generate(llm, prompt, pictures).outputs[0].token_ids) == expected


def test_chat_reads_image_pil_parts_and_refuses_urls(llava, images):
    llm = engine(llava)
    parts = [{"type": "image_pil", "image_pil": images[0]}, {"type": "text", "text": "What?"}]
    (chat,) = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)
    prompt = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "<image>\nWhat?"}], tokenize=False, add_generation_prompt=True
    )
    _, expected = transformers_llava_greedy(llava, prompt, images[:1], MAX_TOKENS)
    assert list(chat.outputs[0].token_ids) == expected
    url = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\].*'image_url'"):
        llm.chat([{"role": "user", "content": url}], GREEDY, use_tqdm=False)


def test_a_thin_strip_and_a_cache_smaller_than_an_image_are_refused(llava):
    from PIL import Image

    llm = engine(llava)
    with pytest.raises(InvalidRequestError) as e:
        generate(llm, ONE, [Image.new("RGB", (8192, 4))])  # gigabytes once scaled up
    assert e.value.param == "multi_modal_data" and "50x" in str(e.value)
    with pytest.raises(ValueError, match="encoder_cache_size 8 is less than one image"):
        engine(llava, encoder_cache_size=8)


def test_a_processor_template_that_reads_parts_renders_text_and_images(tmp_path, images):
    """llava-hf folders keep their chat template with the processor and read content as
    parts: the tokenizer takes it from chat_template.json, and the chat is rendered as parts,
    as transformers' processor renders it (plain strings would render no text at all)."""
    from transformers import AutoProcessor

    folder = make_tiny_llava_checkpoint(tmp_path / "llava-hf", processor_template=True)
    llm = engine(folder)
    parts = [{"type": "image_pil", "image_pil": images[0]}, {"type": "text", "text": "What?"}]
    (chat,) = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False)
    processor = AutoProcessor.from_pretrained(folder)
    conversation = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}
    ]
    prompt = processor.apply_chat_template(conversation, add_generation_prompt=True)
    assert "What?" in prompt
    expanded, expected = transformers_llava_greedy(folder, prompt, images[:1], MAX_TOKENS)
    assert chat.prompt_token_ids == expanded
    assert list(chat.outputs[0].token_ids) == expected
