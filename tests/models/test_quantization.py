"""``--quantization int8|fp8``: weight-only 8-bit linear layers, quantized at load time.

The reference is transformers on the same checkpoint with each decoder-layer projection's
weight replaced by its quantize-then-dequantize image (per output channel, the same rule):
the quantized engine must compute that model's logits (fp32 tolerance) and its greedy tokens,
while differing measurably from the unquantized model (so the quantization really happened).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM
from transformers.pytorch_utils import Conv1D

from pagedserve.engine import LLM, SamplingParams
from pagedserve.kernels.weight_only_linear import quantize_per_channel
from pagedserve.models import ModelLoadError
from pagedserve.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedserve.models.testing import transformers_greedy

PROMPT = list(range(5, 45))
QDTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def _dequantized(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    qweight, scale = quantize_per_channel(weight, fmt)
    return qweight.float() * scale[:, None]


def fake_quantized_transformers(path: str, fmt: str | None):
    """transformers' model, its decoder layers' projections quantized and dequantized."""
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if fmt is None:
        return hf
    layers = hf.transformer.h if hasattr(hf, "transformer") else hf.model.layers
    with torch.no_grad():
        for module in layers.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(_dequantized(module.weight, fmt))
            elif isinstance(module, Conv1D):  # GPT-2 stores [in, out]: channels are columns
                module.weight.copy_(_dequantized(module.weight.T, fmt).T)
    return hf


def assert_two_ranks_serve_as_one_process(path: str, prompt: list[int], **kw) -> None:
    """Greedy tokens of ``path`` over two tensor-parallel ranks equal one process's (torch held
    to one thread meanwhile: two ranks on two cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    prompts = [{"prompt_token_ids": prompt}, {"prompt_token_ids": [7, 8, 9]}]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(model=path, **kw).generate(prompts, params)]
    llm = LLM(model=path, tensor_parallel_size=2, **kw)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == expected
    finally:
        llm.engine.runner.shutdown()
        torch.set_num_threads(before)


def prompt_token_logprobs(llm: LLM, prompt: list[int]) -> torch.Tensor:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return torch.tensor([lp[tok] for lp, tok in zip(out.prompt_logprobs[1:], prompt[1:])])


def transformers_token_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = hf(torch.tensor([prompt])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]


@pytest.mark.parametrize(
    ("arch", "fmt"), [("llama", "int8"), ("llama", "fp8"), ("qwen3", "fp8"), ("gpt2", "int8")]
)
def test_quantized_engine_computes_the_fake_quantized_model(tiny_checkpoint, arch, fmt):
    path = tiny_checkpoint(arch)
    llm = LLM(model=path, block_size=8, quantization=fmt)
    ours = prompt_token_logprobs(llm, PROMPT)
    hf = fake_quantized_transformers(path, fmt)
    torch.testing.assert_close(ours, transformers_token_logprobs(hf, PROMPT), atol=1e-4, rtol=1e-4)
    unquantized = transformers_token_logprobs(fake_quantized_transformers(path, None), PROMPT)
    assert (ours - unquantized).abs().max() > 1e-3  # 8 bits moved the logits: it is quantized
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    assert out.outputs[0].token_ids == transformers_greedy(hf, PROMPT, 16)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_every_projection_holds_8_bit_weights_and_a_quarter_of_the_bytes(tiny_checkpoint, fmt):
    path = tiny_checkpoint("llama")
    quantized = LLM(model=path, block_size=8, quantization=fmt).engine.runner.model

    def projections(model):
        return [
            m for m in model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)
        ]

    assert len(projections(quantized)) == 2 * 4  # 2 layers: qkv, o, gate_up, down
    for layer in projections(quantized):
        assert not hasattr(layer, "weight")
        assert layer.qweight.dtype == QDTYPES[fmt]
        assert layer.weight_scale.shape == (layer.qweight.shape[0],)
    fp32_bytes = sum(4 * m.qweight.numel() for m in projections(quantized))
    held = sum(p.nbytes for m in projections(quantized) for p in m.parameters())
    assert held < 0.27 * fp32_bytes  # 8 bits a weight, plus one fp32 scale per row
    embed = [p for n, p in quantized.named_parameters() if "embed" in n or "lm_head" in n]
    assert embed and all(p.dtype == torch.float32 for p in embed)


def test_unknown_method_is_refused_naming_the_choices(tiny_checkpoint):
    with pytest.raises(ModelLoadError, match=r"'bitsandbytes' is not supported.*awq.*fp8.*int8"):
        LLM(model=tiny_checkpoint("llama"), quantization="bitsandbytes")


def test_a_checkpoint_method_on_an_unquantized_checkpoint_is_refused(tiny_checkpoint):
    with pytest.raises(ModelLoadError, match=r"awq needs a checkpoint stored as awq"):
        LLM(model=tiny_checkpoint("llama"), quantization="awq")


def test_a_pre_quantized_format_we_do_not_read_is_refused_naming_it(tiny_checkpoint, tmp_path):
    folder = tmp_path / "bnb"
    shutil.copytree(tiny_checkpoint("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"quant_method = 'bitsandbytes'.*awq.*gptq.*fp8"):
        LLM(model=str(folder))
