"""GGUF files made here from the tiny random checkpoints (testing.py), for tests: no download.

``write_gguf(folder, path, recipe)`` writes a Hugging Face folder of any architecture with a
GGUF form as llama.cpp's converter would (gguf_testing_converter.py: its metadata keys, its
tensor names, what it does to the tensors), its tokenizer as ``tokenizer.ggml.*`` (a
byte-level BPE: the ``gpt2`` tokenizer model) with the chat template, and each matrix in the
type ``recipe(name)`` picks (a stacked experts tensor too: its rows are quantized alike). The
block types gguf can encode (F16, BF16, Q8_0, Q4_0, Q4_1) are encoded by
``gguf.quants.quantize``; for Q4_K and Q6_K, which it only decodes, ``quantize_q4_k`` /
``quantize_q6_k`` here round to nearest
(llama.cpp searches for better scales; any valid blocks do for a test, and the tests prove
these against gguf's own decoder).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np


def _fp16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """``[N, K]`` fp32 -> Q4_K rows: per 32-weight sub-block ``w ~ scale * q - min`` (q 0..15,
    min >= 0), the eight scales and mins in 6 bits under the super-block's fp16 ``d``/``dmin``."""
    x = w.astype(np.float32).reshape(-1, 8, 32)
    lo, hi = np.minimum(x.min(-1), 0.0), x.max(-1)
    d = _fp16(np.maximum((hi - lo).max(-1) / 15 / 63, 1e-8))
    dmin = _fp16(np.maximum((-lo).max(-1) / 63, 1e-8))
    sc = np.clip(np.round((hi - lo) / 15 / d[:, None]), 1, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / dmin[:, None]), 0, 63).astype(np.uint8)
    step = (d[:, None] * sc)[..., None]
    q = np.clip(np.round((x + (dmin[:, None] * mn)[..., None]) / step), 0, 15).astype(np.uint8)
    scales = np.concatenate(
        [sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
         (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)], axis=-1,
    )  # fmt: skip
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)
    halves = np.stack([d, dmin], -1).astype(np.float16).view(np.uint8)
    return np.concatenate([halves, scales, qs], -1).reshape(w.shape[0], -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """``[N, K]`` fp32 -> Q6_K rows: per 16 weights an int8 scale under the block's fp16 ``d``,
    6-bit ``q - 32`` split into 4 low bits (ql) and 2 high bits (qh)."""
    x = w.astype(np.float32).reshape(-1, 16, 16)
    d = _fp16(np.maximum(np.abs(x).max((-1, -2)) / 31 / 127, 1e-8))
    sc = np.clip(np.round(np.abs(x).max(-1) / 31 / d[:, None]), 1, 127).astype(np.int8)
    step = (d[:, None] * sc)[..., None]
    u = (np.clip(np.round(x / step), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    low, high = u & 0xF, u >> 4  # [block, half, g, lane]
    ql = np.concatenate(
        [low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], -1
    )
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    tail = [sc.view(np.uint8), d.astype(np.float16).view(np.uint8).reshape(-1, 2)]
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), *tail], -1).reshape(
        w.shape[0], -1
    )


def encode(w: np.ndarray, type_name: str) -> tuple[np.ndarray, object]:
    """(data for GGUFWriter.add_tensor, raw_dtype) of ``w`` (a matrix, or a stack of them) in
    ``type_name``: blocks along the last dimension."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[type_name]
    if type_name == "F32":
        return w.astype(np.float32), None
    rows = w.reshape(-1, w.shape[-1]).astype(np.float32)
    if type_name == "Q4_K":
        data = quantize_q4_k(rows)
    elif type_name == "Q6_K":
        data = quantize_q6_k(rows)
    else:
        data = quants.quantize(rows, qtype)
    return data.reshape(*w.shape[:-1], -1), qtype


def _write_tokenizer(writer, folder: Path, vocab_size: int) -> None:
    """The BPE as the converter writes it: one token per embedding row, the rows no token
    uses as ``[PAD{i}]`` of type unused."""
    tok = json.loads((folder / "tokenizer.json").read_text())
    by_id = {i: t for t, i in tok["model"]["vocab"].items()}
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(max(vocab_size, len(by_id)))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(  # control / normal / unused
        [3 if t in special else (1 if i in by_id else 5) for i, t in enumerate(tokens)]
    )
    merges = tok["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    template = cfg.get("chat_template") or (folder / "chat_template.jinja").read_text()
    writer.add_chat_template(template)


def write_gguf(folder: str | Path, path: str | Path, recipe: Callable[[str], str]) -> Path:
    """Write the checkpoint in ``folder`` as a GGUF file at ``path``; ``recipe(gguf_name)``
    gives each matrix's type (vectors, and Phi-3's rope factors, are F32, as llama.cpp keeps
    them)."""
    import gguf

    from pagedserve.models.gguf_testing_converter import (
        converted_tensors,
        gguf_arch,
        write_metadata,
    )

    folder, path = Path(folder), Path(path)
    config = json.loads((folder / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), gguf_arch(config))
    write_metadata(writer, config)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    _write_tokenizer(writer, folder, config["vocab_size"])
    for name, w in converted_tensors(folder, config):
        matrix = w.ndim >= 2
        data, raw_dtype = encode(w, recipe(name)) if matrix else (w.astype(np.float32), None)
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
