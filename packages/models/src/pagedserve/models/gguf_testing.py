"""GGUF files made here from the tiny random checkpoints (testing.py), for tests: no download.

``write_gguf(folder, path, recipe)`` writes a Hugging Face folder of any architecture with a
GGUF form as llama.cpp's converter would (gguf_testing_converter.py: its metadata keys, its
tensor names, what it does to the tensors), its tokenizer as ``tokenizer.ggml.*`` (a
byte-level BPE: the ``gpt2`` tokenizer model) with the chat template, and each matrix in the
type ``recipe(name)`` picks (a stacked experts tensor too: its rows are quantized alike). The
block types gguf can encode (MXFP4 among them: gpt-oss's experts) are encoded by
``gguf.quants.quantize``; the K-quants and IQ4 types, which it only decodes, by the
round-to-nearest encoders of gguf_encode.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from pagedserve.models.gguf_encode import encode


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
    gives each matrix's type (vectors, Phi-3's rope factors and every bias, gpt-oss's stacked
    ``[experts, out]`` ones too, are F32, as llama.cpp keeps them)."""
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
        matrix = w.ndim >= 2 and name.endswith(".weight")
        data, raw_dtype = encode(w, recipe(name)) if matrix else (w.astype(np.float32), None)
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
