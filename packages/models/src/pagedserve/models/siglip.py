"""SigLIP's vision tower, as Gemma 3 reads it: CLIP's ViT (clip.py) without its class row and
pre-norm, with a final norm on every row.

An image ``[3, S, S]`` is cut into ``(S / p)**2`` patches, each patch's pixels mapped to a row
by one linear layer with a bias (SigLIP's stride-``p`` convolution, as the GEMM it is), and
learned positions added; there is no class row and no norm before the encoder. The encoder
layers are CLIP's (LayerNorm, attention with biases, LayerNorm, MLP; SigLIP's activation is
``gelu_pytorch_tanh``), run over all ``num_hidden_layers``; ``post_layernorm`` normalises the
last layer's rows, which are what Gemma 3's projector pools. SigLIP's attention-pooling
``head`` (``vision_use_head``) makes one vector for SigLIP's contrastive loss: Gemma 3 does not
read it, so it is not built and ``skips_weight`` drops its tensors.

Names follow transformers' SiglipVisionModel (``embeddings``, ``encoder.layers``,
``post_layernorm``); q/k/v load into one fused projection.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.kernels.linear import linear
from pagedserve.models.clip import CLIPEncoder, patch_rows
from pagedserve.models.layers.norm import LayerNorm


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, c: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        hidden, patch = c["hidden_size"], c["patch_size"]
        self.image_size, self.patch_size = c["image_size"], patch
        # the convolution's [hidden, C, p, p] weight and its bias, as the checkpoint holds them
        self.patch_embedding = nn.Module()
        self.patch_embedding.weight = nn.Parameter(
            torch.empty(hidden, c.get("num_channels", 3), patch, patch, dtype=dtype)
        )
        self.patch_embedding.bias = nn.Parameter(torch.empty(hidden, dtype=dtype))
        num_positions = (self.image_size // patch) ** 2
        self.position_embedding = nn.Embedding(num_positions, hidden, dtype=dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, C, S, S]`` pixels -> ``[N, patches, hidden]`` rows, row by row."""
        weight, bias = self.patch_embedding.weight, self.patch_embedding.bias
        rows = patch_rows(pixel_values, self.image_size, self.patch_size)
        return (
            linear(rows.to(weight.dtype), weight.flatten(1), bias) + self.position_embedding.weight
        )


class SiglipVisionTower(nn.Module):
    """The whole tower; ``forward`` returns the last layer's rows through ``post_layernorm``
    (transformers' ``last_hidden_state``)."""

    stacked_params = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"),
                      ("qkv_proj", "v_proj", "v")]  # fmt: skip

    def __init__(self, vision_config: dict[str, Any], dtype: torch.dtype) -> None:
        super().__init__()
        c = vision_config
        self.embeddings = SiglipVisionEmbeddings(c, dtype)
        self.encoder = CLIPEncoder(c, c["num_hidden_layers"], dtype)
        self.post_layernorm = LayerNorm(c["hidden_size"], c.get("layer_norm_eps", 1e-6), dtype)
        self.requires_grad_(False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[N, C, S, S]`` -> ``[N, patches, hidden]``."""
        hidden = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            hidden = layer(hidden)
        return self.post_layernorm(hidden)

    def skips_weight(self, name: str) -> bool:
        """Whether a checkpoint tensor (named inside the tower) is one this tower does not
        build: the attention-pooling ``head``, the position ids buffer of old checkpoints."""
        return name.startswith("head.") or name.endswith("position_ids")
