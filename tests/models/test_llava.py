"""LLaVA-1.5 against transformers on a tiny random checkpoint (fp32): the image rows equal
transformers' projected image features; a prompt with image rows scattered into its text
embeddings, run through the paged KV cache, gives transformers' logits and greedy tokens; both
checkpoint namings load the same model; what is not supported is refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoProcessor
from transformers import LlavaForConditionalGeneration as HFLlava

from pagedserve.models import (
    ModelConfig,
    ModelForCausalLM,
    ModelLoadError,
    ParallelContext,
    load_model,
)
from pagedserve.models.llava import LlavaForConditionalGeneration, image_tokens_per_image
from pagedserve.models.pipeline import PipelineStage
from pagedserve.models.testing_multimodal import (
    PagedSequence,
    make_tiny_llava_checkpoint,
    tiny_test_images,
    transformers_llava_greedy,
)
from pagedserve.models.weights import iterate_weights

STRATEGIES = ["default", "full"]
PROMPT = "USER: <image>\n<image>\nWhich one is brighter? ASSISTANT:"
# llava-hf/llava-1.5-7b-hf's config.json as the hub has it: only what differs from defaults
LLAVA_15_7B_CONFIG = {
    "architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100,
    "image_token_index": 32000, "model_type": "llava", "pad_token_id": 32001,
    "projector_hidden_act": "gelu", "tie_word_embeddings": False, "torch_dtype": "float16",
    "text_config": {
        "_name_or_path": "lmsys/vicuna-7b-v1.5", "architectures": ["LlamaForCausalLM"],
        "max_position_embeddings": 4096, "model_type": "llama", "rms_norm_eps": 1e-05,
        "torch_dtype": "float16", "vocab_size": 32064,
    },
    "vision_config": {
        "hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
        "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
        "patch_size": 14, "projection_dim": 768, "vocab_size": 32000,
    },
    "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064,
}  # fmt: skip


@pytest.fixture(scope="module")
def llava_folder(tmp_path_factory):
    """``llava_folder(strategy) -> path``, each built once."""
    made: dict[str, Path] = {}

    def make(strategy: str) -> Path:
        if strategy not in made:
            path = tmp_path_factory.mktemp(f"llava_{strategy}")
            made[strategy] = make_tiny_llava_checkpoint(path, strategy=strategy)
        return made[strategy]

    return make


def _ours(folder: Path, weights=None) -> LlavaForConditionalGeneration:
    config = ModelConfig(model=str(folder), device="cpu", dtype="float32")
    model = LlavaForConditionalGeneration(config)
    model.load_weights(iterate_weights(config.model) if weights is None else weights)
    return model.eval()


def _hf(folder: Path) -> HFLlava:
    return HFLlava.from_pretrained(folder, dtype=torch.float32).eval()


def _prompt_embeds(model: LlavaForConditionalGeneration, ids: torch.Tensor, pixels) -> torch.Tensor:
    """The prompt's rows as the engine builds them: text embeddings, each placeholder's row
    replaced, in order, by the images' rows."""
    embeds = model.embed_input_ids(ids)
    image_rows = torch.cat(model.embed_images(list(pixels)))
    embeds[ids == model.config.image_token_id] = image_rows
    return embeds


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_embed_images_equals_transformers_image_features(llava_folder, strategy):
    folder = llava_folder(strategy)
    pixels = AutoProcessor.from_pretrained(folder).image_processor(
        tiny_test_images()[:2], return_tensors="pt"
    )["pixel_values"]
    ours, hf = _ours(folder), _hf(folder)
    with torch.inference_mode():
        rows = torch.stack(ours.embed_images(list(pixels)))
        ref = torch.stack(list(hf.get_image_features(pixel_values=pixels).pooler_output))
    tokens = image_tokens_per_image(ours.config.hf_config, 32, 32)
    assert rows.shape == ref.shape == (2, tokens, ours.config.hidden_size)
    assert tokens == 16 + (strategy == "full")
    torch.testing.assert_close(rows, ref, atol=1e-5, rtol=1.3e-6)
    assert not torch.allclose(rows[0], rows[1], atol=1e-2)  # two images, two sets of rows


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_prompt_with_images_gives_transformers_logits_and_tokens(llava_folder, strategy):
    """Prefill from the scattered rows, then decode from ids alone over the same cache."""
    folder = llava_folder(strategy)
    images = tiny_test_images()[1:]
    inputs = AutoProcessor.from_pretrained(folder)(text=PROMPT, images=images, return_tensors="pt")
    ids = inputs["input_ids"][0]
    ours, hf = _ours(folder), _hf(folder)
    per_image = image_tokens_per_image(ours.config.hf_config, 32, 32)
    assert int((ids == ours.config.image_token_id).sum()) == 2 * per_image
    sequence = PagedSequence(ours.config)
    with torch.inference_mode():
        embeds = _prompt_embeds(ours, ids, inputs["pixel_values"])
        logits = sequence.run(ours, ids, inputs_embeds=embeds)
        ref = hf(**inputs).logits[0]
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=1e-4)
        tokens = [int(logits[-1].argmax())]
        for _ in range(3):
            tokens.append(int(sequence.run(ours, torch.tensor(tokens[-1:]))[-1].argmax()))
    ref_ids, ref_tokens = transformers_llava_greedy(folder, PROMPT, images, 4)
    assert ref_ids == ids.tolist()
    assert tokens == ref_tokens


def _legacy_name(name: str) -> str:
    """transformers 5's name of a LLaVA tensor -> the llava-hf repos' (transformers 4's)."""
    if name.startswith("model.language_model."):
        return "language_model.model." + name.removeprefix("model.language_model.")
    if name.startswith("lm_head."):
        return "language_model." + name
    if name.startswith("model.vision_tower."):
        return "vision_tower.vision_model." + name.removeprefix("model.vision_tower.")
    return name.removeprefix("model.")


def test_both_checkpoint_namings_load_the_same_model(llava_folder, tmp_path):
    """transformers 5's names (its state_dict), the llava-hf repos' (which transformers also
    loads, checked here), and what save_pretrained writes give the same parameters."""
    folder = llava_folder("default")
    hf = _hf(folder)
    v5 = {name: t.clone() for name, t in hf.state_dict().items()}
    legacy = {_legacy_name(name): t for name, t in v5.items()}
    assert any(n.startswith("vision_tower.vision_model.") for n in legacy)
    legacy_folder = Path(shutil.copytree(folder, tmp_path / "legacy"))
    save_file(legacy, legacy_folder / "model.safetensors", metadata={"format": "pt"})
    reloaded = _hf(legacy_folder).state_dict()
    assert all(torch.equal(reloaded[name], t) for name, t in v5.items())
    saved_model = load_model(ModelConfig(model=str(folder), device="cpu", dtype="float32"))
    assert isinstance(saved_model, ModelForCausalLM)
    saved = saved_model.state_dict()
    for weights in (v5, legacy):
        loaded = _ours(folder, weights.items()).state_dict()
        assert loaded.keys() == saved.keys()
        assert all(torch.equal(loaded[name], t) for name, t in saved.items())
    with pytest.raises(ModelLoadError, match="belongs to no part"):
        _ours(folder, [("text_model.embeddings.weight", torch.zeros(1))])


def test_config_reads_the_decoder_from_text_config(llava_folder, tmp_path):
    config = ModelConfig(model=str(llava_folder("default")), device="cpu")
    assert (config.hidden_size, config.num_layers, config.num_kv_heads) == (64, 2, 2)
    assert config.hf_config["vision_config"]["hidden_size"] == 32
    assert config.image_token_id == AutoProcessor.from_pretrained(config.model).image_token_id
    (tmp_path / "config.json").write_text(json.dumps(LLAVA_15_7B_CONFIG))
    real = ModelConfig(model=str(tmp_path), device="cpu")  # defaults as transformers fills them
    assert (real.hidden_size, real.num_layers, real.num_attention_heads) == (4096, 32, 32)
    assert (real.vocab_size, real.max_model_len, real.image_token_id) == (32064, 4096, 32000)
    assert real.hf_config["vision_config"]["hidden_act"] == "quick_gelu"
    assert image_tokens_per_image(real.hf_config, 336, 336) == 576


def _write_config(folder: Path, tmp_path: Path, **changes) -> str:
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        section, _, field = key.rpartition("__")
        (config[section] if section else config)[field] = value
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_what_is_not_supported_is_refused_by_name(llava_folder, tmp_path):
    from pagedserve.models.lora import LoRAModel

    folder = llava_folder("default")
    config = ModelConfig(model=str(folder), device="cpu")
    for par, field in [
        (ParallelContext(tp_size=2), "tensor_parallel_size"),
        (ParallelContext(stage=PipelineStage(0, 2)), "pipeline_parallel_size"),
    ]:
        with pytest.raises(ValueError, match=field):
            LlavaForConditionalGeneration(config, par)
    with pytest.raises(ValueError, match="quantization"):
        LlavaForConditionalGeneration(ModelConfig(model=str(folder), quantization="int8"))
    with pytest.raises(ValueError, match="convert"):
        load_model(ModelConfig(model=str(folder), convert="embed"))
    config.gguf_file = folder / "model.gguf"
    with pytest.raises(ValueError, match="Hugging Face folder"):
        LlavaForConditionalGeneration(config)
    model = _ours(folder)
    with pytest.raises(ValueError, match="not supported for LlavaForConditionalGeneration"):
        LoRAModel(model, model.config, max_loras=1, max_rank=8)
    with pytest.raises(ValueError, match="vision_config.image_size"):
        model.embed_images([torch.zeros(3, 40, 40)])
    with pytest.raises(ValueError, match="vision_config.image_size"):
        image_tokens_per_image(model.config.hf_config, 24, 40)
    bad = {
        "vision_feature_select_strategy": "vision_feature_select_strategy",
        "vision_config__model_type": "vision_config.model_type",
        "text_config__model_type": "text_config.model_type",
    }
    for key, field in bad.items():
        path = _write_config(folder, tmp_path, **{key: "siglip_vision_model"})
        with pytest.raises(ValueError, match=field):
            LlavaForConditionalGeneration(ModelConfig(model=path, device="cpu"))
    # a decoder pagedserve builds for another vision model is not LLaVA's
    path = _write_config(folder, tmp_path, text_config__model_type="gemma3_text")
    with pytest.raises(ModelLoadError, match="text_config.model_type"):
        LlavaForConditionalGeneration(ModelConfig(model=path, device="cpu"))
