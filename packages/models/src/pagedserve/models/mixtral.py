"""Mixtral, Qwen3-MoE and Qwen2-MoE: Llama's (Qwen's) attention, a sparse mixture-of-experts
MLP (moe.py).

Mixtral routes every layer through ``num_local_experts`` experts, top ``num_experts_per_tok``,
renormalised; its checkpoint calls the block ``block_sparse_moe``. Qwen3-MoE routes through
``num_experts`` experts of ``moe_intermediate_size``, renormalised when ``norm_topk_prob``,
on the layers ``decoder_sparse_step`` picks outside ``mlp_only_layers`` (the others are dense
MLPs of ``intermediate_size``). Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B) is routed the same
way, with Qwen2's attention (qkv bias, no q/k norm), and adds a shared expert (a dense MLP of
``shared_expert_intermediate_size``) scaled per token by a sigmoid gate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from pagedserve.models.config import ModelConfig
from pagedserve.models.layers.linear import ColumnParallelLinear
from pagedserve.models.layers.linear_method import UnquantizedLinearMethod
from pagedserve.models.llama import LlamaForCausalLM, LlamaMLP
from pagedserve.models.moe import GatedSharedExpertMoeBlock, SparseMoeBlock, split_expert_weights
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
            return self.sparse_block(config, par, int(experts))

        return build

    def sparse_block(self, config: ModelConfig, par: ParallelContext, experts: int):
        c = config.hf_config
        return _moe_block(
            config, par, experts, c["num_experts_per_tok"], c["moe_intermediate_size"],
            c.get("norm_topk_prob", False),
        )  # fmt: skip

    def load_weights(self, weights: Iterable) -> None:
        super().load_weights(split_expert_weights(self, weights))


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    def sparse_block(self, config: ModelConfig, par: ParallelContext, experts: int):
        """Routed experts, and the gated shared expert; its down projection's partial sums
        join the routed experts' in the block's one all-reduce."""
        c = config.hf_config
        unreduced = dataclasses.replace(par, all_reduce=None)
        shared = LlamaMLP(config, unreduced, int(c["shared_expert_intermediate_size"]))
        # whole on every rank; one output, never quantized (a 4-bit word packs eight)
        gate = ColumnParallelLinear(
            config.hidden_size, 1, dtype=config.torch_dtype,
            linear_method=UnquantizedLinearMethod(),
        )  # fmt: skip
        return GatedSharedExpertMoeBlock(
            shared, gate, num_experts=experts, top_k=int(c["num_experts_per_tok"]),
            hidden_size=config.hidden_size, intermediate_size=int(c["moe_intermediate_size"]),
            renormalize=bool(c.get("norm_topk_prob", False)), dtype=config.torch_dtype,
            all_reduce=par.all_reduce, **par.shard_args(),
        )  # fmt: skip
