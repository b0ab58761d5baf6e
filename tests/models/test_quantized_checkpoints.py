"""Serving AWQ, GPTQ and fp8 checkpoints: each layout, written here from a tiny random model,
against transformers on the dequantized fp32 model (exactly the weights the checkpoint
encodes, unquantized): prompt log-probabilities within fp32 tolerance, 16 greedy tokens
equal, and measurably away from the unquantized model (so 4 or 8 bits really were served).
Then what a bad checkpoint gets: a ModelLoadError naming what is wrong, at load.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_quantization import (
    assert_two_ranks_serve_as_one_process,
    prompt_token_logprobs,
    transformers_token_logprobs,
)
from transformers import AutoModelForCausalLM

from pagedserve.engine import LLM, SamplingParams
from pagedserve.models import ModelLoadError
from pagedserve.models.testing import transformers_greedy
from pagedserve.models.testing_quantized import (
    Int4Layout,
    quantize_fp8_checkpoint,
    quantize_int4_checkpoint,
)

PROMPT = list(range(5, 45))
KV = 1 << 20  # a 1 MiB KV cache: the tiny model needs a few blocks, not the default pool
CASES = {  # name: (architecture, how to quantize)
    "awq-g32": ("llama", Int4Layout("awq", group_size=32)),
    "gptq-g32": ("llama", Int4Layout("gptq", group_size=32)),
    "gptq-sym-g64-act-order": ("llama", Int4Layout("gptq", 64, sym=True, act_order=True)),
    "gptq-v2-g128-act-order": ("qwen2", Int4Layout("gptq", 128, act_order=True, v2=True)),
    # MoE: the experts dequantized at load, the rest 4-bit (models/moe_quantized.py)
    "awq-g32-mixtral": ("mixtral", Int4Layout("awq", group_size=32)),
    "gptq-act-order-qwen2-moe": ("qwen2_moe", Int4Layout("gptq", 32, act_order=True)),
    "gptq-v2-sym-qwen3-moe": ("qwen3_moe", Int4Layout("gptq", 32, sym=True, v2=True)),
    "fp8-per-tensor": ("llama", {"per_channel": False, "static": False}),
    "fp8-per-channel-static": ("llama", {"per_channel": True, "static": True}),
}


@pytest.fixture(scope="module")
def quantized(tiny_checkpoint, tmp_path_factory):
    """``quantized(case) -> (quantized folder, dequantized folder)``, written once each."""
    made: dict[str, tuple[str, str]] = {}

    def make(case: str) -> tuple[str, str]:
        if case not in made:
            arch, how = CASES[case]
            root = tmp_path_factory.mktemp(case)
            src, dst, deq = tiny_checkpoint(arch), root / "q", root / "deq"
            if isinstance(how, Int4Layout):
                quantize_int4_checkpoint(src, dst, how, dequantized=deq)
            else:
                quantize_fp8_checkpoint(src, dst, dequantized=deq, **how)
            made[case] = (str(dst), str(deq))
        return made[case]

    return make


@pytest.fixture(scope="module")
def unquantized_logprobs(tiny_checkpoint):
    """transformers' prompt log-probabilities on the unquantized tiny model, per arch."""
    made: dict[str, torch.Tensor] = {}

    def get(arch: str) -> torch.Tensor:
        if arch not in made:
            hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(arch)).eval()
            made[arch] = transformers_token_logprobs(hf, PROMPT)
        return made[arch]

    return get


@pytest.mark.parametrize("case", CASES)
def test_a_quantized_checkpoint_serves_the_model_it_encodes(quantized, unquantized_logprobs, case):
    path, dequantized = quantized(case)
    llm = LLM(model=path, block_size=8, kv_cache_memory=KV)
    ours = prompt_token_logprobs(llm, PROMPT)
    hf = AutoModelForCausalLM.from_pretrained(dequantized, dtype=torch.float32).eval()
    torch.testing.assert_close(ours, transformers_token_logprobs(hf, PROMPT), atol=1e-4, rtol=1e-4)
    assert (ours - unquantized_logprobs(CASES[case][0])).abs().max() > 1e-3
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    assert out.outputs[0].token_ids == transformers_greedy(hf, PROMPT, 16)


@pytest.mark.parametrize("kernels", ["numba", "ref"])
def test_projections_hold_4_bits_a_weight_and_an_eighth_of_the_fp32_bytes(
    quantized, monkeypatch, kernels
):
    """A CPU engine holds each layer as rows of 4-bit groups (kernels/cpu/int4_linear.py), the
    reference as int32 words: half a byte a weight either way, and no fp32 weight."""
    monkeypatch.setenv("PAGEDSERVE_KERNELS", kernels)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model = LLM(
        model=quantized("gptq-sym-g64-act-order")[0], block_size=8, kv_cache_memory=KV
    ).engine.runner.model
    layers = [m for m in model.modules() if hasattr(m, "linear_method") and hasattr(m, "g_idx")]
    assert len(layers) == 2 * 4
    weights = sum(m.input_size * m.output_size for m in layers)
    held = sum(t.nbytes for m in layers for t in (*m.parameters(), *m.buffers()))
    packed = "qrows" if kernels == "numba" else "qweight"
    assert all(hasattr(m, packed) and not hasattr(m, "weight") for m in layers)
    assert held < 0.20 * 4 * weights  # 4 bits a weight plus per-group scales, zeros, order


def _edited(src: str, dst, config=None, drop: str | None = None, change=None) -> str:
    """A copy of the checkpoint folder ``src`` with its quantization_config updated by
    ``config``, the tensors whose names end in ``drop`` removed, ``change(state)`` applied."""
    shutil.copytree(src, dst)
    if config:
        data = json.loads((dst / "config.json").read_text())
        data["quantization_config"].update(config)
        (dst / "config.json").write_text(json.dumps(data))
    if drop or change:
        state = load_file(dst / "model.safetensors")
        state = {k: v for k, v in state.items() if not (drop and k.endswith(drop))}
        if change:
            change(state)
        save_file(state, dst / "model.safetensors")
    return str(dst)


@pytest.mark.parametrize(
    ("case", "edit", "message"),
    [
        ("awq-g32", {"config": {"bits": 3}}, r"bits = 3: pagedserve loads 4-bit awq"),
        ("gptq-g32", {"config": {"bits": 8}}, r"bits = 8: pagedserve loads 4-bit gptq"),
        ("awq-g32", {"config": {"version": "gemv"}}, r"version = 'gemv'.*GEMM"),
        ("gptq-g32", {"config": {"group_size": 64}}, r"proj\.qzeros: .*group_size 64.* has shape"),
        ("gptq-g32", {"drop": "qzeros"}, r"missing weights.*qzeros"),
        ("awq-g32", {"config": {"group_size": 12}}, r"group_size = 12"),
        ("fp8-per-tensor", {"config": {"weight_block_size": [128, 128]}}, r"block-wise"),
        (
            "awq-g32-mixtral",
            {"drop": "experts.3.w2.qzeros"},  # in both layers
            r"missing \['qzeros'\] of 2 expert projections.*experts\.3\.w2",
        ),
        (
            "awq-g32-mixtral",
            {"config": {"modules_to_not_convert": ["gate", "w2"]}},
            r"modules_to_not_convert = \['w2'\]",
        ),
        (
            "gptq-act-order-qwen2-moe",
            {"change": lambda state: state["model.layers.1.mlp.experts.2.up_proj.g_idx"].fill_(9)},
            r"g_idx holds groups 9\.\.9, but the projection has 2 groups",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) and " " not in v else None,
)
def test_a_bad_checkpoint_is_a_load_error_naming_it(quantized, tmp_path, case, edit, message):
    folder = _edited(quantized(case)[0], tmp_path / "bad", **edit)
    with pytest.raises(ModelLoadError, match=message):
        LLM(model=folder, block_size=8, kv_cache_memory=KV)


def test_fp8_weights_stored_in_another_dtype_are_refused(quantized, tmp_path):
    def widen(state):
        for name in [n for n in state if n.endswith("down_proj.weight")]:
            state[name] = state[name].float()

    folder = _edited(quantized("fp8-per-tensor")[0], tmp_path / "bad", change=widen)
    with pytest.raises(ModelLoadError, match=r"weight is torch.float32.*F8_E4M3"):
        LLM(model=folder, block_size=8, kv_cache_memory=KV)


def test_quantization_that_disagrees_with_the_checkpoint_is_refused(quantized):
    with pytest.raises(ModelLoadError, match=r"--quantization gptq disagrees.*'awq'"):
        LLM(model=quantized("awq-g32")[0], quantization="gptq")
    llm = LLM(model=quantized("awq-g32")[0], quantization="awq", block_size=8, kv_cache_memory=KV)
    assert llm.engine.runner.model is not None  # the matching name is accepted


def test_a_pre_quantized_gpt2_is_refused_naming_the_architecture(tiny_checkpoint, tmp_path):
    folder = tmp_path / "gpt2-awq"
    shutil.copytree(tiny_checkpoint("gpt2"), folder)
    data = json.loads((folder / "config.json").read_text())
    data["quantization_config"] = Int4Layout("awq").quantization_config()
    (folder / "config.json").write_text(json.dumps(data))
    with pytest.raises(ModelLoadError, match=r"awq checkpoints of GPT2LMHeadModel"):
        LLM(model=str(folder))


def test_moe_experts_are_held_dequantized_and_the_rest_runs_4_bit(quantized, tmp_path):
    """AutoAWQ's Mixtral lists its router as not converted (by name or by path): pagedserve
    never quantizes a router, so that is accepted; the experts load unquantized, attention stays 4-bit."""
    folder = _edited(
        quantized("awq-g32-mixtral")[0], tmp_path / "q",
        {"modules_to_not_convert": ["gate", "block_sparse_moe.gate"]},
    )  # fmt: skip
    model = LLM(model=folder, block_size=8, kv_cache_memory=KV).engine.runner.model
    experts = [m.experts for m in model.modules() if hasattr(m, "experts")]
    assert experts and all(e.w13_weight.dtype == torch.float32 for e in experts)
    attention = [m for name, m in model.named_modules() if name.endswith("qkv_proj")]
    four_bit = [m for m in attention if hasattr(m, "qrows") or hasattr(m, "qweight")]
    assert attention and four_bit == attention and not any(hasattr(m, "weight") for m in attention)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["gptq-sym-g64-act-order", "gptq-act-order-qwen2-moe"])
def test_two_ranks_serve_a_quantized_checkpoint_as_one_process(quantized, case):
    """Column shards hold whole words of output channels; row shards start on a group
    boundary, or (act-order) hold every group's scales with their sorted g_idx."""
    path = quantized(case)[0]
    assert_two_ranks_serve_as_one_process(path, PROMPT, block_size=8, kv_cache_memory=KV)
