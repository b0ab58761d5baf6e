"""gpt-oss (``GptOssForCausalLM``): attention with sinks on alternating sliding-window and
full layers, and a mixture of biased experts with a clamped SwiGLU on every layer.

The decoder is Llama's (pre-norm RMSNorm, residuals). Attention has biases on q, k, v and o,
YaRN rope (neox halves), and ``sinks``: a learned logit per query head in the softmax's
denominator (paged_attention's ``sinks``); ``layer_types`` alternate a ``sliding_window``
layer and a full one. The MLP of every layer is an MoE block: ``router`` (a linear layer with
a bias: the top ``num_experts_per_tok`` logits, then their softmax), ``num_local_experts``
experts of ``intermediate_size`` with biases on both projections, their activation
``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``
(``swiglu_alpha``, ``swiglu_limit``): fused_moe with ``activation="swigluoai"``.

Checkpoint layout (as transformers loads it): each layer's experts are stacked tensors,
``experts.gate_up_proj [E, H, 2I]`` with the gate and up columns interleaved (gate even, up
odd), ``experts.gate_up_proj_bias [E, 2I]`` likewise, ``experts.down_proj [E, I, H]`` and
``experts.down_proj_bias [E, H]``; OpenAI's release stores the two projections in MXFP4 instead
(``<name>_blocks`` and ``<name>_scales``, ``[E, out, ...]``: mxfp4.py), dequantized here at
load. Both become the fused MoE's layout: gate rows then up rows, ``[out, in]`` per expert. A
GGUF file's experts come as the loader puts them back (gguf_loader.py): the same stacked names,
each projection a sequence of per-expert ``[out, in]`` matrices decoded one at a time.

Tensor parallelism: query heads (and their sinks) and KV heads split as Llama's; every expert's
intermediate features split over the ranks (gate and up rows, down columns, the gate/up bias);
the down bias sits on rank 0 only (zeros elsewhere), so the block's all-reduce adds it once.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch import nn

from pagedserve.kernels import fused_moe
from pagedserve.kernels.dispatch import kernel_path
from pagedserve.kernels.mxfp4 import MXFP4Experts
from pagedserve.models.config import ModelConfig, ModelLoadError
from pagedserve.models.layers.attention import PagedAttention
from pagedserve.models.layers.linear_method import WeightShard, load_shard, loadable_param
from pagedserve.models.llama import LlamaAttention, LlamaForCausalLM
from pagedserve.models.moe import SparseMoeBlock
from pagedserve.models.moe_routing import TopKSoftmaxRouter
from pagedserve.models.mxfp4 import MXFP4_BLOCK
from pagedserve.models.parallel import ParallelContext
from pagedserve.models.weights import copy_shard, materialize

# model.layers.{i}.mlp.experts.{gate_up_proj|down_proj}[_bias|_blocks|_scales]
_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp)\.experts\.(gate_up_proj|down_proj)(_\w+)?$")


class GptOssAttention(LlamaAttention):
    """Llama's attention (q/k/v/o biases from ``attention_bias``) with this rank's heads'
    sinks, fp32 (the softmax's precision), owned by the paged attention layer."""

    def __init__(self, config: ModelConfig, par: ParallelContext, layer_idx: int) -> None:
        super().__init__(config, par, layer_idx)
        self.tp_rank = par.tp_rank
        sinks = loadable_param((self.num_heads,), torch.float32, self.load_sinks)
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5,
            sliding_window=config.sliding_windows[layer_idx], sinks=sinks,
        )  # fmt: skip

    def load_sinks(self, param: nn.Parameter, loaded) -> None:
        """This rank's query heads' sinks."""
        n = self.num_heads
        spec = WeightShard(0, self.tp_rank * n, n, loaded.shape[0], "attention sinks")
        load_shard(param, loaded, spec)


class GptOssMoeBlock(SparseMoeBlock):
    """The router, and experts with biases and the clamped SwiGLU, over the fused MoE kernel.
    Loads the checkpoint's stacked expert tensors (``load_stacked``), or with ``packed`` holds
    an MXFP4 checkpoint's experts as they are stored (``load_packed``; see ``holds_mxfp4``)."""

    def __init__(
        self, swiglu_alpha: float, swiglu_limit: float, packed: bool = False, **block_args
    ) -> None:
        super().__init__(expert_weights=not packed, **block_args)
        self.swiglu_alpha, self.swiglu_limit, self.packed = swiglu_alpha, swiglu_limit, packed
        n_experts, hidden, dtype = self.num_experts, block_args["hidden_size"], block_args["dtype"]
        if packed:
            self._packed_parameters(n_experts, hidden)
        for name, shape in (("w13_bias", (n_experts, 2 * self.inter_per_rank)),
                            ("w2_bias", (n_experts, hidden))):  # fmt: skip
            param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            param.loaded_elsewhere = True  # type: ignore[attr-defined]  # by load_stacked
            setattr(self.experts, name, param)

    def _packed_parameters(self, n_experts: int, hidden: int) -> None:
        """uint8 code and scale bytes of both projections, ``[E, out, in / 32, 16]`` and
        ``[E, out, in / 32]`` (gate rows then up rows in w13)."""
        inter = self.inter_per_rank
        if hidden % MXFP4_BLOCK or inter % MXFP4_BLOCK:
            raise ModelLoadError(f"MXFP4 experts need sizes in blocks of 32: {hidden}, {inter}")
        for name, (out, k) in (("w13", (2 * inter, hidden)), ("w2", (hidden, inter))):
            for suffix, shape in (("blocks", (out, k // 32, 16)), ("scales", (out, k // 32))):
                data = torch.empty((n_experts, *shape), dtype=torch.uint8)
                param = nn.Parameter(data, requires_grad=False)
                param.loaded_elsewhere = True  # type: ignore[attr-defined]  # by load_packed
                setattr(self.experts, f"{name}_{suffix}", param)

    def expert_weights(self) -> tuple:
        """(w13, w2) as fused_moe takes them: tensors, or packed MXFP4Experts."""
        e = self.experts
        if self.packed:
            return MXFP4Experts(e.w13_blocks, e.w13_scales), MXFP4Experts(e.w2_blocks, e.w2_scales)
        return e.w13_weight, e.w2_weight

    def load_mxfp4(self, proj: str, experts: MXFP4Experts) -> None:
        """OpenAI's MXFP4 ``proj``: held as stored when the block is ``packed``, else each
        expert dequantized as the loader asks for it (a layer's experts decoded at once would
        take gigabytes)."""
        if not self.packed:
            self.load_stacked(proj, experts, None)
            return
        name, parts = ("w13", (0, 1)) if proj == "gate_up_proj" else ("w2", (2,))
        for suffix, tensor in (("blocks", experts.blocks), ("scales", experts.scales)):
            # gate_up's interleaved rows put gate then up, as the fused MoE reads w13
            if proj == "gate_up_proj":
                tensor = torch.cat([tensor[:, 0::2], tensor[:, 1::2]], dim=1)
            copy_shard(getattr(self.experts, f"{name}_{suffix}").data, tensor, f"{proj} {suffix}")
        self._loaded.update((e, part) for e in range(self.num_experts) for part in parts)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        experts = self.experts
        return fused_moe(
            x, *self.expert_weights(), weights, ids, w13_bias=experts.w13_bias,
            w2_bias=experts.w2_bias, activation="swigluoai", swiglu_alpha=self.swiglu_alpha,
            swiglu_limit=self.swiglu_limit, batch_invariant=self.batch_invariant,
        )  # fmt: skip

    def load_stacked(self, proj: str, weights: Sequence | None, bias: torch.Tensor | None):
        """Every expert's ``proj`` (``gate_up_proj`` or ``down_proj``): ``weights[e] [out, in]``
        (gate_up's rows interleaved gate, up) or ``bias [E, out]``; this rank's part of each."""
        if weights is not None and len(weights) != self.num_experts:
            raise ModelLoadError(f"{proj}: {len(weights)} experts, expected {self.num_experts}")
        if proj == "gate_up_proj" and weights is not None:
            for expert in range(self.num_experts):
                weight, w13 = weights[expert], self.experts.w13_weight
                self.load_expert(w13, weight[0::2], (expert, 0))
                self.load_expert(w13, weight[1::2], (expert, 1))
        elif proj == "down_proj" and weights is not None:
            for expert in range(self.num_experts):
                self.load_expert(self.experts.w2_weight, weights[expert], (expert, 2))
        elif proj == "gate_up_proj":
            size, start = self.inter_per_rank, self.tp_rank * self.inter_per_rank
            for part, rows in enumerate((bias[:, 0::2], bias[:, 1::2])):
                spec = WeightShard(1, start, size, self.inter, "expert gate/up bias", part * size)
                load_shard(self.experts.w13_bias, rows, spec)
            self._loaded.add((-1, 0))
        else:  # added once over the ranks: rank 0 holds it
            self.experts.w2_bias.data.copy_(bias if self.tp_rank == 0 else torch.zeros_like(bias))
            self._loaded.add((-1, 2))

    def check_loaded(self, where: str) -> None:
        super().check_loaded(where)
        missing = [p for p, part in (("gate_up", 0), ("down", 2)) if (-1, part) not in self._loaded]
        if missing:
            raise ModelLoadError(f"checkpoint is missing the expert biases of {where}: {missing}")


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss-20b / 120b for causal generation over a paged KV cache."""

    def attention_factory(self, config: ModelConfig, par: ParallelContext):
        return lambda layer_idx: GptOssAttention(config, par, layer_idx)

    def mlp_factory(self, config: ModelConfig, par: ParallelContext):
        c = config.hf_config
        experts, top_k = int(c["num_local_experts"]), int(c["num_experts_per_tok"])

        packed = holds_mxfp4(config, par)

        def build(i: int) -> GptOssMoeBlock:
            router = TopKSoftmaxRouter(experts, top_k, config.hidden_size, config.torch_dtype)
            return GptOssMoeBlock(
                float(c.get("swiglu_alpha", 1.702)), float(c.get("swiglu_limit", 7.0)), packed,
                num_experts=experts, top_k=top_k, hidden_size=config.hidden_size,
                intermediate_size=int(c["intermediate_size"]), renormalize=False,
                dtype=config.torch_dtype, all_reduce=par.all_reduce, gate=router,
                **par.shard_args(),
            )  # fmt: skip

        return build

    def load_weights(self, weights: Iterable) -> None:
        super().load_weights(self._experts_loaded(weights))

    def _experts_loaded(self, weights: Iterable) -> Iterator:
        """Load each layer's stacked expert tensors into its block (MXFP4 blocks and scales
        paired first); yield every other tensor under our module names."""
        blocks = {n: m for n, m in self.named_modules() if isinstance(m, GptOssMoeBlock)}
        pending: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            match = _EXPERTS.match(name)
            if match is None:
                name = name.replace(".mlp.router.", ".mlp.gate.")
                yield name.replace(".self_attn.sinks", ".self_attn.attn.sinks"), tensor
                continue
            prefix, proj, suffix = match.groups()
            if prefix not in blocks:
                raise ModelLoadError(f"checkpoint tensor {name!r} has no matching layer")
            block = blocks[prefix]
            if suffix == "_bias":
                block.load_stacked(proj, None, materialize(tensor))
            elif isinstance(tensor, Sequence):  # each expert's [out, in] (a GGUF's experts)
                block.load_stacked(proj, tensor, None)
            elif suffix is None:  # [E, in, out], as transformers holds it
                block.load_stacked(proj, materialize(tensor).transpose(1, 2), None)
            elif suffix in ("_blocks", "_scales"):
                parts = pending.setdefault((prefix, proj), {})
                parts[suffix] = materialize(tensor)
                if len(parts) == 2:
                    del pending[(prefix, proj)]
                    block.load_mxfp4(proj, _mxfp4_experts(f"{prefix}.experts.{proj}", parts))
            else:
                raise ModelLoadError(f"checkpoint tensor {name!r}: unknown expert tensor")
        if pending:
            raise ModelLoadError(f"MXFP4 blocks without their scales (or scales alone): {pending}")
        for name, block in blocks.items():
            block.check_loaded(name)


def holds_mxfp4(config: ModelConfig, par: ParallelContext) -> bool:
    """Whether the experts stay MXFP4 in memory (a quarter of their bf16 bytes: gpt-oss-120b's
    ~61 GB): an MXFP4 checkpoint, served by the Triton kernels (a GPU; fused_moe decodes the
    codes in its tiles, kernels/mxfp4.py), on one rank (a packed expert is not split over ranks
    yet). Elsewhere the experts are dequantized at load."""
    qc = config.hf_config.get("quantization_config") or {}
    path = kernel_path(torch.empty(0, device=config.torch_device))
    return qc.get("quant_method") == "mxfp4" and par.tp_size == 1 and path == "triton"


def _mxfp4_experts(name: str, parts: dict[str, torch.Tensor]) -> MXFP4Experts:
    """A projection's ``_blocks`` and ``_scales``, or a ModelLoadError naming it."""
    try:
        return MXFP4Experts(parts["_blocks"], parts["_scales"])
    except ValueError as e:
        raise ModelLoadError(f"{name}: {e}") from e
