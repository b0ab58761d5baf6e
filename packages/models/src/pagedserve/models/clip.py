"""CLIP's vision tower, as LLaVA reads it: a pre-LN ViT over each image's patches.

An image ``[3, S, S]`` (``S = image_size``) is cut into ``(S / p)**2`` patches, each patch's
pixels mapped to a row by one linear layer (CLIP's stride-``p`` convolution, as the GEMM it is);
a learned class row goes in front, learned positions are added, and
``pre_layrnorm`` normalises the rows. Each encoder layer is ``x + out_proj(attn(LN1 x))``, then
``x + fc2(act(fc1(LN2 x)))``, attention bidirectional over the image's own rows (torch's
``scaled_dot_product_attention`` over images batched ``[N, rows, hidden]``: an image is read
whole, once, so there is no KV cache).

LLaVA takes the hidden states after chosen layers (``vision_feature_layer``: -2 is the output of
the second-to-last layer, counted as transformers' ``hidden_states`` count them, with the
embeddings at 0), before any final norm. So only the layers up to the deepest one chosen are
built and run, and CLIP's ``post_layernorm`` (it normalises the pooled class row for CLIP's
contrastive head) is not built; ``skips_weight`` names the checkpoint tensors of both, which a
loader drops. Names follow transformers' CLIPVisionModel; q/k/v load into one fused projection.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import gelu, gelu_tanh, quick_gelu
from pagedserve.kernels.linear import linear
from pagedserve.models.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedserve.models.layers.norm import LayerNorm

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": quick_gelu,
    "gelu": gelu,
    "gelu_pytorch_tanh": gelu_tanh,
}


def activation(name: str, field: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation a config names in ``field``; ValueError naming the field otherwise."""
    if name not in ACTIVATIONS:
        raise ValueError(f"{field} = {name!r} is not supported (one of {sorted(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def feature_layers(vision_feature_layer: int | list[int], num_layers: int) -> list[int]:
    """Each chosen layer as a count of layers run (0: the embeddings, ``num_layers``: the last
    layer's output); negative indices count from the end as a Python index into the
    ``num_layers + 1`` hidden states does."""
    chosen = (
        [vision_feature_layer] if isinstance(vision_feature_layer, int) else vision_feature_layer
    )
    counts = [i if i >= 0 else num_layers + 1 + i for i in chosen]
    if not counts or not all(0 <= c <= num_layers for c in counts):
        raise ValueError(
            f"vision_feature_layer = {vision_feature_layer!r} names no hidden state of a "
            f"{num_layers}-layer vision tower"
        )
    return counts


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, c: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        hidden, patch = c["hidden_size"], c["patch_size"]
        self.image_size, self.patch_size = c["image_size"], patch
        num_positions = (self.image_size // patch) ** 2 + 1
        self.class_embedding = nn.Parameter(torch.empty(hidden, dtype=dtype))
        # a convolution whose stride is its kernel's size: one linear map of each patch's
        # C x p x p pixels, kept in the checkpoint's [hidden, C, p, p] shape
        channels = c.get("num_channels", 3)
        self.patch_embedding = nn.Module()
        self.patch_embedding.weight = nn.Parameter(
            torch.empty(hidden, channels, patch, patch, dtype=dtype)
        )
        self.position_embedding = nn.Embedding(num_positions, hidden, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, C, S, S]`` pixels -> ``[N, 1 + patches, hidden]`` rows, class row first."""
        weight = self.patch_embedding.weight
        rows = patch_rows(pixel_values, self.image_size, self.patch_size)
        patches = linear(rows.to(weight.dtype), weight.flatten(1))
        cls = self.class_embedding.expand(len(pixel_values), 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


def patch_rows(pixel_values: torch.Tensor, image_size: int, patch: int) -> torch.Tensor:
    """``[N, C, S, S]`` pixels -> ``[N, patches (row by row), C * p * p]``: each patch's pixels
    in one row, in the order a ``[hidden, C, p, p]`` convolution weight flattens; ValueError
    for an image that is not ``image_size`` square."""
    height, width = pixel_values.shape[-2:]
    if height != image_size or width != image_size:
        raise ValueError(
            f"images are {height}x{width} pixels; this vision tower reads "
            f"{image_size}x{image_size} (vision_config.image_size)"
        )
    grid = pixel_values.unflatten(2, (height // patch, patch)).unflatten(4, (width // patch, patch))
    return grid.permute(0, 2, 4, 1, 3, 5).flatten(3).flatten(1, 2)


class CLIPAttention(nn.Module):
    def __init__(self, c: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        hidden, self.num_heads = c["hidden_size"], c["num_attention_heads"]
        self.head_dim = hidden // self.num_heads
        heads = self.num_heads
        self.qkv_proj = QKVParallelLinear(
            hidden, self.head_dim, heads, heads, bias=True, dtype=dtype
        )
        self.out_proj = RowParallelLinear(hidden, hidden, bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, rows, hidden = x.shape
        qkv = self.qkv_proj(x.reshape(n * rows, hidden))
        q, k, v = qkv.view(n, rows, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(1, 2).reshape(n * rows, hidden)).view(n, rows, hidden)


class CLIPMLP(nn.Module):
    def __init__(self, c: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        hidden, inter = c["hidden_size"], c["intermediate_size"]
        self.act = activation(c.get("hidden_act", "quick_gelu"), "vision_config.hidden_act")
        self.fc1 = ColumnParallelLinear(hidden, inter, bias=True, dtype=dtype)
        self.fc2 = RowParallelLinear(inter, hidden, bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, c: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        eps = c.get("layer_norm_eps", 1e-5)
        self.layer_norm1 = LayerNorm(c["hidden_size"], eps, dtype)
        self.self_attn = CLIPAttention(c, dtype)
        self.layer_norm2 = LayerNorm(c["hidden_size"], eps, dtype)
        self.mlp = CLIPMLP(c, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, c: dict[str, Any], num_layers: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(c, dtype) for _ in range(num_layers))


class CLIPVisionTower(nn.Module):
    """The tower up to its deepest chosen layer; ``forward`` returns the chosen layers' hidden
    states concatenated on the last dim (in the order chosen), as transformers' LLaVA does."""

    stacked_params = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"),
                      ("qkv_proj", "v_proj", "v")]  # fmt: skip

    def __init__(
        self, vision_config: dict[str, Any], vision_feature_layer: int | list[int], dtype
    ) -> None:
        super().__init__()
        c = vision_config
        self.feature_layers = feature_layers(vision_feature_layer, c["num_hidden_layers"])
        self.embeddings = CLIPVisionEmbeddings(c, dtype)
        self.pre_layrnorm = LayerNorm(c["hidden_size"], c.get("layer_norm_eps", 1e-5), dtype)
        self.encoder = CLIPEncoder(c, max(self.feature_layers), dtype)
        self.requires_grad_(False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, C, S, S]`` -> ``[N, 1 + patches, hidden * len(feature_layers)]``."""
        hidden = self.pre_layrnorm(self.embeddings(pixel_values))
        states = [hidden]
        for layer in self.encoder.layers:
            hidden = layer(hidden)
            states.append(hidden)
        return torch.cat([states[i] for i in self.feature_layers], dim=-1)

    def skips_weight(self, name: str) -> bool:
        """Whether a checkpoint tensor (named inside the tower) is one this tower does not
        build: ``post_layernorm``, a layer past the deepest chosen one, the position ids
        buffer that old checkpoints stored."""
        if name.startswith("post_layernorm.") or name.endswith("position_ids"):
            return True
        if name.startswith("encoder.layers."):
            return int(name.split(".")[2]) >= len(self.encoder.layers)
        return False
