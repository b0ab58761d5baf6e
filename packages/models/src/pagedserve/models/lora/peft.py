"""Reading a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) for a model.

Everything that would make an adapter serve wrongly is refused here, at load time, with a
``LoRAAdapterError`` that names the problem: a missing or corrupt file, a rank above
``max_lora_rank``, target modules the model lacks, shapes that do not fit the base model, and
the PEFT features pagedserve does not apply (bias, DoRA, per-module ranks, modules_to_save).

PEFT stores ``<module>.lora_A.weight`` ``[r, in]`` and ``<module>.lora_B.weight`` ``[out, r]``
under ``base_model.model.``, for Conv1D modules (GPT-2) too: ``fan_in_fan_out`` transposes only
the base weight, never the adapter's. B is returned already multiplied by the scaling,
``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedserve.models.lora.model import LoRAModel

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


class LoRAAdapterError(ValueError):
    """An adapter that cannot be served on this model; the message says why."""


@dataclass
class LoRAAdapterWeights:
    """One adapter, ready to copy into a slot: module name -> (A ``[r, in]``, scaled B)."""

    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def read_adapter_config(path: Path, max_rank: int) -> dict:
    """The adapter's config, checked for what pagedserve can apply."""
    config_file = path / CONFIG_NAME
    if not config_file.is_file():
        raise LoRAAdapterError(f"no {CONFIG_NAME} in {path} (is it a PEFT LoRA adapter folder?)")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoRAAdapterError(f"{config_file} is not valid JSON: {e}") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise LoRAAdapterError(f"{config_file}: not a LoRA adapter (peft_type must be LORA)")
    r = config.get("r")
    if not isinstance(r, int) or r < 1:
        raise LoRAAdapterError(f"{config_file}: 'r' must be a positive integer, not {r!r}")
    if r > max_rank:
        raise LoRAAdapterError(
            f"adapter rank {r} exceeds max_lora_rank {max_rank} (start the engine with a "
            f"larger --max-lora-rank)"
        )
    for key, allowed in (("bias", "none"), ("use_dora", False)):
        if config.get(key, allowed) not in (allowed, None):
            raise LoRAAdapterError(f"{config_file}: {key}={config[key]!r} is not supported")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
        if config.get(key):
            raise LoRAAdapterError(f"{config_file}: {key} is not supported")
    return config


def _check_targets(config: dict, lora_model: LoRAModel) -> None:
    targets = config.get("target_modules")
    if isinstance(targets, str):  # a regular expression: the tensors' names are checked instead
        return
    missing = sorted(set(targets or ()) - lora_model.target_module_names)
    if missing:
        raise LoRAAdapterError(
            f"target modules {missing} are not in this model (it has "
            f"{sorted(lora_model.target_module_names)})"
        )


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights_file = path / WEIGHTS_NAME
    if not weights_file.is_file():
        raise LoRAAdapterError(f"no {WEIGHTS_NAME} in {path}")
    try:
        return load_file(weights_file)
    except (SafetensorError, OSError, ValueError) as e:
        raise LoRAAdapterError(f"{weights_file} is not a readable safetensors file: {e}") from None


def _pairs(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """module name -> {"A": tensor, "B": tensor}, refusing any other kind of tensor."""
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise LoRAAdapterError(f"unsupported tensor {key!r} in the adapter (only LoRA A/B)")
        modules.setdefault(match["module"], {})[match["ab"]] = tensor
    return modules


def load_peft_adapter(
    path: str | Path, lora_model: LoRAModel, max_rank: int, dtype: torch.dtype
) -> LoRAAdapterWeights:
    """Read and validate the adapter at ``path`` for ``lora_model``; tensors in ``dtype``."""
    path = Path(path)
    if not path.is_dir():
        raise LoRAAdapterError(f"adapter folder {path} does not exist")
    config = read_adapter_config(path, max_rank)
    _check_targets(config, lora_model)
    r = config["r"]
    alpha = config.get("lora_alpha", r)
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    weights = {}
    for module, ab in _pairs(_read_tensors(path)).items():
        target = lora_model.targets.get(module)
        if target is None:
            raise LoRAAdapterError(f"the adapter targets {module!r}, which this model lacks")
        if set(ab) != {"A", "B"}:
            raise LoRAAdapterError(f"{module}: the adapter holds lora_A or lora_B, not both")
        a, b = ab["A"], ab["B"]
        want_a, want_b = (r, target.in_features), (target.out_features, r)
        if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
            raise LoRAAdapterError(
                f"{module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the base "
                f"model, which needs {want_a} / {want_b} (an adapter for another model?)"
            )
        weights[module] = (a.to(dtype), (b.float() * scaling).to(dtype))
    if not weights:
        raise LoRAAdapterError(f"{path / WEIGHTS_NAME} holds no LoRA weights")
    return LoRAAdapterWeights(r, scaling, weights)
