"""Building a model from a GGUF file, its weights kept in their blocks.

The model class is the one a Hugging Face folder of the same architecture builds; after it
is built, each decoder projection is handed the GGUF linear method and the embedding and LM
head their GGUF forms (quantization_gguf.py), then the file's tensors are loaded under
transformers' names (gguf_tensor_names.py), through the model's own ``load_weights``. Built
on a CPU, the unquantized weights those layers were created with are never touched
(``torch.empty``) and are freed before loading; on a GPU they are freed and the cache
emptied, as the on-the-fly methods do.

What stays in blocks: every linear layer's weight, the embedding and the LM head. What is
decoded into the model's dtype on load: what the model holds as plain tensors, whatever the
file's type. That is norms and biases, the routers, DeepSeek's ``kv_b_proj`` (its attention
reads the per-head blocks directly), GPT-2's position embedding, and the experts of MoE models:
there is no quantized MoE kernel, so a Q4_0 expert costs its full-precision bytes once loaded.
Experts may also be MXFP4 (gpt-oss's files), which nothing multiplies in blocks (mxfp4.py).

What llama.cpp's converter did to the tensors is undone here (gguf_tensor_names.py lists it):
Llama's Q/K rows are un-permuted (on the rows of blocks, which move whole because blocks run
along the input features), Gemma's ``1 + w`` norms lose their one, GPT-2's matrices are
handed over as the transposes of its Conv1D layout, each layer's stacked experts are split,
DeepSeek's ``attn_k_b`` / ``attn_v_b`` are put back together as ``kv_b_proj``, and gpt-oss's
``ffn_gate_exps`` / ``ffn_up_exps`` as ``gate_up_proj``, their rows interleaved again.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pagedserve.kernels.dispatch import kernel_path
from pagedserve.models.config import ModelConfig, ModelLoadError
from pagedserve.models.gguf_config import field, forget_gguf_readers, open_gguf
from pagedserve.models.gguf_tensor_names import CONFIG_TENSORS, TENSOR_NAMES, TensorNames
from pagedserve.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedserve.models.parallel import ParallelContext
from pagedserve.models.pipeline import stage_weights
from pagedserve.models.quantization_gguf import (
    GGUFEmbedding,
    GGUFLinearMethod,
    GGUFLMHead,
    GGUFTensor,
)

Weight = tuple[str, GGUFTensor | torch.Tensor]


def unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation: its row ``(h, i, j)`` (head, rotary pair, half)
    is transformers' row ``(h, j, i)``."""
    n = rows.shape[0]
    order = np.arange(n).reshape(n_head, n // n_head // 2, 2).transpose(0, 2, 1).reshape(-1)
    return rows[order]


def _file_tensor(t) -> GGUFTensor:
    """A GGUF tensor as a matrix of rows of blocks: every dimension but the fastest (the
    input features, along which blocks run) flattened into the rows."""
    shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists the fastest dim first
    rows = int(np.prod(shape[:-1], dtype=np.int64))
    raw = np.asarray(t.data).view(np.uint8).reshape(rows, -1)
    return GGUFTensor(raw, int(t.tensor_type), (rows, shape[-1]), t.name)


def _experts(names: TensorNames, t, tensor: GGUFTensor) -> Iterator[Weight]:
    """``blk.{n}.ffn_{gate,up,down}_exps``, ``[experts, out, in]``: each expert's rows."""
    layer, kind = int(t.name.split(".")[1]), t.name.split(".")[2]
    count = int(t.shape[2])
    out = tensor.shape[0] // count
    for e, name in enumerate(names.expert_names(layer, kind.split("_")[1], count)):
        yield name, tensor.narrow(0, e * out, out)


class InterleavedExperts(Sequence):
    """A layer's experts as gpt-oss's checkpoint stacks them, from a GGUF's ``parts`` (gate and
    up, or down alone, each ``[experts * out, in]``): expert ``e``'s ``[out, in]`` rows, the
    parts' rows interleaved (gate even, up odd), decoded only when the model asks for it (a
    layer's experts decoded at once would take gigabytes)."""

    def __init__(self, parts: list[GGUFTensor], count: int) -> None:
        self.parts, self.count = parts, count
        self.rows = parts[0].shape[0] // count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, e: int) -> torch.Tensor:
        if not 0 <= e < self.count:
            raise IndexError(f"expert {e} of {self.count}")
        rows = [part.narrow(0, e * self.rows, self.rows).dequantize() for part in self.parts]
        return torch.stack(rows, dim=1).flatten(0, 1)


def _stacked_experts(names: TensorNames, t, tensor: GGUFTensor, split: dict) -> Iterator[Weight]:
    """gpt-oss's ``ffn_{gate,up,down}_exps`` (weights ``[experts, out, in]``, biases
    ``[experts, out]``) under its checkpoint's stacked names: ``down_proj`` at once,
    ``gate_up_proj`` when the layer's gate and up have both come (``split`` holds the first)."""
    _, layer, kind, what = t.name.split(".")
    if kind == "ffn_down_exps":
        projection, ordered = "down_proj", [tensor]
    else:
        parts = split.setdefault((layer, what), {})
        parts[kind] = tensor
        if len(parts) < 2:
            return
        projection, ordered = "gate_up_proj", [parts["ffn_gate_exps"], parts["ffn_up_exps"]]
    name = names.stacked_expert_name(int(layer), projection, what)
    if what == "bias":  # [experts, out] each, decoded whole: they are small
        yield name, torch.stack([p.dequantize() for p in ordered], dim=-1).flatten(-2)
    else:
        yield name, InterleavedExperts(ordered, int(t.shape[-1]))


def _kv_b(k_b: GGUFTensor, v_b: GGUFTensor, heads: int) -> torch.Tensor:
    """DeepSeek's ``kv_b_proj`` ``[heads * (nope + v), kv_lora]`` from llama.cpp's
    ``attn_k_b`` ``[heads, kv_lora, nope]`` (each head's key rows, transposed) and
    ``attn_v_b`` ``[heads, v, kv_lora]``."""
    k = k_b.dequantize().reshape(heads, -1, k_b.shape[1]).transpose(1, 2)
    v = v_b.dequantize().reshape(heads, -1, v_b.shape[1])
    return torch.cat([k, v], dim=1).reshape(-1, v_b.shape[1])


def gguf_weights(reader, config: ModelConfig) -> Iterator[Weight]:
    """Each tensor under its transformers name: a matrix as a ``GGUFTensor`` over its rows of
    blocks, a vector (norms, biases) decoded into the model's dtype."""
    names = TENSOR_NAMES[field(reader, "general.architecture")]
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_kv_heads}
    latent_up: dict[int, dict[str, GGUFTensor]] = {}  # DeepSeek's k_b and v_b, per layer
    split: dict = {}  # gpt-oss's gate or up experts, waiting for the other
    for t in reader.tensors:
        if t.name in CONFIG_TENSORS:
            continue
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        tensor = _file_tensor(t)
        if kind.endswith("_exps") and names.stacked_experts:
            yield from _stacked_experts(names, t, tensor, split)
        elif kind.endswith("_exps"):
            yield from _experts(names, t, tensor)
        elif kind in ("attn_k_b", "attn_v_b"):
            parts = latent_up.setdefault(int(t.name.split(".")[1]), {})
            parts[kind] = tensor
            if len(parts) == 2:
                name = names.hf_name(t.name.replace(kind, "attn_kv_b"))
                yield name, _kv_b(parts["attn_k_b"], parts["attn_v_b"], int(t.shape[2]))
        elif len(t.shape) == 1:
            yield names.hf_name(t.name), _vector(names, t.name, kind, tensor, heads, config)
        else:
            if names.permuted_qk and kind in heads:
                tensor = GGUFTensor(
                    unpermute_rows(tensor.raw, heads[kind]), tensor.qtype, tuple(tensor.shape),
                    t.name,
                )  # fmt: skip
            yield names.hf_name(t.name), tensor.t() if kind in names.conv1d else tensor


def _vector(names: TensorNames, name: str, kind: str, tensor, heads, config) -> torch.Tensor:
    """A 1-D tensor decoded: Q/K biases un-permuted, Gemma's norms less their one."""
    vector = tensor.dequantize().reshape(-1)
    if names.permuted_qk and kind in heads:
        vector = torch.from_numpy(unpermute_rows(vector.numpy(), heads[kind]))
    if names.norm_offset and name.endswith("norm.weight"):
        vector = vector - names.norm_offset
    return vector.to(config.torch_dtype)


def _swap_in_gguf_layers(model: nn.Module, config: ModelConfig, par: ParallelContext) -> None:
    """Hand every projection the GGUF method (freeing the weight it was built with) and give
    the model its GGUF embedding and LM head, the head tied to the embedding's bytes when
    the config says tied (the file has no ``output.weight``)."""
    method = GGUFLinearMethod()
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear | RowParallelLinear):
            out_features, in_features = module.weight.shape
            del module.weight
            module.linear_method = method
            method.create_weights(
                module, in_features, [out_features], config.torch_dtype, module.weight_loader
            )
    shard, swapped = par.shard_args(), {}
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is VocabParallelEmbedding:
                new = GGUFEmbedding(
                    config.vocab_size, dtype=config.torch_dtype, all_reduce=par.all_reduce,
                    **shard,
                )  # fmt: skip
            elif type(child) is ParallelLMHead:
                new = GGUFLMHead(
                    config.vocab_size, dtype=config.torch_dtype, gather=par.gather, **shard
                )
            else:
                continue
            setattr(parent, child_name, new)
            swapped[type(child)] = new
    head, embedding = swapped.get(ParallelLMHead), swapped.get(VocabParallelEmbedding)
    if head is not None and embedding is not None and config.hf_config.get("tie_word_embeddings"):
        head.weight = embedding.weight  # (a later pipeline stage loads the tensor as its head)


def return_freed_memory() -> None:
    """Give the C allocator's free pages back to the system (glibc's ``malloc_trim``): a load's
    transients (records, decoded vectors, the parts of fused weights) leave ~100 MB it would
    otherwise keep for later allocations the engine never makes."""
    import ctypes

    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # the process's own C library
    if trim is not None:  # glibc's; other C libraries have none
        trim(0)


def load_gguf_model(config: ModelConfig, model_cls, par: ParallelContext | None = None):
    """``model_cls`` built for ``config`` (a GGUF's), its weights loaded from the file."""
    par = par or ParallelContext()
    if config.quantization is not None:
        raise ModelLoadError(
            f"{config.model} is a GGUF file, already quantized by type per tensor; "
            f"--quantization {config.quantization} does not apply to it"
        )
    reader = open_gguf(config.model)
    with torch.device(config.torch_device):
        model = model_cls(config, par)
        _swap_in_gguf_layers(model, config, par)
    try:
        model.load_weights(
            stage_weights(gguf_weights(reader, config), par.stage, config.num_layers)
        )
    except ModelLoadError as e:
        raise ModelLoadError(f"{Path(config.model)}: {e}") from e
    for module in model.modules():
        if isinstance(module.__dict__.get("linear_method"), GGUFLinearMethod):
            module.linear_method.process_weights_after_loading(module)
    del reader
    forget_gguf_readers()  # every weight is copied out of the file by now
    return_freed_memory()
    if config.torch_device.type == "cuda":
        torch.cuda.empty_cache()
    elif kernel_path(torch.empty(0), has_numba=True) == "numba":
        from pagedserve.kernels.cpu.gguf_linear import warm_up

        warm_up()  # numba compiles (or loads) the GGUF GEMM now, not in the first request
    return model.eval()
