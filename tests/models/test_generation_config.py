"""generation_config.json: its eos ids stop generation as transformers stops, its sampling
fields are the defaults a request overrides; ``generation_config`` picks auto, vllm or a folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.engine import LLM, SamplingParams
from pagedserve.models import ModelConfig, ModelLoadError
from pagedserve.models.testing import transformers_greedy

PROMPT = [5, 6, 7]


def _with_generation_config(src: str, dst: Path, **fields) -> str:
    shutil.copytree(src, dst)
    path = dst / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    config.update(fields)
    path.write_text(json.dumps(config))
    return str(dst)


def _end_of_turn_id(hf) -> tuple[int, int]:
    """A token the tiny model's greedy continuation reaches at step >= 4 and not before: the
    stand-in for a chat model's end-of-turn id. Returns (token, its step)."""
    free_run = transformers_greedy(hf, PROMPT, 32)
    for step, token in enumerate(free_run):
        if step >= 4 and token not in free_run[:step] and token != 2:
            return token, step
    raise AssertionError(f"no usable stop token in {free_run}")


def test_generation_config_eos_list_stops_where_transformers_stops(tiny_checkpoint, tmp_path):
    """config.json says eos 2; generation_config.json says [2, X], as Llama 3 Instruct's does
    for <|eot_id|>. Before, pagedserve ran past X (it read config.json only)."""
    src = tiny_checkpoint("llama")
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    stop, step = _end_of_turn_id(hf)
    path = _with_generation_config(src, tmp_path / "m", eos_token_id=[2, stop])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=32, do_sample=False)
    ref_tokens = ref[0, len(PROMPT) :].tolist()
    assert ref_tokens[-1] == stop and len(ref_tokens) == step + 1  # transformers stopped on it

    llm = LLM(model=path, block_size=8)
    out = llm.generate(
        [{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=32), use_tqdm=False
    )[0].outputs[0]
    assert out.token_ids == ref_tokens
    assert out.finish_reason == "stop"
    assert stop in llm.engine.eos_token_ids


def test_sampling_defaults_apply_when_a_request_sets_none(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("llama")
    path = _with_generation_config(
        src, tmp_path / "m", temperature=0.0, top_k=7, max_new_tokens=5, repetition_penalty=1.0
    )
    llm = LLM(model=path, block_size=8)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.0, 7, 5)
    out = llm.generate([{"prompt_token_ids": PROMPT}], use_tqdm=False)[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    assert out.token_ids == transformers_greedy(hf, PROMPT, 5)  # greedy, 5 tokens: the defaults
    given = SamplingParams(temperature=0, max_tokens=2)  # an explicit request wins
    assert (
        len(
            llm.generate([{"prompt_token_ids": PROMPT}], given, use_tqdm=False)[0]
            .outputs[0]
            .token_ids
        )
        == 2
    )


def test_modes_auto_vllm_and_folder(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("llama")
    path = _with_generation_config(src, tmp_path / "m", eos_token_id=[2, 9], top_p=0.5)
    auto = ModelConfig(model=path)
    assert auto.eos_token_ids == [2, 9]
    assert auto.generation_defaults.sampling == {"top_p": 0.5}
    assert "top_p=0.5" in auto.generation_defaults.describe()
    vllm = ModelConfig(model=path, generation_config="vllm")
    assert vllm.eos_token_ids == [2, 9] and vllm.generation_defaults.sampling == {}
    elsewhere = tmp_path / "gen"
    elsewhere.mkdir()
    (elsewhere / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    other = ModelConfig(model=src, generation_config=str(elsewhere))
    assert other.generation_defaults.sampling == {"temperature": 0.3}
    assert other.eos_token_ids == [2]
    with pytest.raises(ModelLoadError, match="generation_config"):
        ModelConfig(model=src, generation_config=str(tmp_path / "nowhere"))
