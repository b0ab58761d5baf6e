"""Our models against transformers on the same tiny random weights (fp32).

Logits for a varlen batch of prompts of different lengths, run as one paged prefill, must equal
transformers' logits for each prompt alone; 32 greedy tokens must be identical.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.engine import LLM, SamplingParams
from pagedserve.models.testing import TINY_ARCHS, transformers_greedy

PROMPTS = [
    list(range(5, 22)),  # 17 tokens: not a multiple of the block size
    [100, 200, 300],
    list(range(30, 70)),  # 40 tokens: five blocks of 8
    [7],
]


def _hf(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _our_prefill_logits(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Run all prompts as one varlen prefill and return every position's logits."""
    from pagedserve.scheduler import Request, RequestStatus

    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.scheduler.add_request(Request(f"p{i}", prompt, max_tokens=1))
    step = engine.scheduler.schedule()
    assert len(step.scheduled) == len(prompts), "all prompts must fit in one step"
    runner = engine.runner
    model_input, _ = runner.prepare_input(step)
    with torch.inference_mode():
        hidden = runner.model(
            model_input.input_ids,
            model_input.positions,
            runner.kv_caches,
            model_input.attn_metadata,
        )
        logits = runner.model.compute_logits(hidden)
    engine.scheduler.finish_requests(
        [f"p{i}" for i in range(len(prompts))], RequestStatus.FINISHED_ABORTED
    )
    bounds = model_input.attn_metadata.query_start_loc.tolist()
    return [logits[bounds[i] : bounds[i + 1]] for i in range(len(prompts))]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_prefill_logits_match_transformers(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    llm = LLM(model=path, block_size=8, num_gpu_blocks_override=64, enable_prefix_caching=False)
    hf = _hf(path)
    ours = _our_prefill_logits(llm, PROMPTS)
    for prompt, our_logits in zip(PROMPTS, ours, strict=True):
        with torch.inference_mode():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(our_logits, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_tokens_match_transformers(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    llm = LLM(model=path, block_size=8)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    hf = _hf(path)
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        assert out.outputs[0].token_ids == transformers_greedy(hf, prompt, 32)
        assert out.outputs[0].finish_reason == "length"


def test_llama3_rope_scaling_matches_transformers(tiny_checkpoint):
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    path = tiny_checkpoint("llama", rope_parameters=rope)
    llm = LLM(model=path, block_size=8, enable_prefix_caching=False)
    hf = _hf(path)
    prompt = list(range(3, 120))
    (ours,) = _our_prefill_logits(llm, [prompt])
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_bfloat16_model_runs_close_to_fp32(tiny_checkpoint):
    path = tiny_checkpoint("qwen3")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    fp32 = LLM(model=path, dtype="float32").generate(
        [{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False
    )
    bf16 = LLM(model=path, dtype="bfloat16").generate(
        [{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False
    )
    assert bf16[0].outputs[0].token_ids[0] == fp32[0].outputs[0].token_ids[0]
