"""The sparse mixture-of-experts MLP of Mixtral, Qwen2/3-MoE and DeepSeek, over the fused MoE
kernel.

A router (``gate``, a linear layer to one logit per expert, and its rule: moe_routing.py)
picks each token's top-k experts and their weights; by default the top k of the softmax of
its logits (in fp32, as transformers computes it), which Mixtral renormalises to sum to one
and Qwen-MoE does when ``norm_topk_prob``; DeepSeek passes its own router. The experts' weights are
stacked, ``w13 [E, 2I, H]`` (gate rows then up rows) and ``w2 [E, H, I]``, and
``pagedserve.kernels.fused_moe`` runs them all in one grouped GEMM per projection.

Tensor parallelism shards every expert's intermediate features, as the dense MLP's are: rank r
holds rows ``[r I/tp, (r+1) I/tp)`` of each expert's gate and up and those columns of its down;
the partial outputs are all-reduced. Checkpoints store one tensor per expert and projection
(``experts.{e}.w1/w3/w2`` in Mixtral, ``experts.{e}.gate_proj/up_proj/down_proj`` in Qwen);
``load_expert`` narrows each to this rank's slice, and ``check_loaded`` refuses a checkpoint
that lacks one.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from pagedserve.kernels import fused_moe
from pagedserve.models.config import ModelLoadError
from pagedserve.models.layers.batch_invariance import building_batch_invariant, on_whole_vectors
from pagedserve.models.layers.linear_method import WeightShard, load_shard, loadable_param
from pagedserve.models.moe_quantized import EXPERT_PART, Int4Experts
from pagedserve.models.moe_routing import SoftmaxTopKRouter
from pagedserve.models.weights import CheckpointTensor

# checkpoint projection name -> (our parameter, part): gate and up into w13, down into w2
EXPERT_PROJECTIONS = {
    "w1": ("w13_weight", 0), "gate_proj": ("w13_weight", 0),
    "w3": ("w13_weight", 1), "up_proj": ("w13_weight", 1),
    "w2": ("w2_weight", 2), "down_proj": ("w2_weight", 2),
}  # fmt: skip
EXPERT_NAME = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")


class SparseMoeBlock(nn.Module):
    """Router + stacked experts; ``forward(x [T, H]) -> [T, H]``. ``gate``: the router
    (moe_routing.py); by default the softmax top-``top_k``, renormalised when ``renormalize``."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        dtype: torch.dtype,
        tp_rank: int = 0,
        tp_size: int = 1,
        all_reduce=None,
        gate: nn.Module | None = None,
        expert_weights: bool = True,
    ) -> None:
        """``expert_weights`` False: the experts' weights are the subclass's to hold (gpt-oss's
        packed MXFP4), none allocated here."""
        super().__init__()
        if intermediate_size % tp_size:
            raise ValueError(f"expert size {intermediate_size} is not divisible by {tp_size}")
        self.num_experts = num_experts
        self.inter, self.inter_per_rank = intermediate_size, intermediate_size // tp_size
        self.tp_rank, self.tp_size, self.all_reduce = tp_rank, tp_size, all_reduce
        self.gate = gate or SoftmaxTopKRouter(num_experts, top_k, hidden_size, renormalize, dtype)
        shape13 = (num_experts, 2 * self.inter_per_rank, hidden_size)
        shape2 = (num_experts, hidden_size, self.inter_per_rank)
        self.experts = nn.Module()
        if expert_weights:
            self.experts.w13_weight = loadable_param(shape13, dtype, self.load_expert)
            self.experts.w2_weight = loadable_param(shape2, dtype, self.load_expert)
            for param in (self.experts.w13_weight, self.experts.w2_weight):
                param.loaded_elsewhere = True  # type: ignore[attr-defined]  # check_loaded
        self._loaded: set[tuple[int, int]] = set()
        self.batch_invariant = building_batch_invariant()

    def load_expert(
        self, param: nn.Parameter, loaded: torch.Tensor | CheckpointTensor, shard: tuple[int, int]
    ) -> None:
        """Expert ``shard[0]``'s gate (part 0), up (1) or down (2) projection, this rank's
        slice of its intermediate features."""
        expert, part = shard
        size, start = self.inter_per_rank, self.tp_rank * self.inter_per_rank
        what = f"expert {expert} projection {part}"
        if part == 2:  # down [H, I]: this rank's columns
            spec = WeightShard(1, start, size, self.inter, what)
        else:  # gate / up [I, H]: this rank's rows, gate first then up in w13
            spec = WeightShard(0, start, size, self.inter, what, part * size)
        load_shard(param.data[expert], loaded, spec)  # a view: the copy lands in place
        self._loaded.add(shard)

    def check_loaded(self, where: str) -> None:
        missing = [
            (e, p) for e in range(self.num_experts) for p in range(3) if (e, p) not in self._loaded
        ]
        if missing:
            raise ModelLoadError(f"checkpoint is missing expert weights of {where}: {missing[:6]}")

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' output: under tensor parallelism, this rank's partial sum."""
        weights, ids = self.gate(x)
        experts = self.experts
        return fused_moe(
            x, experts.w13_weight, experts.w2_weight, weights, ids,
            batch_invariant=self.batch_invariant,
        )  # fmt: skip

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``partial`` (itself with one rank)."""
        if self.tp_size > 1 and self.all_reduce is not None:
            return self.all_reduce(partial)
        return partial

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.routed(x))


class SharedExpertsMoeBlock(SparseMoeBlock):
    """DeepSeek's MoE: the routed experts plus ``shared_experts``, a dense MLP (of
    ``n_shared_experts * moe_intermediate_size``) that every token goes through. Under tensor
    parallelism both are partial sums (the shared MLP is built without its own all-reduce),
    added before one all-reduce."""

    def __init__(self, shared_experts: nn.Module, **block_args) -> None:
        super().__init__(**block_args)
        self.shared_experts = shared_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.routed(x) + self.shared_experts(x))


class GatedSharedExpertMoeBlock(SparseMoeBlock):
    """Qwen2-MoE's block: the routed experts plus ``shared_expert`` (a dense MLP of
    ``shared_expert_intermediate_size``) scaled per token by ``sigmoid(shared_expert_gate(x))``,
    a learned scalar gate. The gate is the same on every rank, so the scaled partial sums
    still add up: one all-reduce, as above."""

    def __init__(self, shared_expert: nn.Module, shared_expert_gate: nn.Module, **block_args):
        super().__init__(**block_args)
        self.shared_expert, self.shared_expert_gate = shared_expert, shared_expert_gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.gate_weights(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.reduce(self.routed(x) + shared)

    def gate_weights(self, logits: torch.Tensor) -> torch.Tensor:
        """``sigmoid(logits)``, one value a token (``[T, 1]``); in the batch-invariant mode with
        every token's value on the same vector code (``on_whole_vectors``: in a ``[T, 1]``
        tensor a token's place in the batch would decide whether libm's scalar code rounds it)."""
        if not self.batch_invariant:
            return torch.sigmoid(logits)
        return on_whole_vectors(torch.sigmoid, logits)


def split_expert_weights(model: nn.Module, weights):
    """Route the per-expert checkpoint tensors to their blocks' ``load_expert``; yield the
    rest for the ordinary loader. Each block then checks that every expert arrived. An AWQ or
    GPTQ checkpoint's experts arrive as their stored parts and load dequantized
    (moe_quantized.py)."""
    blocks = {name: m for name, m in model.named_modules() if isinstance(m, SparseMoeBlock)}
    int4_experts = Int4Experts.of(getattr(model, "config", None))
    for name, tensor in weights:
        if int4_experts is not None and (part_name := EXPERT_PART.match(name)):
            if (dequantized := int4_experts.take(part_name, tensor)) is None:
                continue
            name, tensor = dequantized
        match = EXPERT_NAME.match(name)
        if match is None or match.group(3) not in EXPERT_PROJECTIONS:
            yield name, tensor
            continue
        prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
        block = blocks.get(prefix.removesuffix(".experts"))
        if block is None or expert >= block.num_experts:
            raise ModelLoadError(f"checkpoint tensor {name!r} has no matching expert")
        param_name, part = EXPERT_PROJECTIONS[proj]
        block.load_expert(getattr(block.experts, param_name), tensor, (expert, part))
    if int4_experts is not None:
        int4_experts.check_complete()
    for name, block in blocks.items():
        block.check_loaded(name)
