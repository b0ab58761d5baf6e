"""Admission control: a request that can never run is refused when it is added, with a specific
error; a full waiting queue refuses with SchedulerOverloadedError (the server's 503)."""

from __future__ import annotations

import pytest

from pagedserve.blockmgr import KVCacheManager
from pagedserve.scheduler import (
    Request,
    RequestRejectedError,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedulerOverloadedError,
)


def make_scheduler(num_blocks=64, block_size=4, watermark=0.0, **config) -> Scheduler:
    config.setdefault("max_num_batched_tokens", 64)
    config.setdefault("max_model_len", 64)
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True, watermark=watermark)
    return Scheduler(SchedulerConfig(**config), kv)


def test_prompt_plus_max_tokens_over_max_model_len_is_rejected():
    s = make_scheduler(max_model_len=32)
    s.add_request(Request("ok", [1] * 20, max_tokens=12))  # exactly max_model_len
    with pytest.raises(RequestRejectedError, match="exceeds max_model_len"):
        s.add_request(Request("long", [1] * 20, max_tokens=13))
    assert "long" not in s.requests and len(s.waiting) == 1


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "match"),
    [([], 4, "empty"), ([1, 2], 0, "max_tokens must be >= 1")],
)
def test_malformed_requests_are_rejected(prompt, max_tokens, match):
    with pytest.raises(RequestRejectedError, match=match):
        make_scheduler().add_request(Request("r", prompt, max_tokens=max_tokens))


def test_request_larger_than_the_whole_kv_cache_is_rejected_not_queued_forever():
    # 8 blocks of 4 tokens = 32 slots; the last sampled token needs no slot.
    s = make_scheduler(num_blocks=8)
    s.add_request(Request("fits", [1] * 20, max_tokens=13))  # 32 tokens in the cache
    with pytest.raises(RequestRejectedError, match="needs 9 KV blocks"):
        s.add_request(Request("too-big", [1] * 20, max_tokens=14))
    # Watermark: a new request must leave it free, so one request holds at most 8 - 2 blocks.
    s = make_scheduler(num_blocks=8, watermark=0.25)
    with pytest.raises(RequestRejectedError, match="at most 6"):
        s.add_request(Request("too-big", [1] * 20, max_tokens=13))


def test_rejected_error_is_a_value_error_and_duplicates_are_refused():
    s = make_scheduler()
    s.add_request(Request("a", [1, 2], max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(Request("a", [1, 2], max_tokens=2))
    assert issubclass(RequestRejectedError, ValueError)
    assert not issubclass(SchedulerOverloadedError, ValueError)


def test_bounded_waiting_queue_by_requests():
    s = make_scheduler(max_num_waiting=2)
    s.add_request(Request("a", [1, 2], max_tokens=2))
    s.add_request(Request("b", [1, 2], max_tokens=2))
    with pytest.raises(SchedulerOverloadedError, match="max_num_waiting = 2"):
        s.add_request(Request("c", [1, 2], max_tokens=2))
    s.schedule()  # both admitted: the queue has room again
    s.add_request(Request("c", [1, 2], max_tokens=2))
    assert [r.request_id for r in s.waiting] == ["c"]


def test_bounded_waiting_queue_by_tokens_and_abort_gives_room_back():
    s = make_scheduler(max_model_len=32, max_num_waiting_tokens=40)
    s.add_request(Request("a", [1] * 30, max_tokens=2))
    with pytest.raises(SchedulerOverloadedError, match="30 tokens waiting"):
        s.add_request(Request("b", [1] * 11, max_tokens=2))
    s.add_request(Request("b", [1] * 10, max_tokens=2))  # 40 tokens: at the cap
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert s.stats.num_waiting_tokens == 10
    s.add_request(Request("c", [1] * 30, max_tokens=2))


def test_config_refuses_a_token_cap_below_max_model_len():
    with pytest.raises(ValueError, match="max_num_waiting_tokens"):
        SchedulerConfig(max_model_len=64, max_num_waiting_tokens=32)
    with pytest.raises(ValueError, match="policy"):
        SchedulerConfig(policy="lifo")


def test_finish_requests_needs_a_finished_status():
    s = make_scheduler()
    s.add_request(Request("a", [1, 2], max_tokens=2))
    with pytest.raises(ValueError, match="finished status"):
        s.finish_requests(["a"], RequestStatus.RUNNING)
    assert s.finish_requests(["nope"], RequestStatus.FINISHED_ABORTED) == []
