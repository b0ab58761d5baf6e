"""The Qwen2-VL and Qwen2.5-VL vision towers against transformers' on tiny random checkpoints
(fp32): the decoder rows of one image and of three images of different sizes batched equal
transformers' visual model's output on the processor's patches; Qwen2.5-VL's window attention
cuts the images into several windows, the same ones transformers forms; the tiny folders load
in transformers and their processor gives each image size its own grid."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers.vision_utils import get_vision_window_index

from pagedserve.models.qwen2_vl_vision import (
    Qwen2VisionTransformer,
    tower_variant,
    window_partition,
)
from pagedserve.models.testing_multimodal import (
    QWEN2_VL_VARIANTS,
    make_tiny_qwen2_vl_checkpoint,
    qwen2_vl_processor,
    tiny_test_images,
    transformers_qwen2_vl_greedy,
)

PROMPT_PART = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module", params=QWEN2_VL_VARIANTS)
def folder(request, tmp_path_factory) -> Path:
    return make_tiny_qwen2_vl_checkpoint(tmp_path_factory.mktemp(request.param), request.param)


def _hf_model(folder: Path):
    import transformers

    config = json.loads((folder / "config.json").read_text())
    model_cls = getattr(transformers, config["architectures"][0])
    return model_cls.from_pretrained(folder, dtype=torch.float32).eval()


def _our_tower(folder: Path) -> Qwen2VisionTransformer:
    config = json.loads((folder / "config.json").read_text())
    tower = Qwen2VisionTransformer(config["vision_config"], torch.float32)
    tensors = load_file(folder / "model.safetensors")
    # save_pretrained writes the hub's naming (visual.*); transformers 5 names it model.visual.*
    prefixes = ("model.visual.", "visual.")
    tower.load_weights(
        (n.removeprefix("model.").removeprefix("visual."), t)
        for n, t in tensors.items()
        if n.startswith(prefixes)
    )
    return tower


def _processed(folder: Path, images):
    processor = qwen2_vl_processor(folder)
    text = "Look: " + PROMPT_PART * len(images)
    return processor(text=text, images=images, return_tensors="pt")


@pytest.mark.parametrize("count", [1, 3])
def test_tower_equals_transformers(folder, count):
    images = tiny_test_images()[:count]
    inputs = _processed(folder, images)
    pixels, grid = inputs["pixel_values"], inputs["image_grid_thw"]
    with torch.inference_mode():
        expected = _hf_model(folder).model.visual(pixels, grid_thw=grid).pooler_output
        got = _our_tower(folder)(pixels, grid)
    assert got.shape == expected.shape == (int(grid.prod(-1).sum()) // 4, 64)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1.3e-6)
    # one decoder row per placeholder the processor put in the prompt
    image_id = json.loads((folder / "config.json").read_text())["image_token_id"]
    assert int((inputs["input_ids"] == image_id).sum()) == got.shape[0]


def test_windows_are_real_and_match_transformers(tmp_path_factory):
    folder = make_tiny_qwen2_vl_checkpoint(tmp_path_factory.mktemp("w"), "qwen2_5_vl")
    vision = json.loads((folder / "config.json").read_text())["vision_config"]
    grid = _processed(folder, tiny_test_images())["image_grid_thw"]
    merge, patch, window = vision["spatial_merge_size"], vision["patch_size"], vision["window_size"]
    order, cu, longest = window_partition(grid, merge, window // merge // patch)
    frames = grid[:, 1] * grid[:, 2]
    windows = len(cu) - 1
    assert windows >= 2 * len(grid), f"only {windows} windows over {len(grid)} images"
    assert longest < int(frames.min()), "a window as large as the smallest image is no window"
    expected_order, expected_cu = get_vision_window_index(grid, merge, window, patch)
    assert torch.equal(order, expected_order)
    assert torch.equal(cu, expected_cu.to(cu.dtype))
    # a window that held blocks of two images would show as a boundary missing at an image's end
    image_ends = set(frames.cumsum(0).tolist())
    assert image_ends <= set(cu.tolist())


def test_variant_from_config():
    assert tower_variant({"model_type": "qwen2_vl_vision"}) == "qwen2_vl"
    assert tower_variant({"model_type": "qwen2_5_vl_vision"}) == "qwen2_5_vl"
    # the hub's older configs: no model_type in vision_config
    assert tower_variant({"embed_dim": 1280, "depth": 32}) == "qwen2_vl"
    assert tower_variant({"fullatt_block_indexes": [7], "window_size": 112}) == "qwen2_5_vl"
    assert tower_variant({"model_type": "qwen2_vl_vision"}, "qwen2_5_vl") == "qwen2_5_vl"
    with pytest.raises(ValueError, match="model_type"):
        tower_variant({"model_type": "clip_vision_model"})


def test_checkpoint_loads_and_grids_differ(folder):
    config = json.loads((folder / "config.json").read_text())
    model = _hf_model(folder)
    assert type(model).__name__ == config["architectures"][0]
    grids = [
        _processed(folder, [image])["image_grid_thw"][0].tolist() for image in tiny_test_images()
    ]
    assert len({tuple(g) for g in grids}) == 3, grids
    for t, h, w in grids:
        assert t == 1 and h % 2 == 0 and w % 2 == 0 and 16 <= h * w <= 144
    prompt_ids, new_ids = transformers_qwen2_vl_greedy(
        folder, "Look: " + PROMPT_PART, tiny_test_images()[:1], 3
    )
    image_id = config["image_token_id"]
    assert prompt_ids.count(image_id) == grids[0][1] * grids[0][2] // 4
    assert len(new_ids) == 3
