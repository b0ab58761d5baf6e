"""The first continuous-batching loop: admit while blocks are free, one token per running
request per step, finish and free at once."""

from __future__ import annotations

from pagedserve.blockmgr import KVCacheManager
from pagedserve.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig


def make_scheduler(num_blocks=64, block_size=4, **config) -> Scheduler:
    config.setdefault("max_num_batched_tokens", 64)
    config.setdefault("max_model_len", 64)
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False, watermark=0)
    return Scheduler(SchedulerConfig(**config), kv)


def run_step(scheduler: Scheduler, token: int = 7):
    out = scheduler.schedule()
    sampled = {s.request.request_id: [token] for s in out.scheduled if s.needs_sample}
    return out, scheduler.update(out, sampled)


def test_prefill_then_one_token_per_step_then_free():
    s = make_scheduler()
    s.add_request(Request("a", [1, 2, 3, 4, 5], max_tokens=3))
    out, updated = run_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 5)]
    assert updated[0].output_token_ids == [7]
    out, _ = run_step(s)
    assert out.scheduled[0].num_new_tokens == 1 and out.scheduled[0].num_computed_tokens == 5
    _, updated = run_step(s)
    assert updated[0].status is RequestStatus.FINISHED_LENGTH
    assert not s.has_unfinished_requests()
    assert s.kv.num_free_blocks == 64


def test_new_requests_join_running_ones_each_step():
    s = make_scheduler()
    s.add_request(Request("a", [1, 2, 3], max_tokens=10))
    run_step(s)
    s.add_request(Request("b", [4, 5, 6, 7], max_tokens=10))
    out, _ = run_step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 4)]


def test_eos_stops_unless_min_tokens_not_reached():
    s = make_scheduler()
    s.add_request(Request("a", [1, 2], max_tokens=10, min_tokens=2, stop_token_ids=frozenset({7})))
    _, updated = run_step(s, token=7)
    assert not updated[0].is_finished  # min_tokens = 2
    _, updated = run_step(s, token=7)
    assert updated[0].status is RequestStatus.FINISHED_STOPPED and updated[0].stop_reason == 7


def test_sequence_cap_and_block_shortage_keep_requests_waiting():
    s = make_scheduler(num_blocks=3, max_num_seqs=8)
    for i in range(3):
        s.add_request(Request(f"r{i}", [1, 2, 3, 4, 5], max_tokens=2))
    out = s.schedule()
    assert [x.request.request_id for x in out.scheduled] == ["r0"]  # 2 blocks each, 3 blocks in all
    assert len(s.waiting) == 2


def test_abort_frees_blocks_at_once():
    s = make_scheduler()
    s.add_request(Request("a", [1, 2, 3, 4, 5, 6], max_tokens=5))
    run_step(s)
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert s.kv.num_free_blocks == 64 and not s.has_unfinished_requests()
