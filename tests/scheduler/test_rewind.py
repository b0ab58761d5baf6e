"""Scheduler-owned state changes only through the scheduler: rewinding computed tokens (a beam
waiting for its siblings, rejected speculative tokens) and finishing a request with a status."""

from __future__ import annotations

import pytest

from pagedserve.blockmgr import KVCacheManager
from pagedserve.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig


def make_scheduler(prefix_caching: bool = False, num_blocks: int = 16) -> Scheduler:
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=prefix_caching, watermark=0)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64), kv)


def step(s: Scheduler, token: int = 7):
    out = s.schedule()
    s.update(out, {x.request.request_id: [token] for x in out.scheduled if x.needs_sample})
    return out


def test_rewound_tokens_are_computed_again_in_the_blocks_already_held():
    s = make_scheduler()
    s.add_request(Request("r", [1, 2, 3, 4, 5, 6], max_tokens=8))
    step(s, 7)
    step(s, 8)  # 8 tokens known, 7 computed (the last sampled token is not fed back yet)
    request = s.requests["r"]
    assert (request.num_tokens, request.num_computed_tokens) == (8, 7)
    table, free = s.kv.get_block_table("r"), s.kv.num_free_blocks

    s.rewind("r", 3)
    assert request.num_computed_tokens == 4
    out = s.schedule()
    (item,) = out.scheduled
    assert (item.num_computed_tokens, item.num_new_tokens) == (4, 4)  # tokens 4..7 again
    assert item.needs_sample
    assert item.block_table == table and s.kv.num_free_blocks == free
    s.update(out, {"r": [9]})
    assert request.output_token_ids == [7, 8, 9]
    assert (request.num_tokens, request.num_computed_tokens) == (9, 8)


def test_a_rewind_across_a_cached_block_keeps_the_prefix_cache_valid():
    s = make_scheduler(prefix_caching=True)
    s.add_request(Request("r", list(range(10, 19)), max_tokens=4))  # 9 tokens: 2 full blocks
    step(s)
    s.rewind("r", 6)  # back into the first full block
    out = s.schedule()
    assert [(x.num_computed_tokens, x.num_new_tokens) for x in out.scheduled] == [(3, 7)]
    s.update(out, {"r": [7]})
    # A second request with the same prompt still finds both full blocks cached.
    s.add_request(Request("q", list(range(10, 19)), max_tokens=4))
    out = s.schedule()
    q = next(x for x in out.scheduled if x.request.request_id == "q")
    assert q.num_computed_tokens == 8
    assert q.block_table[:2] == s.kv.get_block_table("r")[:2]


def test_rewind_refuses_what_it_cannot_undo():
    s = make_scheduler()
    s.add_request(Request("r", [1, 2, 3], max_tokens=4))
    with pytest.raises(ValueError, match="not running"):
        s.rewind("r", 1)  # still waiting: nothing is computed
    step(s)
    with pytest.raises(ValueError, match="computed 3"):
        s.rewind("r", 4)
    with pytest.raises(ValueError, match="not running"):
        s.rewind("unknown", 1)
    assert s.requests["r"].num_computed_tokens == 3


def test_finish_request_frees_a_live_request_and_labels_one_that_holds_no_blocks():
    s = make_scheduler()
    s.add_request(Request("r", [1, 2, 3, 4, 5], max_tokens=4))
    step(s)
    live = s.requests["r"]
    s.finish_request(live, RequestStatus.FINISHED_STOPPED, stop_reason="stop")
    assert live.status is RequestStatus.FINISHED_STOPPED and live.stop_reason == "stop"
    assert "r" not in s.requests and not s.running and s.kv.num_free_blocks == 16

    s.finish_request(live, RequestStatus.FINISHED_LENGTH)  # already finished: relabelled only
    assert live.status is RequestStatus.FINISHED_LENGTH and s.kv.num_free_blocks == 16

    unborn = Request("c", [1, 2, 3], max_tokens=1)  # a fork that ended at its first token
    s.finish_request(unborn, RequestStatus.FINISHED_LENGTH)
    assert unborn.is_finished and "c" not in s.requests

    with pytest.raises(ValueError, match="finished status"):
        s.finish_request(unborn, RequestStatus.RUNNING)
