"""The fused CPU decoder layer (pagedserve.kernels.cpu.decoder_layer) against the layer composed
of the PyTorch references: rms_norm_ref, F.linear, rotary_embedding_ref, store_kv_ref,
paged_attention_ref and silu_and_mul_ref, in the order LlamaDecoderLayer calls them.

One varlen step of two decode rows and a 5-token chunk over a cached prefix, on caches whose
unused slots hold NaN (a read past a sequence would poison its row), with and without a qkv
bias and a sliding window, on one thread and on two (weights large enough to be shared out).
The stored keys and values are checked too, and every slot the step does not write must be
left as it was.
"""

import pytest
import torch
import torch.nn.functional as F
from tolerances import GEMM_FP32_ATOL, TOLERANCES

from pagedserve.kernels.cpu import decoder_layer as fused
from pagedserve.kernels.cpu.paged_attention import NUMBA_MAX_Q_LEN
from pagedserve.kernels.cpu.paged_attention_plan import step_plan
from pagedserve.kernels.paged_attention_ref import paged_attention_ref
from pagedserve.kernels.rms_norm import rms_norm_ref
from pagedserve.kernels.rotary_embedding import rotary_embedding_ref
from pagedserve.kernels.silu_and_mul import silu_and_mul_ref
from pagedserve.kernels.store_kv import store_kv_ref

BLOCK, BLOCKS = 8, 24
N_CACHED = [19, 36, 11]  # positions each sequence has in the cache before the step
Q_LENS = [1, 1, 5]  # its new tokens: two decodes and a chunk


def _close(actual: torch.Tensor, expected: torch.Tensor, cache_dtype=torch.float32) -> None:
    """Four GEMMs and an attention deep, each summing in another order than its reference:
    the suite's GEMM atol, and the same relative tolerance for the larger values; with a
    16-bit cache, that dtype's tolerance (a key a float rounding apart may round to the
    neighbouring 16-bit value)."""
    assert not actual.isnan().any(), "NaN in the fused layer's output"
    atol = rtol = GEMM_FP32_ATOL
    if cache_dtype != torch.float32:
        atol, rtol = TOLERANCES[cache_dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def _layer(g, hidden, heads, kv_heads, head_dim, inter, bias):
    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    qkv = (heads + 2 * kv_heads) * head_dim
    return dict(
        norms=((1 + rand(hidden, scale=0.1), 1e-5), (1 + rand(hidden, scale=0.1), 1e-6)),
        linears=(
            rand(qkv, hidden, scale=hidden**-0.5),
            rand(hidden, heads * head_dim, scale=(heads * head_dim) ** -0.5),
            rand(2 * inter, hidden, scale=hidden**-0.5),
            rand(hidden, inter, scale=inter**-0.5),
        ),
        qkv_bias=rand(qkv, scale=0.5) if bias else None,
        heads=(heads, kv_heads, head_dim),
    )


def _step(g, kv_heads, head_dim, cache_dtype=torch.float32):
    """Block tables, lengths, slots and positions of the step; caches with the cached prefix
    in place and NaN everywhere else."""
    order = torch.randperm(BLOCKS, generator=g).to(torch.int32)
    seq_lens = torch.tensor([c + q for c, q in zip(N_CACHED, Q_LENS)], dtype=torch.int32)
    width = -(-int(seq_lens.max()) // BLOCK)
    tables = torch.stack([order[i * width : (i + 1) * width] for i in range(len(Q_LENS))])
    caches = [
        torch.full((BLOCKS, BLOCK, kv_heads, head_dim), float("nan"), dtype=cache_dtype)
        for _ in range(2)
    ]
    positions, slots = [], []
    for b, (cached, q) in enumerate(zip(N_CACHED, Q_LENS)):
        for pos in range(cached + q):
            block, offset = int(tables[b, pos // BLOCK]), pos % BLOCK
            if pos < cached:
                for cache in caches:
                    cache[block, offset] = torch.randn(kv_heads, head_dim, generator=g).to(
                        cache_dtype
                    )
            else:
                positions.append(pos)
                slots.append(block * BLOCK + offset)
    starts = torch.tensor([0, *torch.tensor(Q_LENS).cumsum(0).tolist()], dtype=torch.int32)
    return dict(
        block_tables=tables, seq_lens=seq_lens, query_start_loc=starts, caches=caches,
        positions=torch.tensor(positions), slots=torch.tensor(slots),
    )  # fmt: skip


def _reference(x, residual, layer, cos_sin, step, caches, window):
    """LlamaDecoderLayer.forward on the references (the layer's residual convention)."""
    (w_in, eps_in), (w_post, eps_post) = layer["norms"]
    w_qkv, w_o, w_gate_up, w_down = layer["linears"]
    heads, kv_heads, head_dim = layer["heads"]
    if residual is None:
        residual, h = x, rms_norm_ref(x, w_in, eps_in)
    else:
        h, residual = rms_norm_ref(x, w_in, eps_in, residual)
    q, k, v = F.linear(h, w_qkv, layer["qkv_bias"]).split(
        [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1
    )
    q = q.reshape(-1, heads, head_dim).clone()
    k = k.reshape(-1, kv_heads, head_dim).clone()
    rotary_embedding_ref(step["positions"], q, k, cos_sin)
    v = v.reshape(-1, kv_heads, head_dim)
    store_kv_ref(k, v, caches[0], caches[1], step["slots"])
    a = paged_attention_ref(
        q, caches[0], caches[1], step["block_tables"], step["seq_lens"], step["query_start_loc"],
        head_dim**-0.5, sliding_window=window,
    )  # fmt: skip
    h, residual = rms_norm_ref(F.linear(a.reshape(len(q), -1), w_o), w_post, eps_post, residual)
    return F.linear(silu_and_mul_ref(F.linear(h, w_gate_up)), w_down), residual


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("first_layer", [False, True])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fused_layer_matches_the_references(threads, bias, window, first_layer, cache_dtype):
    g = torch.Generator().manual_seed(threads + 2 * bias + 4 * bool(window))
    # hidden 256, 8 query heads and 2 KV heads of 32, MLP 512: gate_up is 1024 x 256, at
    # PARALLEL_FROM_WEIGHTS, so two threads share it out; the others stay in one thread
    layer = _layer(g, 256, 8, 2, 32, 512, bias)
    step = _step(g, 2, 32, cache_dtype)
    cos_sin = torch.randn(64, 32, generator=g)
    x = torch.randn(sum(Q_LENS), 256, generator=g)
    residual = None if first_layer else torch.randn(sum(Q_LENS), 256, generator=g)
    weights = fused.DecoderLayerWeights.of(
        layer["norms"], layer["linears"], layer["qkv_bias"], layer["heads"], (cos_sin, True),
        (32**-0.5, window, None),
    )  # fmt: skip
    plan = step_plan(
        step["block_tables"], step["seq_lens"], step["query_start_loc"], NUMBA_MAX_Q_LEN,
        None, window or 0,
    )  # fmt: skip
    ours_caches = [c.clone() for c in step["caches"]]
    assert fused.supports(x, ours_caches, plan)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)  # the kernels follow torch's count
    try:
        out, new_residual = fused.decoder_layer_numba(
            x, residual, weights, step["positions"], ours_caches, step["slots"], plan
        )
    finally:
        torch.set_num_threads(saved)
    ref_caches = [c.clone() for c in step["caches"]]
    ref_out, ref_residual = _reference(x, residual, layer, cos_sin, step, ref_caches, window)
    _close(out, ref_out, cache_dtype)
    _close(new_residual, ref_residual, cache_dtype)
    for ours, ref in zip(ours_caches, ref_caches, strict=True):
        assert ours.dtype == cache_dtype
        assert torch.equal(ours.isnan(), ref.isnan())  # the same slots written, no others
        _close(ours.nan_to_num(0.0), ref.nan_to_num(0.0), cache_dtype)
