"""Write the new tokens' latents into multi-head latent attention's paged cache.

MLA (DeepSeek-V2/V3) caches one vector per token and layer, shared by every head: the
normalised compressed KV ``kv_c [kv_lora_rank]`` followed by the rotated shared key
``k_pe [rope_dim]``. The cache is ``[num_blocks, block_size, 1, kv_lora_rank + rope_dim]``;
token t goes to slot ``s = slot_mapping[t] = block_id * block_size + offset``, row ``s`` of the
cache viewed as ``[num_blocks * block_size, kv_lora_rank + rope_dim]``. A slot of -1 is
padding and is skipped. The two parts are written side by side, so the model never builds
their concatenation (vLLM's ``concat_and_cache_mla``).

Invariant: the valid slots of one call are distinct, so the order of the writes does not
matter (as for ``store_kv``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.dispatch import use_triton


@triton.jit
def _store_latent_kernel(
    kv_c_ptr, k_pe_ptr, cache_ptr, slot_mapping_ptr,
    kv_c_token_stride, k_pe_token_stride, cache_slot_stride, kv_lora_rank, rope_dim,
    BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    lat = tl.arange(0, BLOCK_L)
    rope = tl.arange(0, BLOCK_R)
    # A padding slot (-1) is clamped to 0 so no address is negative; the masks drop it.
    keep_l = (lat < kv_lora_rank) & ((lat * 0 + slot) >= 0)
    keep_r = (rope < rope_dim) & ((rope * 0 + slot) >= 0)
    row = cache_ptr + tl.maximum(slot, 0) * cache_slot_stride
    kv_c = tl.load(kv_c_ptr + token * kv_c_token_stride + lat, mask=keep_l)
    k_pe = tl.load(k_pe_ptr + token * k_pe_token_stride + rope, mask=keep_r)
    tl.store(row + lat, kv_c.to(cache_ptr.dtype.element_ty), mask=keep_l)
    tl.store(row + kv_lora_rank + rope, k_pe.to(cache_ptr.dtype.element_ty), mask=keep_r)


def store_latent_triton(
    kv_c: torch.Tensor, k_pe: torch.Tensor, latent_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Launch wrapper: one program per new token copies its two parts into its slot."""
    kv_c, k_pe = _check(kv_c, k_pe, latent_cache, slot_mapping)
    n_tokens, kv_lora_rank = kv_c.shape
    if n_tokens == 0:
        return
    rope_dim = k_pe.shape[1]
    _store_latent_kernel[(n_tokens,)](
        kv_c, k_pe, latent_cache, slot_mapping.contiguous(),
        kv_c.stride(0), k_pe.stride(0), latent_cache.stride(1), kv_lora_rank, rope_dim,
        BLOCK_L=triton.next_power_of_2(kv_lora_rank), BLOCK_R=triton.next_power_of_2(rope_dim),
    )  # fmt: skip


def _check(kv_c, k_pe, latent_cache, slot_mapping) -> tuple[torch.Tensor, torch.Tensor]:
    """The shapes every implementation accepts; returns ``kv_c [T, L]`` and ``k_pe [T, R]``
    with unit stride along their features (``k_pe`` may come as ``[T, 1, R]``)."""
    if k_pe.dim() == 3 and k_pe.shape[1] == 1:
        k_pe = k_pe[:, 0]
    if kv_c.dim() != 2 or k_pe.dim() != 2 or kv_c.shape[0] != k_pe.shape[0]:
        raise ValueError(
            f"store_latent: kv_c {tuple(kv_c.shape)} must be [T, L] and k_pe "
            f"{tuple(k_pe.shape)} [T, R] (or [T, 1, R])"
        )
    width = kv_c.shape[1] + k_pe.shape[1]
    if latent_cache.dim() != 4 or latent_cache.shape[2:] != (1, width):
        raise ValueError(
            f"store_latent: cache {tuple(latent_cache.shape)} must be [num_blocks, block_size, "
            f"1, {width}] for {kv_c.shape[1]} latent and {k_pe.shape[1]} rope features"
        )
    if not latent_cache.is_contiguous():
        raise ValueError("store_latent: the latent cache must be contiguous")
    if slot_mapping.shape != (kv_c.shape[0],):
        raise ValueError(f"store_latent: slot_mapping {tuple(slot_mapping.shape)} != (T,)")
    kv_c = kv_c if kv_c.stride(-1) == 1 else kv_c.contiguous()
    return kv_c, (k_pe if k_pe.stride(-1) == 1 else k_pe.contiguous())


def store_latent_ref(
    kv_c: torch.Tensor, k_pe: torch.Tensor, latent_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Reference: the two parts side by side, one indexed copy into the rows of slots."""
    kv_c, k_pe = _check(kv_c, k_pe, latent_cache, slot_mapping)
    slots = slot_mapping.long()
    valid = slots >= 0
    if not bool(valid.all()):
        slots, kv_c, k_pe = slots[valid], kv_c[valid], k_pe[valid]
    rows = torch.cat([kv_c, k_pe], dim=-1).to(latent_cache.dtype)
    latent_cache.view(-1, rows.shape[-1]).index_copy_(0, slots, rows)


def store_latent(
    kv_c: torch.Tensor, k_pe: torch.Tensor, latent_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``kv_c [T, L]`` and ``k_pe [T, R]`` (or ``[T, 1, R]``) at ``slot_mapping [T]``
    (-1 = skip) of ``latent_cache [num_blocks, block_size, 1, L + R]``, in place. Triton on
    CUDA and under TRITON_INTERPRET=1, the reference elsewhere (one indexed copy: nothing a
    numba loop would save)."""
    if use_triton(kv_c):
        store_latent_triton(kv_c, k_pe, latent_cache, slot_mapping)
    else:
        store_latent_ref(kv_c, k_pe, latent_cache, slot_mapping)
