"""The split-KV choice, and the warm-up's reading of which split counts serving can meet.

(That the warm-up compiles every variant a real workload needs is checked with compiled
kernels, in the kernel suite: kernels/warmup_coverage.py.)
"""

import itertools

import torch

from pagedserve.kernels.attention_launch import kv_split_count
from pagedserve.kernels.dispatch import is_cuda, multi_processor_count, taken_as_cuda
from pagedserve.kernels.warmup import paged_attention_warmup, reachable_kv_splits


def test_split_count_bounds():
    assert kv_split_count(1, 8, 1023, 132) == 1  # short contexts never split
    assert kv_split_count(1, 8, 1024, 132) == 2  # >= 512 positions a split
    assert kv_split_count(1, 8, 8192, 132) == 16  # at most max_context // 512
    assert kv_split_count(1, 1, 10**6, 132) == 64  # at most 64
    assert kv_split_count(256, 8, 10**6, 132) == 1  # enough programs without splitting


def test_reachable_splits_are_exactly_what_some_batch_gets():
    for n_kv_heads, max_context, sms in [(8, 8192, 132), (3, 4096, 108), (1, 40000, 16)]:
        contexts = [*range(1, max_context, 97), max_context]
        seen = {
            kv_split_count(n_seqs, n_kv_heads, context, sms)
            for n_seqs, context in itertools.product(range(1, 300), contexts)
        }
        assert set(reachable_kv_splits(n_kv_heads, max_context, sms)) == seen - {1}


def test_taken_as_cuda_is_scoped():
    t = torch.empty(1)
    assert not is_cuda(t)
    with taken_as_cuda(multi_processor_count=7):
        assert is_cuda(t) and multi_processor_count(t) == 7
    assert not is_cuda(t)


def test_warmup_does_nothing_off_a_gpu():
    assert paged_attention_warmup(4, 2, 64, torch.float16, 16, 2048, "cpu") == 0
