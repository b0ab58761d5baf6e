"""The garbage collector's first threshold, raised above what one engine step allocates.

A step makes a few container objects per running sequence (its output, a list of new tokens,
logprob dicts when asked for) that refcounting frees when the step's outputs are dropped.
CPython starts a young-generation collection whenever the objects allocated and not yet freed
pass ``gc.get_threshold()[0]`` (700 by default): a step of 256 decodes passes it about once, so
the collector walks every young object once a step, finds nothing to free, and costs about a
fifth of the engine's host time per step (0.16 of 0.75 ms measured at 256 decodes on the
2-core Intel Xeon VM: tools/bench_host_overhead.py; docs/benchmarks.md). Above the step's peak,
collections only run when objects really pile up, as they do while requests are admitted.

The threshold is process-wide, so it is only ever raised (never lowered below what the process
set), and by an amount that follows ``max_num_seqs``: ``OBJECTS_PER_SEQUENCE`` per sequence
covers a step whose every sequence asks for 20 top logprobs. Reference cycles, the only garbage
the collector exists for, are then found after at most that many allocations instead of 700.
"""

from __future__ import annotations

import gc

OBJECTS_PER_SEQUENCE = 64  # tracked objects one sequence's step may allocate, with margin
BASE_OBJECTS = 1000  # the rest of a step (the scheduler's output, the runner's layout)


def raise_gc_threshold(max_num_seqs: int) -> int:
    """Raise the young generation's threshold to cover a step of ``max_num_seqs`` sequences
    (never lower it); returns the threshold now in force."""
    first, second, third = gc.get_threshold()
    wanted = BASE_OBJECTS + OBJECTS_PER_SEQUENCE * max_num_seqs
    if first and wanted > first:  # 0: the process turned automatic collection off
        gc.set_threshold(wanted, second, third)
    return gc.get_threshold()[0]
