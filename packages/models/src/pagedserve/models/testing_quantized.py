"""Quantized test checkpoints, made here from an unquantized folder: AWQ, GPTQ and fp8.

A round-to-nearest quantizer (no calibration data: the layouts are what is under test, not
the quantizer's accuracy) encodes each decoder-layer projection and writes it the way
AutoAWQ (GEMM), AutoGPTQ/gptqmodel (``gptq`` and ``gptq_v2``) and AutoFP8/vLLM store it, with
the matching ``quantization_config``. Beside each quantized folder it can write the
*dequantized* folder: the same model with every projection replaced by exactly what was
encoded, in fp32 and unquantized, the reference a quantized engine must reproduce.

GPTQ's act-order is imitated with a fixed random permutation per input (q/k/v share one,
gate/up another, as their shared input gives them one Hessian order in real GPTQ): features
are grouped in that order, so ``g_idx`` is a real permutation of groups.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pagedserve.kernels.int4_linear import PACK, pack_int4
from pagedserve.kernels.weight_only_linear import quantize_per_channel
from pagedserve.models.quantization_int4 import AWQ_ORDER

# The decoder layers' projections, an MoE's experts' among them (Mixtral's w1 / w3 / w2 are its
# experts' gate / up / down); routers and Qwen2-MoE's one-output expert gate stay unquantized,
# as AutoAWQ and GPTQ releases keep them.
PROJECTIONS = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3",
)  # fmt: skip
_SHARED_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj", "w3": "w1"}


@dataclass(frozen=True)
class Int4Layout:
    """Which on-disk layout to write: ``method`` awq or gptq; GPTQ's ``sym``, ``act_order``
    and ``v2`` (the ``gptq_v2`` format: zero points stored as they are, not minus one)."""

    method: str
    group_size: int = 32
    sym: bool = False
    act_order: bool = False
    v2: bool = False

    def quantization_config(self) -> dict:
        if self.method == "awq":
            return {"quant_method": "awq", "bits": 4, "group_size": self.group_size,
                    "zero_point": True, "version": "gemm", "modules_to_not_convert": None}  # fmt: skip
        return {"quant_method": "gptq", "bits": 4, "group_size": self.group_size,
                "desc_act": self.act_order, "sym": self.sym, "true_sequential": True,
                "checkpoint_format": "gptq_v2" if self.v2 else "gptq"}  # fmt: skip


def rtn_quantize(
    weight: torch.Tensor, group_size: int, sym: bool, perm: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit groups of a ``[N, K]`` weight: ``(q [K, N] 0..15, zeros [G, N]
    0..15, scales [G, N] fp16, g_idx [K])``; groups run over the input features in ``perm``'s
    order (act-order) or in order. ``W ~ (q - zeros[g]) * scales[g]``."""
    n, k = weight.shape
    gs = k if group_size == -1 else group_size
    order = perm if perm is not None else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // gs).to(torch.int32)
    groups = -(-k // gs)
    w = weight.float().t()[order]  # [K, N], features in quantization order
    pad = groups * gs - k  # a last, shorter group is padded with copies of its first row
    if pad:
        w = torch.cat([w, w[-(k % gs) :][:1].expand(pad, n)])
    wg = w.view(groups, gs, n)
    if sym:
        scales = (2 * wg.abs().amax(1) / 15).clamp_min(1e-6).half()
        zeros = torch.full((groups, n), 8, dtype=torch.int32)
    else:
        lo, hi = wg.amin(1).clamp(max=0), wg.amax(1).clamp(min=0)
        scales = ((hi - lo) / 15).clamp_min(1e-6).half()
        zeros = (-lo / scales.float()).round().clamp(0, 15).to(torch.int32)
    ordered = (wg / scales.float()[:, None] + zeros[:, None]).round().clamp(0, 15)
    q = torch.empty(k, n, dtype=torch.int32)
    q[order] = ordered.reshape(-1, n)[:k].to(torch.int32)
    return q, zeros, scales, g_idx


def dequantize_rtn(q, zeros, scales, g_idx) -> torch.Tensor:
    """The ``[N, K]`` fp32 weight that ``rtn_quantize``'s output encodes."""
    g = g_idx.long()
    return ((q.float() - zeros[g].float()) * scales[g].float()).t().contiguous()


def pack_columns(values: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """``[R, 8C]`` values 0..15 -> ``[R, C]`` int32, nibble ``i`` of word ``c`` holding column
    ``8c + order[i]``."""
    r, n = values.shape
    grouped = values.view(r, n // PACK, PACK)[..., list(order)]
    return pack_int4(grouped, dim=2)


def int4_tensors(layout: Int4Layout, q, zeros, scales, g_idx) -> dict[str, torch.Tensor]:
    """The stored tensors of one layer in ``layout``."""
    if layout.method == "awq":
        return {
            "qweight": pack_columns(q, AWQ_ORDER),
            "qzeros": pack_columns(zeros, AWQ_ORDER),
            "scales": scales,
        }
    stored_zeros = zeros if layout.v2 else zeros - 1  # gptq v1 stores zero - 1 ...
    stored_zeros = stored_zeros & 0xF  # ... in 4 bits, so a zero of 0 wraps to 15
    return {
        "qweight": pack_columns(q.t().contiguous(), tuple(range(PACK))).t().contiguous(),
        "qzeros": pack_columns(stored_zeros, tuple(range(PACK))),
        "scales": scales,
        "g_idx": g_idx,
    }


def _projection(name: str) -> str | None:
    parts = name.split(".")
    if ".layers." in name and parts[-1] == "weight" and parts[-2] in PROJECTIONS:
        return parts[-2]
    return None


def _write(src: Path, dst: Path, tensors: dict, quantization_config: dict | None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in tensors.items()}, dst / "model.safetensors")
    return dst


def quantize_int4_checkpoint(
    src: str | Path, dst: str | Path, layout: Int4Layout, dequantized: str | Path | None = None
) -> Path:
    """Write ``src`` (one model.safetensors) quantized in ``layout`` to ``dst``; with
    ``dequantized``, also the fp32 model that the quantized one encodes."""
    src = Path(src)
    state = load_file(src / "model.safetensors")
    quantized, plain = {}, {}
    perms: dict[tuple[str, str], torch.Tensor] = {}
    for name, tensor in state.items():
        proj = _projection(name)
        if proj is None:
            quantized[name] = plain[name] = tensor
            continue
        perm = None
        if layout.act_order:
            key = (name.rsplit(".", 3)[0], _SHARED_INPUT.get(proj, proj))
            if key not in perms:
                gen = torch.Generator().manual_seed(len(perms) + 1)
                perms[key] = torch.randperm(tensor.shape[1], generator=gen)
            perm = perms[key]
        q, zeros, scales, g_idx = rtn_quantize(tensor, layout.group_size, layout.sym, perm)
        base = name.removesuffix(".weight")
        for suffix, stored in int4_tensors(layout, q, zeros, scales, g_idx).items():
            quantized[f"{base}.{suffix}"] = stored
        if dequantized is not None:  # the fp32 reference is a quarter of the time: on demand
            if layout.method == "gptq" and not layout.v2:  # what the stored 15 decodes to
                zeros = torch.where(zeros == 0, 16, zeros)
            plain[name] = dequantize_rtn(q, zeros, scales, g_idx)
    if dequantized is not None:
        _write(src, Path(dequantized), {k: v.float() for k, v in plain.items()}, None)
    return _write(src, Path(dst), quantized, layout.quantization_config())


def quantize_fp8_checkpoint(
    src: str | Path,
    dst: str | Path,
    per_channel: bool = False,
    static: bool = False,
    dequantized: str | Path | None = None,
) -> Path:
    """Write ``src`` with fp8 e4m3 projections (per-tensor or per-channel ``weight_scale``,
    and an ``input_scale`` each when ``static``), as AutoFP8 / vLLM's fp8 format stores it."""
    src = Path(src)
    state = load_file(src / "model.safetensors")
    quantized, plain = {}, {}
    for name, tensor in state.items():
        if _projection(name) is None:
            quantized[name] = plain[name] = tensor
            continue
        w = tensor.float()
        if per_channel:
            qweight, scale = quantize_per_channel(w, "fp8")
            quantized[name + "_scale"] = scale[:, None]  # [out, 1], as compressed-tensors
        else:
            scale = (w.abs().max() / 448.0).reshape(())
            qweight = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            quantized[name + "_scale"] = scale
        quantized[name] = qweight
        if static:
            quantized[name.removesuffix("weight") + "input_scale"] = torch.tensor(0.02)
        plain[name] = qweight.float() * (scale[:, None] if per_channel else scale)
    if dequantized is not None:
        _write(src, Path(dequantized), {k: v.float() for k, v in plain.items()}, None)
    scheme = "static" if static else "dynamic"
    config = {"quant_method": "fp8", "activation_scheme": scheme, "ignored_layers": ["lm_head"]}
    return _write(src, Path(dst), quantized, config)
