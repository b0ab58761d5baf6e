"""Kernel micro-benchmarks: one table, time and achieved bandwidth (or FLOP/s) per kernel.

Run from the repo root: ``PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python kernels/bench.py``.
MLA's decode runs DeepSeek-V3's shape on one rank of 8 (16 heads over 576-value latents).
On CUDA: Triton vs the torch reference, and Triton's bandwidth as a share of the device's
copy bandwidth measured here with a torch copy. On CPU: the reference only (it is the CPU
engine's hot path; the interpreter is not worth timing). Workload: Llama-3-8B-like shapes
in bf16 on CUDA, SmolLM2-135M-like shapes in fp32 on CPU; seed 0.
Not a test (pytest collects test_*.py only).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from pagedserve.kernels.gelu_tanh import gelu_tanh_ref, gelu_tanh_triton
from pagedserve.kernels.layer_norm import layer_norm_ref, layer_norm_triton
from pagedserve.kernels.mla_decode import mla_paged_decode_ref, mla_paged_decode_triton
from pagedserve.kernels.paged_attention import paged_attention_ref, paged_attention_triton
from pagedserve.kernels.quick_gelu import quick_gelu_ref, quick_gelu_triton
from pagedserve.kernels.rms_norm import rms_norm_ref, rms_norm_triton
from pagedserve.kernels.rotary_embedding import rotary_embedding_ref, rotary_embedding_triton
from pagedserve.kernels.sampling import sample_tokens_ref, sample_tokens_triton
from pagedserve.kernels.silu_and_mul import silu_and_mul_ref, silu_and_mul_triton
from pagedserve.kernels.store_kv import store_kv_ref, store_kv_triton
from pagedserve.kernels.testing import make_paged_batch

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@dataclass
class Model:
    hidden: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype: torch.dtype


MODEL = (
    Model(4096, 32, 8, 128, 14336, 128256, torch.bfloat16)
    if CUDA
    else Model(576, 9, 3, 64, 1536, 49152, torch.float32)
)


def time_ms(fn: Callable[[], object]) -> float:
    """Median wall time of one call, in ms."""
    if CUDA:
        import triton.testing

        return triton.testing.do_bench(fn, warmup=10, rep=50)
    fn()
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - start) * 1e3)
    return statistics.median(runs)


def copy_bandwidth_gbs() -> float:
    """The device's practical bandwidth: a large tensor copy (read + write)."""
    src = torch.empty(256 * 2**20 if CUDA else 32 * 2**20, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    return 2 * src.numel() / time_ms(lambda: dst.copy_(src)) / 1e6


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def cases():
    """(name, workload, triton fn or None, ref fn, bytes moved, flops)."""
    m, dt = MODEL, MODEL.dtype
    tokens = 2048 if CUDA else 256
    x = torch.randn(tokens, m.hidden, device=DEVICE, dtype=dt)
    w = torch.randn(m.hidden, device=DEVICE, dtype=dt)
    yield (
        "rms_norm+residual",
        f"{tokens}x{m.hidden}",
        rms_norm_triton,
        rms_norm_ref,
        (x, w, 1e-6, x.clone()),
        5 * nbytes(x),
        0,
    )
    yield (
        "layer_norm",
        f"{tokens}x{m.hidden}",
        layer_norm_triton,
        layer_norm_ref,
        (x, w, w, 1e-5),
        2 * nbytes(x),
        0,
    )
    yield from activation_cases(tokens)
    q = torch.randn(tokens, m.n_q_heads, m.head_dim, device=DEVICE, dtype=dt)
    k = torch.randn(tokens, m.n_kv_heads, m.head_dim, device=DEVICE, dtype=dt)
    pos = torch.arange(tokens, device=DEVICE)
    cache = torch.randn(8192, m.head_dim, device=DEVICE)
    yield (
        "rotary (neox)",
        f"{tokens} tok",
        rotary_embedding_triton,
        rotary_embedding_ref,
        (pos, q, k, cache),
        2 * nbytes(q, k),
        0,
    )
    kv_cache = torch.zeros(4 * tokens // 16, 16, m.n_kv_heads, m.head_dim, device=DEVICE, dtype=dt)
    slots = torch.randperm(kv_cache.shape[0] * 16, device=DEVICE)[:tokens]
    yield (
        "store_kv",
        f"{tokens} tok",
        store_kv_triton,
        store_kv_ref,
        (k, k, kv_cache, kv_cache.clone(), slots),
        4 * nbytes(k),
        0,
    )
    yield from attention_cases()
    yield from mla_cases()
    n = 64 if CUDA else 8
    logits = torch.randn(n, m.vocab, device=DEVICE)
    params = (torch.full((n,), 0.8, device=DEVICE), torch.full((n,), 50, device=DEVICE, dtype=torch.int32),
              torch.full((n,), 0.9, device=DEVICE), torch.full((n,), 0.05, device=DEVICE))  # fmt: skip
    noise = torch.empty_like(logits).exponential_()
    yield (
        "sample (k+p+min_p)",
        f"{n}x{m.vocab}",
        sample_tokens_triton,
        sample_tokens_ref,
        (logits, *params, noise),
        3 * nbytes(logits),
        0,
    )


def activation_cases(tokens: int):
    """The MLP activations over ``tokens`` rows of the intermediate size: the gated one (its
    input gate and up side by side) and the plain GELUs (GPT-2's tanh form, CLIP's QuickGELU)."""
    m = MODEL
    gate_up = torch.randn(tokens, 2 * m.intermediate, device=DEVICE, dtype=m.dtype)
    yield (
        "silu_and_mul",
        f"{tokens}x2x{m.intermediate}",
        silu_and_mul_triton,
        silu_and_mul_ref,
        (gate_up,),
        1.5 * nbytes(gate_up),
        0,
    )
    x = gate_up[:, : m.intermediate].contiguous()
    for name, triton_fn, ref_fn in (
        ("gelu_tanh", gelu_tanh_triton, gelu_tanh_ref),
        ("quick_gelu", quick_gelu_triton, quick_gelu_ref),
    ):
        yield (name, f"{tokens}x{m.intermediate}", triton_fn, ref_fn, (x,), nbytes(gate_up), 0)


def attention_cases():
    m, dt = MODEL, MODEL.dtype
    shapes = {
        "decode": ([(4096, 1)] * 64 if CUDA else [(512, 1)] * 16),
        "decode long": ([(32768, 1)] * 4 if CUDA else [(4096, 1)] * 2),
        "prefill": ([(2048, 2048)] * 4 if CUDA else [(512, 512)]),
        "chunk/prefix": ([(4096, 512)] * 4 if CUDA else [(1024, 128)] * 2),
    }
    for name, seqs in shapes.items():
        b = make_paged_batch(seqs, m.n_q_heads, m.n_kv_heads, m.head_dim, 16, dt, DEVICE)
        kv_bytes = (
            sum(s for s, _ in seqs) * 2 * m.n_kv_heads * m.head_dim * b.k_cache.element_size()
        )
        flops = sum(4 * q * (s - q / 2) * m.n_q_heads * m.head_dim for s, q in seqs)
        work = f"B={len(seqs)} ctx={seqs[0][0]} q={seqs[0][1]}"
        yield (
            f"paged_attention {name}",
            work,
            paged_attention_triton,
            paged_attention_ref,
            b.args(),
            kv_bytes,
            flops,
        )


def mla_cases():
    """MLA's absorbed decode over the latent cache, DeepSeek-V3's shape on one rank of 8 (16
    heads, kv_lora_rank 512 + rope 64); on CPU a smaller batch. Bytes: the latents read once."""
    heads, kv_lora_rank, width = 16, 512, 576
    shapes = {
        "decode": ([(4096, 1)] * 64 if CUDA else [(512, 1)] * 16),
        "decode long": ([(32768, 1)] * 4 if CUDA else [(4096, 1)] * 2),
    }
    for name, seqs in shapes.items():
        b = make_paged_batch(seqs, heads, 1, width, 16, MODEL.dtype, DEVICE)
        args = (b.query, b.k_cache, b.block_tables, b.seq_lens, 192**-0.5, kv_lora_rank)
        context = sum(s for s, _ in seqs)
        yield (
            f"mla_paged_decode {name}",
            f"B={len(seqs)} ctx={seqs[0][0]} H={heads}",
            mla_paged_decode_triton,
            mla_paged_decode_ref,
            args,
            context * width * b.k_cache.element_size(),
            2 * (width + kv_lora_rank) * heads * context,
        )


def main() -> None:
    torch.manual_seed(0)
    peak = copy_bandwidth_gbs()
    print(f"device: {torch.cuda.get_device_name() if CUDA else 'cpu'}  dtype: {MODEL.dtype}  "
          f"threads: {torch.get_num_threads()}  model shapes: {MODEL}  copy bandwidth: {peak:.0f} GB/s")  # fmt: skip
    head = f"{'kernel':<28}{'workload':<26}{'ref ms':>9}{'triton ms':>11}{'speedup':>9}{'GB/s':>8}{'% copy':>8}{'TFLOP/s':>9}"
    print(head + "\n" + "-" * len(head))
    for name, work, triton_fn, ref_fn, args, moved, flops in cases():
        ref_ms = time_ms(partial(ref_fn, *args))
        ms = time_ms(partial(triton_fn, *args)) if CUDA else ref_ms
        tri = f"{ms:11.3f}{ref_ms / ms:8.2f}x" if CUDA else f"{'-':>11}{'-':>9}"
        gbs = moved / ms / 1e6
        tflops = f"{flops / ms / 1e9:9.2f}" if flops else f"{'-':>9}"
        print(f"{name:<28}{work:<26}{ref_ms:9.3f}{tri}{gbs:8.0f}{100 * gbs / peak:7.0f}%{tflops}")


if __name__ == "__main__":
    main()
