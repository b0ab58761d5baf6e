"""At most ``max_loras`` LoRA adapters among the running requests: a request whose adapter would
be one too many waits at the head of the queue (nothing behind it jumps ahead), and is admitted
as soon as a running adapter's requests are gone, so it never starves."""

from __future__ import annotations

from pagedserve.blockmgr import KVCacheManager
from pagedserve.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig


def scheduler(max_loras: int) -> Scheduler:
    kv = KVCacheManager(64, 4, enable_prefix_caching=False, watermark=0)
    config = SchedulerConfig(max_num_batched_tokens=64, max_model_len=64, max_loras=max_loras)
    return Scheduler(config, kv)


def running_ids(s: Scheduler) -> list[str]:
    return [r.request_id for r in s.running]


def test_a_request_whose_adapter_has_no_slot_waits_at_the_head_then_runs():
    s = scheduler(max_loras=2)
    for rid, lora in (("a", 1), ("base", 0), ("b", 2), ("c", 3), ("a2", 1)):
        s.add_request(Request(rid, [1, 2, 3], max_tokens=4, lora_int_id=lora))
    s.schedule()
    # adapters 1 and 2 fill the slots; "c" (adapter 3) waits, and "a2" behind it waits too
    assert running_ids(s) == ["a", "base", "b"]
    assert [r.request_id for r in s.waiting] == ["c", "a2"]
    for _ in range(3):
        s.schedule()
    assert running_ids(s) == ["a", "base", "b"]  # never more than two adapters running
    s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    s.schedule()
    assert running_ids(s) == ["a", "base", "c", "a2"]


def test_base_rows_and_an_unlimited_scheduler_are_not_held():
    s = scheduler(max_loras=0)  # LoRA off: ids are not counted
    for i in range(4):
        s.add_request(Request(str(i), [1, 2], max_tokens=2, lora_int_id=i + 1))
    s.schedule()
    assert len(s.running) == 4
    s = scheduler(max_loras=1)
    s.add_request(Request("x", [1, 2], max_tokens=2, lora_int_id=5))
    s.add_request(Request("base", [3, 4], max_tokens=2))
    s.schedule()
    assert running_ids(s) == ["x", "base"]
