"""The engine on the CPU's numba attention path equals the engine on the reference path,
token for token: a tiny GQA llama (chunked prefill, a prefix-cache hit, decode) and SmolLM2.

The spies (on public functions only) prove the wiring: decode rows and short chunks over a
cached prefix reach the numba attention (module by module, or inside the CPU runner's fused
decoder layer of a step of at most 16 rows), longer prefill chunks reach SDPA, and the
reference run touches no numba kernel.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine import LLM, SamplingParams
from pagedserve.kernels.cpu import decoder_layer, paged_attention_plan
from pagedserve.kernels.cpu import paged_attention as pan
from pagedserve.models.testing import make_tiny_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
LONG_PROMPT = list(range(5, 45))  # 40 tokens: chunks of 16 under the token budget
SHARED_PREFIX_PROMPT = LONG_PROMPT[:32] + [300, 301, 302, 303, 304]  # 4 cached blocks + 5 new


def _spy(monkeypatch) -> dict[str, list[int]]:
    """Record the q_lens each path handled: ``numba`` every sequence a numba plan gave work to
    (``paged_attention_cpu`` or the fused layer), ``sdpa`` each SDPA call's query length."""
    seen: dict[str, list[int]] = {"numba": [], "sdpa": []}
    attention, fused_layer = pan.paged_attention_cpu, decoder_layer.decoder_layer_numba
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def record(plan):
        starts = plan.layout[2]  # query_start_loc
        sequences = sorted(set(plan.work[:, 0].tolist()))
        seen["numba"] += [int(starts[b + 1] - starts[b]) for b in sequences]

    def attention_spy(query, k_cache, v_cache, block_tables, seq_lens, starts, *args, **kw):
        plan = paged_attention_plan.step_plan(
            block_tables, seq_lens, starts, pan.NUMBA_MAX_Q_LEN, None, kw.get("sliding_window") or 0
        )
        record(plan)
        return attention(query, k_cache, v_cache, block_tables, seq_lens, starts, *args, **kw)

    def fused_spy(*args):
        record(args[-1])
        return fused_layer(*args)

    def sdpa_spy(query, *args, **kwargs):
        seen["sdpa"].append(query.shape[-2])
        return sdpa(query, *args, **kwargs)

    monkeypatch.setattr(pan, "paged_attention_cpu", attention_spy)
    monkeypatch.setattr(decoder_layer, "decoder_layer_numba", fused_spy)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa_spy)
    return seen


def _tiny_llama_tokens(path: str, monkeypatch, kernels: str) -> list[list[int]]:
    monkeypatch.setenv("PAGEDSERVE_KERNELS", kernels)
    llm = LLM(model=path, block_size=8, max_num_batched_tokens=16)
    first = llm.generate(
        [{"prompt_token_ids": LONG_PROMPT}, {"prompt_token_ids": [100, 200, 300]}],
        GREEDY,
        use_tqdm=False,
    )
    second = llm.generate([{"prompt_token_ids": SHARED_PREFIX_PROMPT}], GREEDY, use_tqdm=False)
    assert second[0].num_cached_tokens == 32, "the shared prefix must come from the cache"
    return [out.outputs[0].token_ids for out in first + second]


@pytest.mark.slow
def test_tiny_gqa_llama_numba_path_generates_the_reference_tokens(tmp_path, monkeypatch):
    path = str(
        make_tiny_checkpoint(
            "llama",
            tmp_path / "llama",
            hidden_size=96,
            num_attention_heads=6,
            num_key_value_heads=2,
        )  # fmt: skip
    )
    seen = _spy(monkeypatch)
    reference = _tiny_llama_tokens(path, monkeypatch, "ref")
    assert seen["numba"] == [], "the reference run must not touch the numba path"
    seen["sdpa"].clear()
    numba = _tiny_llama_tokens(path, monkeypatch, "numba")
    assert 1 in seen["numba"] and 5 in seen["numba"]  # decode rows, the chunk over the prefix
    assert 16 in seen["sdpa"]  # the long prompt's full chunks
    assert numba == reference


@pytest.mark.slow
def test_smollm2_numba_path_generates_the_reference_tokens(
    default_model_path, monkeypatch, smollm2_greedy_batch
):
    """The numba side is the session's greedy batch (tests/e2e/conftest.py, run on the numba
    path): the reference path runs two of its prompts here, batched on their own."""
    numba = smollm2_greedy_batch.outputs
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "ref")
    llm = LLM(model=default_model_path, block_size=16)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [numba[p].outputs[0].token_ids[:16] for p in prompts] == ref


def test_the_cpu_runner_plans_each_fused_step_once_for_all_layers(tmp_path, monkeypatch):
    """The fused layers share their step's attention plan: one plan per forward, not one per
    layer (the runner builds it; engine/cpu_runner.py)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("PAGEDSERVE_KERNELS", raising=False)
    path = make_tiny_checkpoint("llama", tmp_path / "llama", num_hidden_layers=3)
    builds, build = [], paged_attention_plan.step_plan
    monkeypatch.setattr(paged_attention_plan, "step_plan", lambda *a: builds.append(1) or build(*a))
    llm = LLM(model=str(path), block_size=8)
    builds.clear()  # the start-up's warm-up calls
    llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=4))
    assert len(builds) == 4  # the prefill and three decodes, over three layers each
