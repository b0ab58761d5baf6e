"""The launches vision-language models add to a serving engine's (engine_launches.py): a
CLIP tower's norms and QuickGELU (LLaVA), the rotary kernel's M-RoPE variants (Qwen2-VL's text
layers and its tower's 2-D rotary), and paged attention with per-row key limits (Gemma 3's
images read both ways)."""

from __future__ import annotations

from collections.abc import Callable
from itertools import product

import torch
from engine_launches import attention_steps, launch_wrappers

from pagedserve.kernels.testing import make_paged_batch

# LLaVA-1.5's vision tower, CLIP ViT-L/14 at 336 pixels: (name, rows an image, hidden,
# intermediate).
VISION_SHAPE = ("clip-vit-l14-336", 577, 1024, 4096)
# M-RoPE (Qwen2-VL / Qwen2.5-VL): (name, q heads, kv heads, head_dim, mrope_section). The
# text model's [3, T] positions turn three sections of pairs; the vision tower's 2-D rotary
# turns two (h, w) over all 80 dims of its MHA heads.
MROPE_SHAPES = [
    ("qwen2-vl-2b", 12, 2, 128, (16, 24, 24)),
    ("qwen2-vl-vision", 16, 16, 80, (20, 20)),
]

# Gemma 3's vision-language prefill: an image's tokens attend to the whole image (paged
# attention's ``key_limits``), in its global and its sliding-window layers. (name, q heads, kv
# heads, head_dim, window, batch-invariant mode too?): the 4B's 256-dim heads (the 12B's too)
# and the 27B's 128. The batch-invariant tile of 256-dim heads spills on sm90 with or without
# key limits (20-24 bytes: attention_launch.batch_invariant_tile_shape), so that mode is
# launched for the 27B's heads only.
KEY_LIMITS_SHAPES = [("gemma3-4b", 8, 4, 256, 1024, False), ("gemma3-27b", 32, 16, 128, 1024, True)]


def vision_launches(dtype: torch.dtype, record: Callable, label: str) -> None:
    """A CLIP vision tower's own launches over an image's rows (LLaVA's): its LayerNorms and
    QuickGELU. Its attention is torch's SDPA, and its projector's exact GELU is the encoders'
    launch (encoder_launches)."""
    mods = launch_wrappers()
    name, rows, hidden, intermediate = VISION_SHAPE
    x, weight = torch.randn(rows, hidden).to(dtype), torch.randn(hidden).to(dtype)
    mods["layer_norm"].layer_norm_triton(x, weight, weight.clone(), 1e-5)
    mods["quick_gelu"].quick_gelu_triton(torch.randn(rows, intermediate).to(dtype))
    record(f"{name} {label}")


def mrope_launches(dtype: torch.dtype, record: Callable, label: str, n_tokens: int = 3) -> None:
    """The rotary kernel's M-RoPE variants (NUM_SECTIONS 3 and 2) on views of a fused qkv
    output, as Qwen2-VL's text layers and vision tower launch them."""
    mods = launch_wrappers()
    for name, n_q, n_kv, head_dim, section in MROPE_SHAPES:
        qkv = torch.randn(n_tokens, n_q + 2 * n_kv, head_dim).to(dtype)
        q, k = qkv[:, :n_q], qkv[:, n_q : n_q + n_kv]
        positions = torch.arange(n_tokens).expand(len(section), -1)
        cos_sin = torch.randn(64, 2 * sum(section))
        mods["rotary_embedding"].rotary_embedding_triton(
            positions, q, k, cos_sin, True, mrope_section=section
        )
        record(f"{name} {label} mrope")


def causal_key_limits(batch) -> torch.Tensor:
    """Each new token's position + 1 (int32 ``[T]``): key limits as a step without an image
    has them. Only their dtype and shape decide what compiles."""
    starts, lens = batch.query_start_loc.long(), batch.seq_lens.long()
    q_lens = starts[1:] - starts[:-1]
    first = torch.repeat_interleave(lens - q_lens - starts[:-1], q_lens)  # position - row
    return (first + torch.arange(batch.query.shape[0]) + 1).to(torch.int32)


def key_limits_launches(dtype: torch.dtype, block_size: int, record: Callable, label: str):
    """Paged attention with a key limit per row (``KEY_LIMITS_SHAPES``' layers) for every step
    shape, global and windowed, as launched and in the batch-invariant mode: the KEY_LIMITS
    variants of each tile, split and fold."""
    mods = launch_wrappers()
    for name, n_q_heads, n_kv_heads, head_dim, window, invariant_too in KEY_LIMITS_SHAPES:
        modes = (False, True) if invariant_too else (False,)
        for step, seqs in attention_steps(block_size).items():
            batch = make_paged_batch(seqs, n_q_heads, n_kv_heads, head_dim, block_size, dtype)
            limits = causal_key_limits(batch)
            for layer, invariant in product(({}, {"sliding_window": window}), modes):
                mods["paged_attention"].paged_attention_triton(
                    *batch.args(), batch_invariant=invariant, key_limits=limits, **layer
                )
                mode = (" window" if layer else "") + (" batch-invariant" if invariant else "")
                record(f"{name} {label} bs{block_size} {step} key-limits{mode}")


def vision_language_launches(dtype: torch.dtype, sizes: list[int], record: Callable, label: str):
    """Every launch of this module for one dtype and its block sizes."""
    vision_launches(dtype, record, label)
    mrope_launches(dtype, record, label)
    for block_size in sizes:
        key_limits_launches(dtype, block_size, record, label)
