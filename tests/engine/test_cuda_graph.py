"""The padded decode path of CUDA graphs, on CPU: padding changes no real row, and writes nothing
a real sequence owns. The capture itself is tested on a GPU (skipped here) and in gpu_check.sh.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from pagedserve.blockmgr import CacheConfig
from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.config import EngineArgs
from pagedserve.engine.cuda_graph import CUDAGraphConfig, cuda_graph_sizes
from pagedserve.engine.model_runner import ModelRunner
from pagedserve.models import ModelConfig
from pagedserve.scheduler import Request, ScheduledRequest, SchedulerOutput

BLOCK_SIZE, NUM_BLOCKS = 8, 112


def test_buckets_are_vllms_and_end_at_max_num_seqs():
    assert cuda_graph_sizes(1) == [1]
    assert cuda_graph_sizes(6) == [1, 2, 4, 6]
    assert cuda_graph_sizes(64) == [1, 2, 4, *range(8, 65, 8)]
    sizes = cuda_graph_sizes(300)
    assert sizes[-4:] == [256, 272, 288, 300] and sizes[:5] == [1, 2, 4, 8, 16]


@pytest.fixture(scope="module")
def runners(tiny_checkpoint):
    """(padded, unpadded) runners over the same weights; the padded one pads on CPU."""
    path = tiny_checkpoint("llama")

    def make(graph_config):
        return ModelRunner(
            ModelConfig(model=path, device="cpu", max_model_len=64),
            CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS),
            graph_config=graph_config,
        )

    padded = make(CUDAGraphConfig(max_num_seqs=16, pad_decode_on_cpu=True))
    return padded, make(None)


def random_decode_step(rng: random.Random, num_seqs: int, vocab: int):
    """A pure-decode step over distinct random blocks; the slots holding each sequence's
    context (every position before its new token)."""
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    scheduled, context = [], []
    for i in range(num_seqs):
        length = rng.randint(1, 40)  # tokens in the cache before this step
        table = [free.pop() for _ in range(length // BLOCK_SIZE + 1)]
        num_prompt = rng.randint(1, length)
        request = Request(
            request_id=str(i),
            prompt_token_ids=[rng.randrange(vocab) for _ in range(num_prompt)],
            max_tokens=100,
            payload=SimpleNamespace(needs_prompt_logits=False),
        )
        request.output_token_ids = [rng.randrange(vocab) for _ in range(length + 1 - num_prompt)]
        scheduled.append(ScheduledRequest(request, length, 1, table))
        context += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(length)]
    return SchedulerOutput(scheduled=scheduled), context


def fill_caches(runner: ModelRunner, context: list[int], seed: int) -> None:
    """Random keys and values in the context slots, NaN in every other slot."""
    generator = torch.Generator().manual_seed(seed)
    for k_cache, v_cache in runner.kv_caches:
        for cache in (k_cache, v_cache):
            flat = cache.view(-1, *cache.shape[2:])
            values = torch.randn(len(context), *flat.shape[1:], generator=generator)
            flat.fill_(float("nan"))
            flat[torch.tensor(context)] = values


def cache_slots(runner: ModelRunner) -> list[torch.Tensor]:
    return [c.view(-1, *c.shape[2:]).clone() for kv in runner.kv_caches for c in kv]


def test_padded_decode_equals_unpadded_and_writes_only_its_own_slots(runners):
    padded, eager = runners
    assert padded.kv_caches[0][0].shape[0] == NUM_BLOCKS + 1  # the padding block
    assert padded.num_blocks == eager.num_blocks == NUM_BLOCKS
    padding_slot = NUM_BLOCKS * BLOCK_SIZE
    rng = random.Random(0)
    vocab = padded.model_config.vocab_size
    # larger batches first, so later ones run over buffers holding stale rows
    for step, num_seqs in enumerate([13, 3, 16, 1, 9, 5, 2]):
        output, context = random_decode_step(rng, num_seqs, vocab)
        for runner in runners:
            fill_caches(runner, context, seed=step)
        before = cache_slots(padded)
        padded_input, layout = padded.prepare_input(output)
        bucket = padded_input.padded_batch_size
        assert bucket == min(s for s in cuda_graph_sizes(16) if s >= num_seqs)
        assert padded_input.input_ids.shape == (bucket,)
        eager_input, eager_layout = eager.prepare_input(output)
        logits = padded.execute_model(padded_input, output.blocks_to_copy)
        eager_logits = eager.execute_model(eager_input, output.blocks_to_copy)
        assert layout == eager_layout and logits.shape == eager_logits.shape == (num_seqs, vocab)
        torch.testing.assert_close(logits, eager_logits, atol=1e-5, rtol=1.3e-6)
        assert torch.equal(logits.argmax(-1), eager_logits.argmax(-1))

        new_slots = {item.block_table[item.num_computed_tokens // BLOCK_SIZE] * BLOCK_SIZE
                     + item.num_computed_tokens % BLOCK_SIZE for item in output.scheduled}  # fmt: skip
        after, eager_after = cache_slots(padded), cache_slots(eager)
        for old, new, reference in zip(before, after, eager_after, strict=True):
            changed = ~((old == new) | (old.isnan() & new.isnan())).flatten(1).all(1)
            written = set(changed.nonzero().flatten().tolist())
            expected = new_slots | ({padding_slot} if bucket > num_seqs else set())
            assert written == expected  # no padding row wrote a slot a sequence owns
            real = torch.tensor(sorted(new_slots))
            torch.testing.assert_close(new[real], reference[real], atol=1e-5, rtol=1.3e-6)


def test_a_step_with_a_prefill_stays_unpadded(runners):
    padded, _ = runners
    output, _ = random_decode_step(random.Random(1), 3, padded.model_config.vocab_size)
    items = output.scheduled
    first = items[0]
    if first.num_computed_tokens:
        items[0] = ScheduledRequest(
            first.request, first.num_computed_tokens - 1, 2, first.block_table
        )
    model_input, _ = padded.prepare_input(SchedulerOutput(scheduled=items))
    assert model_input.padded_batch_size is None and model_input.input_ids.shape == (4,)


def test_the_engine_generates_the_same_tokens_through_the_padded_path(tiny_checkpoint, monkeypatch):
    """Prefills, decodes of changing batch sizes, n > 1 forks: padding changes no token."""
    rng = random.Random(3)
    prompts = [{"prompt_token_ids": [rng.randrange(200) for _ in range(rng.randint(2, 20))]}
               for _ in range(7)]  # fmt: skip
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 12)) for _ in prompts]
    params[2] = SamplingParams(temperature=0.8, n=3, seed=5, max_tokens=6)

    def generate():
        llm = LLM(model=tiny_checkpoint("llama"), block_size=8, num_gpu_blocks_override=64)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return llm, [[o.token_ids for o in out.outputs] for out in outs]

    _, eager_tokens = generate()
    monkeypatch.setattr(
        EngineArgs,
        "cuda_graph_config",
        lambda self: CUDAGraphConfig(max_num_seqs=self.max_num_seqs, pad_decode_on_cpu=True),
    )
    llm, padded_tokens = generate()
    assert llm.engine.runner.decode_buffers is not None
    assert padded_tokens == eager_tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_replay_decode_with_the_eager_tokens(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    prompts = [{"prompt_token_ids": list(range(3 + i, 12 + 2 * i))} for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=16)

    def generate(enforce_eager: bool):
        llm = LLM(model=path, device="cuda", dtype="float32", enforce_eager=enforce_eager,
                  max_num_seqs=8, max_model_len=256, gpu_memory_utilization=0.3)  # fmt: skip
        return llm, [
            out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)
        ]

    eager_llm, eager = generate(True)
    assert eager_llm.engine.runner.cuda_graphs is None
    llm, graphed = generate(False)
    graphs = llm.engine.runner.cuda_graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 8]
    replays = []
    real_replay = graphs.replay
    graphs.replay = lambda bucket: replays.append(bucket) or real_replay(bucket)
    again = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
    assert graphed == again == eager
    assert 8 in replays and set(replays) <= {1, 2, 4, 8}  # five decodes pad to the bucket of 8
