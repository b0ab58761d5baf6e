"""The batch-invariant mode's tensor-parallel sum: a row's bits do not depend on the buffer.

With three gloo ranks, an all-reduce of the first m rows of the same partials gives other bits
for a row than the all-reduce of all 200 (a ring sums each chunk of the buffer starting at
another rank, and where a row falls follows m): the reason for ``all_reduce_in_rank_order``,
which gives every row the same bits for every m, on every rank, and equals the partials
summed in rank order.
"""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from pagedserve.engine.distributed.group import ParallelGroups, free_loopback_port

WORLD = 3
SIZES = (1, 2, 7, 50, 200)


def _partials(rank: int) -> torch.Tensor:
    return torch.randn(200, 96, generator=torch.Generator().manual_seed(rank))


def _worker(rank: int, port: int, results) -> None:
    group = ParallelGroups.join(rank, WORLD, "127.0.0.1", port)
    try:
        ring_whole = group.all_reduce(_partials(rank).clone())
        ordered_whole = group.all_reduce_in_rank_order(_partials(rank).clone())
        ring_differs, ordered_same = 0, 0
        for m in SIZES:
            ring = group.all_reduce(_partials(rank)[:m].clone())
            ordered = group.all_reduce_in_rank_order(_partials(rank)[:m].clone())
            ring_differs += int(not torch.equal(ring, ring_whole[:m]))
            ordered_same += int(torch.equal(ordered, ordered_whole[:m]))
        results[rank] = (ring_differs, ordered_same, ordered_whole)
    finally:
        group.close()


def test_rank_order_sum_is_the_same_bits_for_every_row_count():
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(free_loopback_port(), results), nprocs=WORLD)
    expected = (_partials(0) + _partials(1)) + _partials(2)
    for rank in range(WORLD):
        ring_differs, ordered_same, ordered_whole = results[rank]
        assert ring_differs > 0  # the ring's order follows the buffer: the mode is needed
        assert ordered_same == len(SIZES)
        assert torch.equal(ordered_whole, expected)
