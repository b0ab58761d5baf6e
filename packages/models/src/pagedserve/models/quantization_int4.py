"""AWQ and GPTQ checkpoints: 4-bit weights in groups, loaded as Hugging Face stores them.

Both formats keep, per linear layer, ``qweight`` (eight 4-bit values per int32), ``qzeros``
(eight 4-bit zero points per int32), ``scales`` (one per group of ``group_size`` input
features and output channel) and, for GPTQ, ``g_idx`` (each input feature's group). They
differ in which axis is packed and in what order:

=========  =====================================  ========================================
tensor     AWQ (AutoAWQ, GEMM version)            GPTQ (AutoGPTQ, gptqmodel, optimum)
=========  =====================================  ========================================
qweight    ``[in, out / 8]``: 8 output channels    ``[in / 8, out]``: 8 input features per
           per word, interleaved: nibble ``i``     word, nibble ``j`` is feature ``8p + j``
           holds channel ``AWQ_ORDER[i]``
qzeros     ``[in / gs, out / 8]``, interleaved     ``[in / gs, out / 8]``, in order; format
                                                   ``gptq`` stores ``zero - 1``, ``gptq_v2``
                                                   the zero itself
scales     ``[in / gs, out]``                      ``[in / gs, out]``
g_idx      (none: groups are contiguous)           ``[in]``, act-order (``desc_act``) when
                                                   not ``arange(in) // gs``
=========  =====================================  ========================================

Loading reads each rank's shard of those tensors as stored (``load_weight``: output shards
along the packed channel axis in words, input shards on group boundaries), then
``process_weights_after_loading`` repacks both formats into the one layout the 4-bit kernel
reads (pagedserve.kernels.int4_linear); on a CPU (the numba path) a layer whose groups are
contiguous rewrites that once more into rows of 4-bit groups, one output feature a row, which
the CPU's GEMM decodes in place (pagedserve.kernels.cpu.int4_linear). Act-order's permutation is undone there: input
features are sorted by group so that groups are contiguous again, and ``apply`` permutes the
activations to match (what vLLM's exllama and Marlin paths do).

Under tensor parallelism a column-parallel rank holds whole input features (every group) for
its output channels; a row-parallel rank holds a run of input features: its ``qweight`` rows,
its groups' ``scales`` and ``qzeros`` (so the shard must start and end on group boundaries),
and its ``g_idx``. With act-order a row-parallel shard's features belong to any group, so
every rank holds every group's ``scales`` and ``qzeros``, and the kernel looks each feature's
group up in the (sorted) ``g_idx``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagedserve.kernels.dispatch import kernel_path
from pagedserve.kernels.int4_linear import PACK, Int4Workspace, int4_linear, pack_int4_rows
from pagedserve.models.config import ModelLoadError
from pagedserve.models.layers.linear_method import (
    LinearMethodBase,
    LinearMethodFactory,
    Loaded,
    WeightLoader,
    WeightShard,
    load_shard,
    loadable_param,
)
from pagedserve.models.weights import copy_shard

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds channel AWQ_ORDER[i]
# Modules a checkpoint may list as left unquantized that pagedserve never quantizes anyway: the
# LM head, an MoE's router ("gate": AutoAWQ's Mixtral) and Qwen2-MoE's one-output expert gate,
# matched by a listed name's last part ("gate", "mlp.gate" and "block_sparse_moe.gate" alike).
NEVER_QUANTIZED = ("lm_head", "gate", "shared_expert_gate")
GPTQ_ORDER = tuple(range(PACK))
_SHIFTS = tuple(range(0, 32, 4))


@dataclass(frozen=True)
class Int4Config:
    """What ``quantization_config`` says about a 4-bit checkpoint. ``group_size`` -1 means
    one group over all of a layer's input features; ``zero_offset`` is what the stored zero
    points lack (1 for GPTQ's original ``gptq`` format, 0 for ``gptq_v2`` and AWQ)."""

    method: str
    group_size: int
    desc_act: bool = False
    zero_offset: int = 0

    def describe(self) -> str:
        act = ", desc_act" if self.desc_act else ""
        return f"{self.method}, 4 bits, group_size {self.group_size}{act}"


def _field(qc: dict[str, Any], *names: str, default: Any = None) -> Any:
    return next((qc[n] for n in names if qc.get(n) is not None), default)


def parse_int4_config(qc: dict[str, Any]) -> Int4Config:
    """The checkpoint's ``quantization_config`` (quant_method awq or gptq), or a
    ModelLoadError naming the field that pagedserve cannot serve."""
    method = qc["quant_method"]
    bits = _field(qc, "bits", "w_bit", default=4)
    if bits != 4:
        raise ModelLoadError(
            f"quantization_config.bits = {bits}: pagedserve loads 4-bit {method} checkpoints only"
        )
    group_size = int(_field(qc, "group_size", "q_group_size", default=128))
    if group_size != -1 and (group_size <= 0 or group_size % PACK):
        raise ModelLoadError(
            f"quantization_config.group_size = {group_size}: expected -1 or a positive "
            "multiple of 8"
        )
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ModelLoadError(
                f"quantization_config.version = {version!r}: pagedserve loads AWQ's GEMM "
                "layout (version 'gemm'), not GEMV or other kernel-specific layouts"
            )
        if qc.get("zero_point") is False:
            raise ModelLoadError("quantization_config.zero_point = false: AWQ GEMM needs zeros")
        listed = qc.get("modules_to_not_convert") or []
        skipped = [m for m in listed if m.rsplit(".", 1)[-1] not in NEVER_QUANTIZED]
        if skipped:
            raise ModelLoadError(
                f"quantization_config.modules_to_not_convert = {skipped}: pagedserve quantizes "
                "every decoder-layer projection alike and cannot leave some unquantized"
            )
        return Int4Config("awq", group_size)
    fmt = str(_field(qc, "checkpoint_format", "format", default="gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ModelLoadError(
            f"quantization_config.checkpoint_format = {fmt!r}: pagedserve loads the 'gptq' "
            "and 'gptq_v2' layouts"
        )
    offset = 1 if fmt == "gptq" else 0
    return Int4Config("gptq", group_size, bool(qc.get("desc_act", False)), offset)


@dataclass(frozen=True)
class _Packed:
    """How a stored tensor's axes relate to the logical ``[out, in]`` weight: which axis
    holds output channels (``None``: the tensor is whole on every part, like ``g_idx``) and
    how many per entry (8 when packed), and which axis holds input features and how many per
    entry (8 packed, ``group_size`` for per-group tensors; ``None``: replicated)."""

    out_dim: int | None
    out_per: int
    in_dim: int
    in_per: int | None


class Int4LinearMethod(LinearMethodBase):
    """AWQ or GPTQ weights, loaded as stored and repacked for the 4-bit kernel."""

    def __init__(self, config: Int4Config, workspace: Int4Workspace) -> None:
        self.config = config
        self.workspace = workspace
        self.layout: dict[str, _Packed] = {}
        self.whole_loaded: set[str] = set()
        self.cpu_rows = False  # held as INT4_GROUPS rows (kernels/cpu/int4_linear.py)

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_rank: int,
        output_sizes_per_rank: list[int],
        dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        k, n = input_size_per_rank, sum(output_sizes_per_rank)
        total_in = getattr(layer, "input_size", k)  # only a row-parallel layer shards it
        row_sharded = total_in != k
        gs = self.config.group_size
        self.group_size = k if gs == -1 else gs  # -1: one group, whatever the rank holds
        replicated_groups = row_sharded and (gs == -1 or self.config.desc_act)
        if gs == -1:
            groups = 1
        else:
            groups = -(-(total_in if replicated_groups else k) // gs)
        if k % PACK or any(size % PACK for size in output_sizes_per_rank):
            raise ModelLoadError(
                f"4-bit {self.config.method} needs features in multiples of 8 per rank; this "
                f"layer holds {k} input and {output_sizes_per_rank} output features"
            )
        if row_sharded and not replicated_groups and k % self.group_size:
            raise ModelLoadError(
                f"a tensor-parallel shard of {k} input features does not end on a group "
                f"boundary (group_size {gs}): use a tensor_parallel_size that divides the groups"
            )
        per_group = None if replicated_groups else self.group_size
        if self.config.method == "awq":
            specs = {
                "qweight": ((k, n // PACK), torch.int32, _Packed(1, PACK, 0, 1)),
                "qzeros": ((groups, n // PACK), torch.int32, _Packed(1, PACK, 0, per_group)),
                "scales": ((groups, n), torch.float32, _Packed(1, 1, 0, per_group)),
            }
        else:
            specs = {
                "qweight": ((k // PACK, n), torch.int32, _Packed(1, 1, 0, PACK)),
                "qzeros": ((groups, n // PACK), torch.int32, _Packed(1, PACK, 0, per_group)),
                "scales": ((groups, n), torch.float32, _Packed(1, 1, 0, per_group)),
                "g_idx": ((k,), torch.int32, _Packed(None, 1, 0, 1)),
            }
        for name, (shape, param_dtype, packed) in specs.items():
            param = loadable_param(shape, param_dtype, weight_loader)
            param.int4_name = name  # type: ignore[attr-defined]
            setattr(layer, name, param)
            self.layout[name] = packed

    def load_weight(self, param: nn.Parameter, loaded: Loaded, shard: WeightShard) -> None:
        name = param.int4_name  # type: ignore[attr-defined]
        packed = self.layout[name]
        what = f"{shard.what} {name} ({self.config.describe()})"
        dim, per = (packed.out_dim, packed.out_per) if shard.dim == 0 else (0, packed.in_per)
        if dim is None or per is None:  # whole on every rank and every fused part
            self._load_whole(param, loaded, name, what)
            return
        whole_words = per == PACK and shard.size % per
        if shard.start % per or shard.param_offset % per or whole_words:
            raise ModelLoadError(f"{what}: a shard of {shard.size} features is not whole words")
        size, total = -(-shard.size // per), -(-shard.total // per)
        load_shard(
            param, loaded, WeightShard(dim, shard.start // per, size, total, what,
                                       shard.param_offset // per)
        )  # fmt: skip

    def _load_whole(self, param: nn.Parameter, loaded: Loaded, name: str, what: str) -> None:
        if name not in self.whole_loaded:
            copy_shard(param.data, loaded, what)
            self.whole_loaded.add(name)
            return
        again = torch.empty_like(param.data)
        copy_shard(again, loaded, what)
        if not torch.equal(again, param.data):
            raise ModelLoadError(
                f"{what}: the fused projections' {name} differ (q/k/v and gate/up share one "
                "input, so one act-order permutation); this checkpoint cannot be fused"
            )

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        gptq = self.config.method == "gptq"
        q, zeros = unpack_int4(layer.qweight.data, layer.qzeros.data, self.config)
        scales = layer.scales.data
        g_idx = layer.g_idx.data if gptq else None
        for name in list(self.layout):
            delattr(layer, name)
        perm, g_idx = self._sort_groups(g_idx, q.shape[0], scales.shape[0])
        if perm is not None:
            q = q.index_select(0, perm)
        zeros = zeros.to(torch.uint8)
        self.cpu_rows = g_idx is None and kernel_path(q, has_numba=True) == "numba"
        if self.cpu_rows:  # a CPU's GEMM reads one output feature's groups per row of bytes
            from pagedserve.kernels.cpu.int4_linear import int4_group_rows

            rows = int4_group_rows(q, scales, zeros, self.group_size)
            layer.qrows = nn.Parameter(rows, requires_grad=False)
        else:
            layer.qweight = nn.Parameter(pack_int4_rows(q), requires_grad=False)
            layer.scales = nn.Parameter(scales, requires_grad=False)
            layer.zeros = nn.Parameter(zeros, requires_grad=False)
        layer.register_buffer("g_idx", g_idx, persistent=False)
        layer.register_buffer("input_perm", perm, persistent=False)

    def _sort_groups(
        self, g_idx: torch.Tensor | None, k: int, groups: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(perm, sorted g_idx)``: the input order that makes each group one run, and each
        sorted feature's group where the runs are not ``group_size`` long (None: k // gs)."""
        if g_idx is None:
            return None, None
        contiguous = torch.arange(k, device=g_idx.device) // self.group_size
        if not self.config.desc_act:  # a row shard's groups start at its first one
            if not torch.equal(g_idx.long() - int(g_idx[0]), contiguous):
                raise ModelLoadError(
                    "g_idx is not the contiguous grouping, but quantization_config.desc_act "
                    "is false: the checkpoint's config disagrees with its tensors"
                )
            return None, None
        if torch.equal(g_idx.long(), contiguous):
            return None, None
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise ModelLoadError(
                f"g_idx holds groups {int(g_idx.min())}..{int(g_idx.max())}, but the layer "
                f"has {groups} groups of scales ({self.config.describe()})"
            )
        perm = torch.sort(g_idx.long(), stable=True).indices
        sorted_groups = g_idx.index_select(0, perm)
        if torch.equal(sorted_groups.long(), contiguous):
            return perm, None
        return perm, sorted_groups.to(torch.int32).contiguous()

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if layer.input_perm is not None:
            x = x.index_select(-1, layer.input_perm)
        if self.cpu_rows:
            from pagedserve.kernels.cpu.int4_linear import int4_rows_linear

            return int4_rows_linear(x, layer.qrows, bias)
        return int4_linear(
            x, layer.qweight, layer.scales, layer.zeros, self.group_size, layer.g_idx, bias,
            self.workspace,
        )  # fmt: skip


def unpack_int4(
    qweight: torch.Tensor, qzeros: torch.Tensor, config: Int4Config
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [in, out], zeros [groups, out])``, values 0..15 (the zeros with the format's
    offset added) from one layer's stored words, whichever format packed them."""
    if config.method == "gptq":  # packed along the input features: unpack the transpose's columns
        q, order = unpack_columns(qweight.t(), GPTQ_ORDER).t(), GPTQ_ORDER
    else:
        q, order = unpack_columns(qweight, AWQ_ORDER), AWQ_ORDER
    return q, unpack_columns(qzeros, order) + config.zero_offset


def dequantize_int4(stored: dict[str, torch.Tensor], config: Int4Config) -> torch.Tensor:
    """The ``[out, in]`` fp32 weight that one layer's stored tensors (``qweight``, ``qzeros``,
    ``scales``, GPTQ's ``g_idx``) encode: ``(q - zero[g]) * scale[g]``, ``g`` each input
    feature's group. For weights held unquantized once loaded: an MoE's experts
    (moe_quantized.py)."""
    q, zeros = unpack_int4(stored["qweight"], stored["qzeros"], config)
    if "g_idx" in stored:
        groups = stored["g_idx"].long()
        if groups.numel() and (int(groups.min()) < 0 or int(groups.max()) >= zeros.shape[0]):
            raise ModelLoadError(
                f"g_idx holds groups {int(groups.min())}..{int(groups.max())}, but the "
                f"projection has {zeros.shape[0]} groups of zeros ({config.describe()})"
            )
    else:
        size = q.shape[0] if config.group_size == -1 else config.group_size
        groups = torch.arange(q.shape[0]) // size
    scales = stored["scales"].float()
    return ((q - zeros[groups]).float() * scales[groups]).t().contiguous()


def unpack_columns(packed: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """``[R, C]`` int32 words -> ``[R, 8C]`` values 0..15, where nibble ``i`` of word ``c``
    holds column ``8c + order[i]``."""
    shifts = torch.tensor(_SHIFTS, dtype=torch.int32, device=packed.device)
    nibbles = (packed[..., None] >> shifts) & 0xF  # [R, C, 8]: nibble i
    where = torch.tensor([order.index(j) for j in range(PACK)], device=packed.device)
    return nibbles.index_select(-1, where).reshape(packed.shape[0], -1)


def int4_method_factory(qc: dict[str, Any]) -> LinearMethodFactory:
    """One fresh method per linear layer, all sharing the model's dequantization workspace."""
    config = parse_int4_config(qc)
    workspace = Int4Workspace()
    return lambda: Int4LinearMethod(config, workspace)
