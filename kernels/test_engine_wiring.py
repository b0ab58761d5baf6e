"""The engine on the Triton path equals the engine on the reference path, token for token.

Every device op of a forward pass (store_kv, paged attention, rms_norm / layer_norm, rotary,
silu_and_mul / gelu_tanh; DeepSeek's store_latent, MLA decode and fused MoE; gpt-oss's
attention with sinks and its experts' clamped SwiGLU), the sampler's kernels and copy_blocks
(n=2 forks write into a shared block) run through Triton — in its interpreter on CPU, compiled on a GPU — and the generated
tokens must equal those of the reference path. This proves the dispatch wiring end to end: the
kernels are not only right on their own, the engine actually calls them with the right inputs.
"""

from __future__ import annotations

import importlib
from collections import Counter

import pytest
import torch

from pagedserve.engine import LLM, SamplingParams
from pagedserve.models.testing import make_tiny_checkpoint

# (module, launch wrapper) of every Triton kernel one of these engine runs must reach.
WRAPPERS = [
    ("pagedserve.kernels.store_kv", "store_kv_triton"),
    ("pagedserve.kernels.paged_attention", "paged_attention_triton"),
    ("pagedserve.kernels.rms_norm", "rms_norm_triton"),
    ("pagedserve.kernels.layer_norm", "layer_norm_triton"),
    ("pagedserve.kernels.rotary_embedding", "rotary_embedding_triton"),
    ("pagedserve.kernels.silu_and_mul", "silu_and_mul_triton"),
    ("pagedserve.kernels.gelu_tanh", "gelu_tanh_triton"),
    ("pagedserve.kernels.sampling", "sample_tokens_triton"),
    ("pagedserve.kernels.penalties", "apply_penalties_triton"),
    ("pagedserve.kernels.copy_blocks", "copy_blocks_triton"),
    ("pagedserve.kernels.store_latent", "store_latent_triton"),
    ("pagedserve.kernels.mla_decode", "mla_paged_decode_triton"),
    ("pagedserve.kernels.fused_moe", "fused_moe_triton"),
    ("pagedserve.kernels.swigluoai_and_mul", "swigluoai_and_mul_triton"),
]
EXPECTED = {
    "llama": {
        "store_kv_triton",
        "paged_attention_triton",
        "rms_norm_triton",
        "rotary_embedding_triton",
        "silu_and_mul_triton",
        "sample_tokens_triton",
        "apply_penalties_triton",
        "copy_blocks_triton",
    },
    "gpt2": {
        "store_kv_triton",
        "paged_attention_triton",
        "layer_norm_triton",
        "gelu_tanh_triton",
        "sample_tokens_triton",
        "apply_penalties_triton",
        "copy_blocks_triton",
    },
}
EXPECTED["qwen3"] = EXPECTED["llama"]
# DeepSeek: latent attention (its store and decode kernels; prefills run torch's attention),
# copy-on-write of latent caches, a dense first layer, then the fused MoE
EXPECTED["deepseek_v2"] = EXPECTED["llama"] - {"store_kv_triton", "paged_attention_triton"} | {
    "store_latent_triton",
    "mla_paged_decode_triton",
    "fused_moe_triton",
}

# gpt-oss: every MLP is its experts (no dense silu_and_mul), their activation the clamped SwiGLU
EXPECTED["gpt_oss"] = EXPECTED["llama"] - {"silu_and_mul_triton"} | {
    "fused_moe_triton",
    "swigluoai_and_mul_triton",
}


def _count_calls(monkeypatch) -> Counter:
    """Wrap each Triton launch wrapper so the test can see which ones the engine reached."""
    calls: Counter = Counter()
    for module_name, name in WRAPPERS:
        module = importlib.import_module(module_name)
        original = getattr(module, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return calls


PROMPTS = [{"prompt_token_ids": list(range(5, 24))}, {"prompt_token_ids": [100, 200, 300]}]


def _generate(path: str, monkeypatch, kernels: str) -> list[list[int]]:
    monkeypatch.setenv("PAGEDSERVE_KERNELS", kernels)
    llm = LLM(model=path, block_size=8, max_num_batched_tokens=16)  # 16: the long prompt is chunked
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    seeded = SamplingParams(
        n=2,
        temperature=0.8,
        top_k=20,
        repetition_penalty=1.2,
        seed=7,
        max_tokens=6,
        ignore_eos=True,
    )
    outputs = llm.generate(PROMPTS, [greedy, seeded], use_tqdm=False)
    return [c.token_ids for out in outputs for c in out.outputs]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2", "deepseek_v2", "gpt_oss"])
def test_triton_path_generates_the_reference_tokens(arch, tmp_path, monkeypatch):
    path = str(make_tiny_checkpoint(arch, tmp_path / arch))
    calls = _count_calls(monkeypatch)
    reference = _generate(path, monkeypatch, "ref")
    assert not calls, "the reference run must not touch Triton"
    triton = _generate(path, monkeypatch, "triton")
    assert set(calls) == EXPECTED[arch]
    assert len(reference) == 3  # one greedy completion, two seeded children
    assert triton == reference


@pytest.mark.slow
def test_structured_outputs_mask_through_the_triton_kernel(tmp_path, monkeypatch):
    """A constrained request beside an unconstrained one: the Triton path masks (the bitmask
    kernel is reached) and draws the same tokens as the reference path."""
    import re

    path = str(make_tiny_checkpoint("llama", tmp_path / "llama"))
    module = importlib.import_module("pagedserve.kernels.token_bitmask")
    calls: Counter = Counter()
    original = module.apply_token_bitmask_triton

    def spy(*args, **kwargs):
        calls["apply_token_bitmask_triton"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(module, "apply_token_bitmask_triton", spy)
    constrained = SamplingParams(
        temperature=1.0, seed=5, max_tokens=4, structured_outputs={"regex": "[0-9]{2,6}"}
    )
    plain = SamplingParams(temperature=1.0, seed=6, max_tokens=3, ignore_eos=True)
    runs = {}
    for kernels in ("ref", "triton"):
        monkeypatch.setenv("PAGEDSERVE_KERNELS", kernels)
        llm = LLM(model=path, block_size=8)
        outputs = llm.generate(PROMPTS, [constrained, plain], use_tqdm=False)
        runs[kernels] = [out.outputs[0].token_ids for out in outputs]
        assert re.fullmatch("[0-9]{2,6}", outputs[0].outputs[0].text)
        assert bool(calls) == (kernels == "triton")
    assert runs["triton"] == runs["ref"]


@pytest.mark.slow
def test_mxfp4_experts_stay_packed_on_the_triton_path(tmp_path, monkeypatch):
    """OpenAI's MXFP4 gpt-oss: on the Triton path the experts are held as their code and scale
    bytes and decoded in fused_moe's tiles; on the reference path they are dequantized at
    load. Both generate the same tokens."""
    from pagedserve.models.gpt_oss import GptOssMoeBlock
    from pagedserve.models.testing import make_mxfp4_checkpoint

    source = make_tiny_checkpoint("gpt_oss", tmp_path / "gpt_oss")
    path = str(make_mxfp4_checkpoint(source, tmp_path / "mxfp4"))
    calls = _count_calls(monkeypatch)
    reference = _generate(path, monkeypatch, "ref")
    triton = _generate(path, monkeypatch, "triton")
    assert set(calls) == EXPECTED["gpt_oss"]
    assert triton == reference
    model = LLM(model=path, block_size=8).engine.runner.model  # still on the Triton path
    blocks = [m for m in model.modules() if isinstance(m, GptOssMoeBlock)]
    assert blocks and all(b.packed and not hasattr(b.experts, "w13_weight") for b in blocks)
    assert all(b.experts.w13_blocks.dtype == torch.uint8 for b in blocks)
