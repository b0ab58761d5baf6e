"""The registry is the one list of architectures (README included); .bin checkpoints load like
safetensors; a hub id is refused with what to do instead."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pagedserve.engine import LLM, SamplingParams
from pagedserve.models import ModelConfig, ModelLoadError
from pagedserve.models.loader import MODEL_CLASSES
from pagedserve.models.registry import ARCHITECTURES, supported_architectures_table
from pagedserve.models.testing import TINY_ARCHS
from pagedserve.models.weights import checkpoint_files

README = Path(__file__).parents[2] / "README.md"


def test_readme_table_is_the_registry():
    """Regenerate with ``python tools/architecture_table.py``."""
    assert supported_architectures_table() in README.read_text()


def test_the_table_tool_writes_and_checks_the_registrys_table(tmp_path):
    stale = README.read_text().replace("| yes | yes (`llama`) |", "| yes | no |", 1)
    readme = tmp_path / "README.md"
    readme.write_text(stale)
    tool = [sys.executable, str(README.parent / "tools" / "architecture_table.py")]
    check = subprocess.run([*tool, "--check", "--readme", str(readme)], capture_output=True)
    assert check.returncode == 1 and b"stale" in check.stdout
    subprocess.run([*tool, "--readme", str(readme)], check=True)
    assert readme.read_text() == README.read_text()


def test_every_registered_family_has_a_model_class():
    assert {a.family for a in ARCHITECTURES.values()} == set(MODEL_CLASSES)


def test_an_unsupported_architecture_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture") as error:
        ModelConfig(model=str(tmp_path))
    assert all(name in str(error.value) for name in ARCHITECTURES)


def _greedy(path: str) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = LLM(model=path).generate([{"prompt_token_ids": [3, 4, 5, 6]}], params, use_tqdm=False)
    return out[0].outputs[0].token_ids


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_pytorch_bin_checkpoint_loads_like_safetensors(tiny_checkpoint, tmp_path, sharded):
    src = tiny_checkpoint("llama")
    dst = tmp_path / "bin"
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    (dst / "model.safetensors").unlink()
    if not sharded:
        torch.save(tensors, dst / "pytorch_model.bin")
    else:
        names = sorted(tensors)
        files = {"pytorch_model-00001-of-00002.bin": names[::2]}
        files["pytorch_model-00002-of-00002.bin"] = names[1::2]
        for file, part in files.items():
            torch.save({n: tensors[n] for n in part}, dst / file)
        weight_map = {n: f for f, part in files.items() for n in part}
        (dst / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert _greedy(str(dst)) == _greedy(src)


def test_a_bin_file_that_holds_code_is_refused(tiny_checkpoint, tmp_path):
    dst = tmp_path / "pickled"
    shutil.copytree(tiny_checkpoint("llama"), dst)
    (dst / "model.safetensors").unlink()
    torch.save(
        {"weights": object()}, dst / "pytorch_model.bin"
    )  # not a tensor: unpickling runs code
    with pytest.raises(ModelLoadError, match="tensors only"):
        LLM(model=str(dst))


def test_a_hub_id_says_download_it_first(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError, match="download it first") as error:
        ModelConfig(model="meta-llama/Llama-3.2-1B-Instruct")
    message = str(error.value)
    assert "huggingface-cli download meta-llama/Llama-3.2-1B-Instruct" in message
    assert "config.json" in message and "model.safetensors" in message
    with pytest.raises(ModelLoadError, match="pytorch_model.bin"):
        checkpoint_files(tmp_path)  # a folder without weights names both formats


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_lora_and_parallel_columns_are_what_loading_does(tiny_checkpoint, arch):
    """Where the registry says LoRA, every projection takes adapters; where it says tensor
    (pipeline) parallel, rank 0's shard of two (last stage of two) builds; where it says no,
    each is refused by name."""
    from pagedserve.engine.distributed.executor import plan_layout
    from pagedserve.models import load_model
    from pagedserve.models.lora import LoRAModel

    config = ModelConfig(model=tiny_checkpoint(arch))
    declared = ARCHITECTURES[config.hf_architecture]
    model = load_model(config)
    if declared.lora:
        assert LoRAModel(model, config, max_loras=1, max_rank=8).targets
    else:
        with pytest.raises(ValueError, match=f"not supported for {config.hf_architecture}"):
            LoRAModel(model, config, max_loras=1, max_rank=8)
    if declared.tensor_parallel:
        assert plan_layout(config, 2).world_size == 2
    else:
        with pytest.raises(ValueError, match="runs without tensor parallelism"):
            plan_layout(config, 2)
    if declared.pipeline_parallel:
        assert plan_layout(config, 1, 2).world_size == 2
    else:
        with pytest.raises(ValueError, match="runs without pipeline parallelism"):
            plan_layout(config, 1, 2)


def test_pooling_architectures_refuse_tensor_parallelism_by_name(tiny_pooling_checkpoint):
    from pagedserve.engine.distributed.executor import plan_layout

    config = ModelConfig(model=tiny_pooling_checkpoint("bert"))
    assert not ARCHITECTURES[config.hf_architecture].tensor_parallel
    with pytest.raises(ValueError, match="BertModel runs without tensor parallelism"):
        plan_layout(config, 2)


def test_an_expert_format_loads_only_where_the_registry_declares_it(tiny_checkpoint, tmp_path):
    """MXFP4 is gpt-oss's experts' format (its ``quantized``): the same quantization_config on
    a Llama is refused, naming the architectures that load it."""
    assert [n for n, a in ARCHITECTURES.items() if "mxfp4" in a.quantized] == ["GptOssForCausalLM"]
    folder = Path(shutil.copytree(tiny_checkpoint("llama"), tmp_path / "llama"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="experts of GptOssForCausalLM.*LlamaForCausalLM"):
        ModelConfig(model=str(folder))
