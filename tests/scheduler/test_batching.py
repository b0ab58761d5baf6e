"""One token budget for prefill chunks and decodes, preemption by recompute, the two policies,
and the counters the engine exports."""

from __future__ import annotations

import pytest

from pagedserve.blockmgr import KVCacheManager
from pagedserve.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig


def make_scheduler(num_blocks=64, block_size=4, caching=True, **config) -> Scheduler:
    config.setdefault("max_num_batched_tokens", 64)
    config.setdefault("max_model_len", 64)
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching, watermark=0)
    return Scheduler(SchedulerConfig(**config), kv)


def step(s: Scheduler, token: int = 7):
    out = s.schedule()
    s.update(out, {x.request.request_id: [token] for x in out.scheduled if x.needs_sample})
    return out


def shares(out) -> list[tuple[str, int]]:
    return [(x.request.request_id, x.num_new_tokens) for x in out.scheduled]


def test_long_prompt_is_chunked_and_never_stalls_decodes():
    s = make_scheduler(max_num_batched_tokens=8, max_model_len=64)
    s.add_request(Request("d", [1, 2], max_tokens=20))
    step(s)
    s.add_request(Request("long", list(range(100, 125)), max_tokens=2))
    chunks = []
    while s.requests.get("long") and not s.requests["long"].output_token_ids:
        out = step(s)
        assert shares(out)[0] == ("d", 1)  # the decode runs every step
        assert out.num_scheduled_tokens <= 8
        chunks.append(dict(shares(out))["long"])
    assert chunks == [7, 7, 7, 4]  # 25 prompt tokens, 7 per step beside the decode


def test_long_prefill_threshold_caps_one_prompt_per_step():
    s = make_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=5)
    s.add_request(Request("a", list(range(12)), max_tokens=2))
    s.add_request(Request("b", list(range(50, 53)), max_tokens=5))
    assert shares(step(s)) == [("a", 5), ("b", 3)]
    assert shares(step(s)) == [("a", 5), ("b", 1)]
    assert shares(step(s)) == [("a", 2), ("b", 1)]


def test_without_chunked_prefill_a_prompt_waits_for_a_budget_it_fits_in():
    s = make_scheduler(max_num_batched_tokens=64, enable_chunked_prefill=False)
    s.add_request(Request("a", [1] * 40, max_tokens=3))
    s.add_request(Request("b", [2] * 30, max_tokens=3))
    assert shares(step(s)) == [("a", 40)]  # b (30) does not fit in the 24 left: it waits
    assert shares(step(s)) == [("a", 1), ("b", 30)]


def test_sequence_cap_holds_admissions():
    s = make_scheduler(max_num_seqs=2)
    for i in range(3):
        s.add_request(Request(f"r{i}", [i + 1] * 3, max_tokens=5))
    assert shares(step(s)) == [("r0", 3), ("r1", 3)]
    assert s.stats.num_running == 2 and s.stats.num_waiting == 1


def test_newest_running_request_is_preempted_and_recomputed_from_the_prefix_cache():
    # 6 blocks of 4. a and b (7-token prompts) take 2 blocks each, then a third each at
    # position 8; at position 12 a needs a fourth, and the newest (b) gives its blocks up.
    s = make_scheduler(num_blocks=6)
    s.add_request(Request("a", list(range(1, 8)), max_tokens=12))
    s.add_request(Request("b", list(range(11, 18)), max_tokens=12))
    for _ in range(5):
        assert not step(s).preempted  # positions 0..6, then 7, 8, 9, 10
    assert not step(s).preempted  # position 11: both hold 3 full blocks, none is free
    out = step(s)
    assert [r.request_id for r in out.preempted] == ["b"]
    assert shares(out) == [("a", 1)]
    b = s.requests["b"]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert s.waiting.peek() is b and s.stats.num_preemptions == 1
    tokens_before = list(b.output_token_ids)
    assert b.num_tokens == 13  # 12 computed before the preemption, 1 sampled
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    out = step(s)
    (item,) = out.scheduled
    # a's fourth block evicted b's third (the LRU gives up a prefix's tail first); b's first
    # two blocks are still cached: only the rest is recomputed, and b samples on from there.
    assert item.request is b and item.num_computed_tokens == 8
    assert item.num_new_tokens == 13 - 8
    assert b.output_token_ids == tokens_before + [7]


def test_a_request_alone_that_cannot_grow_preempts_itself_and_returns():
    s = make_scheduler(num_blocks=3, caching=False)
    s.add_request(Request("a", [1] * 8, max_tokens=5))  # 12 tokens in the cache: 3 blocks
    s.add_request(Request("b", [2] * 3, max_tokens=2))
    step(s)  # a: 2 blocks; b: 1 block
    out = step(s)  # a needs a 3rd block: b (newest) is preempted
    assert [r.request_id for r in out.preempted] == ["b"]
    while s.has_unfinished_requests():
        step(s)
    assert s.kv.num_free_blocks == 3


def test_priority_policy_admits_lower_value_first_and_preempts_the_lowest():
    s = make_scheduler(num_blocks=6, max_num_seqs=2, policy="priority")
    s.add_request(Request("low", list(range(1, 8)), max_tokens=12, priority=5))
    s.add_request(Request("high", list(range(11, 18)), max_tokens=12, priority=0))
    s.add_request(Request("mid", list(range(21, 24)), max_tokens=2, priority=1))
    out = step(s)
    assert shares(out) == [("high", 7), ("mid", 3)]
    assert [r.request_id for r in s.running] == ["high", "mid"]
    step(s)  # mid finishes (max_tokens=2)
    out = step(s)
    assert [r.request_id for r in s.running] == ["high", "low"]
    while not out.preempted:
        out = step(s)
    assert [r.request_id for r in out.preempted] == ["low"]  # high keeps going


def test_an_important_arrival_preempts_less_important_running_requests_to_get_in():
    """Under the priority policy a waiting request that matters more than the running tail, and
    finds the sequence cap reached or no blocks, preempts from the tail in the same step and is
    admitted; one that matters no more waits, as under FCFS."""
    s = make_scheduler(num_blocks=8, max_num_seqs=2, policy="priority")
    for name in ("batch-a", "batch-b"):
        s.add_request(Request(name, list(range(1, 9)), max_tokens=20, priority=9))
    step(s)  # both batch requests run, holding the sequence cap
    s.add_request(Request("peer", [5, 6, 7], max_tokens=2, priority=9))
    out = step(s)
    assert not out.preempted and all(name != "peer" for name, _ in shares(out))
    s.add_request(Request("interactive", [7, 8, 9], max_tokens=2, priority=0))
    out = step(s)
    assert [r.request_id for r in out.preempted] == ["batch-b"]  # the tail, least important
    assert ("interactive", 3) in shares(out) and ("batch-a", 1) in shares(out)
    assert [r.request_id for r in s.running] == ["interactive", "batch-a"]
    while s.has_unfinished_requests():
        step(s)
    assert s.kv.num_free_blocks == 8


def test_background_work_yields_the_steps_that_read_a_more_important_prompt():
    """With ``background_priority`` (the server's Batch API lines), a step in which a more
    important request reads its prompt runs no background request: no decode, no prompt
    chunk, no admission. Once that prompt is read, background work runs again beside it."""
    s = make_scheduler(
        max_num_batched_tokens=8, max_num_seqs=8, policy="priority", background_priority=100
    )
    s.add_request(Request("batch-a", [1, 2, 3], max_tokens=30, priority=100))
    step(s)
    assert shares(step(s)) == [("batch-a", 1)]
    s.add_request(Request("chat", list(range(10, 22)), max_tokens=4, priority=0))
    s.add_request(Request("batch-b", [4, 5, 6], max_tokens=30, priority=100))
    assert shares(step(s)) == [("chat", 8)]
    assert shares(step(s)) == [("chat", 4)]  # the prompt's last chunk: still alone
    assert shares(step(s)) == [("chat", 1), ("batch-a", 1), ("batch-b", 3)]
    while s.has_unfinished_requests():
        step(s)
    assert s.kv.num_free_blocks == 64


def test_background_work_does_not_yield_to_a_prompt_waiting_for_its_adapter_slot():
    """The interactive head needs an adapter slot that a background request holds: background
    work keeps running (held, it would never finish and free the slot), then the head runs."""
    s = make_scheduler(policy="priority", background_priority=100, max_loras=1)
    s.add_request(Request("batch", [1, 2, 3], max_tokens=6, priority=100, lora_int_id=1))
    step(s)
    s.add_request(Request("chat", [4, 5, 6, 7], max_tokens=2, lora_int_id=2))
    ran = [shares(step(s)) for _ in range(8)]
    assert ran[:5] == [[("batch", 1)]] * 5  # its last decode finishes it; the slot is free
    assert ran[5] == [("chat", 4)]
    assert not s.has_unfinished_requests()


def test_background_work_runs_in_a_step_whose_more_important_prompt_cannot_start():
    """Background work yields only to a prompt that is read in the step. Here the interactive
    prompt found room before the step, but a foreground decode took a block first: the prompt
    waits, so background work runs; in the next step the prompt preempts it for the room."""
    s = make_scheduler(
        num_blocks=7, block_size=2, caching=False, policy="priority", background_priority=100
    )
    s.add_request(Request("fg", [1, 2, 3], max_tokens=10))
    s.add_request(Request("batch", [4, 5, 6], max_tokens=10, priority=100))
    assert shares(step(s)) == [("fg", 3)]  # background yields to fg's prompt
    assert shares(step(s)) == [("fg", 1), ("batch", 3)]
    s.add_request(Request("chat", [7, 8, 9, 10, 11], max_tokens=1))  # 3 blocks: 3 are free
    assert shares(step(s)) == [("fg", 1), ("batch", 1)]  # fg's decode took one of them
    out = step(s)
    assert [r.request_id for r in out.preempted] == ["batch"]
    assert shares(out) == [("fg", 1), ("chat", 5)]
    while s.has_unfinished_requests():
        step(s)
    assert s.kv.num_free_blocks == 7


def test_a_more_important_whole_prompt_preempts_the_background_work_in_its_way():
    """Without chunked prefill the whole prompt must find its blocks at once (the long-prefill
    threshold does not apply): the interactive request preempts the background request that
    holds one of them, instead of waiting behind it for ever (background work yields to it)."""
    s = make_scheduler(
        num_blocks=6,
        block_size=2,
        enable_chunked_prefill=False,
        long_prefill_token_threshold=3,
        policy="priority",
        background_priority=100,
    )
    s.add_request(Request("batch", [1], max_tokens=4, priority=100))
    step(s)
    s.add_request(Request("chat", list(range(11, 22)), max_tokens=1))  # all 6 blocks
    out = step(s)
    assert [r.request_id for r in out.preempted] == ["batch"]
    assert shares(out) == [("chat", 11)]
    while s.has_unfinished_requests():
        step(s)
    assert s.requests == {} and s.kv.num_free_blocks == 6


def test_a_more_important_prompt_counts_the_idle_cached_blocks_it_takes_back():
    """A prefix-cache hit on blocks no running request holds takes them out of the free pool
    (they were ready to evict): the room a more important prompt makes counts them."""
    s = make_scheduler(
        num_blocks=8,
        block_size=2,
        max_num_batched_tokens=3,
        policy="priority",
        background_priority=100,
    )
    s.add_request(Request("warm", [0, 7, 3, 10, 6], max_tokens=1))
    while s.has_unfinished_requests():
        step(s)  # leaves [0, 7] and [3, 10] cached, idle
    s.add_request(Request("batch", list(range(20, 31)), max_tokens=3, priority=100))
    while s.kv.num_free_blocks > 2:
        step(s)
    s.add_request(Request("chat", [0, 7, 3, 10, 6], max_tokens=1))  # 2 idle hits + 1 new block
    out = step(s)
    assert [r.request_id for r in out.preempted] == ["batch"]
    assert shares(out) == [("chat", 1)]


def test_background_priority_needs_the_priority_policy():
    with pytest.raises(ValueError, match="needs the priority policy"):
        SchedulerConfig(background_priority=100)


def test_fcfs_preempted_request_goes_back_ahead_of_later_arrivals():
    s = make_scheduler(num_blocks=6, max_num_seqs=2)
    s.add_request(Request("a", list(range(1, 8)), max_tokens=12))
    s.add_request(Request("b", list(range(11, 18)), max_tokens=12))
    s.add_request(Request("c", [3, 3], max_tokens=2))
    out = step(s)
    while not out.preempted:
        out = step(s)
    assert [r.request_id for r in s.waiting] == ["b", "c"]


def test_stats_count_steps_tokens_and_preemptions():
    s = make_scheduler(max_num_batched_tokens=10)
    s.add_request(Request("a", [1] * 6, max_tokens=3))
    s.add_request(Request("b", [2] * 6, max_tokens=3))
    step(s)
    st = s.stats
    assert (st.num_scheduled_tokens, st.num_scheduled_seqs, st.num_steps) == (10, 2, 1)
    assert (st.num_running, st.num_waiting, st.num_preemptions) == (2, 0, 0)
    while s.has_unfinished_requests():
        step(s)
    st = s.stats
    assert st.total_scheduled_tokens == 12 + 2 * 2 and st.num_running == 0


def test_abort_mid_prefill_and_between_schedule_and_update():
    s = make_scheduler(max_num_batched_tokens=4, caching=False)
    s.add_request(Request("long", list(range(1, 15)), max_tokens=3))
    s.add_request(Request("short", [5, 6], max_tokens=3))
    step(s)  # long: first chunk of 4
    out = s.schedule()  # long: second chunk
    assert dict(shares(out))["long"] == 4
    s.finish_requests(["long"], RequestStatus.FINISHED_ABORTED)  # before the step's update
    updated = s.update(out, {x.request.request_id: [9] for x in out.scheduled if x.needs_sample})
    long = out.scheduled[0].request
    assert long.status is RequestStatus.FINISHED_ABORTED and long.output_token_ids == []
    assert long.num_computed_tokens == 4 and "long" not in s.kv.block_tables
    assert all(r.request_id != "long" for r in updated)
    assert [x.request.request_id for x in s.schedule().scheduled] == ["short"]


def test_abort_of_a_preempted_request_waiting_to_return():
    s = make_scheduler(num_blocks=6)
    s.add_request(Request("a", list(range(1, 8)), max_tokens=12))
    s.add_request(Request("b", list(range(11, 18)), max_tokens=12))
    out = step(s)
    while not out.preempted:
        out = step(s)
    assert s.requests["b"].status is RequestStatus.PREEMPTED
    (b,) = s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert b.status is RequestStatus.FINISHED_ABORTED and not s.waiting
    assert s.stats.num_waiting_tokens == 0
    while s.has_unfinished_requests():
        step(s)
    assert s.kv.num_free_blocks == 6
