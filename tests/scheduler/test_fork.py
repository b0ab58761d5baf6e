"""Forked children (n > 1, beam search) run right after their parent and share its blocks;
the first write into a shared, partly filled block copies it."""

from __future__ import annotations

import pytest

from pagedserve.blockmgr import KVCacheManager
from pagedserve.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig


def make_scheduler(num_blocks=16, block_size=4, **config) -> Scheduler:
    config.setdefault("max_num_batched_tokens", 64)
    config.setdefault("max_model_len", 64)
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False, watermark=0)
    return Scheduler(SchedulerConfig(**config), kv)


def step(s: Scheduler, tokens: dict[str, int] | None = None, default: int = 7):
    out = s.schedule()
    sampled = {
        x.request.request_id: [(tokens or {}).get(x.request.request_id, default)]
        for x in out.scheduled
        if x.needs_sample
    }
    s.update(out, sampled)
    return out


def fork(s: Scheduler, parent_id: str, child_id: str, last_token: int) -> Request:
    parent = s.requests[parent_id]
    child = Request(
        child_id,
        list(parent.prompt_token_ids),
        max_tokens=parent.max_tokens,
        output_token_ids=parent.output_token_ids[:-1] + [last_token],
    )
    s.add_forked_request(parent_id, child)
    return child


def test_children_follow_their_parent_share_blocks_and_copy_on_write():
    s = make_scheduler()
    s.add_request(Request("p", [1, 2, 3, 4, 5, 6], max_tokens=4))
    s.add_request(Request("q", [9, 9, 9], max_tokens=4))
    step(s)  # both prefilled; each sampled its first token
    parent_table = s.kv.get_block_table("p")
    free_before = s.kv.num_free_blocks
    fork(s, "p", "p1", last_token=11)
    fork(s, "p", "p2", last_token=12)
    assert [r.request_id for r in s.running] == ["p", "p1", "p2", "q"]
    assert s.kv.get_block_table("p1") == parent_table
    assert s.kv.num_free_blocks == free_before  # shared, not copied
    assert s.requests["p1"].num_computed_tokens == 6

    out = s.schedule()
    # p writes its 7th token into the partly filled block 1 that p1 and p2 share: one copy for
    # p and one for p1; p2, the last holder, then owns the original.
    assert len(out.blocks_to_copy) == 2
    tables = {x.request.request_id: x.block_table for x in out.scheduled}
    assert tables["p"][0] == tables["p1"][0] == tables["p2"][0]  # the full block stays shared
    assert len({tables["p"][1], tables["p1"][1], tables["p2"][1]}) == 3
    s.update(out, {r: [7] for r in tables})
    assert s.requests["p2"].output_token_ids == [12, 7]


def test_children_finish_and_free_independently():
    s = make_scheduler()
    s.add_request(Request("p", [1, 2, 3, 4, 5], max_tokens=3))
    step(s)
    fork(s, "p", "c", last_token=8)
    s.finish_requests(["p"], RequestStatus.FINISHED_ABORTED)
    while s.has_unfinished_requests():
        step(s)
    assert s.kv.num_free_blocks == 16


def test_fork_refuses_a_child_that_does_not_extend_its_parent():
    s = make_scheduler()
    s.add_request(Request("p", [1, 2, 3, 4, 5], max_tokens=3))
    with pytest.raises(ValueError, match="not running"):
        s.add_forked_request("p", Request("c", [1, 2, 3, 4, 5], max_tokens=3))
    step(s)
    with pytest.raises(ValueError, match="computed tokens"):
        s.add_forked_request("p", Request("c", [1, 2, 0, 4, 5, 8], max_tokens=3))
    with pytest.raises(ValueError, match="already in use"):
        s.add_forked_request("p", Request("p", [1, 2, 3, 4, 5, 8], max_tokens=3))
