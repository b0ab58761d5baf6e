"""Model folder loading: sharded checkpoints, clear errors for bad folders."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.engine import LLM, SamplingParams
from pagedserve.models import ModelConfig, ModelLoadError


def test_sharded_checkpoint_loads_like_single_file(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("llama")
    shutil.copytree(src, tmp_path / "sharded")
    sharded = tmp_path / "sharded"
    tensors = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, sharded / file)
        weight_map.update({n: file for n in part})
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = [{"prompt_token_ids": [3, 4, 5, 6]}]
    a = LLM(model=src).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    b = LLM(model=str(sharded)).generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b


def test_missing_weight_is_a_clear_error(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("qwen2")
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ModelLoadError, match="up_proj"):
        LLM(model=str(broken))


def test_not_a_model_folder(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        ModelConfig(model=str(tmp_path))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["T5ForConditionalGeneration"]})
    )
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        ModelConfig(model=str(tmp_path))


def test_max_model_len_beyond_positions_is_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match="max_model_len"):
        ModelConfig(model=tiny_checkpoint("gpt2"), max_model_len=10**6)


def test_dtype_auto_is_float32_on_cpu(tiny_checkpoint):
    assert ModelConfig(model=tiny_checkpoint("llama")).torch_dtype == torch.float32
