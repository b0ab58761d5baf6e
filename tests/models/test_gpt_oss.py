"""gpt-oss as OpenAI releases it: experts stored in MXFP4 (``_blocks`` and ``_scales``,
quant_method ``mxfp4``), dequantized at load. The same folder through transformers (which
dequantizes it on a CPU) and through pagedserve: fp32 prefill logits at 1e-4, 32 greedy
tokens; the dequantization itself against transformers' and against the format's definition;
and what config.json says about the model.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.engine import LLM, SamplingParams
from pagedserve.models import ModelConfig
from pagedserve.models.config import ModelLoadError
from pagedserve.models.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from pagedserve.models.testing import make_mxfp4_checkpoint, transformers_greedy

LONG = [(i * 37) % 500 + 3 for i in range(50)]  # three windows of the tiny model's 16
PROMPTS = [LONG, [100, 200, 300], list(range(30, 70))]


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tiny_checkpoint, tmp_path_factory):
    return str(
        make_mxfp4_checkpoint(tiny_checkpoint("gpt_oss"), tmp_path_factory.mktemp("mx") / "gpt-oss")
    )


def test_mxfp4_checkpoint_equals_transformers(mxfp4_checkpoint):
    hf = AutoModelForCausalLM.from_pretrained(mxfp4_checkpoint, dtype=torch.float32).eval()
    llm = LLM(model=mxfp4_checkpoint, block_size=8, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    params_logits = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    for prompt in PROMPTS:
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert out.outputs[0].token_ids == transformers_greedy(hf, prompt, 32), prompt
        (first,) = llm.generate([{"prompt_token_ids": prompt}], params_logits, use_tqdm=False)
        with torch.inference_mode():
            ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), -1)
        ours = first.outputs[0].logprobs[0]
        for token, logprob in ours.items():
            assert abs(logprob.logprob - float(ref[token])) < 1e-4


def test_the_loaded_experts_are_transformers_dequantized_weights(mxfp4_checkpoint):
    """Our block of layer 1: gate rows then up rows, [out, in], exactly transformers' weights
    (its gate_up_proj is [E, in, out] with gate and up interleaved)."""
    hf = AutoModelForCausalLM.from_pretrained(mxfp4_checkpoint, dtype=torch.float32)
    llm = LLM(model=mxfp4_checkpoint, block_size=8)
    ours = llm.engine.runner.model.model.layers[1].mlp.experts
    theirs = hf.model.layers[1].mlp.experts
    gate_up = theirs.gate_up_proj.data.transpose(1, 2)  # [E, 2I, H], rows interleaved
    assert torch.equal(ours.w13_weight, torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1))
    assert torch.equal(ours.w2_weight, theirs.down_proj.data.transpose(1, 2))
    bias = theirs.gate_up_proj_bias.data
    assert torch.equal(ours.w13_bias, torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1))


def test_dequantization_follows_the_format():
    """One block by hand: codes 0..15 (two a byte, the low nibble first) are E2M1's 0, 0.5, 1,
    1.5, 2, 3, 4, 6 and their negatives; the E8M0 scale 129 doubles them twice."""
    codes = torch.arange(32) % 16
    blocks = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8)[None]  # [1 block, 16 bytes]
    scales = torch.tensor([129], dtype=torch.uint8)
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    expected = torch.tensor(e2m1 + [-v for v in e2m1]).repeat(2) * 4
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), expected)


def test_quantization_round_trips_and_is_near():
    weight = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(0))
    deq = dequantize_mxfp4(*quantize_mxfp4(weight), torch.float32)
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(deq), torch.float32), deq)
    assert ((deq - weight).norm() / weight.norm()) < 0.2  # 4-bit floats, a scale per 32


def test_config_alternates_windows_and_has_sinks(tiny_checkpoint):
    config = ModelConfig(model=tiny_checkpoint("gpt_oss"))
    assert config.sliding_windows == [16, None] and config.has_attention_sinks
    assert config.checkpoint_quantization is None and config.quantization is None


def test_mxfp4_of_another_architecture_is_refused(tiny_checkpoint, tmp_path):
    folder = tmp_path / "llama-mxfp4"
    shutil.copytree(tiny_checkpoint("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="GptOssForCausalLM"):
        ModelConfig(model=str(folder))
