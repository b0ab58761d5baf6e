"""Mixtral and Qwen3-MoE: Llama's (Qwen3's) attention, a sparse mixture-of-experts MLP (moe.py).

Mixtral routes every layer through ``num_local_experts`` experts, top ``num_experts_per_tok``,
renormalised; its checkpoint calls the block ``block_sparse_moe``. Qwen3-MoE routes through
``num_experts`` experts of ``moe_intermediate_size``, renormalised when ``norm_topk_prob``,
on the layers ``decoder_sparse_step`` picks outside ``mlp_only_layers`` (the others are dense
MLPs of ``intermediate_size``). Qwen3-MoE has no shared expert (Qwen2-MoE's is not served).
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedserve.models.config import ModelConfig
from pagedserve.models.llama import LlamaForCausalLM, LlamaMLP
from pagedserve.models.moe import SparseMoeBlock, split_expert_weights
from pagedserve.models.parallel import ParallelContext


def _moe_block(config: ModelConfig, par: ParallelContext, experts, top_k, inter, renormalize):
    return SparseMoeBlock(
        int(experts), int(top_k), config.hidden_size, int(inter), bool(renormalize),
        config.torch_dtype, all_reduce=par.all_reduce, **par.shard_args(),
    )  # fmt: skip


class MixtralForCausalLM(LlamaForCausalLM):
    def mlp_factory(self, config: ModelConfig, par: ParallelContext):
        c = config.hf_config
        experts, top_k = c["num_local_experts"], c["num_experts_per_tok"]
        return lambda i: _moe_block(config, par, experts, top_k, c["intermediate_size"], True)

    def load_weights(self, weights: Iterable) -> None:
        renamed = ((n.replace(".block_sparse_moe.", ".mlp."), t) for n, t in weights)
        super().load_weights(split_expert_weights(self, renamed))


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    def mlp_factory(self, config: ModelConfig, par: ParallelContext):
        c = config.hf_config
        dense_layers = set(c.get("mlp_only_layers") or [])
        step = int(c.get("decoder_sparse_step") or 1)

        # transformers 5 writes num_local_experts; older configs num_experts
        experts = c.get("num_local_experts") or c.get("num_experts")

        def build(i: int):
            if i in dense_layers or not experts or (i + 1) % step:
                return LlamaMLP(config, par)
            return _moe_block(
                config, par, experts, c["num_experts_per_tok"],
                c["moe_intermediate_size"], c.get("norm_topk_prob", False),
            )  # fmt: skip

        return build

    def load_weights(self, weights: Iterable) -> None:
        super().load_weights(split_expert_weights(self, weights))
