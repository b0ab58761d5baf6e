"""SmolLM2-135M quantized here to AWQ and GPTQ (4 bits, group 64, round-to-nearest; GPTQ with
act-order) and served: its next-token choices stay close to the fp32 model's.

The measure is teacher-forced: the fp32 engine's 24 greedy tokens per prompt are fed back as
a prompt, and we count the positions where the quantized model's most likely next token is
the one fp32 chose. (Free-running greedy text diverges after a few tokens and then compares
nothing: 4-bit round-to-nearest without AWQ's or GPTQ's calibration moves a 135M model's
near-ties.) Measured on these 4 prompts x 24 positions (2026-12-01): AWQ group 64 0.57,
GPTQ act-order group 64 0.66 (and, not run here: GPTQ sym g64 0.54, AWQ g32 0.65, AWQ g128
0.67: with 96 positions the spread is noise). The SmolLM2 served here is itself a dequantized
Q4_1 GGUF, which 4-bit RTN re-rounds. The floor, 0.45, is below that noise: this test is
about serving a real model's shapes end to end (a wrong nibble order, zero point or group
decodes to a different model; the tiny-model tests hold every layout exactly).
"""

from __future__ import annotations

import pytest

from pagedserve.engine import LLM, SamplingParams
from pagedserve.models.testing_quantized import Int4Layout, quantize_int4_checkpoint

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colours are",
]
FLOORS = {"awq": 0.45, "gptq": 0.45}
KV = 1 << 26


def top1_agreement(llm: LLM, sequences: list[list[int]], prompt_lens: list[int]) -> float:
    """Share of the continuation positions where ``llm``'s top token is the sequence's next."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    hits = total = 0
    for out, seq, start in zip(outs, sequences, prompt_lens, strict=True):
        for pos in range(start, len(seq)):
            ranked = out.prompt_logprobs[pos]  # the top token and the actual one: logprobs
            hits += max(ranked, key=ranked.__getitem__) == seq[pos]
            total += 1
    return hits / total


@pytest.mark.slow
def test_quantized_smollm2_chooses_the_fp32_models_next_tokens(default_model_path, tmp_path):
    fp32 = LLM(model=default_model_path, kv_cache_memory=KV, max_model_len=256)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = fp32.generate(PROMPTS, greedy, use_tqdm=False)
    sequences = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    prompt_lens = [len(o.prompt_token_ids) for o in outs]
    del fp32
    # "Paris" is the answer's first token in fp32 and both layouts: six tokens hold it with room
    answer = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    layouts = {"awq": Int4Layout("awq", 64), "gptq": Int4Layout("gptq", 64, act_order=True)}
    for method, layout in layouts.items():
        path = quantize_int4_checkpoint(default_model_path, tmp_path / method, layout)
        llm = LLM(model=str(path), kv_cache_memory=KV, max_model_len=256)
        agreement = top1_agreement(llm, sequences, prompt_lens)
        assert agreement >= FLOORS[method], (method, agreement)
        text = llm.generate(PROMPTS[:1], answer, use_tqdm=False)[0].outputs[0].text
        assert "Paris" in text, (method, text)
