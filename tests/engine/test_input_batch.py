"""The model runner's step inputs against a naive reference built token by token, over the steps
of a real scheduler (prefill chunks, decodes, a rewound request, prompt logprobs; unpadded and
through the padded decode buffers); the persistent ``BlockTable`` against a fresh array; and
the ``InputBatch`` forgetting what finished."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pagedserve.blockmgr import CacheConfig, KVCacheManager
from pagedserve.blockmgr.slot_mapping import block_table_array
from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.cuda_graph import CUDAGraphConfig
from pagedserve.engine.input_batch import BlockTable
from pagedserve.engine.model_runner import ModelRunner
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


def naive_inputs(output) -> dict:
    """The step's inputs written out token by token from each item's own tokens and table."""
    ids, positions, slots, sample_rows, prompt_rows, lengths, starts = [], [], [], [], [], [], [0]
    for item in output.scheduled:
        request = item.request
        tokens = list(request.prompt_token_ids) + list(request.output_token_ids)
        for offset in range(item.num_new_tokens):
            position = item.num_computed_tokens + offset
            ids.append(tokens[position])
            positions.append(position)
            block = item.block_table[position // BLOCK_SIZE]
            slots.append(block * BLOCK_SIZE + position % BLOCK_SIZE)
            if request.needs_prompt_logits and position < request.num_prompt_tokens - 1:
                prompt_rows.append(len(ids) - 1)
        if item.num_computed_tokens + item.num_new_tokens == len(tokens):
            sample_rows.append(len(ids) - 1)
        lengths.append(item.num_computed_tokens + item.num_new_tokens)
        starts.append(len(ids))
    return {
        "input_ids": ids,
        "positions": positions,
        "slot_mapping": slots,
        "seq_lens": lengths,
        "query_start_loc": starts,
        "logits_indices": sample_rows + prompt_rows,
    }


def check_inputs(runner: ModelRunner, output) -> list[str]:
    """The runner's inputs equal the naive ones on the real rows; the sampled request ids."""
    model_input, layout = runner.prepare_input(output)
    meta = model_input.attn_metadata
    expected = naive_inputs(output)
    num_tokens, num_seqs = len(expected["input_ids"]), output.num_scheduled_seqs
    got = {
        "input_ids": model_input.input_ids[:num_tokens],
        "positions": model_input.positions[:num_tokens],
        "slot_mapping": meta.slot_mapping[:num_tokens],
        "seq_lens": meta.seq_lens[:num_seqs],
        "query_start_loc": meta.query_start_loc[: num_seqs + 1],
        "logits_indices": model_input.logits_indices,
    }
    for name, tensor in got.items():
        assert tensor.tolist() == expected[name], name
    tables = meta.block_tables[:num_seqs]
    for row, item in enumerate(output.scheduled):
        assert tables[row, : len(item.block_table)].tolist() == list(item.block_table)
    if model_input.padded_batch_size is not None:  # padding rows never write a real slot
        assert (meta.slot_mapping[num_tokens:] >= NUM_BLOCKS * BLOCK_SIZE).all()
    return layout.sampled


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "padded"])
def test_step_inputs_equal_the_naive_layout(runners, padded):
    runner = runners[padded]
    rng = random.Random(padded)
    kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, watermark=0, sliding_window=rng.choice([None, 12]))
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=MAX_LEN)
    scheduler = Scheduler(config, kv)
    vocab = runner.model_config.vocab_size
    kinds = set()
    for step in range(160):
        if len(scheduler.requests) < 8 and rng.random() < 0.2:
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
            request = Request(f"r{step}", prompt, max_tokens=rng.randint(1, 30))
            request.needs_prompt_logits = rng.random() < 0.2
            scheduler.add_request(request)
        if not scheduler.has_unfinished_requests():
            continue
        output = scheduler.schedule()
        sampled = check_inputs(runner, output)
        kinds.add(output.num_scheduled_tokens == output.num_scheduled_seqs)
        scheduler.update(output, {rid: [rng.randrange(vocab)] for rid in sampled})
    assert kinds == {True, False}  # pure-decode steps and steps with prefill chunks


def test_a_decode_short_of_its_last_token_samples_nothing(runners):
    """One token per request, but not the last known one (a rewound request): no row of it is
    sampled."""
    runner = runners[0]
    kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, watermark=0)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=4, max_model_len=MAX_LEN), kv)
    for name in ("a", "b"):
        scheduler.add_request(Request(name, [1, 2, 3, 4, 5, 6], max_tokens=9))
    scheduler.update(scheduler.schedule(), {"a": [7], "b": [8]})
    scheduler.rewind("a", 1)
    scheduler.config = SchedulerConfig(
        max_num_seqs=4, max_model_len=MAX_LEN, long_prefill_token_threshold=1
    )
    output = scheduler.schedule()
    assert [(s.num_new_tokens, s.needs_sample) for s in output.scheduled] == [(1, False), (1, True)]
    assert check_inputs(runner, output) == ["b"]


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


def test_a_reused_request_id_gets_its_own_sampling_state(tiny_checkpoint):
    """The second request under an id samples as its own params say (logprobs), and every
    sequence's state is forgotten once it has finished."""
    engine = LLM(model=tiny_checkpoint("llama"), block_size=8, num_gpu_blocks_override=64).engine
    outputs = {}
    for params in (SamplingParams(temperature=0, max_tokens=2),
                   SamplingParams(temperature=0, max_tokens=2, logprobs=1)):  # fmt: skip
        engine.add_request("same", [5, 6, 7], params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[params.logprobs] = out.outputs[0]
    assert outputs[None].logprobs is None
    assert outputs[1].token_ids == outputs[None].token_ids
    assert len(outputs[1].logprobs) == 2
    engine.step()  # the runner forgets the sequences that finished since the last step
    assert not engine.runner.input_batch.states
