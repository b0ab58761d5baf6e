"""The vision tower of Qwen2-VL and Qwen2.5-VL: a ViT that reads images at their own resolution.

CLIP (clip.py) reads every image as one fixed square. Qwen2-VL does not: the processor resizes
each image only to a multiple of ``patch_size * spatial_merge_size`` pixels on each side (its
pixel count kept between ``min_pixels`` and ``max_pixels``), so a wide image stays wide and a
small one stays small. The image then costs as many rows as it has patches. What the tower
receives is already cut up: ``pixel_values [P, C * temporal_patch_size * p * p]``, one row per
patch (an image is its frame repeated ``temporal_patch_size`` times, so the same patch embedding
reads videos), all images of a batch one after another, and ``grid_thw [N, 3]``, each image's
(frames, patch rows, patch columns). The processor lists each image's patches 2x2 block by 2x2
block (``spatial_merge_size`` 2), not row by row, so that the four patches of a block are
consecutive rows.

The layers:

- Patch embedding: a 3-D convolution whose stride is its kernel, so one linear map of each row.
- Blocks: pre-norm attention then MLP. Attention is bidirectional within one image (one frame)
  only: the batch is one varlen sequence list (``cu_seqlens``), read by ``encoder_attention``.
- 2-D rotary: with no fixed grid there is no table of learned positions; instead each head's
  pairs are cut in two halves, the first turned by the patch's row, the second by its column
  (M-RoPE with two sections, ``mrope_section = (head_dim/4, head_dim/4)``), so attention scores
  depend on the vertical and horizontal offset between two patches.
- Patch merger: each 2x2 block's four rows are normed and concatenated, and a two-layer MLP maps
  them to one row of the decoder's width: an image of P patches becomes P/4 decoder tokens.

Qwen2.5-VL changes three things: RMSNorm for LayerNorm, a gated SiLU MLP (``gate_proj``,
``up_proj``, ``down_proj``) for fc1/act/fc2, and window attention. A large image has thousands
of patches and full attention is quadratic in them, so all but the ``fullatt_block_indexes``
layers attend only within windows of ``window_size`` pixels (``window_size / patch_size /
spatial_merge_size`` merged tokens a side; edge windows smaller). To make each window a
contiguous varlen sequence, the patches are reordered window by window (whole 2x2 blocks move
together) before the first layer and the merger's output is put back in image order after it.
Full-attention layers read each image whole in the same reordered rows: attention does not care
about row order, and each row carries its own rotary positions.

The variant comes from ``vision_config["model_type"]`` (``qwen2_vl_vision`` /
``qwen2_5_vl_vision``, or the top-level names that older checkpoints put there), else from the
keys only Qwen2.5-VL has; a caller that knows it passes ``variant``. Weights load by the
tower's own checkpoint names (``patch_embed.proj.weight``, ``blocks.N.attn.qkv.weight``,
``merger.mlp.0.weight``, ...), the ``visual.`` / ``model.visual.`` prefix already stripped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedserve.kernels import gelu, rotary_embedding, silu_and_mul
from pagedserve.kernels.encoder_attention import encoder_attention
from pagedserve.kernels.linear import linear
from pagedserve.models.clip import activation
from pagedserve.models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedserve.models.layers.norm import LayerNorm, RMSNorm
from pagedserve.models.weights import CheckpointTensor, load_stacked_weights

VARIANTS = ("qwen2_vl", "qwen2_5_vl")
_VARIANT_OF_MODEL_TYPE = {
    "qwen2_vl_vision": "qwen2_vl", "qwen2_vl": "qwen2_vl",
    "qwen2_5_vl_vision": "qwen2_5_vl", "qwen2_5_vl": "qwen2_5_vl",
}  # fmt: skip
_NORM_EPS = 1e-6  # every norm of both towers; not in the config


def tower_variant(vision_config: dict[str, Any], variant: str | None = None) -> str:
    """``variant`` if given, else the one ``vision_config`` names (its model_type, else the
    window keys only Qwen2.5-VL's tower has)."""
    if variant is None:
        model_type = vision_config.get("model_type")
        if model_type in _VARIANT_OF_MODEL_TYPE:
            variant = _VARIANT_OF_MODEL_TYPE[model_type]
        elif model_type is not None:
            raise ValueError(
                f"vision_config.model_type = {model_type!r} is not a Qwen2-VL / Qwen2.5-VL tower "
                f"(one of {sorted(_VARIANT_OF_MODEL_TYPE)})"
            )
        else:
            windowed = "fullatt_block_indexes" in vision_config
            variant = "qwen2_5_vl" if windowed else "qwen2_vl"
    if variant not in VARIANTS:
        raise ValueError(f"variant = {variant!r} is not one of {VARIANTS}")
    return variant


@dataclass
class VisionAttentionMetadata:
    """What one forward's attention layers read: each patch's (row, column) ``positions
    [2, P]``, the rotary ``cos_sin_cache``, and the varlen sequences (``cu_seqlens`` int32
    ``[S + 1]``, the longest ``max_seq_len``): frames, or windows."""

    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seq_len: int


def patch_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """``[2, P]``: each patch's (row, column) in its frame, in the processor's order (frame by
    frame, ``merge x merge`` blocks row by row, the patches of a block row by row)."""
    per_image = []
    for t, h, w in grid_thw.tolist():
        rows = torch.arange(h).view(h // merge, 1, merge, 1).expand(-1, w // merge, -1, merge)
        cols = torch.arange(w).view(1, w // merge, 1, merge).expand(h // merge, -1, merge, -1)
        per_image.append(torch.stack([rows.flatten(), cols.flatten()]).repeat(1, t))
    return torch.cat(per_image, dim=1)


def frame_seqlens(grid_thw: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(cu_seqlens, max_seq_len)`` with one sequence per frame of each image."""
    lengths = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    return cu, int(lengths.max())


def window_partition(
    grid_thw: torch.Tensor, merge: int, window_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(order, cu_seqlens, max_seq_len)`` of window attention, in merged tokens (``merge x
    merge`` patch blocks): ``order[i]`` is the block that goes i-th when the blocks are listed
    window by window (windows row by row in each frame, blocks row by row in each window);
    ``cu_seqlens`` cuts the reordered patches into windows of ``window_tokens`` blocks a side
    (fewer at the right and bottom edges)."""
    orders, lengths, offset = [], [], 0
    side = window_tokens
    for t, h, w in grid_thw.tolist():
        mh, mw = h // merge, w // merge
        across, down = -(-mw // side), -(-mh // side)
        frame = torch.arange(t).view(t, 1, 1)
        i, j = torch.arange(mh).view(1, mh, 1), torch.arange(mw).view(1, 1, mw)
        window = (frame * down + i // side) * across + j // side  # [t, mh, mw]
        inside = (i % side) * side + j % side
        orders.append(torch.argsort((window * side * side + inside).flatten()) + offset)
        lengths.append(torch.bincount(window.flatten(), minlength=t * down * across))
        offset += t * mh * mw
    blocks = torch.cat(lengths) * merge * merge
    cu = torch.zeros(len(blocks) + 1, dtype=torch.int32)
    cu[1:] = blocks.cumsum(0)
    return torch.cat(orders), cu, int(blocks.max())


class VisionAttention(nn.Module):
    """Multi-head attention within each sequence of the metadata, with 2-D rotary."""

    def __init__(self, dim: int, num_heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = QKVParallelLinear(
            dim, self.head_dim, num_heads, num_heads, bias=True, dtype=dtype
        )
        self.proj = RowParallelLinear(dim, dim, bias=True, dtype=dtype)
        self.mrope_section = (self.head_dim // 4, self.head_dim // 4)

    def forward(self, x: torch.Tensor, meta: VisionAttentionMetadata) -> torch.Tensor:
        qkv = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(1)
        q, k = rotary_embedding(
            meta.positions, q, k, meta.cos_sin_cache, True, mrope_section=self.mrope_section
        )
        out = encoder_attention(q, k, v, meta.cu_seqlens, meta.max_seq_len, self.head_dim**-0.5)
        return self.proj(out.reshape(x.shape[0], -1))


class VisionMLP(nn.Module):
    """Qwen2-VL's: ``fc2(act(fc1 x))``, ``act`` the config's ``hidden_act``."""

    def __init__(self, dim: int, inter: int, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(dim, inter, bias=True, dtype=dtype)
        self.act = activation(act, "vision_config.hidden_act")
        self.fc2 = RowParallelLinear(inter, dim, bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionGatedMLP(nn.Module):
    """Qwen2.5-VL's: ``down(silu(gate x) * up x)``, gate and up fused into one GEMM."""

    def __init__(self, dim: int, inter: int, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        if act != "silu":
            raise ValueError(f"vision_config.hidden_act = {act!r}: Qwen2.5-VL's tower runs silu")
        self.gate_up_proj = MergedColumnParallelLinear(dim, [inter, inter], bias=True, dtype=dtype)
        self.down_proj = RowParallelLinear(inter, dim, bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class VisionBlock(nn.Module):
    def __init__(self, c: dict[str, Any], windowed: bool, dtype: torch.dtype) -> None:
        super().__init__()
        norm = RMSNorm if windowed else LayerNorm
        if windowed:
            dim, inter, mlp = c["hidden_size"], c["intermediate_size"], VisionGatedMLP
        else:
            dim, mlp = c["embed_dim"], VisionMLP
            inter = int(dim * c.get("mlp_ratio", 4))
        act = c.get("hidden_act", "silu" if windowed else "quick_gelu")
        self.norm1 = norm(dim, _NORM_EPS, dtype)
        self.attn = VisionAttention(dim, c["num_heads"], dtype)
        self.norm2 = norm(dim, _NORM_EPS, dtype)
        self.mlp = mlp(dim, inter, act, dtype)

    def forward(self, x: torch.Tensor, meta: VisionAttentionMetadata) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), meta)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each ``merge x merge`` block's rows, normed and concatenated, through
    ``fc2(gelu(fc1 x))`` (exact GELU) to the decoder's width."""

    def __init__(self, dim: int, out: int, unit: int, windowed: bool, dtype) -> None:
        super().__init__()
        self.width = dim * unit
        self.ln_q = (RMSNorm if windowed else LayerNorm)(dim, _NORM_EPS, dtype)
        self.fc1 = ColumnParallelLinear(self.width, self.width, bias=True, dtype=dtype)
        self.fc2 = RowParallelLinear(self.width, out, bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(gelu(self.fc1(self.ln_q(x).view(-1, self.width))))


class Qwen2VisionTransformer(nn.Module):
    """``forward(pixel_values, grid_thw)``: the processor's patch rows of N images in, their
    decoder rows out (``t * h * w / spatial_merge_size**2`` per image, in order)."""

    stacked_params = [
        ("qkv", "q_proj", "q"), ("qkv", "k_proj", "k"), ("qkv", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1),
    ]  # fmt: skip

    def __init__(
        self, vision_config: dict[str, Any], dtype: torch.dtype, variant: str | None = None
    ) -> None:
        super().__init__()
        c = vision_config
        self.variant = tower_variant(c, variant)
        self.windowed = self.variant == "qwen2_5_vl"
        width = c["hidden_size"] if self.windowed else c["embed_dim"]
        out = c["out_hidden_size"] if self.windowed else c["hidden_size"]
        self.out_hidden_size = out
        self.patch_size, self.spatial_merge_size = c["patch_size"], c.get("spatial_merge_size", 2)
        self.window_size = c.get("window_size", 112)
        # Qwen2-VL: every block attends to whole images
        depth = c["depth"]
        full_blocks = c.get("fullatt_block_indexes", ()) if self.windowed else range(depth)
        self.fullatt_block_indexes = set(full_blocks)
        channels = c.get("in_channels", c.get("in_chans", 3))
        kernel = (c.get("temporal_patch_size", 2), self.patch_size, self.patch_size)
        self.patch_embed = nn.Module()  # a Conv3d's weight, kept in the checkpoint's shape
        self.patch_embed.proj = nn.Module()
        self.patch_embed.proj.weight = nn.Parameter(
            torch.empty(width, channels, *kernel, dtype=dtype)
        )
        self.head_dim = width // c["num_heads"]
        self.rope_theta = (c.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        self.blocks = nn.ModuleList(VisionBlock(c, self.windowed, dtype) for _ in range(depth))
        unit = self.spatial_merge_size**2
        self.merger = PatchMerger(width, out, unit, self.windowed, dtype)
        self.requires_grad_(False)

    def cos_sin_cache(self, max_position: int) -> torch.Tensor:
        """``[max_position, head_dim]`` fp32: cos then sin of ``p * cat(f, f)`` for each
        position p, so pair i < head_dim/4 reads frequency i and pair i >= head_dim/4
        frequency i - head_dim/4 (the row and the column share the frequencies)."""
        half = self.head_dim // 2  # each axis's frequencies span half the head
        inv_freq = 1.0 / self.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half)
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq.repeat(2))
        return torch.cat([angles.cos(), angles.sin()], dim=-1)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """``[P, C * temporal_patch_size * p * p]`` patch rows and ``grid_thw [N, 3]`` ->
        ``[P / spatial_merge_size**2, out_hidden_size]``."""
        weight = self.patch_embed.proj.weight
        x = linear(pixel_values.to(weight.device, weight.dtype), weight.flatten(1))
        order, full, windows = self.attention_layout(grid_thw.cpu(), weight.device)
        unit = self.spatial_merge_size**2
        if order is not None:  # whole blocks move, so a block's patches stay together
            x = x.view(-1, unit, x.shape[-1])[order].flatten(0, 1)
        for i, block in enumerate(self.blocks):
            x = block(x, full if i in self.fullatt_block_indexes else windows)
        merged = self.merger(x)
        if order is None:
            return merged
        in_image_order = torch.empty_like(merged)
        in_image_order[order] = merged
        return in_image_order

    def attention_layout(
        self, grid_thw: torch.Tensor, device: torch.device
    ) -> tuple[torch.Tensor | None, VisionAttentionMetadata, VisionAttentionMetadata]:
        """``(order, full, windows)`` for a batch of ``grid_thw``: the window order of the
        merged blocks (None for Qwen2-VL, whose patches stay in the processor's order), and
        the metadata of full-attention and of windowed layers (the same for Qwen2-VL), their
        positions in the order the patches are processed."""
        merge = self.spatial_merge_size
        positions = patch_positions(grid_thw, merge)
        cache = self.cos_sin_cache(int(grid_thw[:, 1:].max())).to(device)
        cu, longest = frame_seqlens(grid_thw)
        if not self.windowed:
            full = VisionAttentionMetadata(positions.to(device), cache, cu.to(device), longest)
            return None, full, full
        side = self.window_size // merge // self.patch_size
        order, window_cu, window_longest = window_partition(grid_thw, merge, side)
        positions = positions.view(2, -1, merge * merge)[:, order].flatten(1).to(device)
        full = VisionAttentionMetadata(positions, cache, cu.to(device), longest)
        windows = VisionAttentionMetadata(positions, cache, window_cu.to(device), window_longest)
        return order.to(device), full, windows

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | CheckpointTensor]]) -> None:
        """Load the tower's checkpoint tensors, named as in the checkpoint less its ``visual.``
        / ``model.visual.`` prefix; every parameter must come exactly once."""
        load_stacked_weights(self, _split_fused(weights), self.stacked_params, _our_name)


def _split_fused(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """The checkpoint's fused ``attn.qkv`` as its three thirds (q, k, v), so that the fused
    projection's loader places each (and could shard each by heads)."""
    for name, tensor in weights:
        if ".attn.qkv." in name:
            for part, third in zip(("q_proj", "k_proj", "v_proj"), tensor.chunk(3, dim=0)):
                yield name.replace(".qkv.", f".{part}."), third
        else:
            yield name, tensor


def _our_name(name: str) -> str:
    """The merger's ``mlp.0`` / ``mlp.2`` (an nn.Sequential's indices) are our fc1 / fc2."""
    return name.replace("merger.mlp.0.", "merger.fc1.").replace("merger.mlp.2.", "merger.fc2.")
