"""A draft-model configuration: vLLM's spellings, the checks at start-up, the KV budget split,
and the draft's distribution (the exponential race it draws with is what it hands on as q)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine import LLM, EngineArgs, LLMEngine, SamplingParams
from pagedserve.engine.input_batch import SamplingState
from pagedserve.engine.kv_cache import bytes_per_block
from pagedserve.engine.spec_decode import SpeculativeConfig, SpeculativeConfigError
from pagedserve.engine.spec_decode.draft_model import draw_draft_tokens
from pagedserve.kernels.rejection_sample import rejection_sample
from pagedserve.kernels.sampling import sampling_probs
from pagedserve.models import KVCacheSpec
from pagedserve.scheduler import Request


def test_the_older_spelling_infers_the_method_from_the_model():
    config = SpeculativeConfig.from_dict({"model": "/some/draft", "num_speculative_tokens": 3})
    assert (config.method, config.model, config.num_speculative_tokens) == (
        "draft_model",
        "/some/draft",
        3,
    )
    assert SpeculativeConfig.from_dict({"model": "[ngram]"}).method == "ngram"
    text = '{"method": "draft_model", "model": "/d", "num_speculative_tokens": 2}'
    assert SpeculativeConfig.from_dict(text).model == "/d"
    with pytest.raises(SpeculativeConfigError) as info:
        SpeculativeConfig.from_dict({"model": "/d", "draft_tensor_parallel_size": 1})
    assert info.value.param == "speculative_config.draft_tensor_parallel_size"


def test_a_missing_draft_folder_is_refused_at_start_up(tiny_checkpoint, tmp_path):
    missing = str(tmp_path / "no-such-draft")
    with pytest.raises(SpeculativeConfigError, match="no-such-draft") as info:
        LLM(model=tiny_checkpoint("llama"), speculative_config={"model": missing})
    assert info.value.param == "speculative_config.model"


def test_a_draft_with_another_tokenizer_is_refused(tiny_checkpoint, tmp_path):
    """Same vocabulary size, other token -> id map: proposals would be other tokens."""
    import json
    import shutil

    target = tiny_checkpoint("llama")
    draft = shutil.copytree(target, tmp_path / "draft")  # the target, two tokens' ids swapped
    data = json.loads((draft / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (draft / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(SpeculativeConfigError, match="other ids") as info:
        LLM(model=target, speculative_config={"model": str(draft)})
    assert info.value.param == "speculative_config.model"


def test_the_kv_budget_is_split_between_target_and_draft(tiny_checkpoint):
    target = tiny_checkpoint("llama")
    draft = tiny_checkpoint("gpt2")  # 2 layers of 4 heads x 16 against the target's 2 x 2 x 16
    budget = 1 << 20
    args = dict(model=target, block_size=8, kv_cache_memory=budget)
    alone = LLMEngine(EngineArgs(**args))
    both = LLMEngine(EngineArgs(**args, speculative_config={"model": draft}))
    target_bytes = bytes_per_block(KVCacheSpec(2, 2, 16, 2), 8, torch.float32)
    draft_bytes = bytes_per_block(KVCacheSpec(2, 4, 16, 2), 8, torch.float32)
    assert alone.runner.num_blocks == budget // target_bytes
    assert both.runner.num_blocks == budget // (target_bytes + draft_bytes)
    k_cache = both.speculator.draft.kv_caches[0][0]
    assert k_cache.shape == (both.runner.num_blocks, 8, 4, 16)
    assert both.kv_cache_manager.num_blocks == both.runner.num_blocks


VOCAB, DRAWS = 6, 60_000
# chi-square's upper 0.1 % points by degrees of freedom (the support's size - 1)
CRITICAL = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


def chi_square_passes(tokens: torch.Tensor, probs: torch.Tensor) -> bool:
    """Counts of ``tokens`` against ``probs`` over its support (none may fall outside)."""
    counts = torch.bincount(tokens, minlength=VOCAB).double()
    support = probs > 0
    assert counts[~support].sum() == 0
    expected = probs[support].double() * len(tokens)
    statistic = float(((counts[support] - expected) ** 2 / expected).sum())
    return statistic < CRITICAL[int(support.sum()) - 1]


def _State(params: SamplingParams, seed: int) -> SamplingState:
    request = Request("r", [1], max_tokens=8)
    return SamplingState(request, params, torch.Generator().manual_seed(seed))


def test_draft_tokens_follow_the_q_they_hand_on_and_the_target_survives():
    """Draft draws under temperature and top-p follow the returned q; verified against a
    different target with that q, the emitted tokens follow the target's distribution."""
    gen = torch.Generator().manual_seed(0)
    draft_logits = torch.randn(VOCAB, generator=gen) * 1.5
    params = SamplingParams(temperature=1.5, top_p=0.9)
    state = _State(params, seed=1)
    rows = draft_logits.expand(DRAWS, VOCAB).contiguous()
    tokens, q = draw_draft_tokens(rows, [state] * DRAWS)
    tokens = torch.tensor(tokens)
    assert 2 < int((q[0] > 0).sum()) < VOCAB  # top-p cut some tokens, kept several
    assert chi_square_passes(tokens, q[0])
    t, p, m = (torch.tensor([x]) for x in (1.5, 0.9, 0.0))
    assert torch.allclose(q[0], sampling_probs(draft_logits[None], t, torch.tensor([0]), p, m)[0])
    target = torch.softmax(torch.randn(VOCAB, generator=gen) * 1.5, dim=-1)
    assert (target - q[0]).abs().max() > 0.1
    out = rejection_sample(
        tokens[:, None],
        torch.ones(DRAWS, dtype=torch.int32),
        q[:, None],
        target.expand(DRAWS, 1, VOCAB).contiguous(),
        torch.zeros(DRAWS, dtype=torch.long),
        torch.rand(DRAWS, 1, generator=gen),
        torch.empty(DRAWS, 1, VOCAB).exponential_(generator=gen),
    )
    assert chi_square_passes(out[:, 0], target)
    greedy, none = draw_draft_tokens(rows[:3], [_State(SamplingParams(temperature=0), 0)] * 3)
    assert greedy == [int(draft_logits.argmax())] * 3 and none is None
