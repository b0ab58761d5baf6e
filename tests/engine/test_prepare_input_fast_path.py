"""The decode fast path of ``ModelRunner.prepare_input`` against the general path: the same
tensors (values, dtypes, shapes), unpadded and through the padded decode buffers, over the steps
of a real scheduler; and the persistent ``BlockTable`` against ``block_table_array``."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from pagedserve.blockmgr import CacheConfig, KVCacheManager
from pagedserve.blockmgr.slot_mapping import block_table_array
from pagedserve.engine.cuda_graph import CUDAGraphConfig
from pagedserve.engine.input_batch import BlockTable
from pagedserve.engine.model_runner import ModelInput, ModelRunner
from pagedserve.models import ModelConfig
from pagedserve.scheduler import Request, Scheduler, SchedulerConfig

BLOCK_SIZE, NUM_BLOCKS, MAX_LEN = 8, 96, 64


@pytest.fixture(scope="module")
def runners(tiny_checkpoint):
    """An unpadded runner and one that pads decode steps on CPU (the CUDA-graph path)."""
    path = tiny_checkpoint("llama")

    def make(graph_config):
        return ModelRunner(
            ModelConfig(model=path, device="cpu", max_model_len=MAX_LEN),
            CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS),
            graph_config=graph_config,
        )

    return make(None), make(CUDAGraphConfig(max_num_seqs=8, pad_decode_on_cpu=True))


def tensors(model_input: ModelInput) -> dict:
    meta = model_input.attn_metadata
    named = {
        "input_ids": model_input.input_ids,
        "positions": model_input.positions,
        "logits_indices": model_input.logits_indices,
        "slot_mapping": meta.slot_mapping,
        "block_tables": meta.block_tables,
        "seq_lens": meta.seq_lens,
        "query_start_loc": meta.query_start_loc,
    }
    # cloned: the padded path returns views of buffers that the next call rewrites
    return {name: t.clone() for name, t in named.items()}


def prepare_both(runner: ModelRunner, output) -> tuple[ModelInput, ModelInput]:
    """The step through the general path, then through the fast path; asserts them equal."""
    runner.decode_fast_path = False
    try:
        slow = runner.prepare_input(output)
        expected = tensors(slow)  # before the fast path rewrites the padded buffers
    finally:
        runner.decode_fast_path = True
    fast = runner.prepare_input(output)
    assert fast.sample_request_ids == slow.sample_request_ids
    assert fast.padded_batch_size == slow.padded_batch_size
    assert fast.lora_token_slot is None and slow.lora_token_slot is None
    for name, got in tensors(fast).items():
        assert got.dtype == expected[name].dtype, name
        assert torch.equal(got, expected[name]), name
    return fast, slow


def arrive(scheduler: Scheduler, rng: random.Random, vocab: int, step: int) -> bool:
    """Now and then a new request (at most 8 at once); True when any is unfinished."""
    if len(scheduler.requests) < 8 and rng.random() < 0.2:
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        scheduler.add_request(Request(f"r{step}", prompt, max_tokens=rng.randint(1, 30)))
    return scheduler.has_unfinished_requests()


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_decode_inputs_equal_the_general_paths(runners, padded):
    runner = runners[padded]
    rng = random.Random(padded)
    kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, watermark=0, sliding_window=rng.choice([None, 12]))
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=MAX_LEN)
    scheduler = Scheduler(config, kv)
    vocab = runner.model_config.vocab_size
    decode_steps = 0
    for step in range(160):
        if not arrive(scheduler, rng, vocab, step):
            continue
        output = scheduler.schedule()
        fast, _ = prepare_both(runner, output)
        decode_steps += output.num_scheduled_tokens == len(output.scheduled)
        sampled = {rid: rng.randrange(vocab) for rid in fast.sample_request_ids}
        scheduler.update(output, sampled)
    assert decode_steps > 40  # most steps were pure decodes, through the fast path


def test_a_decode_short_of_its_last_token_takes_the_general_path(runners):
    """One token per request, but not the last known one (a rewound request): no sample for
    it, which the fast path must not assume."""
    runner = runners[0]
    kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, watermark=0)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_model_len=MAX_LEN), kv)
    for name in ("a", "b"):
        scheduler.add_request(Request(name, [1, 2, 3, 4, 5, 6], max_tokens=9))
    scheduler.update(scheduler.schedule(), {"a": 7, "b": 8})
    scheduler.rewind("a", 1)
    scheduler.config = SchedulerConfig(
        max_num_seqs=4, max_model_len=MAX_LEN, long_prefill_token_threshold=1
    )
    output = scheduler.schedule()
    assert [(s.num_new_tokens, s.needs_sample) for s in output.scheduled] == [(1, False), (1, True)]
    fast, _ = prepare_both(runner, output)
    assert fast.sample_request_ids == ["b"]


def test_the_block_table_rows_equal_a_fresh_array():
    rng = random.Random(0)
    table = BlockTable(max_blocks_per_seq=3, rows=2)  # grows in both directions below
    lists: list[list[int]] = []
    for _ in range(200):
        num_seqs = rng.randint(0, 9)
        while len(lists) < num_seqs:
            lists.append([rng.randrange(50) for _ in range(rng.randint(0, 5))])
        for i in rng.sample(range(num_seqs), k=min(num_seqs, 2)):  # a table changes: a new list
            lists[i] = lists[i] + [rng.randrange(50)] if rng.random() < 0.7 else lists[i][:1]
        rng.shuffle(lists)  # sequences change rows (a finished one leaves a gap)
        tables = lists[:num_seqs]
        got = table.fill(tables)
        expected = block_table_array(tables)
        assert got.dtype == expected.dtype == np.int32
        assert np.array_equal(got, expected)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_scheduled_decodes_build_the_inputs_without_the_requests(runners, padded, monkeypatch):
    """A pure-decode step whose every item the scheduler's fast path made is built from its
    ``decodes`` lists alone (``_prepare_decodes``, which reads the requests, is not called),
    and equals the general path; a step with any other item reads the requests."""
    runner = runners[padded]
    rng = random.Random(3)
    kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, watermark=0)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=MAX_LEN)
    scheduler = Scheduler(config, kv)
    vocab = runner.model_config.vocab_size
    real = runner._prepare_decodes
    calls = {"requests": 0, "lists": 0}

    def from_requests(output):
        calls["requests"] += 1
        assert len(output.decodes.req_ids) < len(output.scheduled)
        return real(output)

    monkeypatch.setattr(runner, "_prepare_decodes", from_requests)
    for step in range(120):
        if not arrive(scheduler, rng, vocab, step):
            continue
        running = [r for r in scheduler.running if r.num_output_tokens]
        if running and len(scheduler.requests) < 8 and rng.random() < 0.1:  # a fork: a copy
            parent = rng.choice(running)
            child = Request(f"{parent.request_id}.{step}", list(parent.prompt_token_ids), 30)
            child.output_token_ids = list(parent.output_token_ids)
            scheduler.add_forked_request(parent.request_id, child)
        output = scheduler.schedule()
        calls["lists"] += len(output.decodes.req_ids) == len(output.scheduled)
        fast, _ = prepare_both(runner, output)
        scheduler.update(output, {rid: rng.randrange(vocab) for rid in fast.sample_request_ids})
    assert calls["lists"] > 40 and calls["requests"] > 0
