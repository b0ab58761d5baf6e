"""Qwen2-VL's model side: M-RoPE positions equal transformers' ``get_rope_index`` for any run
of a prompt's positions and past it; the processor's batch is cut into images by their grids;
both checkpoint namings load; what it does not run with is refused at load."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.engine.multimodal import ImageInput
from pagedserve.models import ModelConfig, load_model, processed_images
from pagedserve.models.qwen2_vl import mrope_positions
from pagedserve.models.testing_multimodal import (
    make_tiny_qwen2_vl_checkpoint,
    qwen2_vl_processor,
    tiny_test_images,
)

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_qwen2_vl_checkpoint(tmp_path_factory.mktemp("qwen2_vl"), "qwen2_vl")


def _transformers_rope_index(folder, prompt, pictures):
    from transformers import Qwen2VLForConditionalGeneration

    processor = qwen2_vl_processor(folder)
    inputs = processor(text=prompt, images=pictures, return_tensors="pt")
    model = Qwen2VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    positions, delta = model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"]
    )
    return inputs, positions[:, 0].numpy(), int(delta)


def _images(folder, inputs) -> list[ImageInput]:
    config = ModelConfig(model=str(folder))
    ids = inputs["input_ids"][0].tolist()
    starts = [i for i, t in enumerate(ids) if t == config.image_token_id and ids[i - 1] != t]
    return [
        ImageInput(start, image.num_tokens, bytes(1), image.pixel_values, image.grid_thw)
        for start, image in zip(starts, processed_images(config, inputs), strict=True)
    ]


def test_m_rope_positions_equal_transformers_in_chunks_and_after(folder):
    prompt = f"Look: {IMAGE} then {IMAGE}{IMAGE} done."
    inputs, expected, delta = _transformers_rope_index(folder, prompt, tiny_test_images())
    images = _images(folder, inputs)
    assert len(images) == 3 and len({image.grid_thw for image in images}) == 3
    length = expected.shape[1]
    whole = mrope_positions(np.arange(length), images, 2)
    np.testing.assert_array_equal(whole, expected)
    for start in range(0, length, 7):  # any chunk is the same as its part of the whole
        chunk = np.arange(start, min(start + 7, length))
        np.testing.assert_array_equal(mrope_positions(chunk, images, 2), expected[:, chunk])
    later = np.arange(length, length + 5)  # decoding: sequence position + transformers' delta
    np.testing.assert_array_equal(mrope_positions(later, images, 2), np.stack([later + delta] * 3))


def test_processed_images_cut_the_batch_by_grid(folder):
    from transformers import AutoImageProcessor

    config = ModelConfig(model=str(folder))
    batch = AutoImageProcessor.from_pretrained(folder)(
        images=tiny_test_images(), return_tensors="pt"
    )
    images = processed_images(config, batch)
    assert [tuple(g) for g in batch["image_grid_thw"].tolist()] == [i.grid_thw for i in images]
    assert torch.equal(torch.cat([i.pixel_values for i in images]), batch["pixel_values"])
    assert [i.num_tokens for i in images] == [
        t * h * w // 4 for t, h, w in (i.grid_thw for i in images)
    ]


def test_both_namings_load_the_same(folder, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    assert any(name.startswith("visual.") for name in tensors)  # what save_pretrained writes
    new = {}
    for name, tensor in tensors.items():  # transformers 5's in-memory naming
        if name.startswith("visual."):
            name = "model." + name
        elif name.startswith("model."):
            name = "model.language_model." + name.removeprefix("model.")
        new[name] = tensor
    other = tmp_path / "new"
    other.mkdir()
    for path in folder.iterdir():
        if path.name != "model.safetensors":
            (other / path.name).write_bytes(path.read_bytes())
    save_file(new, other / "model.safetensors")
    a, b = (load_model(ModelConfig(model=str(f), dtype="float32")) for f in (folder, other))
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def test_what_it_does_not_run_with_is_refused_by_name(folder):
    from pagedserve.models.parallel import ParallelContext
    from pagedserve.models.pipeline import PipelineStage
    from pagedserve.models.qwen2_vl import Qwen2VLForConditionalGeneration

    config = ModelConfig(model=str(folder), device="cpu")
    for par, field in [
        (ParallelContext(tp_size=2), "tensor_parallel_size"),
        (ParallelContext(stage=PipelineStage(0, 2)), "pipeline_parallel_size"),
    ]:
        with pytest.raises(ValueError, match=field):
            Qwen2VLForConditionalGeneration(config, par)
    with pytest.raises(ValueError, match="quantization"):
        Qwen2VLForConditionalGeneration(ModelConfig(model=str(folder), quantization="int8"))
    with pytest.raises(ValueError, match="convert"):
        load_model(ModelConfig(model=str(folder), convert="embed"))


# Qwen2-VL-2B-Instruct's config.json as its repository holds it: the decoder's fields flat at
# the top level, M-RoPE in rope_scaling, the tower's width in embed_dim, its output in hidden_size
QWEN2_VL_2B_CONFIG = {
    "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl",
    "bos_token_id": 151643, "eos_token_id": 151645, "vision_start_token_id": 151652,
    "vision_end_token_id": 151653, "vision_token_id": 151654, "image_token_id": 151655,
    "video_token_id": 151656, "hidden_act": "silu", "hidden_size": 1536,
    "intermediate_size": 8960, "max_position_embeddings": 32768, "max_window_layers": 28,
    "num_attention_heads": 12, "num_hidden_layers": 28, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_sliding_window": False,
    "vision_config": {
        "depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
        "hidden_size": 1536, "patch_size": 14, "spatial_merge_size": 2,
        "spatial_patch_size": 14, "temporal_patch_size": 2,
    },
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vocab_size": 151936,
}  # fmt: skip


def test_the_flat_config_of_a_real_checkpoint_builds_its_shapes(tmp_path):
    import json

    from pagedserve.models.qwen2_vl import Qwen2VLForConditionalGeneration

    (tmp_path / "config.json").write_text(json.dumps(QWEN2_VL_2B_CONFIG))
    config = ModelConfig(model=str(tmp_path), device="cpu")
    shape = (config.hidden_size, config.num_layers, config.num_attention_heads, config.head_dim)
    assert shape == (1536, 28, 12, 128) and config.num_kv_heads == 2
    assert (config.vocab_size, config.image_token_id) == (151936, 151655)
    with torch.device("meta"):
        model = Qwen2VLForConditionalGeneration(config)
    attention = model.language_model.model.layers[0].self_attn
    assert attention.rotary_emb.mrope_section == (16, 24, 24)
    assert attention.qkv_proj.bias is not None and attention.o_proj.bias is None  # Qwen2's
    assert model.language_model.lm_head.weight is model.language_model.model.embed_tokens.weight
    assert model.visual.out_hidden_size == 1536 and len(model.visual.blocks) == 32
