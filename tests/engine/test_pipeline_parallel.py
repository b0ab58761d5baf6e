"""Pipeline parallelism over torch.distributed (gloo on CPU).

- The layers are cut into contiguous stages: evenly (the extras before the last stage), by
  ``pp_layer_partition``, or by vLLM's ``VLLM_PP_LAYER_PARTITION``; a bad split or an
  architecture without stages is refused before any process starts. Rank 0's group holds the
  last stage; a stage's rank sends to the next stage's rank of the same shard.
- ``LLM(..., pipeline_parallel_size=2)`` gives the single-process greedy tokens on the tiny
  models (dense, tied head, MoE, latent attention, sinks), with chunked prefill and a prefix
  hit; three stages on 3-layer tiny Llama, Qwen2 and Mixtral; tensor parallelism inside each
  stage (2 x 2 ranks); SmolLM2 at 3 stages and at 2 stages of 3 shards with chunked prefill,
  prefix hits and preemptions; and SmolLM2's shipped GGUF with an uneven split, its tied head
  loaded on the last stage from the embedding's blocks. Each rank holds its own layers'
  weights and KV cache only (``rank_memory``).
- A stage's worker that dies fails the engine with a clear error, never a hang.
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from pagedserve.engine import LLM, EngineArgs, SamplingParams
from pagedserve.engine.distributed.group import ParallelLayout
from pagedserve.engine.errors import DistributedError
from pagedserve.models.pipeline import partition_layers

PROMPTS = [list(range(5, 22)), [100, 200, 300], list(range(30, 70)), [7]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _counts(stages) -> list[int]:
    assert [s.start for s in stages[1:]] == [s.stop for s in stages[:-1]]  # contiguous
    return [len(s) for s in stages]


def test_layers_are_cut_into_contiguous_stages(monkeypatch):
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    assert _counts(partition_layers(30, 2)) == [15, 15]
    assert _counts(partition_layers(30, 4)) == [7, 8, 8, 7]  # extras before the last stage
    assert _counts(partition_layers(5, 1)) == [5]
    assert _counts(partition_layers(30, 2, "10,20")) == [10, 20]
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "12,18")
    assert _counts(partition_layers(30, 2)) == [12, 18]
    assert _counts(partition_layers(30, 2, "29,1")) == [29, 1]  # the argument wins
    for bad in ("10,10", "30,0", "a,b", "10,10,10"):
        with pytest.raises(ValueError, match="pp_layer_partition"):
            partition_layers(30, 2, bad)
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION")
    with pytest.raises(ValueError, match="more than the model's 2 layers"):
        partition_layers(2, 3)


def test_rank_0s_group_holds_the_last_stage_and_peers_share_a_shard():
    layers = (range(0, 4), range(4, 8), range(8, 10))
    layout = ParallelLayout(tp_size=2, pp_size=3, stage_layers=layers)
    assert layout.world_size == 6
    assert [layout.stage_of(rank) for rank in range(6)] == [2, 2, 0, 0, 1, 1]
    assert [layout.stage_ranks(s) for s in range(3)] == [[2, 3], [4, 5], [0, 1]]
    # hidden states go from a rank to the rank of the next stage holding the same shard
    assert [layout.peer(rank, 1) for rank in (2, 3)] == [4, 5]
    assert [layout.peer(rank, 2) for rank in (4, 5)] == [0, 1]
    stage = layout.pipeline_stage(5)
    assert (stage.index, stage.is_first, stage.is_last) == (1, False, False)
    assert stage.layer_range(10) == range(4, 8)
    assert layout.pipeline_stage(1).is_last and layout.pipeline_stage(3).is_first
    assert ParallelLayout(tp_size=3).stage_ranks(0) == [0, 1, 2]  # one stage: every rank


def test_what_cannot_be_staged_is_refused_before_any_process_starts(tiny_checkpoint):
    with pytest.raises(ValueError, match="GPT2LMHeadModel runs without pipeline parallelism"):
        LLM(model=tiny_checkpoint("gpt2"), pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="more than the model's 2 layers"):
        LLM(model=tiny_checkpoint("llama"), pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="must give each of the 2 stages"):
        LLM(model=tiny_checkpoint("llama"), pipeline_parallel_size=2, pp_layer_partition="2,0")
    with pytest.raises(ValueError, match="pp_layer_partition '1,1' splits pipeline stages"):
        EngineArgs(model="unused", pp_layer_partition="1,1")  # one stage: nothing to split
    for refused, kwargs in {
        "enable_lora": dict(enable_lora=True),
        "kv_offload": dict(kv_offload_memory=1 << 20),
    }.items():
        with pytest.raises(ValueError, match=f"{refused}.*pipeline_parallel_size"):
            EngineArgs(model="unused", pipeline_parallel_size=2, **kwargs)


# ---- the engine over real ranks ------------------------------------------------------------


@contextmanager
def staged_llm(path: str, **kwargs):
    llm = LLM(model=path, **kwargs)
    try:
        yield llm
    finally:
        llm.engine.runner.shutdown()


def _greedy(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


# tied head, MoE, the gated shared expert, latent attention, sinks and sliding windows
TINY_ARCHS = ["llama", "qwen2", "mixtral", "qwen2_moe", "deepseek_v2", "gpt_oss"]


@pytest.mark.slow
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_two_stages_equal_one_process_on_tiny_models(tiny_checkpoint, one_thread, arch):
    path = tiny_checkpoint(arch)
    # a small token budget: prefills go in chunks, some steps sample nothing
    engine_args = dict(block_size=8, max_num_batched_tokens=24, kv_cache_memory=8 << 20)
    prompts = [*PROMPTS, PROMPTS[2] + [9, 9]]  # the last hits the prefix cache on PROMPTS[2]
    single = LLM(model=path, **engine_args)
    expected = _greedy(single, prompts)
    whole = single.engine.runner
    with staged_llm(path, pipeline_parallel_size=2, **engine_args) as llm:
        assert _greedy(llm, prompts) == expected
        runner = llm.engine.runner
        workers = list(runner.workers.procs.values())
        memory = runner.rank_memory
        assert [(m.stage, list(m.layers)) for m in memory] == [(1, [1]), (0, [0])]
        assert len(runner.driver.kv_caches) == 1  # the last stage's one layer
        weights = sum(p.numel() * p.element_size() for p in whole.model.parameters())
        assert all(m.weight_bytes < weights for m in memory)
        # a stage's block holds half the layers: about twice the blocks in the same memory
        assert runner.num_blocks in (2 * whole.num_blocks, 2 * whole.num_blocks + 1)
    assert [p.returncode for p in workers] == [0]  # a clean stop, not a kill


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral"])
def test_three_stages_equal_one_process_on_tiny_models(tiny_checkpoint, one_thread, arch):
    path = tiny_checkpoint(arch, num_hidden_layers=3)
    engine_args = dict(block_size=8, max_num_batched_tokens=24, num_gpu_blocks_override=64)
    prompts = [*PROMPTS, PROMPTS[2] + [9, 9]]
    expected = _greedy(LLM(model=path, **engine_args), prompts)
    with staged_llm(path, pipeline_parallel_size=3, **engine_args) as llm:
        assert _greedy(llm, prompts) == expected
        assert [m.stage for m in llm.engine.runner.rank_memory] == [2, 0, 1]


SMOL_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
    "List three colours:",
    "The theory of relativity changed how physicists think about space and time because",
    "Q: What is 12 times 12?\nA:",
    "Paged attention is",
    "In Python, a list comprehension",
]


@pytest.mark.slow
@pytest.mark.parametrize("pp, tp", [(3, 1), (2, 3)])
def test_smollm2_stages_equal_one_process_under_preemption(default_model_path, one_thread, pp, tp):
    """Three stages; two stages of three shards (9 query heads, 3 KV heads: one each). A
    shared prefix (prefix hits), a 48-token budget (chunked prefills) and 20 blocks of 16
    tokens for 8 sequences growing to ~70 tokens each (preemptions)."""
    prefix = "You are a helpful assistant who answers in one short sentence. "
    prompts = [prefix + p for p in SMOL_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    kw = dict(block_size=16, max_num_batched_tokens=48, num_gpu_blocks_override=20)
    single = LLM(model=default_model_path, **kw)
    expected = _greedy(single, prompts, params)
    assert single.engine.get_stats().num_preemptions > 0
    staged = dict(pipeline_parallel_size=pp, tensor_parallel_size=tp)
    with staged_llm(default_model_path, **staged, **kw) as llm:
        assert _greedy(llm, prompts, params) == expected
        stats = llm.engine.get_stats()
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


@pytest.mark.slow
def test_tensor_parallel_inside_each_of_two_stages(tiny_checkpoint, one_thread):
    path = tiny_checkpoint("llama")
    engine_args = dict(block_size=8, max_num_batched_tokens=24, kv_cache_memory=8 << 20)
    expected = _greedy(LLM(model=path, **engine_args), PROMPTS)
    with staged_llm(path, pipeline_parallel_size=2, tensor_parallel_size=2, **engine_args) as llm:
        assert _greedy(llm, PROMPTS) == expected
        memory = llm.engine.runner.rank_memory
        assert [m.stage for m in memory] == [1, 1, 0, 0]  # rank 0's pair holds the last stage
        heads = llm.engine.model_config.num_kv_heads // 2
        assert llm.engine.runner.driver.kv_caches[0][0].shape[2] == heads


@pytest.mark.slow
def test_smollm2_gguf_in_two_uneven_stages(one_thread):
    """The shipped Q4_1 file: the head is tied, so the last stage, which holds no embedding,
    loads the embedding's blocks as its head."""
    from pagedserve.models.default_model import find_default_gguf

    path = str(find_default_gguf())
    prompts = ["The capital of France is", "def fibonacci(n):", "Paged attention is"]
    kw = dict(kv_cache_memory=32 << 20)
    expected = _greedy(LLM(model=path, **kw), prompts)
    with staged_llm(path, pipeline_parallel_size=2, pp_layer_partition="10,20", **kw) as llm:
        assert _greedy(llm, prompts) == expected
        first, last = sorted(llm.engine.runner.rank_memory, key=lambda m: m.stage)
        assert (first.layers, last.layers) == (range(0, 10), range(10, 30))
        assert first.kv_cache_bytes * 2 == last.kv_cache_bytes  # same blocks, half the layers


@pytest.mark.slow
def test_dead_stage_fails_the_step_at_once(tiny_checkpoint, one_thread):
    path = tiny_checkpoint("llama")
    with staged_llm(path, pipeline_parallel_size=2, block_size=8) as llm:
        _greedy(llm, PROMPTS[:1])
        worker = llm.engine.runner.workers.procs[1]  # the first stage
        worker.kill()
        worker.wait()
        with pytest.raises(DistributedError, match="rank 1 exited with code -9"):
            _greedy(llm, PROMPTS[:1])
        with pytest.raises(DistributedError, match="rank 1 exited"):  # stays failed
            _greedy(llm, PROMPTS[:1])
