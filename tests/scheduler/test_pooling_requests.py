"""Pooling (prefill-only) requests: batched beside generating ones under one token budget,
chunked when long, finished at the step that computes their last prompt token, and holding no
block after it; a model without a KV cache (an encoder) schedules them with no blocks at all."""

from __future__ import annotations

import pytest

from pagedserve.blockmgr import KVCacheManager, NoKVCacheManager
from pagedserve.scheduler import (
    Request,
    RequestRejectedError,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
)


def make_scheduler(kv=None, **config) -> Scheduler:
    config.setdefault("max_num_batched_tokens", 8)
    config.setdefault("max_model_len", 32)
    kv = kv or KVCacheManager(16, 4, enable_prefix_caching=False, watermark=0)
    return Scheduler(SchedulerConfig(**config), kv)


def pooling(request_id: str, length: int) -> Request:
    return Request(request_id, list(range(1, length + 1)), max_tokens=0, pooling=True)


def step(scheduler: Scheduler):
    out = scheduler.schedule()
    sampled = {r.request_id: [7] for r in out.requests if not r.pooling}
    return out, scheduler.update(out, sampled)


def test_a_long_prompt_is_chunked_and_finishes_at_its_last_chunk():
    s = make_scheduler()
    s.add_request(pooling("p", 19))
    s.add_request(Request("g", [1, 2, 3], max_tokens=4))
    chunks = []
    while s.has_unfinished_requests():
        out, updated = step(s)
        chunks.append({r.request_id: n for r, n in zip(out.requests, out.num_new_tokens)})
        finished_pooling = [r for r in updated if r.pooling]
        if finished_pooling:
            (request,) = finished_pooling
            assert request.status is RequestStatus.FINISHED_STOPPED
            assert request.output_token_ids == []  # it generates nothing
            assert s.kv.block_ids("p") == []  # freed in the same step
    assert [c.get("p", 0) for c in chunks] == [8, 8, 3, 0, 0, 0]  # chunked under the budget
    assert chunks[2] == {"p": 3, "g": 3}  # its last chunk batched beside a generating request
    assert s.kv.num_free_blocks == 16


def test_a_prompt_may_fill_max_model_len_but_not_pass_it():
    s = make_scheduler(max_model_len=12, max_num_batched_tokens=12)
    s.add_request(pooling("full", 12))  # no token follows a pooling prompt
    with pytest.raises(RequestRejectedError, match="max_model_len"):
        s.add_request(pooling("long", 13))


def test_without_a_kv_cache_whole_prompts_run_with_no_blocks():
    s = make_scheduler(
        kv=NoKVCacheManager(block_size=16), max_num_batched_tokens=32, enable_chunked_prefill=False
    )
    for i, length in enumerate([20, 10, 30]):
        s.add_request(pooling(str(i), length))
    out, updated = step(s)
    assert [r.request_id for r in out.requests] == ["0", "1"]  # whole prompts within 32 tokens
    assert all(table == [] for table in out.block_ids)
    assert [r.request_id for r in updated] == ["0", "1"]
    out, updated = step(s)
    assert [(r.request_id, n) for r, n in zip(out.requests, out.num_new_tokens)] == [("2", 30)]
    assert not s.has_unfinished_requests()
