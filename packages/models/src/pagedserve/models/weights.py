"""Reading safetensors checkpoints and copying their tensors into a model's parameters.

A checkpoint is one ``model.safetensors`` or several shards listed in
``model.safetensors.index.json``. Tensors are read one at a time (memory-mapped), so loading
never holds two copies of the model.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from pagedserve.models.config import ModelLoadError


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no safetensors weights in {model_dir}")
    return files


def iterate_weights(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ModelLoadError(
            f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}"
        )
    param.data.copy_(loaded)


def load_stacked_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
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
        for fused, part, shard_id in stacked_params:
            if f".{part}." in name:
                target = name.replace(f".{part}.", f".{fused}.")
                param = _param(params, target, ckpt_name)
                param.weight_loader(param, tensor, shard_id)
                loaded.add(f"{target}#{shard_id}")
                break
        else:
            param = _param(params, name, ckpt_name)
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(name)
    _check_complete(params, loaded, stacked_params)


def _param(params: dict[str, nn.Parameter], name: str, ckpt_name: str) -> nn.Parameter:
    if name not in params:
        raise ModelLoadError(
            f"checkpoint tensor {ckpt_name!r} has no matching parameter ({name!r})"
        )
    return params[name]


def _check_complete(params: dict[str, nn.Parameter], loaded: set[str], stacked_params) -> None:
    missing = []
    for name in params:
        fused = [(f, s) for f, _, s in stacked_params if f".{f}." in name]
        if fused:
            missing += [f"{name}#{s}" for _, s in fused if f"{name}#{s}" not in loaded]
        elif name not in loaded:
            missing.append(name)
    if missing:
        raise ModelLoadError(
            f"checkpoint is missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}"
        )
