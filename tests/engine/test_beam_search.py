"""Beam search equals transformers' generate(num_beams=k, do_sample=False), hypotheses and scores."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.beam_search import BeamSearchParams

PROMPTS = [[5, 17, 99, 240, 3, 77, 8, 120, 45], [300, 12, 9, 64]]


def hf_beam_search(model, prompt, k, max_new_tokens, eos, length_penalty=1.0):
    """transformers' k hypotheses (tokens after the prompt, EOS included) and their scores."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=k,
            num_return_sequences=k,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=sorted(eos),
            pad_token_id=0,
            length_penalty=length_penalty,
            early_stopping=False,
            return_dict_in_generate=True,
            output_scores=True,
        )
    hypotheses = []
    for row, score in zip(out.sequences, out.sequences_scores, strict=True):
        tokens = row[len(prompt) :].tolist()
        for i, t in enumerate(tokens):  # cut the padding after an EOS
            if t in eos:
                tokens = tokens[: i + 1]
                break
        hypotheses.append((tokens, float(score)))
    return hypotheses


def check_equal(outputs, references, length_penalty):
    for out, ref in zip(outputs, references, strict=True):
        assert out.finished
        assert [o.token_ids for o in out.outputs] == [tokens for tokens, _ in ref]
        for o, (tokens, score) in zip(out.outputs, ref, strict=True):
            assert o.cumulative_logprob / len(tokens) ** length_penalty == pytest.approx(
                score, abs=1e-4
            )


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_beam_search_equals_transformers(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    llm = LLM(model=path, block_size=8, num_gpu_blocks_override=128)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = llm.engine.eos_token_ids
    params = BeamSearchParams(beam_width=3, max_tokens=7)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    check_equal(outputs, [hf_beam_search(hf, p, 3, 7, eos) for p in PROMPTS], 1.0)
    kv = llm.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.slow
def test_beam_search_with_early_eos_and_length_penalty(tiny_checkpoint):
    """A frequent token is made a stop token, so hypotheses end at different lengths and the
    length penalty and transformers' early-stop heuristic decide the ranking."""
    path = tiny_checkpoint("llama")
    llm = LLM(model=path, block_size=8, num_gpu_blocks_override=128)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = PROMPTS[0]
    free_run = hf_beam_search(hf, prompt, 4, 8, llm.engine.eos_token_ids)
    stop_token = free_run[0][0][1]  # the second token of the best hypothesis
    eos = llm.engine.eos_token_ids | {stop_token}
    lengths = []
    for length_penalty in (1.0, 0.3, 2.0):
        params = SamplingParams(
            n=4, temperature=0, use_beam_search=True, max_tokens=8,
            stop_token_ids=[stop_token], length_penalty=length_penalty,
        )  # fmt: skip
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        ref = hf_beam_search(hf, prompt, 4, 8, eos, length_penalty)
        lengths.append([len(tokens) for tokens, _ in ref])
        check_equal(out, [ref], length_penalty)
        ended = [o for o in out[0].outputs if o.token_ids[-1] in eos]
        assert all(o.finish_reason == "stop" for o in ended)
    # the penalty reorders hypotheses of different lengths (so the test can tell them apart)
    assert len({tuple(x) for x in lengths}) == 3 and min(min(x) for x in lengths) < 8


def test_beam_search_parameters_are_validated():
    with pytest.raises(ValueError, match="temperature must be 0"):
        SamplingParams(use_beam_search=True, n=2)
    with pytest.raises(ValueError, match="top_p is not supported with beam search"):
        SamplingParams(use_beam_search=True, n=2, temperature=0, top_p=0.5)
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=2, best_of=3)
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
