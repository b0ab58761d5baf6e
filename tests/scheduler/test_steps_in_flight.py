"""Steps in flight (a pipeline's micro-batches): a request gets no second step while its last
one has not come back, is never preempted meanwhile, and the runner hears of its abort only
once its step is back. Driven as the engine drives a pipeline of depth 2: schedule two steps,
then update the oldest."""

from __future__ import annotations

import random

from pagedserve.blockmgr import KVCacheManager
from pagedserve.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig


def make_scheduler(num_blocks=64, block_size=4, prefix=False, **config) -> Scheduler:
    config.setdefault("max_num_batched_tokens", 64)
    config.setdefault("max_model_len", 64)
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix, watermark=0)
    return Scheduler(SchedulerConfig(**config), kv)


def token_for(request: Request) -> int:
    """A sampled token that depends only on the request and its length (so any schedule gives
    the same outputs)."""
    return (sum(request.prompt_token_ids) + 3 * len(request.output_token_ids)) % 50 + 1


def sampled(out) -> dict[str, int]:
    return {s.request.request_id: token_for(s.request) for s in out.scheduled if s.needs_sample}


def ids(out) -> list[str]:
    return [s.request.request_id for s in out.scheduled]


def test_a_request_in_flight_gets_no_second_step():
    s = make_scheduler()
    s.add_request(Request("a", [1, 2, 3], max_tokens=5))
    s.add_request(Request("b", [4, 5, 6, 7], max_tokens=5))
    first = s.schedule()
    s.add_request(Request("c", [8, 9], max_tokens=5))
    second = s.schedule()  # a and b are in flight: only c's prompt
    assert ids(first) == ["a", "b"] and ids(second) == ["c"]
    assert len(s.steps_in_flight) == 2
    assert s.schedule().is_empty  # everything is in flight
    s.update(first, sampled(first))
    third = s.schedule()  # a and b decode; c is still in flight
    assert ids(third) == ["a", "b"]
    assert [x.num_computed_tokens for x in third.scheduled] == [3, 4]
    s.update(second, sampled(second))
    s.update(third, sampled(third))
    assert len(s.steps_in_flight) == 0
    assert [len(s.requests[r].output_token_ids) for r in "abc"] == [2, 2, 1]


def test_a_prompt_chunk_in_flight_waits_before_its_next_chunk():
    s = make_scheduler(max_num_batched_tokens=8, long_prefill_token_threshold=8)
    s.add_request(Request("long", list(range(1, 21)), max_tokens=2))
    first = s.schedule()
    assert ids(first) == ["long"] and first.scheduled[0].num_new_tokens == 8
    assert s.schedule().is_empty
    s.update(first, {})
    second = s.schedule()
    assert second.scheduled[0].num_computed_tokens == 8


def test_a_request_in_flight_is_never_the_victim():
    # 4 blocks of 4 tokens; a and b hold two each and are scheduled in alternate steps
    s = make_scheduler(num_blocks=4)
    s.add_request(Request("a", list(range(1, 8)), max_tokens=10))
    a1 = s.schedule()
    s.add_request(Request("b", list(range(11, 18)), max_tokens=10))
    b1 = s.schedule()
    assert (ids(a1), ids(b1), s.kv.num_free_blocks) == (["a"], ["b"], 0)
    s.update(a1, sampled(a1))
    a2 = s.schedule()  # a's 8th token still fits its second block
    s.update(b1, sampled(b1))
    b2 = s.schedule()
    s.update(a2, sampled(a2))
    # a's 9th token needs a third block; the pool is empty and the tail, b, is in flight
    waiting = s.schedule()
    assert waiting.is_empty and not waiting.preempted
    assert s.requests["b"].status is RequestStatus.RUNNING
    s.update(b2, sampled(b2))
    a3 = s.schedule()  # b's step is back: now it is the victim
    assert ids(a3) == ["a"] and [r.request_id for r in a3.preempted] == ["b"]


def test_an_abort_in_flight_reaches_the_runner_after_its_step():
    s = make_scheduler()
    s.add_request(Request("a", [1, 2, 3], max_tokens=5))
    s.add_request(Request("b", [4, 5, 6], max_tokens=5))
    first = s.schedule()
    free_before = s.kv.num_free_blocks
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert s.kv.num_free_blocks > free_before  # its blocks are free at once
    second = s.schedule()
    assert [r.request_id for r in second.finished] == []  # its step is still in flight
    updated = s.update(first, sampled(first))
    assert [r.request_id for r in updated] == ["b"]  # a's token is dropped
    assert s.schedule().finished[0].request_id == "a"


def test_two_steps_in_flight_give_every_request_the_same_tokens_as_one():
    """Random arrivals, aborts and a pool small enough to preempt: with two steps in flight
    every request ends with the tokens it ends with one step at a time, in-flight steps never
    share a request, no victim is in flight, and every block comes back."""
    for seed in range(8):
        one, two = run_workload(seed, depth=1), run_workload(seed, depth=2)
        assert one == two, seed


def run_workload(seed: int, depth: int) -> dict[str, tuple[str, list[int]]]:
    rng = random.Random(seed)
    s = make_scheduler(num_blocks=24, prefix=True, max_num_batched_tokens=16, max_num_seqs=6)
    s.pipeline_depth = depth
    plan = [
        (f"r{i}", [rng.randrange(1, 9) for _ in range(rng.randrange(2, 20))]) for i in range(14)
    ]
    aborts = {f"r{i}" for i in rng.sample(range(14), 3)}
    requests: dict[str, Request] = {}
    queue: list = []
    step = 0
    while plan or s.has_unfinished_requests() or queue:
        if plan and step % 2 == 0:
            request_id, prompt = plan.pop(0)
            requests[request_id] = Request(request_id, prompt, max_tokens=rng.randrange(1, 8))
            s.add_request(requests[request_id])
        while len(queue) < depth:
            out = s.schedule()
            in_flight = {id(r) for q in queue for r in q.requests}
            assert not in_flight & {id(r) for r in out.requests}
            assert not in_flight & {id(r) for r in out.preempted}
            if out.is_empty:
                break
            queue.append(out)
        if queue:
            oldest = queue.pop(0)
            s.update(oldest, sampled(oldest))
        for request_id in list(aborts):
            request = requests.get(request_id)
            if request is not None and len(request.output_token_ids) >= 1:
                s.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
                aborts.discard(request_id)
        step += 1
    assert s.kv.num_free_blocks == 24 and not s.steps_in_flight
    return {
        r.request_id: (r.status.name, r.output_token_ids)
        for r in requests.values()
        if r.status is not RequestStatus.FINISHED_ABORTED
    }


def test_a_pipelines_steps_share_the_requests():
    """With two steps in flight a step takes at most half the live requests (rounded up), so
    the next step has the other half rather than nothing."""
    s = make_scheduler()
    for i in range(5):
        s.add_request(Request(f"r{i}", [1 + i, 2, 3], max_tokens=4))
    s.pipeline_depth = 2
    first, second = s.schedule(), s.schedule()
    assert (ids(first), ids(second)) == (["r0", "r1", "r2"], ["r3", "r4"])
    s.update(first, sampled(first))
    assert ids(s.schedule()) == ["r0", "r1", "r2"]  # r3, r4 are in flight
