"""Routers of the sparse MoE blocks: which k experts each token goes to, and with what weight.

Each is the block's ``gate`` (its checkpoint name): a linear layer to one logit per expert
(``weight [E, H]``), then its rule. ``forward(x [T, H]) -> (weights [T, k] fp32, ids [T, k])``.

- ``SoftmaxTopKRouter`` (Mixtral, Qwen2/3-MoE): softmax over the experts, the top k, optionally
  renormalised to sum to one.
- ``TopKSoftmaxRouter`` (gpt-oss, its checkpoint's ``router``): a linear layer with a bias; the
  top k logits, then the softmax of those k alone.
- ``GroupLimitedRouter`` (DeepSeek-V2): softmax, but only among the ``topk_group`` groups (of
  ``n_group`` equal groups of experts) whose best expert scores highest ("group-limited
  greedy"; one group: plain greedy top-k); the k weights times ``routed_scaling_factor``.
- ``NoAuxRouter`` (DeepSeek-V3's ``noaux_tc``): sigmoid scores; the choice (not the weights)
  adds a learned per-expert correction bias, the auxiliary-loss-free load balancing; groups are
  ranked by the sum of their two best biased scores; the k unbiased scores, renormalised when
  ``norm_topk_prob``, times ``routed_scaling_factor``.

DeepSeek computes its router in fp32 whatever the model's dtype (its gate weight and bias are
fp32 parameters), as transformers and the reference implementation do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels.linear import linear
from pagedserve.models.layers.batch_invariance import building_batch_invariant, on_whole_vectors
from pagedserve.models.weights import default_weight_loader


def router_logits(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, batch_invariant: bool
) -> torch.Tensor:
    """One logit per expert, ``x W^T (+ b)``; in the batch-invariant mode through the
    batch-invariant GEMM, so that a near-tie between two experts cannot follow the batch."""
    if batch_invariant:
        return linear(x, weight, bias, batch_invariant=True)
    return F.linear(x, weight, bias)


def _replicated(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """A router parameter: whole on every tensor-parallel rank."""
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = default_weight_loader  # type: ignore[attr-defined]
    return param


class SoftmaxTopKRouter(nn.Module):
    def __init__(
        self, num_experts: int, top_k: int, hidden_size: int, renormalize: bool, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.weight = _replicated(num_experts, hidden_size, dtype=dtype)
        self.batch_invariant = building_batch_invariant()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = router_logits(x, self.weight, None, self.batch_invariant)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


class TopKSoftmaxRouter(nn.Module):
    def __init__(self, num_experts: int, top_k: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.weight = _replicated(num_experts, hidden_size, dtype=dtype)
        self.bias = _replicated(num_experts, dtype=dtype)
        self.batch_invariant = building_batch_invariant()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = router_logits(x, self.weight, self.bias, self.batch_invariant)
        logits, ids = torch.topk(logits.float(), self.top_k, dim=-1)
        return torch.softmax(logits, dim=-1), ids


def keep_top_groups(
    choice: torch.Tensor, group_scores: torch.Tensor, topk_group: int, fill: float
) -> torch.Tensor:
    """``choice [T, E]`` with every expert outside each token's ``topk_group`` best groups (by
    ``group_scores [T, G]``; experts in G equal consecutive groups) set to ``fill``."""
    n_tokens, n_groups = group_scores.shape
    best = torch.topk(group_scores, topk_group, dim=-1, sorted=False).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    keep = keep[:, :, None].expand(n_tokens, n_groups, choice.shape[1] // n_groups)
    return choice.masked_fill(~keep.reshape(n_tokens, -1), fill)


class GroupLimitedRouter(nn.Module):
    def __init__(
        self, num_experts: int, top_k: int, hidden_size: int, n_group: int, topk_group: int,
        routed_scaling_factor: float,
    ) -> None:  # fmt: skip
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.n_group, self.topk_group = n_group, topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.weight = _replicated(num_experts, hidden_size, dtype=torch.float32)
        self.batch_invariant = building_batch_invariant()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = router_logits(x.float(), self.weight, None, self.batch_invariant)
        scores = torch.softmax(logits, dim=-1)
        if self.n_group > 1:
            group_best = scores.view(x.shape[0], self.n_group, -1).amax(dim=-1)
            scores = keep_top_groups(scores, group_best, self.topk_group, 0.0)
        weights, ids = torch.topk(scores, self.top_k, dim=-1, sorted=False)
        return weights * self.routed_scaling_factor, ids


class NoAuxRouter(nn.Module):
    def __init__(
        self, num_experts: int, top_k: int, hidden_size: int, n_group: int, topk_group: int,
        renormalize: bool, routed_scaling_factor: float,
    ) -> None:  # fmt: skip
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.n_group, self.topk_group = n_group, topk_group
        self.renormalize, self.routed_scaling_factor = renormalize, routed_scaling_factor
        self.weight = _replicated(num_experts, hidden_size, dtype=torch.float32)
        self.e_score_correction_bias = _replicated(num_experts, dtype=torch.float32)
        self.batch_invariant = building_batch_invariant()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = router_logits(x.float(), self.weight, None, self.batch_invariant)
        if self.batch_invariant:  # a row of a few scores: see on_whole_vectors
            scores = on_whole_vectors(torch.sigmoid, logits)
        else:
            scores = torch.sigmoid(logits)
        choice = scores + self.e_score_correction_bias
        group_top2 = choice.view(x.shape[0], self.n_group, -1).topk(2, dim=-1).values.sum(-1)
        choice = keep_top_groups(choice, group_top2, self.topk_group, float("-inf"))
        ids = torch.topk(choice, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids
