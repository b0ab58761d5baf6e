"""A request held for its grammar (``waiting_for_grammar``) stays in the waiting queue, lets the
requests behind it pass, and is admitted, in its place, once released."""

from __future__ import annotations

import pytest

from pagedserve.blockmgr import KVCacheManager
from pagedserve.scheduler import Request, Scheduler, SchedulerConfig


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_held_request_waits_and_the_others_pass(policy):
    kv = KVCacheManager(32, 4, enable_prefix_caching=False, watermark=0)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64, policy=policy), kv)
    held = Request("held", [1, 2, 3], max_tokens=4, waiting_for_grammar=True)
    s.add_request(held)
    s.add_request(Request("free", [4, 5, 6], max_tokens=4))
    s.add_request(Request("free2", [7, 8], max_tokens=4))
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["free", "free2"]
    assert list(s.waiting) == [held] and s.waiting.num_tokens == 3
    assert not kv.block_ids("held")
    s.update(out, {"free": 9, "free2": 9})
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["free", "free2"]  # still held
    s.update(out, {"free": 9, "free2": 9})
    held.waiting_for_grammar = False
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["free", "free2", "held"]
    assert not s.waiting and s.waiting.num_tokens == 0


def test_only_held_requests_schedule_nothing():
    kv = KVCacheManager(8, 4, enable_prefix_caching=False, watermark=0)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=64), kv)
    s.add_request(Request("held", [1, 2], max_tokens=2, waiting_for_grammar=True))
    assert s.schedule().is_empty and s.has_unfinished_requests()
