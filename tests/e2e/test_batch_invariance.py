"""``--batch-invariant``: a request's logprobs are the same bits alone and inside any batch.

A target request (greedy and seeded-sampled, both with logprobs) runs alone on a fresh engine,
so its prompt is computed whole in one prefill. Then it runs again among random others:

- on the same engine in batches of 2 and 64 (its prompt's full blocks are now prefix hits, so
  only its last block is computed, among the others' prefills);
- on engines whose token budget (7, 19) cuts every prefill into chunks, prefix caching off;
- on an engine whose KV pool is too small for the batch, so that requests are preempted and
  recomputed (partly from the prefix cache).

Every run's tokens and logprobs must equal the first's, with ``torch.equal`` on the logprob
values. On every tiny architecture and on SmolLM2, on CPU; with three tensor-parallel ranks on
a tiny Llama. Without the mode the same workload finds differences (the test's teeth; the
figures are in docs/batch_invariance.md).
"""

from __future__ import annotations

import random
from contextlib import contextmanager

import pytest
import torch

from pagedserve.engine import LLM, SamplingParams
from pagedserve.models.testing import TINY_ARCHS

GREEDY = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
SEEDED = SamplingParams(
    temperature=0.9, top_p=0.9, seed=7, max_tokens=6, logprobs=3, ignore_eos=True
)
POOL = dict(block_size=8, kv_cache_memory=16 << 20)


def random_prompts(rng: random.Random, n: int, vocab: int, longest: int = 40) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(1, longest))] for _ in range(n)]


def as_tensors(output) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A completion's token ids, and its logprob entries (token, value), flattened in a fixed
    order (an entry has the top 3, and the drawn token when it is not among them)."""
    entries = [pair for position in output.outputs[0].logprobs for pair in sorted(position.items())]
    ids = torch.tensor([token for token, _ in entries])
    values = torch.tensor([float(value) for _, value in entries], dtype=torch.float64)
    return torch.tensor(output.outputs[0].token_ids), ids, values


def run_among(llm: LLM, targets: list[tuple[list[int], SamplingParams]], others) -> list:
    """Each (target prompt, its params) placed inside ``others`` (greedy); the targets'
    outputs as tensors, in order."""
    prompts = [{"prompt_token_ids": p} for p in others]
    params = [GREEDY] * len(others)
    for i, (target, target_params) in enumerate(targets):
        at = (i + 1) * len(others) // (len(targets) + 1) + i
        prompts.insert(at, {"prompt_token_ids": target})
        params.insert(at, target_params)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    marked = [p["prompt_token_ids"] for p in prompts]
    return [as_tensors(outputs[marked.index(t)]) for t, _ in targets]


def differences(
    model: str, batch_invariant: bool, vocab: int, sizes: tuple[int, ...] = (2, 64), seed: int = 0
) -> list[str]:
    """The scenarios of the module docstring (batches of ``sizes`` with prefix hits); the
    names of those where a target's outputs differ from its alone run's (two targets: a
    greedy one and a seeded one)."""
    rng = random.Random(seed)
    targets = [([rng.randrange(3, vocab) for _ in range(41)], p) for p in (GREEDY, SEEDED)]
    kw = dict(POOL, batch_invariant=batch_invariant)
    llm = LLM(model=model, **kw)
    alone = [run_among(llm, [t], [])[0] for t in targets]  # distinct prompts: no prefix hits
    runs = {f"batch of {n} with prefix hits": (llm, n) for n in sizes}
    for budget in (7, 19):
        engine = LLM(model=model, max_num_batched_tokens=budget, enable_prefix_caching=False, **kw)
        runs[f"chunks of {budget}"] = (engine, 9)
    # 7 blocks of 8: the longest request fits alone (6 blocks), never beside many others
    tight = LLM(model=model, **dict(kw, kv_cache_memory=None), num_gpu_blocks_override=7)
    runs["preempted and recomputed"] = (tight, 16)
    found = []
    for name, (engine, n) in runs.items():
        got = run_among(engine, targets, random_prompts(rng, n, vocab))
        if not all(torch.equal(a, b) for x, y in zip(got, alone) for a, b in zip(x, y)):
            found.append(name)
    assert tight.engine.scheduler.stats.num_preemptions > 0
    return found


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_models_give_the_same_bits_in_any_batch(tiny_checkpoint, arch):
    assert differences(tiny_checkpoint(arch), True, vocab=512) == []


@pytest.mark.slow
def test_smollm2_gives_the_same_bits_in_any_batch(default_model_path):
    assert differences(default_model_path, True, vocab=49152, sizes=(2, 16)) == []


def test_without_the_mode_the_same_workload_differs(tiny_checkpoint):
    """The teeth: the default kernels (MKL from 17 rows on, SDPA for prefills over 15 tokens,
    the numba GEMM below) give other bits on the same workload."""
    found = differences(tiny_checkpoint("llama"), False, vocab=512)
    assert "batch of 64 with prefix hits" in found, found


@contextmanager
def tp_llm(path: str, tp_size: int, **kwargs):
    llm = LLM(model=path, tensor_parallel_size=tp_size, **kwargs)
    try:
        yield llm
    finally:
        llm.engine.runner.shutdown()


@pytest.mark.slow
def test_three_tensor_parallel_ranks_give_the_same_bits_in_any_batch(tiny_checkpoint):
    """Three ranks: a ring all-reduce would sum a row's partials in an order that follows
    where the row falls in the buffer; the mode sums them in rank order."""
    path = tiny_checkpoint(
        "llama", hidden_size=96, intermediate_size=192, num_attention_heads=6,
        num_key_value_heads=3,
    )  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # two cores, three ranks (workers inherit it)
    try:
        rng = random.Random(3)
        target = [rng.randrange(3, 512) for _ in range(37)]
        with tp_llm(path, 3, batch_invariant=True, max_num_batched_tokens=19, **POOL) as llm:
            alone = run_among(llm, [(target, GREEDY)], [])
            for n in (2, 12):
                got = run_among(llm, [(target, GREEDY)], random_prompts(rng, n, 512))
                assert all(torch.equal(a, b) for a, b in zip(got[0], alone[0])), n
    finally:
        torch.set_num_threads(threads)
