"""The garbage collector's first threshold, raised with max_num_seqs (gc_tuning.py): a step of
a full batch of decodes runs without a collection, and a setting the process made is kept."""

from __future__ import annotations

import gc

import pytest

from pagedserve.engine import LLMEngine, RequestOutputKind, SamplingParams
from pagedserve.engine.config import EngineArgs
from pagedserve.engine.gc_tuning import raise_gc_threshold

NUM_SEQS = 256


@pytest.fixture
def restored_gc_threshold():
    saved = gc.get_threshold()
    yield
    gc.set_threshold(*saved)


def test_the_threshold_rises_with_max_num_seqs_and_never_falls(restored_gc_threshold):
    gc.set_threshold(700, 10, 10)
    assert raise_gc_threshold(256) == gc.get_threshold()[0] > 256 * 10
    assert gc.get_threshold()[1:] == (10, 10)
    high = gc.get_threshold()[0]
    assert raise_gc_threshold(8) == high  # a smaller engine in the same process lowers nothing
    gc.set_threshold(0)  # the process turned automatic collection off: it stays off
    assert raise_gc_threshold(256) == 0


def test_a_step_of_a_full_batch_of_decodes_runs_no_collection(
    restored_gc_threshold, tiny_checkpoint
):
    """256 streamed decodes: each step's outputs are freed by refcounting; at CPython's default
    threshold (700) the collector would walk them about once a step for nothing."""
    gc.set_threshold(700, 10, 10)
    engine = LLMEngine(
        EngineArgs(
            model=tiny_checkpoint("llama"),
            max_num_seqs=NUM_SEQS,
            max_model_len=64,
            num_gpu_blocks_override=NUM_SEQS * 4 + 8,
            max_num_batched_tokens=4096,
        )
    )
    params = SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    for i in range(NUM_SEQS):
        engine.add_request(f"r{i}", [5 + i % 50, 7, 9], params)
    for _ in range(3):  # the prompts, then decodes only
        engine.step()
    collections = []
    gc.callbacks.append(callback := lambda phase, info: collections.append(info["generation"]))
    try:
        for _ in range(10):
            assert len(engine.step()) == NUM_SEQS
    finally:
        gc.callbacks.remove(callback)
    assert [g for g in collections if g == 0] == []
