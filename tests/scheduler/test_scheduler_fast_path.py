"""The decode fast paths of ``Scheduler.schedule`` and ``Scheduler.update`` against the general
paths (``decode_fast_path = False``), step for step over random workloads: the same scheduled
chunks, block tables, copies, preemptions, appended tokens, stops and freed blocks.

The workloads mix what the fast paths must hand to the general path: prefill chunks, shared
prefixes (prefix-cache hits and blocks filled by a decode, to register), forks (copy-on-write of
a shared last block), proposals to verify, stop tokens under ``min_tokens``, aborts, a pool small
enough to preempt, and a sliding window that releases blocks as decodes go.
"""

from __future__ import annotations

import random

import pytest

from pagedserve.blockmgr import KVCacheManager
from pagedserve.scheduler import Request, RequestStatus, Scheduler, SchedulerConfig

VOCAB = 7  # small: stop tokens and shared prefixes come up often


def make_scheduler(fast: bool, window: int | None, num_blocks: int) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size=4, watermark=0, sliding_window=window)
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, max_model_len=64)
    scheduler = Scheduler(config, kv)
    scheduler.decode_fast_path = fast
    if not fast:  # allocate_slots's own O(1) decode check off too: every chunk allocates in full
        kv._decodes_in_place = lambda *args: False
    return scheduler


def step_view(output) -> tuple:
    """Everything a step decided, by value."""
    return (
        [
            (s.request.request_id, s.num_computed_tokens, s.num_new_tokens, list(s.block_table))
            + (list(s.spec_token_ids),)
            for s in output.scheduled
        ],
        output.blocks_to_copy,
        [r.request_id for r in output.preempted],
        output.num_scheduled_tokens,
        output.num_spec_tokens,
    )


def state_view(scheduler: Scheduler) -> tuple:
    kv = scheduler.kv
    return (
        [r.request_id for r in scheduler.running],
        sorted(scheduler.requests),
        {
            rid: (r.num_computed_tokens, list(r.output_token_ids))
            for rid, r in scheduler.requests.items()
        },
        {rid: kv.get_block_table(rid) for rid in scheduler.requests},
        [b.ref_count for b in kv.pool.blocks],
        kv.num_free_blocks,
        dict(kv._num_registered),
    )


def new_request(rng: random.Random, index: int, prefix: list[int]) -> dict:
    """A request's fields (each scheduler gets its own Request)."""
    prompt = prefix[: rng.randint(0, len(prefix))] + [rng.randrange(VOCAB) for _ in range(3)]
    return dict(
        request_id=f"r{index}",
        prompt_token_ids=prompt,
        max_tokens=rng.randint(1, 30),
        min_tokens=rng.choice([0, 0, 3]),
        stop_token_ids=frozenset({0}) if rng.random() < 0.5 else frozenset(),
    )


def drive(seed: int, window: int | None, num_blocks: int) -> int:
    """Run one random workload through both schedulers; returns how many steps ran."""
    rng = random.Random(seed)
    fast, slow = make_scheduler(True, window, num_blocks), make_scheduler(False, window, num_blocks)
    prefix = [rng.randrange(VOCAB) for _ in range(12)]
    arrivals = 0
    for step in range(300):
        if arrivals < 14 and rng.random() < 0.3:
            fields = new_request(rng, arrivals, prefix)
            for scheduler in (fast, slow):
                prompt = list(fields["prompt_token_ids"])
                scheduler.add_request(Request(**{**fields, "prompt_token_ids": prompt}))
            arrivals += 1
        if not fast.has_unfinished_requests():
            if arrivals >= 14:
                return step
            continue
        perturb(rng, fast, slow, step)
        outputs = [s.schedule() for s in (fast, slow)]
        assert step_view(outputs[0]) == step_view(outputs[1]), step
        sampled = sample(rng, outputs[0])
        updated = [s.update(o, sampled) for s, o in zip((fast, slow), outputs)]
        assert [r.request_id for r in updated[0]] == [r.request_id for r in updated[1]], step
        assert [r.status for r in updated[0]] == [r.status for r in updated[1]], step
        assert state_view(fast) == state_view(slow), step
    return 300


def perturb(rng: random.Random, fast: Scheduler, slow: Scheduler, step: int) -> None:
    """The same outside events on both: a fork, proposals to verify, an abort."""
    running = [r for r in fast.running if r.num_output_tokens]
    if not running:
        return
    parent = rng.choice(running)
    event = rng.random()
    proposals = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 3))]
    for scheduler in (fast, slow):
        request = scheduler.requests[parent.request_id]
        if event < 0.05 and len(scheduler.requests) < 10:
            child = Request(
                request_id=f"{request.request_id}.{step}",
                prompt_token_ids=list(request.prompt_token_ids),
                max_tokens=request.max_tokens,
                output_token_ids=list(request.output_token_ids),
            )
            scheduler.add_forked_request(request.request_id, child)
        elif event < 0.15:
            request.spec_token_ids = list(proposals)
        elif event < 0.18:
            scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED)


def sample(rng: random.Random, output) -> dict[str, int | list[int]]:
    sampled: dict[str, int | list[int]] = {}
    for item in output.scheduled:
        if item.spec_token_ids:  # accept a random run of the proposals, then one more token
            accepted = list(item.spec_token_ids[: rng.randint(0, len(item.spec_token_ids))])
            sampled[item.request.request_id] = [*accepted, rng.randrange(VOCAB)]
        elif item.needs_sample:
            sampled[item.request.request_id] = rng.randrange(VOCAB)
    return sampled


@pytest.mark.parametrize("window, num_blocks", [(None, 64), (None, 14), (6, 64), (6, 12)], ids=str)
def test_fast_paths_decide_what_the_general_paths_decide(window, num_blocks):
    steps = [drive(seed, window, num_blocks) for seed in range(6)]
    assert sum(steps) > 200  # the workloads really ran


def test_the_fast_path_takes_the_common_decode(monkeypatch):
    """A running decode with room in its block is answered by ``decode_in_place`` and never
    reaches ``allocate_slots`` (so a fast path that silently fell back would fail here)."""
    scheduler = make_scheduler(True, None, 64)
    scheduler.add_request(Request("a", [1, 2, 3, 4, 5], max_tokens=10))
    scheduler.update(scheduler.schedule(), {"a": 6})  # the prompt; block 2 has room for 3 more
    calls = []
    real = scheduler.kv.allocate_slots
    monkeypatch.setattr(
        scheduler.kv, "allocate_slots", lambda *a, **k: calls.append(a) or real(*a, **k)
    )
    output = scheduler.schedule()
    assert [(s.num_computed_tokens, s.num_new_tokens) for s in output.scheduled] == [(5, 1)]
    assert calls == [] and output.scheduled[0].block_table == scheduler.kv.get_block_table("a")


@pytest.mark.parametrize("window", [None, 6], ids=str)
def test_the_decodes_list_what_the_fast_path_scheduled(window):
    """``output.decodes`` lists, in order, the items the decode fast path made: each runs its
    one last known token at its computed count, into the item's blocks. A decode that starts a
    block or fills one takes the fast path too (``allocate_decode_slot``), so nearly every decode
    is listed: all but those that copy a shared block first (after a fork)."""
    rng = random.Random(7)
    scheduler = make_scheduler(True, window, 64)
    listed = decodes = 0
    for step in range(200):
        if len(scheduler.requests) < 6 and rng.random() < 0.3:
            scheduler.add_request(Request(**new_request(rng, step, [1, 2, 3, 4, 5])))
        if not scheduler.has_unfinished_requests():
            continue
        running = [r for r in scheduler.running if r.num_output_tokens]
        if running and rng.random() < 0.2:  # proposals to verify, or a fork: not listed
            request = rng.choice(running)
            if rng.random() < 0.5:
                request.spec_token_ids = [rng.randrange(VOCAB)]
            elif len(scheduler.requests) < 8:
                child = Request(f"{request.request_id}.{step}", list(request.prompt_token_ids), 30)
                child.output_token_ids = list(request.output_token_ids)
                scheduler.add_forked_request(request.request_id, child)
        output = scheduler.schedule()
        fast = output.decodes
        items = [s for s in output.scheduled if s.request.request_id in set(fast.req_ids)]
        assert [s.request.request_id for s in items] == fast.req_ids
        lists = (fast.num_computed_tokens, fast.token_ids, fast.block_ids)
        for item, computed, token, ids in zip(items, *lists, strict=True):
            request = item.request
            assert (item.num_new_tokens, item.num_computed_tokens) == (1, computed)
            assert not item.spec_token_ids and computed + 1 == request.num_tokens
            assert token == request.all_token_ids[computed] and ids == item.block_table
            assert ids == scheduler.kv.get_block_table(request.request_id)
        listed += len(items)
        decodes += sum(
            s.num_new_tokens == 1 and not s.spec_token_ids and s.needs_sample
            for s in output.scheduled
        )
        scheduler.update(output, sample(rng, output))
    assert listed > 0.9 * decodes > 100


def test_a_pure_decode_step_makes_no_item_until_one_is_read():
    """The fast path's decodes are items only once ``scheduled`` is read: update reads the
    lists; read afterwards, the items are those of the general path, in the same order."""
    fast, slow = make_scheduler(True, None, 64), make_scheduler(False, None, 64)
    for scheduler in (fast, slow):
        for name, prompt in (("a", [1, 2, 3]), ("b", [4, 5, 6, 1, 2])):
            scheduler.add_request(Request(name, prompt, max_tokens=10))
        scheduler.update(scheduler.schedule(), {"a": 3, "b": 4})
    for step in range(6):  # "b" starts a block at step 2 and fills it at step 5
        outputs = [s.schedule() for s in (fast, slow)]
        assert outputs[0]._scheduled == [] and outputs[0].num_scheduled_seqs == 2
        assert outputs[0].all_decodes and not outputs[1].all_decodes
        sampled = {"a": step % VOCAB, "b": (step + 1) % VOCAB}
        updated = [s.update(o, sampled) for s, o in zip((fast, slow), outputs)]
        assert outputs[0]._scheduled == []  # update read the lists alone
        assert [r.request_id for r in updated[0]] == [r.request_id for r in updated[1]]
        assert step_view(outputs[0]) == step_view(outputs[1]), step
        assert state_view(fast) == state_view(slow), step
