"""Properties of the scheduler over random workloads and tiny KV pools (hypothesis).

The scheduler is driven by a simulated engine that checks it from the outside:
- a fake KV cache: every scheduled token writes ``(position, token)`` into its slot through the
  block table, after the step's copy-on-write copies; before sampling, every position of the
  sequence read back through its block table must hold that sequence's own token. This catches
  a block handed to two writers, a prefix hit on a block that was never written, a lost copy;
- a fake model: the next token is a fixed function of the whole sequence, so each request's
  output must equal the one computed for it alone, however it was chunked, preempted or batched.

Checked at every step: the token budget and the sequence cap; the decodes' tokens that the
model runner reads from the output; FCFS admits in arrival order and
never lets a later arrival run while an earlier one waits; priority admits in key order. At the
end: every admitted request finished, aborted ones at random points included, and no block is
held.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagedserve.blockmgr import KVCacheManager
from pagedserve.scheduler import (
    Request,
    RequestRejectedError,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
)

MAX_MODEL_LEN = 40
STOP_TOKEN = 0
VOCAB = 11
MAX_STEPS = 3000


def next_token(tokens: list[int]) -> int:
    """The fake model: a deterministic function of the whole sequence."""
    acc = 0
    for i, t in enumerate(tokens):
        acc = (acc * 31 + (i + 1) * (t + 3)) % 1_000_003
    return acc % VOCAB


def reference_output(
    prompt: list[int], max_tokens: int, min_tokens: int, stop: bool, first: list[int] = ()
) -> list[int]:
    """What the fake model generates for one request alone (a forked child: from ``first``)."""
    out = list(first)
    while True:
        out.append(next_token(prompt + out))
        if stop and len(out) >= min_tokens and out[-1] == STOP_TOKEN:
            return out
        if len(out) >= max_tokens:
            return out


@dataclass
class Spec:
    prompt: list[int]
    max_tokens: int
    min_tokens: int
    stop: bool
    priority: int
    arrival_step: int


BASES = [[(7 * i + 3 * b) % VOCAB for i in range(30)] for b in range(3)]

spec_strategy = st.builds(
    lambda base, shared, tail, max_tokens, min_tokens, stop, priority, arrival: Spec(
        (BASES[base][:shared] + tail) or [1],
        max_tokens,
        min(min_tokens, max_tokens),
        stop,
        priority,
        arrival,
    ),
    base=st.integers(0, 2),
    shared=st.integers(0, 24),
    tail=st.lists(st.integers(0, VOCAB - 1), max_size=8),
    max_tokens=st.integers(1, 12),
    min_tokens=st.integers(0, 4),
    stop=st.booleans(),
    priority=st.integers(0, 3),
    arrival=st.sampled_from([0, 0, 1, 2, 3, 5, 8, 12]),
)

setup_strategy = st.fixed_dictionaries(
    {
        "num_blocks": st.integers(4, 20),
        "block_size": st.sampled_from([2, 4]),
        "watermark": st.sampled_from([0.0, 0.1]),
        "caching": st.sampled_from([True, True, False]),
        "budget": st.integers(1, 48),
        "max_num_seqs": st.integers(1, 8),
        "threshold": st.sampled_from([0, 0, 3, 8]),
        "chunked": st.sampled_from([True, True, True, False]),
        # "background": the priority policy with priority 3 as background work
        "policy": st.sampled_from(["fcfs", "priority", "background"]),
    }
)


class SimulatedEngine:
    """Drives a Scheduler like the engine does, checking it against the fake KV and model."""

    def __init__(self, setup: dict) -> None:
        self.setup = setup
        budget = setup["budget"] if setup["chunked"] else max(setup["budget"], MAX_MODEL_LEN)
        self.config = SchedulerConfig(
            max_num_seqs=setup["max_num_seqs"],
            max_num_batched_tokens=budget,
            max_model_len=MAX_MODEL_LEN,
            long_prefill_token_threshold=setup["threshold"],
            enable_chunked_prefill=setup["chunked"],
            policy="fcfs" if setup["policy"] == "fcfs" else "priority",
            background_priority=3 if setup["policy"] == "background" else None,
        )
        self.kv = KVCacheManager(
            setup["num_blocks"], setup["block_size"], setup["caching"], setup["watermark"]
        )
        self.scheduler = Scheduler(self.config, self.kv)
        self.slots: dict[int, tuple[int, int]] = {}
        self.first_admitted: list[Request] = []
        self.next_position: dict[str, int] = {}  # where a running request's next chunk starts
        self.forked: dict[str, tuple[Request, Spec, list[int]]] = {}

    def fits(self, spec: Spec) -> bool:
        """Independent statement of the admission rule."""
        bs = self.setup["block_size"]
        blocks = -(-(len(spec.prompt) + spec.max_tokens - 1) // bs)
        usable = self.setup["num_blocks"] - int(self.setup["watermark"] * self.setup["num_blocks"])
        return len(spec.prompt) + spec.max_tokens <= MAX_MODEL_LEN and blocks <= usable

    def add(self, rid: str, spec: Spec) -> Request | None:
        request = Request(
            rid,
            list(spec.prompt),
            max_tokens=spec.max_tokens,
            min_tokens=spec.min_tokens,
            stop_token_ids=frozenset({STOP_TOKEN}) if spec.stop else frozenset(),
            priority=spec.priority,
            arrival_time=float(spec.arrival_step),
        )
        try:
            self.scheduler.add_request(request)
        except RequestRejectedError:
            assert not self.fits(spec)
            return None
        assert self.fits(spec)
        return request

    def step(self) -> None:
        s = self.scheduler
        waiting_before = list(s.waiting)
        out = s.schedule()
        self.check_limits(out)
        self.check_decode_tokens(out)
        self.check_policy(out, waiting_before)
        self.run_kv(out)
        sampled = {
            x.request.request_id: [next_token(x.request.all_token_ids)]
            for x in out.scheduled
            if x.needs_sample
        }
        s.update(out, sampled)

    def fork(self, rid: str, spec: Spec, token: int) -> None:
        """Fork a request that has just sampled, as n > 1 does: the child's last token differs."""
        parent = self.scheduler.requests.get(rid)
        if parent is None or parent.status is not RequestStatus.RUNNING:
            return
        if not parent.output_token_ids or parent.num_computed_tokens != parent.num_tokens - 1:
            return
        first = parent.output_token_ids[:-1] + [token]
        child = Request(
            f"{rid}.{len(self.forked)}",
            list(parent.prompt_token_ids),
            max_tokens=parent.max_tokens,
            min_tokens=parent.min_tokens,
            stop_token_ids=parent.stop_token_ids,
            output_token_ids=list(first),
        )
        if child.check_stop() is not None:
            return  # done at its first token: the engine never schedules it
        self.scheduler.add_forked_request(rid, child)
        self.forked[child.request_id] = (child, spec, first)
        self.next_position[child.request_id] = parent.num_computed_tokens

    def check_limits(self, out) -> None:
        s, config = self.scheduler, self.config
        assert out.num_scheduled_tokens <= config.max_num_batched_tokens
        assert len(out.scheduled) <= config.max_num_seqs
        if not self.forked:  # forks join running beside their parent, over the cap if need be
            assert len(s.running) <= config.max_num_seqs
        ids = [x.request.request_id for x in out.scheduled]
        assert len(set(ids)) == len(ids)
        assert all(r.num_computed_tokens == 0 for r in s.waiting)
        for r in out.preempted:
            del self.next_position[r.request_id]
        for x in out.scheduled:  # chunks are contiguous: nothing skipped, nothing computed twice
            start = self.next_position.get(x.request.request_id)
            assert start is None or x.num_computed_tokens == start
            self.next_position[x.request.request_id] = x.num_computed_tokens + x.num_new_tokens
        for x in out.scheduled:
            assert x.num_new_tokens >= 1
            assert x.num_computed_tokens + x.num_new_tokens <= x.request.num_tokens
            if config.long_prefill_token_threshold and config.enable_chunked_prefill:
                assert x.num_new_tokens <= config.long_prefill_token_threshold
            if not config.enable_chunked_prefill:
                assert x.num_new_tokens == 1 or x.needs_sample  # whole prompts only
        stats = s.stats
        assert stats.num_scheduled_tokens == out.num_scheduled_tokens
        assert (stats.num_running, stats.num_waiting) == (len(s.running), len(s.waiting))
        assert stats.num_waiting_tokens == sum(r.num_tokens for r in s.waiting)

    def check_decode_tokens(self, out) -> None:
        """The column the model runner lays decodes out from: an entry's token is its request's
        last known token, and it is a one-token decode; every other entry is listed apart."""
        others = set(out.other_entries)
        assert len(out.decode_token_ids) == len(out.requests)
        assert len(others) == len(out.other_entries) == out.decode_token_ids.count(-1)
        for index, (x, token) in enumerate(zip(out.scheduled, out.decode_token_ids)):
            if token < 0:
                assert index in others
            else:
                assert x.num_new_tokens == 1 and not x.spec_token_ids
                assert x.num_computed_tokens + 1 == x.request.num_tokens
                assert token == x.request.all_token_ids[-1]

    def check_policy(self, out, waiting_before: list[Request]) -> None:
        s = self.scheduler
        admitted = [r for r in waiting_before if r.status is RequestStatus.RUNNING]
        still_waiting = [r for r in waiting_before if r.status is not RequestStatus.RUNNING]
        if self.config.policy == "fcfs":
            key = lambda r: r.arrival_order  # noqa: E731
            if s.running and s.waiting:  # no later arrival runs while an earlier one waits
                # (a forked child shares its parent's arrival: the two may be on either side)
                assert max(key(r) for r in s.running) <= min(key(r) for r in s.waiting)
        else:
            key = lambda r: (r.priority, r.arrival_time, r.arrival_order)  # noqa: E731
        if admitted and still_waiting:  # ties: only a parent and its forked children share a key
            assert max(map(key, admitted)) <= min(map(key, still_waiting))
        for r in admitted:
            if r.num_preemptions == 0:
                self.first_admitted.append(r)
        for r in out.preempted:
            assert r.status is RequestStatus.PREEMPTED and r.request_id not in self.kv.block_tables

    def run_kv(self, out) -> None:
        """Copy, write every new token's (position, token), then read every sequence back."""
        bs = self.setup["block_size"]
        for src, dst in out.blocks_to_copy:
            for off in range(bs):
                if src * bs + off in self.slots:
                    self.slots[dst * bs + off] = self.slots[src * bs + off]
        for x in out.scheduled:
            tokens = x.request.all_token_ids
            for pos in range(x.num_computed_tokens, x.num_computed_tokens + x.num_new_tokens):
                self.slots[x.block_table[pos // bs] * bs + pos % bs] = (pos, tokens[pos])
        for x in out.scheduled:
            tokens = x.request.all_token_ids
            for pos in range(x.num_computed_tokens + x.num_new_tokens):
                slot = x.block_table[pos // bs] * bs + pos % bs
                assert self.slots.get(slot) == (pos, tokens[pos]), (x.request.request_id, pos)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    setup=setup_strategy,
    specs=st.lists(spec_strategy, min_size=1, max_size=12),
    aborts=st.lists(st.tuples(st.integers(0, 24), st.integers(0, 11)), max_size=4),
    forks=st.lists(
        st.tuples(st.integers(0, 12), st.integers(0, 11), st.integers(0, VOCAB - 1)), max_size=8
    ),
)
def test_random_workloads_finish_correctly_within_limits(setup, specs, aborts, forks):
    sim = SimulatedEngine(setup)
    admitted: dict[str, tuple[Request, Spec]] = {}
    aborted: set[str] = set()
    step = 0
    while step < MAX_STEPS:
        for i, spec in enumerate(specs):
            if spec.arrival_step == step:
                request = sim.add(f"r{i}", spec)
                if request is not None:
                    admitted[request.request_id] = (request, spec)
        for abort_step, index in aborts:
            rid = f"r{index}"
            if abort_step == step and rid in sim.scheduler.requests:
                sim.scheduler.finish_requests([rid], RequestStatus.FINISHED_ABORTED)
                aborted.add(rid)
                assert rid not in sim.kv.block_tables
        if step > 12 and not sim.scheduler.has_unfinished_requests():
            break
        sim.step()
        for fork_step, index, token in forks:
            if fork_step == step and f"r{index}" in admitted:
                sim.fork(f"r{index}", specs[index], token)
        step += 1
    assert not sim.scheduler.has_unfinished_requests(), "a request never finished"

    for rid, (request, spec) in admitted.items():
        expected = reference_output(spec.prompt, spec.max_tokens, spec.min_tokens, spec.stop)
        if rid in aborted:
            assert request.status is RequestStatus.FINISHED_ABORTED
            assert request.output_token_ids == expected[: request.num_output_tokens]
        else:
            assert request.output_token_ids == expected
            stopped = spec.stop and expected[-1] == STOP_TOKEN and len(expected) >= spec.min_tokens
            want = RequestStatus.FINISHED_STOPPED if stopped else RequestStatus.FINISHED_LENGTH
            assert request.status is want
    for child, spec, first in sim.forked.values():  # children are never aborted here
        expected = reference_output(spec.prompt, spec.max_tokens, spec.min_tokens, spec.stop, first)
        assert child.output_token_ids == expected and child.is_finished
    if setup["policy"] == "fcfs":  # the head of the queue is never overtaken
        orders = [r.arrival_order for r in sim.first_admitted]
        assert orders == sorted(orders)
    event(f"preempted: {sim.scheduler.stats.num_preemptions > 0}")
    event(f"aborted: {bool(aborted)}")
    event(f"rejected: {len(admitted) < len(specs)}")
    event(f"prefix hits: {sim.kv.prefix_cache_stats.hits > 0}")
    event(f"forked: {bool(sim.forked)}")
    assert not sim.scheduler.requests and not sim.kv.block_tables
    assert sim.kv.num_free_blocks == setup["num_blocks"]
    assert all(b.ref_count == 0 for b in sim.kv.pool.blocks)
