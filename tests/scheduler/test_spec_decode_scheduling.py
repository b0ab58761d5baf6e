"""Speculative decodes in the scheduler: 1 + k tokens under the token budget, slots for the
proposals, the accepted run appended under the stop rules, the rejected tail rewound and the
blocks that only it used given back."""

from __future__ import annotations

from pagedserve.blockmgr import KVCacheManager
from pagedserve.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig

BLOCK = 4


def make_scheduler(budget: int = 64, num_blocks: int = 16, prefix_caching: bool = True):
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=prefix_caching, watermark=0)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_model_len=64), kv)


def decoding(s: Scheduler, prompt: list[int], max_tokens: int = 20, **kw) -> Request:
    """A request past its prefill: one output token, ready to decode."""
    request = Request("r", prompt, max_tokens=max_tokens, **kw)
    s.add_request(request)
    while not request.output_token_ids:  # the prefill, in chunks under a small budget
        out = s.schedule()
        s.update(out, {"r": [100]} if out.scheduled[0].needs_sample else {})
    assert request.num_computed_tokens + 1 == request.num_tokens
    return request


def test_a_decode_runs_its_proposals_and_the_budget_counts_them():
    s = make_scheduler(budget=3)
    request = decoding(s, [1, 2, 3, 4, 5])  # 6 tokens known, 5 computed
    request.spec_token_ids = [6, 7, 8, 9]
    out = s.schedule()
    (item,) = out.scheduled
    assert list(item.spec_token_ids) == [6, 7]  # 1 + 2 fills the budget of 3
    assert (item.num_computed_tokens, item.num_new_tokens) == (5, 3)
    assert item.needs_sample and out.num_scheduled_tokens == 3
    assert request.spec_token_ids == []  # taken: a later step never reuses them
    assert len(item.block_table) == 2  # slots for positions 5..7: a second block


def test_accepted_run_then_rejected_tail_gives_back_its_blocks():
    s = make_scheduler()
    request = decoding(s, [1, 2, 3, 4, 5, 6, 7])  # 8 known, 7 computed: block 1 is full
    free = s.kv.num_free_blocks
    request.spec_token_ids = [21, 22, 23, 24, 25]  # positions 8..12 reach a fourth block
    out = s.schedule()
    assert len(out.scheduled[0].block_table) == 4 and s.kv.num_free_blocks == free - 2
    s.update(out, {"r": [21, 30]})  # proposal 0 accepted, 1 rejected: 30 is the target's own
    assert request.output_token_ids == [100, 21, 30]
    assert (request.num_tokens, request.num_computed_tokens) == (10, 9)  # 30 not yet computed
    assert s.kv.get_block_table("r") == out.scheduled[0].block_table[:3]
    assert s.kv.num_free_blocks == free - 1  # the block only rejected tokens used is back
    out = s.schedule()  # the next plain decode computes token 30 at position 9
    assert [(x.num_computed_tokens, x.num_new_tokens) for x in out.scheduled] == [(9, 1)]


def test_a_stop_token_inside_the_run_ends_the_output_there():
    s = make_scheduler()
    request = decoding(s, [1, 2, 3], stop_token_ids=frozenset({2}))
    request.spec_token_ids = [5, 2, 6]
    out = s.schedule()
    updated = s.update(out, {"r": [5, 2, 6, 9]})
    assert updated == [request]
    assert request.output_token_ids == [100, 5, 2]
    assert request.status is RequestStatus.FINISHED_STOPPED and request.stop_reason == 2
    assert s.kv.num_free_blocks == 16 and not s.running


def test_max_tokens_inside_the_run_ends_the_output_there():
    s = make_scheduler()
    request = decoding(s, [1, 2, 3], max_tokens=3)
    request.spec_token_ids = [5, 6, 7]
    s.update(s.schedule(), {"r": [5, 6, 7, 8]})
    assert request.output_token_ids == [100, 5, 6]
    assert request.status is RequestStatus.FINISHED_LENGTH


def test_a_preempted_request_drops_its_proposals():
    s = make_scheduler(num_blocks=3, prefix_caching=False)
    request = decoding(s, [1, 2, 3, 4, 5, 6, 7], max_tokens=5)  # 8 known: 2 blocks held
    other = Request("o", [9, 9, 9], max_tokens=4)
    s.add_request(other)
    s.update(s.schedule(), {"r": [101], "o": [50]})  # "o" takes the third block
    other.spec_token_ids = [51]
    out = s.schedule()  # position 8 of "r" needs a block: "o", the newest, is preempted
    assert out.preempted == [other] and other.status is RequestStatus.PREEMPTED
    assert other.spec_token_ids == []  # recomputed later from its prompt: proposals anew
    assert request.status is RequestStatus.RUNNING


def test_proposals_that_do_not_fit_fall_back_to_a_plain_decode():
    s = make_scheduler(num_blocks=3, prefix_caching=False)
    request = decoding(s, [1, 2, 3, 4, 5, 6], max_tokens=6)  # 7 known, 6 computed: 2 blocks
    other = Request("o", [9, 9, 9], max_tokens=4)
    s.add_request(other)
    s.update(s.schedule(), {"r": [101], "o": [50]})  # "o" takes the third block
    request.spec_token_ids = [8, 8, 8]  # positions 7..10 would need the block "o" holds
    out = s.schedule()
    assert not out.preempted
    plan = [(x.request.request_id, x.num_new_tokens, list(x.spec_token_ids)) for x in out.scheduled]
    assert plan == [("r", 1, []), ("o", 1, [])]  # position 7 fits in the block "r" holds
