"""Reading checkpoints and copying their tensors into a model's parameters.

A checkpoint is one ``model.safetensors`` or several shards listed in
``model.safetensors.index.json``; failing those, PyTorch's ``pytorch_model.bin`` (or its shards
and ``pytorch_model.bin.index.json``), read with ``torch.load(weights_only=True)`` so that a
checkpoint can hold tensors only, never code to run, and memory-mapped where the file allows. Tensors are yielded as ``CheckpointTensor`` handles that read
nothing until asked: a tensor-parallel rank narrows a handle to its rows or columns and reads
only those bytes (safetensors ``get_slice``), so no rank ever materialises a weight it does not
hold, and loading never holds two copies of the model.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pagedserve.models.config import ModelLoadError


def _indexed(model_dir: Path, index_name: str) -> list[Path] | None:
    index = model_dir / index_name
    if not index.is_file():
        return None
    weight_map = json.loads(index.read_text())["weight_map"]
    return [model_dir / f for f in sorted(set(weight_map.values()))]


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The weight files of a model folder: safetensors when there are any, else .bin."""
    model_dir = Path(model_dir)
    for index_name, single, pattern in (
        ("model.safetensors.index.json", "model.safetensors", "*.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin", "pytorch_model*.bin"),
    ):
        files = _indexed(model_dir, index_name)
        if files is None:
            files = [model_dir / single] if (model_dir / single).is_file() else []
            files = files or sorted(model_dir.glob(pattern))
        if files:
            return files
    raise ModelLoadError(
        f"no weights in {model_dir}: expected model.safetensors (or shards listed in "
        "model.safetensors.index.json) or pytorch_model.bin (or pytorch_model.bin.index.json)"
    )


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


class CheckpointTensor:
    """A lazy view of one tensor in a safetensors file: ``narrow``, ``t``, ``chunk``, ``to``.

    The view is a box of index ranges over the stored tensor, a permutation of its dimensions
    (``t`` for GPT-2's Conv1D weights) and a target dtype; ``read()`` fetches exactly the box.
    It mirrors the few ``torch.Tensor`` methods the weight loaders use, so a loader works on a
    real tensor and on a handle alike; ``materialize`` turns either into a tensor. A handle is
    valid while ``iterate_weights`` is on its tensor (the file is open).
    """

    def __init__(self, source, ranges: list[tuple[int, int]], dims: list[int], dtype=None):
        self._source = source
        self._ranges = ranges  # per stored dimension: [start, stop)
        self._dims = dims  # stored dimension of each view dimension
        self._dtype = dtype

    @classmethod
    def open(cls, source) -> CheckpointTensor:
        shape = source.get_shape()
        return cls(source, [(0, n) for n in shape], list(range(len(shape))))

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._ranges[d][1] - self._ranges[d][0] for d in self._dims)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype ``read()`` returns: the target of ``to``, else the stored one."""
        if self._dtype is not None:
            return self._dtype
        stored = self._source.get_dtype()
        if stored not in _SAFETENSORS_DTYPES:
            raise ModelLoadError(f"checkpoint tensor of unsupported dtype {stored}")
        return _SAFETENSORS_DTYPES[stored]

    def dim(self) -> int:
        return len(self._dims)

    def _with(self, ranges=None, dims=None, dtype=None) -> CheckpointTensor:
        return CheckpointTensor(
            self._source, ranges or self._ranges, dims or self._dims, dtype or self._dtype
        )

    def narrow(self, dim: int, start: int, length: int) -> CheckpointTensor:
        if not 0 <= start <= start + length <= self.shape[dim]:
            raise ModelLoadError(
                f"cannot take [{start}, {start + length}) of dimension {dim} of a checkpoint "
                f"tensor of shape {tuple(self.shape)}"
            )
        stored = self._dims[dim]
        base = self._ranges[stored][0]
        ranges = list(self._ranges)
        ranges[stored] = (base + start, base + start + length)
        return self._with(ranges=ranges)

    def t(self) -> CheckpointTensor:
        if self.dim() != 2:
            raise ValueError(f"t() expects a 2-D tensor, got {self.dim()}-D")
        return self._with(dims=self._dims[::-1])

    def chunk(self, chunks: int, dim: int = 0) -> list[CheckpointTensor]:
        """torch.chunk's split: pieces of ``ceil(size / chunks)``, the last one shorter."""
        size = self.shape[dim]
        step = -(-size // chunks)
        return [self.narrow(dim, s, min(step, size - s)) for s in range(0, size, step)]

    def to(self, dtype: torch.dtype) -> CheckpointTensor:
        return self._with(dtype=dtype)

    def read(self) -> torch.Tensor:
        """Read the view's box from the file (only those bytes) as a contiguous tensor."""
        tensor = self._source[tuple(slice(a, b) for a, b in self._ranges)]
        if self._dims != sorted(self._dims):
            tensor = tensor.permute(self._dims)
        if self._dtype is not None:
            tensor = tensor.to(self._dtype)
        return tensor.contiguous()


def materialize(loaded: torch.Tensor | CheckpointTensor) -> torch.Tensor:
    """A real tensor from a loader's input: a checkpoint handle (or a GGUF matrix, decoded:
    quantization_gguf.GGUFTensor) is read."""
    return loaded if isinstance(loaded, torch.Tensor) else loaded.read()


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    """A PyTorch checkpoint's tensors, memory-mapped when it is in the zip format (torch >=
    1.6 writes that), so a rank that narrows a tensor touches only those pages."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # the legacy format cannot be memory-mapped
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle refusing a non-tensor object, a truncated file
        raise ModelLoadError(f"cannot read {path} as tensors only: {e}") from e
    if not isinstance(state, dict):
        raise ModelLoadError(f"{path} holds a {type(state).__name__}, not a state dict")
    return state


def iterate_weights(
    model_dir: str | Path,
) -> Iterator[tuple[str, CheckpointTensor | torch.Tensor]]:
    """Every tensor of the checkpoint: a lazy handle for safetensors (read by the loader that
    consumes it), a (memory-mapped) tensor for .bin files."""
    for path in checkpoint_files(model_dir):
        if path.suffix == ".bin":
            yield from _load_bin(path).items()
            continue
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, CheckpointTensor.open(f.get_slice(name))


def copy_shard(dst: torch.Tensor, shard: torch.Tensor | CheckpointTensor, what: str) -> None:
    """Copy one rank's shard into (a slice of) a parameter, with a clear error on a mismatch."""
    if tuple(dst.shape) != tuple(shard.shape):
        raise ModelLoadError(
            f"shape mismatch for {what}: parameter {tuple(dst.shape)} vs checkpoint shard "
            f"{tuple(shard.shape)}"
        )
    dst.copy_(materialize(shard))


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor | CheckpointTensor) -> None:
    """A replicated parameter: every rank holds the whole checkpoint tensor."""
    copy_shard(param.data, loaded, "a replicated parameter")


def load_stacked_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor | CheckpointTensor]],
    stacked_params: list[tuple[str, str, object]],
    rename: Callable[[str], str | None],
) -> None:
    """Copy checkpoint tensors into ``model``, routing q/k/v and gate/up into fused parameters.

    ``stacked_params`` holds (fused name, checkpoint name, shard id). ``rename`` maps a
    checkpoint name to ours, or None to skip it. Every parameter must be loaded exactly once.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for ckpt_name, tensor in weights:
        name = rename(ckpt_name)
        if name is None:
            continue
        try:
            loaded.add(_load_one(params, name, ckpt_name, tensor, stacked_params))
        except ModelLoadError as e:  # say which tensor, whichever layer found the fault
            if ckpt_name in str(e):
                raise
            raise ModelLoadError(f"{ckpt_name}: {e}") from e
    _check_complete(params, loaded, stacked_params)


def _load_one(params, name: str, ckpt_name: str, tensor, stacked_params) -> str:
    """Route one checkpoint tensor into its (fused) parameter; returns what was loaded."""
    for fused, part, shard_id in stacked_params:
        if f".{part}." in name:
            target = name.replace(f".{part}.", f".{fused}.")
            param = _param(params, target, ckpt_name)
            param.weight_loader(param, tensor, shard_id)
            return f"{target}#{shard_id}"
    param = _param(params, name, ckpt_name)
    getattr(param, "weight_loader", default_weight_loader)(param, tensor)
    return name


def _param(params: dict[str, nn.Parameter], name: str, ckpt_name: str) -> nn.Parameter:
    if name not in params:
        raise ModelLoadError(
            f"checkpoint tensor {ckpt_name!r} has no matching parameter ({name!r})"
        )
    return params[name]


def _check_complete(params: dict[str, nn.Parameter], loaded: set[str], stacked_params) -> None:
    missing = []
    for name in params:
        if getattr(params[name], "loaded_elsewhere", False):  # its owner checks it
            continue
        fused = [(f, s) for f, _, s in stacked_params if f".{f}." in name]
        if fused:
            missing += [f"{name}#{s}" for _, s in fused if f"{name}#{s}" not in loaded]
        elif name not in loaded:
            missing.append(name)
    if missing:
        raise ModelLoadError(
            f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}"
        )
