"""DeepSeek-V2/V3 (latent attention, shared experts, grouped routing, a dense first layer),
Qwen2-MoE (a gated shared expert) and gpt-oss (attention sinks, a windowed then a full layer,
biased experts with a clamped SwiGLU) served with chunked prefill and prefix caching on: 32
greedy tokens equal transformers', for prompts split into many chunks, prompts that hit the
prefix cache (whole blocks and then a partial one, over latents another request stored), and,
for gpt-oss and a Qwen2-MoE with a sliding window on one layer, prompts three windows long.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.engine import LLM, SamplingParams
from pagedserve.models.testing import transformers_greedy

LONG = [(i * 37) % 500 + 3 for i in range(50)]  # 50 tokens: seven blocks of 8, three windows
PROMPTS = [LONG, list(range(30, 70)), LONG[:21] + [7, 8, 9], [11, 12, 13]]
CASES = {
    "deepseek_v2": ("deepseek_v2", {}),
    "deepseek_v3": ("deepseek_v3", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    "gpt_oss": ("gpt_oss", {}),  # its layer 0 windowed (16), layer 1 full
    "qwen2_moe-window": (
        "qwen2_moe",
        dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_prefill_and_prefix_caching_match_transformers(tiny_checkpoint, case):
    arch, overrides = CASES[case]
    path = tiny_checkpoint(arch, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(
        model=path, block_size=8, max_num_batched_tokens=16, long_prefill_token_threshold=12,
        enable_prefix_caching=True,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)[0]
    rest = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[1:]], params, use_tqdm=False)
    assert rest[1].num_cached_tokens == 16  # two whole blocks of LONG's, stored by the first
    for prompt, out in zip(PROMPTS, [first, *rest], strict=True):
        assert out.outputs[0].token_ids == transformers_greedy(hf, prompt, 32), prompt
    if overrides or arch == "gpt_oss":  # layer 0 windowed (config.json's layer_types)
        assert llm.engine.model_config.sliding_windows == [16, None]


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen2_moe"])
def test_int8_quantizes_the_linear_layers_and_keeps_the_experts_and_kv_b_proj(
    tiny_checkpoint, arch
):
    """``--quantization int8`` on an MoE model: its linear layers (attention projections, dense
    and shared-expert MLPs, Qwen2-MoE's shared-expert gate) hold int8 weights; the routed
    experts and DeepSeek's kv_b_proj stay fp32. The engine computes transformers' model with
    exactly those weights quantized and dequantized."""
    from torch import nn

    from pagedserve.kernels.weight_only_linear import quantize_per_channel

    path = tiny_checkpoint(arch)
    llm = LLM(model=path, block_size=8, quantization="int8")
    model = llm.engine.runner.model
    assert {p.dtype for n, p in model.named_parameters() if n.endswith("qweight")} == {torch.int8}
    routed = [p for n, p in model.named_parameters() if ".experts." in n]
    assert routed and all(p.dtype == torch.float32 for p in routed)
    if arch == "deepseek_v3":  # both MLA paths read its per-head blocks: never quantized
        assert model.model.layers[1].self_attn.kv_b_proj.weight.dtype == torch.float32
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in hf.model.layers.named_modules():
            if isinstance(module, nn.Linear) and not name.endswith("kv_b_proj"):
                qweight, scale = quantize_per_channel(module.weight, "int8")
                module.weight.copy_(qweight.float() * scale[:, None])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": LONG}], params, use_tqdm=False)
    assert out.outputs[0].token_ids == transformers_greedy(hf, LONG, 16)


def test_an_old_qwen2_moe_config_without_layer_types_windows_nothing_unless_asked(
    tiny_checkpoint, tmp_path
):
    """Qwen1.5-MoE's config.json: no layer_types, ``use_sliding_window: false`` beside a
    ``sliding_window`` shorter than the context: no layer is windowed."""
    import json
    import shutil

    from pagedserve.models import ModelConfig

    folder = tmp_path / "qwen1.5-moe"
    shutil.copytree(tiny_checkpoint("qwen2_moe"), folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("layer_types")
    config.update(use_sliding_window=False, sliding_window=32, max_window_layers=1)
    (folder / "config.json").write_text(json.dumps(config))
    assert ModelConfig(model=str(folder)).sliding_windows == [None, None]
