"""Phi-3: Llama's layers, with the query/key/value and gate/up projections fused in the
checkpoint and LongRoPE ("su") scaling (layers/rotary.py).

The fused checkpoint tensors are split into Llama's names on the way in (lazily: each part is a
``narrow`` of the stored tensor), so the Llama loader shards each part as it shards a separate
``q_proj``; under tensor parallelism a rank still reads only its own rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.models.weights import CheckpointTensor

Weight = tuple[str, torch.Tensor | CheckpointTensor]


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 mini/medium (``Phi3ForCausalLM``) for causal generation over a paged KV cache."""

    def _split_fused(self, weights: Iterable[Weight]) -> Iterator[Weight]:
        c = self.config
        q_size = c.num_attention_heads * c.head_dim
        kv_size = c.num_kv_heads * c.head_dim
        inter = int(c.hf_config["intermediate_size"])
        fused = {
            ".qkv_proj.": [("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)],
            ".gate_up_proj.": [("gate_proj", inter), ("up_proj", inter)],
        }
        for name, tensor in weights:
            parts = next((p for key, p in fused.items() if key in name), None)
            if parts is None:
                yield name, tensor
                continue
            key = ".qkv_proj." if ".qkv_proj." in name else ".gate_up_proj."
            start = 0
            for part, size in parts:
                yield name.replace(key, f".{part}."), tensor.narrow(0, start, size)
                start += size

    def load_weights(self, weights: Iterable[Weight]) -> None:
        super().load_weights(self._split_fused(weights))
