"""Slot utilisation: static batching against pagedserve's continuous batching.

Workload (the seeds' example): eight requests that generate 50, 100, ..., 400 tokens fill a batch
of eight slots, and a queue of more requests with the same lengths waits behind them. Static
batching runs a batch until its longest request ends, so a slot whose request ended early idles:
the first batch uses 1800 of its 8 x 400 slot-steps, 56.3%. Continuous batching frees a slot the
step its request ends and fills it from the queue the next step, so while the queue is not empty
every slot works.

Our side is the real ``pagedserve.scheduler.Scheduler`` over a real ``KVCacheManager`` (no model:
each sampled token is a constant, and requests end on ``max_tokens``). Each request has a
one-token prompt, so it holds its slot for exactly as many steps as it generates tokens, as in
the static model.

Run: ``.venv/bin/python tools/slot_utilization.py [--queue 24]``. Importable:
``static_batching(lengths, batch_size)`` and ``continuous_batching(lengths, batch_size)``.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from pagedserve.blockmgr import KVCacheManager
from pagedserve.scheduler import Request, Scheduler, SchedulerConfig

SEED_LENGTHS = [50, 100, 150, 200, 250, 300, 350, 400]


@dataclass
class Utilisation:
    """Slot-steps used over slot-steps offered, overall and while requests were queued."""

    name: str
    steps: int  # steps until the last request ended
    busy_slot_steps: int  # sum over steps of the slots that computed a token
    offered_slot_steps: int  # steps x batch size
    queued_busy: int  # the same two, counted only over steps that began with a non-empty queue
    queued_offered: int

    @property
    def overall(self) -> float:
        return self.busy_slot_steps / self.offered_slot_steps

    @property
    def while_queued(self) -> float:
        return self.queued_busy / self.queued_offered if self.queued_offered else float("nan")


def workload(queue: int) -> list[int]:
    """The seeds' eight lengths, then ``queue`` more cycling through the same lengths."""
    return SEED_LENGTHS + [SEED_LENGTHS[i % len(SEED_LENGTHS)] for i in range(queue)]


def static_batching(lengths: list[int], batch_size: int) -> Utilisation:
    """Batches of ``batch_size`` in arrival order; a batch runs until its longest request ends."""
    steps = busy = queued_busy = queued_offered = 0
    for start in range(0, len(lengths), batch_size):
        batch = lengths[start : start + batch_size]
        longest = max(batch)
        steps += longest
        busy += sum(batch)
        if start + batch_size < len(lengths):  # requests were queued behind this batch
            queued_busy += sum(batch)
            queued_offered += longest * batch_size
    return Utilisation(
        "static batching", steps, busy, steps * batch_size, queued_busy, queued_offered
    )


def continuous_batching(
    lengths: list[int], batch_size: int, block_size: int = 16, token: int = 1
) -> Utilisation:
    """Run the scheduler on one-token prompts that generate ``lengths`` tokens each."""
    max_len = max(lengths) + 1
    blocks_per_request = -(-max_len // block_size)
    kv = KVCacheManager(batch_size * blocks_per_request, block_size, watermark=0.0)
    config = SchedulerConfig(
        max_num_seqs=batch_size,
        max_num_batched_tokens=max(batch_size, max_len),
        max_model_len=max_len,
        max_num_waiting=max(1, len(lengths)),
    )
    scheduler = Scheduler(config, kv)
    for i, n in enumerate(lengths):
        scheduler.add_request(Request(f"r{i}", [token], max_tokens=n))
    steps = busy = queued_busy = queued_offered = 0
    while scheduler.has_unfinished_requests():
        queued = len(scheduler.waiting) > 0
        out = scheduler.schedule()
        sampled = {x.request.request_id: [token] for x in out.scheduled if x.needs_sample}
        scheduler.update(out, sampled)
        steps += 1
        busy += len(out.scheduled)
        if queued:
            queued_busy += len(out.scheduled)
            queued_offered += batch_size
    return Utilisation(
        "continuous batching", steps, busy, steps * batch_size, queued_busy, queued_offered
    )


def percent(fraction: float) -> str:
    """One decimal, halves rounded up (0.5625 -> 56.3%, where format() would round to even)."""
    return f"{math.floor(fraction * 1000 + 0.5) / 10:.1f}%"


def format_table(results: list[Utilisation]) -> str:
    lines = [
        f"{'':22}{'steps':>8}{'overall':>10}{'while queued':>14}",
        *(
            f"{r.name:22}{r.steps:>8}{percent(r.overall):>10}{percent(r.while_queued):>14}"
            for r in results
        ),
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--queue", type=int, default=24, help="requests queued behind the 8")
    args = parser.parse_args()
    lengths = workload(args.queue)
    static = static_batching(lengths, args.batch_size)
    ours = continuous_batching(lengths, args.batch_size)
    print(
        f"workload: {len(lengths)} requests generating {SEED_LENGTHS[0]}..{SEED_LENGTHS[-1]} "
        f"tokens (the seeds' 8, then {args.queue} queued), one-token prompts, "
        f"batch size {args.batch_size}"
    )
    print(f"first batch alone, static: {percent(static_batching(SEED_LENGTHS, 8).overall)}")
    print(format_table([static, ours]))
    print(f"steps to finish everything: static / continuous = {static.steps / ours.steps:.2f}x")


if __name__ == "__main__":
    main()
