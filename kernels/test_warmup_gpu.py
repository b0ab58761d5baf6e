"""On a GPU: after paged_attention_warmup, a serving workload compiles no attention kernel.

(On a CPU the same claim is checked key for key against Triton's cache keys, for sm80 and
sm90, by kernels/warmup_coverage.py in test_compile_check.py.)
"""

import random

import pytest
import torch
from engine_launches import MODELS
from triton import knobs
from warmup_coverage import step_args, workload

from pagedserve.kernels.paged_attention import paged_attention_triton
from pagedserve.kernels.warmup import paged_attention_warmup


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("model", MODELS[:3], ids=lambda m: m.name)
def test_serving_compiles_nothing_after_the_warm_up(model):
    max_model_len, dtype = 8192, torch.bfloat16
    m = model
    assert (
        paged_attention_warmup(
            m.n_q_heads, m.n_kv_heads, m.head_dim, dtype, 16, max_model_len, "cuda"
        )
        >= 2
    )
    compiled = []
    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = lambda *, fn, **_: compiled.append(fn.name)  # then compiles
    try:
        for seqs in workload(random.Random(1), 256, max_model_len):
            paged_attention_triton(*step_args(m, seqs, dtype, 16, "cuda"))
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_cache_hook = previous
    assert compiled == []
