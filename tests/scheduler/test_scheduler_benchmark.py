"""Micro-benchmark of one scheduler step (schedule + update) with 256 running decodes and 64
requests waiting behind the sequence cap. Not a pass/fail gate: run with
``.venv/bin/python -m pytest tests/scheduler/test_scheduler_benchmark.py`` and read the mean.
Target: well under 1 ms per step, so that the host never holds up the accelerator."""

from __future__ import annotations

from pagedserve.blockmgr import KVCacheManager
from pagedserve.scheduler import Request, Scheduler, SchedulerConfig

NUM_RUNNING = 256
NUM_WAITING = 64
PROMPT_LEN = 128
BLOCK_SIZE = 16


def make_busy_scheduler() -> Scheduler:
    """256 requests past their prefill (one decode each per step), 64 more waiting."""
    max_len = 4096
    kv = KVCacheManager(NUM_RUNNING * (max_len // BLOCK_SIZE) // 4, BLOCK_SIZE, watermark=0.0)
    config = SchedulerConfig(
        max_num_seqs=NUM_RUNNING, max_num_batched_tokens=8192, max_model_len=max_len
    )
    s = Scheduler(config, kv)
    for i in range(NUM_RUNNING + NUM_WAITING):
        prompt = [(i * 7919 + j) % 32000 for j in range(PROMPT_LEN)]
        s.add_request(Request(f"r{i}", prompt, max_tokens=max_len - PROMPT_LEN))
    while len(s.running) < NUM_RUNNING or any(r.num_output_tokens == 0 for r in s.running):
        out = s.schedule()  # the prefills, 64 per step, beside the first decodes
        s.update(out, {x.request.request_id: [1] for x in out.scheduled if x.needs_sample})
    assert len(s.running) == NUM_RUNNING and len(s.waiting) == NUM_WAITING
    return s


def test_schedule_and_update_with_256_decodes_and_64_waiting(benchmark):
    s = make_busy_scheduler()
    counter = iter(range(10**9))

    def step():
        out = s.schedule()
        token = next(counter) % 32000
        s.update(out, {x.request.request_id: [token] for x in out.scheduled})
        return out

    out = benchmark.pedantic(step, rounds=200, iterations=1, warmup_rounds=5)
    assert len(out.scheduled) == NUM_RUNNING and out.num_scheduled_tokens == NUM_RUNNING
    assert len(s.waiting) == NUM_WAITING
