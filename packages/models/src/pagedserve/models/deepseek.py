"""DeepSeek-V2 and V3: multi-head latent attention (layers/mla.py) over a paged latent cache,
and mixture-of-experts MLPs with shared experts.

The decoder is Llama's (pre-norm RMSNorm, residuals) with MLA as its attention. The first
``first_k_dense_replace`` layers have a dense MLP (``intermediate_size``); every later one is
an MoE block: ``n_routed_experts`` experts of ``moe_intermediate_size``, ``num_experts_per_tok``
of them per token, plus ``n_shared_experts`` shared experts fused into one dense MLP every
token goes through. The router (moe_routing.py) is V2's softmax with group-limited greedy
top-k (``topk_method``) or V3's sigmoid with the ``e_score_correction_bias`` (``noaux_tc``);
its weights are scaled by ``routed_scaling_factor``.

Checkpoints name modules as transformers does. V3's checkpoints carry the multi-token
prediction layer(s) after the last decoder layer (``model.layers.61`` in V3); serving does not
use them and they are skipped.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

from pagedserve.models.config import ModelConfig
from pagedserve.models.layers.mla import MultiHeadLatentAttention, mla_rotary_embedding
from pagedserve.models.llama import LlamaForCausalLM, LlamaMLP
from pagedserve.models.moe import SharedExpertsMoeBlock, split_expert_weights
from pagedserve.models.moe_routing import GroupLimitedRouter, NoAuxRouter
from pagedserve.models.parallel import ParallelContext

_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def _routing(config: ModelConfig) -> tuple[int, int, int, int, float]:
    """(experts, top_k, groups, groups kept, routed_scaling_factor) from a DeepSeek config."""
    c = config.hf_config
    return (
        int(c["n_routed_experts"]), int(c["num_experts_per_tok"]), int(c.get("n_group") or 1),
        int(c.get("topk_group") or 1), float(c.get("routed_scaling_factor") or 1.0),
    )  # fmt: skip


def deepseek_moe(config: ModelConfig, par: ParallelContext, router) -> SharedExpertsMoeBlock:
    """One MoE layer: routed experts, and the shared ones as a dense MLP whose partial sums the
    block all-reduces together with the routed experts'."""
    c = config.hf_config
    inter = int(c["moe_intermediate_size"])
    unreduced = dataclasses.replace(par, all_reduce=None)
    shared = LlamaMLP(config, unreduced, inter * int(c.get("n_shared_experts") or 1))
    return SharedExpertsMoeBlock(
        shared, num_experts=int(c["n_routed_experts"]), top_k=int(c["num_experts_per_tok"]),
        hidden_size=config.hidden_size, intermediate_size=inter, renormalize=False,
        dtype=config.torch_dtype, all_reduce=par.all_reduce, gate=router,
        **par.shard_args(),
    )  # fmt: skip


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V2 (and V2-Lite) for causal generation over a paged latent cache."""

    stacked_params = [("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]

    def attention_factory(self, config: ModelConfig, par: ParallelContext):
        rotary = mla_rotary_embedding(config)  # one cos/sin cache, shared by every layer
        return lambda layer_idx: MultiHeadLatentAttention(config, par, rotary)

    def mlp_factory(self, config: ModelConfig, par: ParallelContext):
        first_moe = int(config.hf_config.get("first_k_dense_replace") or 0)

        def build(i: int):
            if i < first_moe:
                return LlamaMLP(config, par)
            return deepseek_moe(config, par, self.router(config))

        return build

    def router(self, config: ModelConfig) -> GroupLimitedRouter:
        """Softmax top-k, group-limited when ``topk_method`` says ``group_limited_greedy``
        (V2), plain greedy otherwise (V2-Lite); no renormalisation (transformers' V2 reads
        no ``norm_topk_prob``)."""
        experts, top_k, groups, kept, scaling = _routing(config)
        if config.hf_config.get("topk_method") != "group_limited_greedy":
            groups = kept = 1
        return GroupLimitedRouter(experts, top_k, config.hidden_size, groups, kept, scaling)

    def load_weights(self, weights: Iterable) -> None:
        num_layers = self.config.num_layers

        def decoder_layers_only(pairs):
            for name, tensor in pairs:
                layer = _LAYER_INDEX.match(name)
                if layer is None or int(layer.group(1)) < num_layers:
                    yield name, tensor

        super().load_weights(split_expert_weights(self, decoder_layers_only(weights)))


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3 (and R1, and models built on its architecture): V2's model with the
    auxiliary-loss-free router (``noaux_tc``: sigmoid scores, the correction bias in the
    choice only, groups ranked by their two best experts)."""

    def router(self, config: ModelConfig) -> NoAuxRouter:
        experts, top_k, groups, kept, scaling = _routing(config)
        renormalize = bool(config.hf_config.get("norm_topk_prob"))
        return NoAuxRouter(experts, top_k, config.hidden_size, groups, kept, renormalize, scaling)
