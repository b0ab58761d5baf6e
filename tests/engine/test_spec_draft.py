"""Speculative decoding with a draft model, end to end on tiny random models.

Drafts for a tiny Llama target: the target itself (every greedy proposal accepted), a noisy copy
of it (about half accepted: rejections and accepted runs mixed), its first layer alone (a
truncated draft, few accepted), a tiny GPT-2 and a smaller Llama (other architectures and
head layouts, sharing the target's tokenizer). Greedy outputs must be token for token the
target's alone in every case; the draft's KV cache must hold, after every step, the draft's
keys and values for every token the target has computed (checked against the target's own
cache when the draft is the target), prefix-cache hits included.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_spec_decode import (
    GREEDY,
    assert_accepted,
    repetitive_prompts,
    run,
    stop_inside_a_run,
    token_ids,
)

from pagedserve.engine import EngineArgs, InvalidRequestError, LLMEngine, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from make_draft_model import truncate_layers  # noqa: E402


def draft_config(path: str, k: int = 4) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def target(tiny_checkpoint) -> str:
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def noisy_draft(target, tmp_path_factory) -> str:
    """The target's weights plus Gaussian noise (sd 0.005 against weights of sd 0.1): a
    draft whose greedy proposals the target accepts about 40% of the time."""
    from safetensors.torch import load_file, save_file

    out = truncate_layers(target, 2, tmp_path_factory.mktemp("noisy"))  # a full copy
    weights = load_file(out / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    noisy = {n: w + 0.005 * torch.randn(w.shape, generator=gen) for n, w in weights.items()}
    save_file(noisy, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


@pytest.fixture(scope="module")
def truncated_draft(target, tmp_path_factory) -> str:
    return str(truncate_layers(target, 1, tmp_path_factory.mktemp("truncated")))


def assert_draft_cache_is_the_targets(engine, atol: float = 1e-4, rtol: float = 1e-4) -> None:
    """With the target as its own draft, both caches hold the same keys and values at every
    slot a running sequence has computed (its prefix-cache hits included), within the cache
    dtype's rounding (``atol``, ``rtol``)."""
    kv, draft = engine.kv_cache_manager, engine.speculator.draft
    for request in engine.scheduler.running:
        n = request.num_computed_tokens
        table = torch.tensor(kv.block_ids(request.request_id))
        positions = torch.arange(n)
        slots = table[positions // kv.block_size] * kv.block_size + positions % kv.block_size
        for (tk, tv), (dk, dv) in zip(engine.runner.kv_caches, draft.kv_caches, strict=True):
            for target_cache, draft_cache in ((tk, dk), (tv, dv)):
                want = target_cache.flatten(0, 1)[slots]
                got = draft_cache.flatten(0, 1)[slots]
                torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def test_the_target_as_its_own_draft_accepts_everything_and_mirrors_its_cache(target):
    """Chunked prefill, a batch, and then prompts that extend the first ones' outputs, so the
    prefix cache serves blocks written by verify steps (fully accepted runs among them)."""
    prompts = repetitive_prompts(3)
    kwargs = dict(max_num_batched_tokens=24, long_prefill_token_threshold=16)
    base, _, _ = run(target, prompts, GREEDY, speculative=False, **kwargs)
    spec, chunks, engine = run(
        target, prompts, GREEDY, draft_config(target), assert_draft_cache_is_the_targets, **kwargs
    )
    assert token_ids(spec) == token_ids(base)
    stats = engine.get_stats()
    assert stats.spec_decode_acceptance_rate > 0.95
    assert stats.spec_decode_mean_acceptance_length > 4
    assert max(max(c) for c in chunks.values()) == 5  # k accepted + the bonus token

    follow_ups = [p + base[str(i)].outputs[0].token_ids + [7, 8, 9] for i, p in enumerate(prompts)]
    again, _, engine = run(
        target,
        prompts + follow_ups,
        GREEDY,
        draft_config(target),
        assert_draft_cache_is_the_targets,
        max_num_seqs=3,  # the follow-ups run after the first ones, and hit their blocks
    )
    assert sum(again[str(i)].num_cached_tokens for i in range(3, 6)) > 3 * 16
    assert engine.get_stats().spec_decode_acceptance_rate > 0.95
    want, _, _ = run(target, follow_ups, GREEDY, speculative=False)
    assert [again[str(i + 3)].outputs[0].token_ids for i in range(3)] == [
        want[str(i)].outputs[0].token_ids for i in range(3)
    ]
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


CHUNKED = dict(max_num_batched_tokens=32, long_prefill_token_threshold=16)


@pytest.fixture(scope="module")
def greedy_base(target):
    """Prompts, and the target's greedy outputs for them without speculation."""
    prompts = repetitive_prompts(4, seed=1)
    return prompts, run(target, prompts, GREEDY, speculative=False, **CHUNKED)[0]


@pytest.mark.parametrize("draft", ["noisy", "truncated", "gpt2", "small_llama"])
def test_greedy_with_another_draft_is_the_targets_alone(
    draft, target, greedy_base, noisy_draft, truncated_draft, tiny_checkpoint
):
    path = {
        "noisy": noisy_draft,
        "truncated": truncated_draft,
        "gpt2": tiny_checkpoint("gpt2"),
        "small_llama": tiny_checkpoint(
            "llama",
            seed=3,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        ),
    }[draft]
    prompts, base = greedy_base
    spec, _, engine = run(target, prompts, GREEDY, draft_config(path), **CHUNKED)
    assert token_ids(spec) == token_ids(base)
    stats = engine.get_stats()
    assert stats.spec_decode_num_draft_tokens > 50
    if draft == "noisy":  # accepted runs and rejections, both often
        assert 0.2 < stats.spec_decode_acceptance_rate < 0.9
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_preemption_forks_and_logprobs(target, noisy_draft):
    """A 24-block pool that preempts; n = 2 forks sharing their prompt's blocks (copy-on-write
    in both caches); logprobs of the accepted tokens are the target's."""
    prompts = repetitive_prompts(6, seed=2)
    params = SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    kwargs = dict(num_gpu_blocks_override=24, max_num_batched_tokens=64)
    base, _, _ = run(target, prompts, params, speculative=False, **kwargs)
    spec, _, engine = run(target, prompts, params, draft_config(noisy_draft), **kwargs)
    assert engine.get_stats().num_preemptions > 0
    assert token_ids(spec) == token_ids(base)
    assert_accepted(engine)
    for rid, out in spec.items():
        for got, want in zip(out.outputs, base[rid].outputs, strict=True):
            for got_step, want_step in zip(got.logprobs, want.logprobs, strict=True):
                assert got_step.keys() == want_step.keys()
                for token, value in want_step.items():
                    assert got_step[token] == pytest.approx(value, abs=1e-4)
    assert engine.kv_cache_manager.num_free_blocks == 24


@pytest.mark.parametrize("kind", ["max_tokens", "stop"])
def test_a_stop_inside_an_accepted_draft_run(kind, target):
    spec_config = draft_config(target)
    prompt, stopped, index = stop_inside_a_run(target, kind, spec_config)
    base, _, _ = run(target, [prompt], stopped, speculative=False)
    spec, _, engine = run(target, [prompt], stopped, spec_config)
    got, want = spec["0"].outputs[0], base["0"].outputs[0]
    assert (got.token_ids, got.text, got.finish_reason) == (
        want.token_ids,
        want.text,
        want.finish_reason,
    )
    assert len(got.token_ids) == index + 1
    assert_accepted(engine)


def test_seeded_sampling_is_reproducible_and_leaks_no_block(target, noisy_draft):
    """The draft draws with each request's own generator: a seeded request gives the same
    tokens alone as in a batch; after many rejections every block is back."""
    prompts = repetitive_prompts(5, seed=3)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    spec = draft_config(noisy_draft)
    first, _, engine = run(target, prompts, params, spec, num_gpu_blocks_override=40)
    stats = engine.get_stats()
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens > 0
    assert engine.kv_cache_manager.num_free_blocks == 40
    alone, _, _ = run(target, prompts[2:3], params[2:3], spec)
    assert alone["0"].outputs[0].token_ids == first["2"].outputs[0].token_ids


def test_beam_search_with_a_draft_model_is_refused(target):
    engine = LLMEngine(
        EngineArgs(
            model=target, speculative_config=draft_config(target), num_gpu_blocks_override=16
        )
    )
    params = SamplingParams(n=2, use_beam_search=True, temperature=0, max_tokens=4)
    with pytest.raises(InvalidRequestError, match="speculative") as info:
        engine.add_request("0", [5, 6, 7], params)
    assert info.value.param == "use_beam_search"
