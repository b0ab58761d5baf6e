"""GGUF weights held in their blocks: the linear method, the embedding and the LM head.

Every 2-D tensor of a GGUF file stays as the file stores it, ``uint8 [rows, row_bytes]``
rows of blocks (pagedserve.kernels.gguf_dequant has the layouts), with its ggml type id:

- ``GGUFLinearMethod`` holds a linear layer's weight so and multiplies through
  ``gguf_linear`` (Triton on a GPU; on a CPU numba, which decodes each weight row from its
  blocks as it multiplies: cpu/gguf_linear.py). A fused layer (qkv, gate_up) whose parts share a
  type holds them as one matrix, rows stacked; parts of different types (llama.cpp's
  mixtures: Q4_K_M gives V and down Q6_K) stay apart and are multiplied one by one.
- ``GGUFEmbedding`` gathers its tokens' rows and decodes only those; ``GGUFLMHead`` multiplies
  by the rows. A model with no ``output.weight`` ties the head to the embedding's bytes.

Tensor parallelism: output rows shard as they do unquantized (a rank takes whole rows). A
row-parallel layer's input features run along the blocks, so its shard must start and end on
a block boundary (32 weights, 256 for the K-quants); otherwise loading says so.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pagedserve.kernels.gguf_dequant import gguf_dequantize_ref, gguf_type
from pagedserve.kernels.gguf_linear import gguf_linear
from pagedserve.models.config import ModelLoadError
from pagedserve.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.models.layers.linear_method import (
    LinearMethodBase,
    Loaded,
    WeightLoader,
    WeightShard,
    loadable_param,
)
from pagedserve.models.mxfp4 import GGML_MXFP4, dequantize_gguf_mxfp4


class GGUFTensor:
    """One GGUF matrix as ``[out, in]`` logical features over its ``[out, row_bytes]`` rows.

    ``narrow`` along the rows is free; along the inputs it takes whole blocks only. The rows
    are a memory map of the file until ``rows()`` copies them out. A parameter that holds
    plain tensors (a router, an expert) loads one decoded: ``read()``, as it reads a
    checkpoint handle (weights.materialize).
    """

    def __init__(self, raw: np.ndarray, qtype: int, shape: tuple[int, int], name: str) -> None:
        self.raw, self.qtype, self._shape, self.name = raw, qtype, shape, name

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._shape)

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> GGUFTensor:
        out, k = self._shape
        if dim == 0:
            return GGUFTensor(self.raw[start : start + length], self.qtype, (length, k), self.name)
        t = gguf_type(self.qtype)
        if start % t.block_size or length % t.block_size:
            raise ModelLoadError(
                f"{self.name}: a shard of input features [{start}, {start + length}) does not "
                f"fall on {t.name}'s block boundaries (every {t.block_size} weights); use a "
                "tensor_parallel_size that splits this layer's inputs into whole blocks"
            )
        lo, hi = (
            start // t.block_size * t.block_bytes,
            (start + length) // t.block_size * t.block_bytes,
        )
        return GGUFTensor(self.raw[:, lo:hi], self.qtype, (out, length), self.name)

    def chunk(self, chunks: int, dim: int = 0) -> list[GGUFTensor]:
        """Equal parts along the rows (GPT-2's fused q/k/v)."""
        if dim != 0 or self._shape[0] % chunks:
            raise ModelLoadError(
                f"{self.name}: cannot split {self._shape} in {chunks} on dim {dim}"
            )
        size = self._shape[0] // chunks
        return [self.narrow(0, i * size, size) for i in range(chunks)]

    def t(self) -> TransposedGGUFTensor:
        """The matrix marked transposed, for a loader that transposes what it is given (GPT-2's,
        whose checkpoints store Conv1D weights ``[in, out]``): its own ``t()`` gives this
        matrix back. Blocks run along the input features; they are never transposed."""
        return TransposedGGUFTensor(self)

    def rows(self, device: torch.device) -> torch.Tensor:
        return torch.from_numpy(np.array(self.raw, order="C")).to(device)  # a writable copy

    def dequantize(self) -> torch.Tensor:
        """The matrix in fp32. MXFP4 (stacked experts only: gguf_config.py) decodes here
        rather than in pagedserve.kernels, whose types are the ones a GEMM multiplies."""
        rows = self.rows(torch.device("cpu"))
        if self.qtype == GGML_MXFP4:
            return dequantize_gguf_mxfp4(rows, torch.float32)
        return gguf_dequantize_ref(rows, self.qtype)

    read = dequantize


class TransposedGGUFTensor:
    """``GGUFTensor.t()``: a shape and the way back, nothing else."""

    def __init__(self, tensor: GGUFTensor) -> None:
        self.tensor = tensor

    @property
    def shape(self) -> torch.Size:
        return torch.Size(reversed(self.tensor.shape))

    def t(self) -> GGUFTensor:
        return self.tensor


def _gguf_tensor(loaded: Loaded, what: str) -> GGUFTensor:
    if not isinstance(loaded, GGUFTensor):
        raise ModelLoadError(f"the GGUF {what} expects a GGUF matrix, got {type(loaded).__name__}")
    return loaded


class GGUFLinearMethod(LinearMethodBase):
    """``layer.weight``: the GGUF rows (uint8), with ``layer.weight_type`` their type; or, for
    a fused layer of mixed types, ``layer.weight_parts`` (one ``(type, rows)`` per part)."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_rank: int,
        output_sizes_per_rank: list[int],
        dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        # The size and type of each part are the file's: the shards bring them when loaded.
        layer.weight = loadable_param((0,), torch.uint8, weight_loader)
        layer.weight.gguf_parts = {}  # type: ignore[attr-defined]
        layer.gguf_shape = (sum(output_sizes_per_rank), input_size_per_rank)

    def load_weight(self, param: nn.Parameter, loaded: Loaded, shard: WeightShard) -> None:
        tensor = _gguf_tensor(loaded, shard.what)
        if tensor.shape[shard.dim] != shard.total:
            raise ModelLoadError(
                f"GGUF tensor {tensor.name!r} has shape {tuple(tensor.shape)}; expected "
                f"{shard.total} along dimension {shard.dim} for the {shard.what}"
            )
        part = tensor.narrow(shard.dim, shard.start, shard.size)
        param.gguf_parts[shard.param_offset] = (part.qtype, part.rows(param.device), part.shape)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        parts = [layer.weight.gguf_parts[offset] for offset in sorted(layer.weight.gguf_parts)]
        rows = sum(shape[0] for _, _, shape in parts)
        if (rows, parts[0][2][1]) != layer.gguf_shape:
            raise ModelLoadError(
                f"GGUF weights of shape ({rows}, {parts[0][2][1]}) for a layer of "
                f"{layer.gguf_shape}"
            )
        types = {qtype for qtype, _, _ in parts}
        if len(types) == 1:
            layer.weight = nn.Parameter(torch.cat([r for _, r, _ in parts]), requires_grad=False)
            layer.weight_type, layer.weight_parts = types.pop(), None
        else:
            del layer.weight
            layer.weight_parts = nn.ParameterList(
                nn.Parameter(r, requires_grad=False) for _, r, _ in parts
            )
            layer.weight_part_types = [qtype for qtype, _, _ in parts]

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if layer.weight_parts is None:
            return gguf_linear(x, layer.weight, layer.weight_type, bias)
        outs = [gguf_linear(x, w, t) for w, t in zip(layer.weight_parts, layer.weight_part_types)]
        out = torch.cat(outs, dim=-1)
        return out if bias is None else out + bias


class GGUFEmbedding(VocabParallelEmbedding):
    """The vocabulary's rows in their GGUF blocks; a lookup decodes the looked-up rows only,
    into ``dtype``."""

    def __init__(self, vocab_size: int, dtype: torch.dtype = torch.float32, **kw) -> None:
        super().__init__(vocab_size, 0, dtype=dtype, **kw)  # no rows of floats allocated
        self.out_dtype = dtype
        self.weight = loadable_param((0,), torch.uint8, self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded) -> None:
        tensor = _gguf_tensor(loaded, "embedding")
        if tensor.shape[0] != self.vocab_size:
            raise ModelLoadError(
                f"GGUF {tensor.name!r} has {tensor.shape[0]} rows; expected {self.vocab_size}"
            )
        rows = tensor.narrow(0, self.vocab_start, self.vocab_end - self.vocab_start)
        data = torch.zeros(self.vocab_per_rank, tensor.raw.shape[1], dtype=torch.uint8)
        data[: rows.shape[0]] = rows.rows(torch.device("cpu"))  # padding rows decode to zeros
        param.data = data.to(param.device)
        param.gguf_type = tensor.qtype  # type: ignore[attr-defined]

    def lookup(self, local_ids: torch.Tensor) -> torch.Tensor:
        rows = self.weight[local_ids.reshape(-1)]
        out = gguf_dequantize_ref(rows, self.weight.gguf_type).to(self.out_dtype)
        return out.reshape(*local_ids.shape, -1)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.lookup(token_ids)
        in_shard = (token_ids >= self.vocab_start) & (token_ids < self.vocab_end)
        local = torch.where(in_shard, token_ids - self.vocab_start, 0)
        out = self.lookup(local) * in_shard.unsqueeze(-1).to(self.out_dtype)
        return self.all_reduce(out) if self.all_reduce is not None else out


class GGUFLMHead(ParallelLMHead):
    """Logits through ``gguf_linear`` on the head's rows (its own, or the embedding's)."""

    def __init__(self, vocab_size: int, dtype: torch.dtype = torch.float32, **kw) -> None:
        super().__init__(vocab_size, 0, dtype=dtype, **kw)
        self.weight = loadable_param((0,), torch.uint8, self.weight_loader)

    weight_loader = GGUFEmbedding.weight_loader

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = gguf_linear(hidden, self.weight, self.weight.gguf_type)
        if self.tp_size > 1 and self.gather is not None:
            logits = self.gather(logits)
        return logits[..., : self.vocab_size]
