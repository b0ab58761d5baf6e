"""Gemma 3 (vision-language) against transformers on a tiny random checkpoint (fp32): the image
rows equal transformers' projected image features; the text embedding is transformers' scaled
one, and the decoder run from it gives transformers' logits on a text prompt past the sliding
window; every naming loads every parameter; the processor's batch is one 16-token image per
picture, pan-and-scan refused; the config of a real Gemma 3 4B builds its shapes. (A prompt
with images needs the image tokens' two-way attention in the paged kernels: not tested here.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoImageProcessor, AutoProcessor
from transformers import Gemma3ForConditionalGeneration as HFGemma3

from pagedserve.models import (
    ModelConfig,
    ModelForCausalLM,
    ModelLoadError,
    ParallelContext,
    load_model,
    processed_images,
)
from pagedserve.models.gemma3_mm import Gemma3ForConditionalGeneration
from pagedserve.models.pipeline import PipelineStage
from pagedserve.models.testing_gemma3 import (
    make_tiny_gemma3_checkpoint,
    transformers_gemma3_greedy,
)
from pagedserve.models.testing_multimodal import PagedSequence, tiny_test_images
from pagedserve.models.weights import iterate_weights

PROMPT = (
    "<|im_start|>user\nThe quick brown fox: <start_of_image> and then <start_of_image> which "
    "one is brighter?<|im_end|>\n<|im_start|>model\n"
)
# 76 tokens: text the tiny tokenizer was not trained on
TEXT_PROMPT = (
    "A tiny Gemma reads each image as sixteen rows; its local window slides past them, seven "
    "by seven, 2 + 2 = 4."
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_tiny_gemma3_checkpoint(tmp_path_factory.mktemp("gemma3"))


def _ours(folder: Path, weights=None) -> Gemma3ForConditionalGeneration:
    config = ModelConfig(model=str(folder), device="cpu", dtype="float32")
    model = Gemma3ForConditionalGeneration(config)
    model.load_weights(iterate_weights(config.model) if weights is None else weights)
    return model.eval()


def _hf(folder: Path) -> HFGemma3:
    return HFGemma3.from_pretrained(folder, dtype=torch.float32).eval()


def test_embed_images_equals_transformers_image_features(folder):
    pixels = AutoImageProcessor.from_pretrained(folder)(
        tiny_test_images()[:2], return_tensors="pt"
    )["pixel_values"]
    ours, hf = _ours(folder), _hf(folder)
    with torch.inference_mode():
        rows = torch.stack(ours.embed_images(list(pixels)))
        ref = hf.get_image_features(pixel_values=pixels).pooler_output
    assert rows.shape == ref.shape == (2, 16, ours.config.hidden_size)
    torch.testing.assert_close(rows, ref, atol=1e-5, rtol=1.3e-6)
    assert not torch.allclose(rows[0], rows[1], atol=1e-2)  # two images, two sets of rows


def test_embed_input_ids_is_transformers_scaled_embedding(folder):
    ours, hf = _ours(folder), _hf(folder)
    ids = torch.arange(ours.config.vocab_size)
    with torch.inference_mode():
        embedded = ours.embed_input_ids(ids)
        ref = hf.get_input_embeddings()(ids)
    torch.testing.assert_close(embedded, ref, atol=0, rtol=0)
    unscaled = hf.get_input_embeddings().weight
    torch.testing.assert_close(embedded, unscaled * 64**0.5)  # sqrt(hidden_size), once


def test_a_text_prompt_from_embeddings_gives_transformers_logits(folder):
    """The runner's path for an image prompt, without images: ``forward(inputs_embeds=
    embed_input_ids(ids))`` (no second scaling) and ``forward(ids)`` both give transformers'
    logits over a prompt longer than the local layer's window, then decode over the cache."""
    ours, hf = _ours(folder), _hf(folder)
    tokenizer = AutoProcessor.from_pretrained(folder).tokenizer
    ids = torch.tensor(tokenizer(TEXT_PROMPT)["input_ids"])
    assert len(ids) > 2 * ours.config.sliding_windows[0]
    with torch.inference_mode():
        ref = hf(input_ids=ids[None]).logits[0]
        from_ids = PagedSequence(ours.config).run(ours, ids)
        sequence = PagedSequence(ours.config)
        logits = sequence.run(ours, ids, inputs_embeds=ours.embed_input_ids(ids))
        torch.testing.assert_close(from_ids, ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
        tokens = [int(logits[-1].argmax())]
        for _ in range(3):
            tokens.append(int(sequence.run(ours, torch.tensor(tokens[-1:]))[-1].argmax()))
        expected = hf.generate(ids[None], max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert tokens == expected[0, len(ids) :].tolist()


def test_transformers_reference_decodes_over_its_own_cache_as_recomputed(folder):
    """transformers_gemma3_greedy (its own cache, image blocks two-way at prefill) equals
    recomputing the whole sequence every step: the reference an engine test will be held to."""
    images = tiny_test_images()[:2]
    prompt_ids, tokens = transformers_gemma3_greedy(folder, PROMPT, images, 6)
    inputs = AutoProcessor.from_pretrained(folder)(text=PROMPT, images=images, return_tensors="pt")
    assert inputs["input_ids"][0].tolist() == prompt_ids
    assert len(prompt_ids) > 3 * 16  # past the local layer's window
    hf, ids, types = _hf(folder), inputs["input_ids"], inputs["token_type_ids"]
    recomputed = []
    with torch.inference_mode():
        for _ in range(6):
            logits = hf(
                input_ids=ids, pixel_values=inputs["pixel_values"], token_type_ids=types
            ).logits
            recomputed.append(int(logits[0, -1].argmax()))
            ids = torch.cat([ids, torch.tensor([[recomputed[-1]]])], dim=1)
            types = torch.cat([types, torch.zeros(1, 1, dtype=types.dtype)], dim=1)
    assert tokens == recomputed


def _google_name(name: str) -> str:
    """transformers 5's name of a Gemma 3 tensor -> the google/gemma-3 repositories'."""
    if name.startswith("model.vision_tower."):
        return "vision_tower.vision_model." + name.removeprefix("model.vision_tower.")
    if name.startswith("model.language_model."):
        return "language_model.model." + name.removeprefix("model.language_model.")
    if name.startswith("lm_head."):
        return "language_model." + name
    return name.removeprefix("model.")


def test_every_naming_loads_every_parameter_alike(folder):
    """What save_pretrained writes (the folder), transformers 5's state dict and Google's
    names load the same parameters; load_weights refuses to finish with any left unloaded."""
    saved_model = load_model(ModelConfig(model=str(folder), device="cpu", dtype="float32"))
    assert isinstance(saved_model, ModelForCausalLM)
    saved = saved_model.state_dict()
    v5 = {name: t.clone() for name, t in _hf(folder).state_dict().items()}
    google = {_google_name(name): t for name, t in v5.items()}
    assert any(n.startswith("vision_tower.vision_model.") for n in google)
    for weights in (v5, google):
        loaded = _ours(folder, weights.items()).state_dict()
        assert loaded.keys() == saved.keys()
        assert all(torch.equal(loaded[name], t) for name, t in saved.items())
    with pytest.raises(ModelLoadError):
        _ours(folder, [(n, t) for n, t in v5.items() if "mm_soft_emb_norm" not in n])
    with pytest.raises(ModelLoadError, match="belongs to no part"):
        _ours(folder, [("text_model.embeddings.weight", torch.zeros(1))])


def test_processed_images_are_one_16_token_image_each(folder):
    config = ModelConfig(model=str(folder), device="cpu")
    image_processor = AutoImageProcessor.from_pretrained(folder)
    batch = image_processor(images=tiny_test_images(), return_tensors="pt")
    images = processed_images(config, batch)
    assert [i.num_tokens for i in images] == [16, 16, 16]
    assert all(i.grid_thw is None for i in images)
    assert torch.equal(torch.stack([i.pixel_values for i in images]), batch["pixel_values"])
    inputs = AutoProcessor.from_pretrained(folder)(
        text=PROMPT, images=tiny_test_images()[:2], return_tensors="pt"
    )
    ids, c = inputs["input_ids"][0], config.hf_config
    assert int((ids == config.image_token_id).sum()) == 2 * 16
    assert torch.equal(inputs["token_type_ids"][0].bool(), ids == config.image_token_id)
    for marker in ("boi_token_index", "eoi_token_index"):
        assert int((ids == c[marker]).sum()) == 2
    wide = tiny_test_images()[0].resize((160, 32))
    pan_and_scan = dict(
        do_pan_and_scan=True, pan_and_scan_min_crop_size=16, pan_and_scan_max_num_crops=4,
        pan_and_scan_min_ratio_to_activate=1.2,
    )  # fmt: skip
    crops = image_processor(images=[wide], return_tensors="pt", **pan_and_scan)
    assert len(crops["pixel_values"]) > 1
    with pytest.raises(ValueError, match="do_pan_and_scan"):
        processed_images(config, crops)


def _write_config(folder: Path, tmp_path: Path, **changes) -> str:
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        section, _, field = key.rpartition("__")
        (config[section] if section else config)[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_what_is_not_supported_is_refused_by_name(folder, tmp_path):
    from pagedserve.models.lora import LoRAModel

    config = ModelConfig(model=str(folder), device="cpu")
    for par, field in [
        (ParallelContext(tp_size=2), "tensor_parallel_size"),
        (ParallelContext(stage=PipelineStage(0, 2)), "pipeline_parallel_size"),
    ]:
        with pytest.raises(ValueError, match=field):
            Gemma3ForConditionalGeneration(config, par)
    with pytest.raises(ValueError, match="quantization"):
        Gemma3ForConditionalGeneration(ModelConfig(model=str(folder), quantization="int8"))
    with pytest.raises(ValueError, match="convert"):
        load_model(ModelConfig(model=str(folder), convert="embed"))
    model = _ours(folder)
    with pytest.raises(ValueError, match="not supported for Gemma3ForConditionalGeneration"):
        LoRAModel(model, model.config, max_loras=1, max_rank=8)
    with pytest.raises(ValueError, match="vision_config.image_size"):
        model.embed_images([torch.zeros(3, 40, 40)])
    with pytest.raises(ValueError, match="grid_thw"):
        model.embed_images([torch.zeros(3, 32, 32)], [(1, 8, 8)])
    bad = {
        "vision_config__model_type": ("clip_vision_model", "vision_config.model_type"),
        "text_config__model_type": ("gemma2", "text_config.model_type"),
        "mm_tokens_per_image": (15, "mm_tokens_per_image"),  # not a square
        "mm_tokens_per_image@": (9, "mm_tokens_per_image"),  # 3 does not divide the 8-patch side
    }
    for key, (value, field) in bad.items():
        path = _write_config(folder, tmp_path, **{key.rstrip("@"): value})
        with pytest.raises(ValueError, match=field):
            Gemma3ForConditionalGeneration(ModelConfig(model=path, device="cpu"))


# google/gemma-3-4b-it's config.json: only what differs from transformers' defaults
GEMMA3_4B_CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
    "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
    "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
    "text_config": {
        "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "torch_dtype": "bfloat16",
    "vision_config": {
        "hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
        "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
        "patch_size": 14, "vision_use_head": False,
    },
}  # fmt: skip


def test_the_config_of_gemma3_4b_builds_its_shapes(tmp_path):
    from pagedserve.models.gemma3_mm import gemma3_images

    (tmp_path / "config.json").write_text(json.dumps(GEMMA3_4B_CONFIG))
    config = ModelConfig(model=str(tmp_path), device="cpu")
    shape = (config.hidden_size, config.num_layers, config.num_attention_heads, config.head_dim)
    assert shape == (2560, 34, 8, 256) and config.num_kv_heads == 4
    assert (config.vocab_size, config.image_token_id) == (262208, 262144)
    assert config.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert config.sliding_windows[0] == 1024 and config.sliding_windows[5] is None
    with torch.device("meta"):
        model = Gemma3ForConditionalGeneration(config)
    assert model.bidirectional_images
    lm = model.language_model
    assert lm.lm_head.weight is lm.model.embed_tokens.weight
    assert tuple(lm.model.embed_tokens.weight.shape) == (262208, 2560)
    assert lm.model.layers[0].self_attn.q_norm is not None  # Gemma 3's, not Gemma 2's
    assert lm.model.layers[5].self_attn.rotary_emb is not lm.model.layers[0].self_attn.rotary_emb
    tower = model.vision_tower
    assert tuple(tower.embeddings.patch_embedding.weight.shape) == (1152, 3, 14, 14)
    assert tuple(tower.embeddings.position_embedding.weight.shape) == (4096, 1152)
    assert len(tower.encoder.layers) == 27
    projector = model.multi_modal_projector
    assert tuple(projector.mm_input_projection_weight.shape) == (1152, 2560)
    assert projector.kernel_size == 4  # a 64 x 64 patch grid pooled to 16 x 16
    batch = {"pixel_values": torch.zeros(2, 3, 896, 896), "num_crops": torch.tensor([0, 0])}
    assert [i.num_tokens for i in gemma3_images(config.hf_config, batch)] == [256, 256]
