"""One KV block outside the engine: a header that pins what it is, then its bytes.

A block leaves the KV cache as one record: every layer's keys then values for its
``block_size`` slots, in the cache's own dtype (``KVBlockIO``). Whatever holds it (a file of
the disk tier, the wire of a disaggregated transfer) may hand back something else: another
model's block, another dtype, a torn or flipped file. So every record starts with a header
that pins the model (``model_fingerprint``), the cache dtype, the block's shape and the key it
was saved under, and carries a checksum of its bytes; a reader loads a record only if all of
them match what it expects (``check_record``), and otherwise refuses it with the reason
(``BlockRecordError.kind``: ``mismatch`` for a sound record of something else, ``corrupt``
for bytes that are not a whole record), so the caller recomputes instead.

Header (little-endian, ``HEADER.size`` bytes): magic ``PSKV``, format version, the model's
fingerprint (16 bytes), the dtype's name (8 bytes), block size, layers, KV heads and head
size, the key (32 bytes), the payload's length and its BLAKE2b-128 digest.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pagedserve.kernels.kv_q8 import row_width

MAGIC = b"PSKV"
VERSION = 1
HEADER = struct.Struct("<4sH16s8s4I32sQ16s")
KEY_BYTES = 32
_ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8e4m3": 1, "q8_0": 1}


def record_dtype_name(dtype: torch.dtype) -> str:
    """The cache dtype's name in a record's header (8 bytes at most: fp8 is ``fp8e4m3``)."""
    names = {torch.float8_e4m3fn: "fp8e4m3", torch.int8: "q8_0"}
    name = names.get(dtype) or str(dtype).removeprefix("torch.")
    if name not in _ELEMENT_BYTES:
        raise ValueError(f"KV blocks of dtype {dtype} cannot be saved or sent")
    return name


_SAMPLES_PER_FILE = 8
_SAMPLE_BYTES = 64 * 1024


class BlockRecordError(ValueError):
    """A record that must not be loaded. ``kind`` is ``mismatch`` (a whole record of another
    model, dtype, shape or key) or ``corrupt`` (torn, truncated or altered bytes)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class BlockLayout:
    """What a block of this engine's cache is: the model it was computed by, its element type
    and its shape. Two engines can exchange blocks only when their layouts are equal."""

    model_fingerprint: bytes
    cache_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @property
    def payload_bytes(self) -> int:
        """Bytes of one block: keys and values of every layer."""
        row = row_width(self.head_dim) if self.cache_dtype == "q8_0" else self.head_dim
        elements = 2 * self.num_layers * self.block_size * self.num_kv_heads * row
        return elements * _ELEMENT_BYTES[self.cache_dtype]

    def tag(self) -> str:
        """A short name of the layout (the disk tier's folder for this engine's blocks)."""
        digest = hashlib.blake2b(digest_size=8)
        digest.update(self.model_fingerprint)
        digest.update(self.cache_dtype.encode())
        digest.update(struct.pack("<4I", *self._shape()))
        return digest.hexdigest()

    def _shape(self) -> tuple[int, int, int, int]:
        return (self.block_size, self.num_layers, self.num_kv_heads, self.head_dim)


def encode_header(layout: BlockLayout, key: bytes, payload: np.ndarray) -> bytes:
    """The header of ``payload`` (uint8, ``layout.payload_bytes`` long) saved under ``key``."""
    return HEADER.pack(
        MAGIC,
        VERSION,
        layout.model_fingerprint,
        layout.cache_dtype.encode().ljust(8, b"\0"),
        *layout._shape(),
        key,
        payload.nbytes,
        _checksum(payload),
    )


def check_record(layout: BlockLayout, key: bytes, record: bytes | memoryview) -> np.ndarray:
    """The payload of ``record`` (header + bytes) as uint8, if it is a sound record of
    ``layout``'s block saved under ``key``; else ``BlockRecordError``."""
    if len(record) < HEADER.size:
        raise BlockRecordError("corrupt", f"a record of {len(record)} bytes has no whole header")
    magic, version, fingerprint, dtype, *rest = HEADER.unpack_from(record)
    shape, record_key, length, checksum = tuple(rest[:4]), rest[4], rest[5], rest[6]
    if magic != MAGIC or version != VERSION:
        raise BlockRecordError("corrupt", "not a pagedserve KV block record")
    expected = {
        "model": (fingerprint, layout.model_fingerprint),
        "dtype": (dtype.rstrip(b"\0").decode(errors="replace"), layout.cache_dtype),
        "shape": (shape, layout._shape()),
        "key": (record_key, key),
    }
    for what, (found, wanted) in expected.items():
        if found != wanted:
            raise BlockRecordError("mismatch", f"the block's {what} is not this engine's")
    payload = np.frombuffer(record, dtype=np.uint8, offset=HEADER.size)
    if length != layout.payload_bytes or payload.nbytes != length:
        raise BlockRecordError("corrupt", f"{payload.nbytes} bytes of a {length}-byte block")
    if _checksum(payload) != checksum:
        raise BlockRecordError("corrupt", "the block's bytes do not match its checksum")
    return payload


def _checksum(payload: np.ndarray) -> bytes:
    return hashlib.blake2b(memoryview(payload), digest_size=16).digest()


def model_fingerprint(model: str, dtype: str, quantization: str | None) -> bytes:
    """16 bytes that name the weights the keys and values come from, wherever they sit.

    A digest of the checkpoint's config.json and of each weight file's name, size and eight
    64 KiB samples spread over it (a file of other weights differs in its samples with near
    certainty, without reading gigabytes at start-up), with the dtype and quantization the
    model runs in. Not the path: two machines that hold the same checkpoint agree.
    """
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps([dtype, quantization]).encode())
    path = Path(model)
    files = [path] if path.is_file() else sorted(path.iterdir())
    for file in files:
        if file.name == "config.json":
            digest.update(file.read_bytes())
        elif file.suffix in (".safetensors", ".bin", ".gguf", ".pt"):
            digest.update(file.name.encode())
            digest.update(_file_samples(file))
    return digest.digest()


def _file_samples(file: Path) -> bytes:
    size = file.stat().st_size
    samples = [size.to_bytes(8, "little")]
    with open(file, "rb") as f:
        for i in range(_SAMPLES_PER_FILE):
            f.seek(max(0, size - _SAMPLE_BYTES) * i // (_SAMPLES_PER_FILE - 1))
            samples.append(f.read(_SAMPLE_BYTES))
    return b"".join(samples)
