"""Building a model from a GGUF file, its weights kept in their blocks.

The model class is the one a Hugging Face folder of the same architecture builds; after it
is built, each decoder projection is handed the GGUF linear method and the embedding and LM
head their GGUF forms (quantization_gguf.py), then the file's tensors are loaded under
transformers' names. Built on a CPU, the unquantized weights those layers were created with
are never touched (``torch.empty``) and are freed before loading; on a GPU they are freed
and the cache emptied, as the on-the-fly methods do.

llama.cpp's converter permutes the rows of Llama's Q and K projections (per head, the two
rotary halves interleaved, for its rotary layout); loading undoes it, on the rows of blocks,
which move whole because blocks run along the input features.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from pagedserve.kernels.dispatch import kernel_path
from pagedserve.models.config import ModelConfig, ModelLoadError
from pagedserve.models.gguf_config import gguf_architecture, open_gguf
from pagedserve.models.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagedserve.models.parallel import ParallelContext
from pagedserve.models.quantization_gguf import (
    GGUFEmbedding,
    GGUFLinearMethod,
    GGUFLMHead,
    GGUFTensor,
)

_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_SKIPPED = {"rope_freqs.weight"}  # read into the config's rope scaling (gguf_config.py)


def hf_name(name: str) -> str:
    """The transformers name of a GGUF tensor (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``)."""
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    m = _BLOCK.fullmatch(name)
    if m is None or m.group(2) not in _PER_LAYER:
        raise ModelLoadError(f"GGUF tensor {name!r} has no counterpart in the model")
    return f"model.layers.{m.group(1)}.{_PER_LAYER[m.group(2)]}.{m.group(3)}"


def unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation: its row ``(h, i, j)`` (head, rotary pair, half)
    is transformers' row ``(h, j, i)``."""
    n = rows.shape[0]
    order = np.arange(n).reshape(n_head, n // n_head // 2, 2).transpose(0, 2, 1).reshape(-1)
    return rows[order]


def gguf_weights(reader, config: ModelConfig) -> Iterator[tuple[str, GGUFTensor | torch.Tensor]]:
    """Each tensor under its transformers name: a matrix as a ``GGUFTensor`` over its rows of
    blocks, a vector (norms, biases) decoded into the model's dtype."""
    _, _, permuted = gguf_architecture(reader, Path(config.model))
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_kv_heads}
    for t in reader.tensors:
        if t.name in _SKIPPED:
            continue
        name = hf_name(t.name)
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists the fastest dim first
        rows = np.asarray(t.data).view(np.uint8).reshape(shape[0] if len(shape) == 2 else 1, -1)
        kind = t.name.split(".")[2] if t.name.startswith("blk.") else ""
        if permuted and kind in heads:
            rows = unpermute_rows(rows, heads[kind])
        tensor = GGUFTensor(
            rows, int(t.tensor_type), shape if len(shape) == 2 else (1, shape[0]), t.name
        )
        if len(shape) == 2:
            yield name, tensor
        else:
            yield name, tensor.dequantize().reshape(shape).to(config.torch_dtype)


def _swap_in_gguf_layers(model: nn.Module, config: ModelConfig, par: ParallelContext) -> None:
    """Hand every projection the GGUF method (freeing the weight it was built with) and give
    the model its GGUF embedding and LM head, the head tied to the embedding's bytes when
    the file has no ``output.weight``."""
    method = GGUFLinearMethod()
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear | RowParallelLinear):
            out_features, in_features = module.weight.shape
            del module.weight
            module.linear_method = method
            method.create_weights(
                module, in_features, [out_features], config.torch_dtype, module.weight_loader
            )
    shard = par.shard_args()
    model.model.embed_tokens = GGUFEmbedding(
        config.vocab_size, dtype=config.torch_dtype, all_reduce=par.all_reduce, **shard
    )
    model.lm_head = GGUFLMHead(
        config.vocab_size, dtype=config.torch_dtype, gather=par.gather, **shard
    )
    if model.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight


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
    model.load_weights(gguf_weights(reader, config))
    for module in model.modules():
        if isinstance(module.__dict__.get("linear_method"), GGUFLinearMethod):
            module.linear_method.process_weights_after_loading(module)
    if config.torch_device.type == "cuda":
        torch.cuda.empty_cache()
    elif kernel_path(torch.empty(0), has_numba=True) == "numba":
        from pagedserve.kernels.cpu.gguf_linear import warm_up

        warm_up()  # numba compiles (or loads) the GGUF GEMM now, not in the first request
    return model.eval()
