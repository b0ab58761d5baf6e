"""The model authors' generation settings: ``generation_config.json`` beside config.json.

Chat models list their end-of-turn ids there (Llama 3 Instruct stops on ``<|eot_id|>`` only
because its generation_config names it beside ``<|end_of_text|>``) and the sampling settings
they were tuned for. As vLLM's ``--generation-config``:

- ``auto`` (the default): read the model folder's file; its ``eos_token_id`` (an id or a list)
  joins the stop ids and its sampling fields become the defaults a request overrides;
- ``vllm``: the end-of-turn ids are still honoured (a model that never stops is never what
  anyone wants), but the sampling defaults are pagedserve's own (SamplingParams');
- a folder path: read ``generation_config.json`` from that folder instead of the model's.

Only the fields vLLM takes over are read, under SamplingParams' names: ``temperature``,
``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and ``max_new_tokens`` (as
``max_tokens``). ``do_sample`` is not read (vLLM does not either): a config that means greedy
says ``temperature`` 0 or leaves the sampling fields out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json name -> SamplingParams name
SAMPLING_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


class GenerationConfigError(ValueError):
    """``--generation-config`` names no usable file, or the file is malformed."""


@dataclass(frozen=True)
class GenerationDefaults:
    """What a model folder's generation_config.json contributes to serving.

    ``eos_token_ids``: end ids the engine stops on (beside config.json's and the tokenizer's);
    ``sampling``: SamplingParams fields and values a request inherits unless it sets them;
    ``source``: the file read, or None when there was none (or ``vllm`` mode).
    """

    eos_token_ids: tuple[int, ...] = ()
    sampling: dict[str, Any] = field(default_factory=dict)
    source: str | None = None

    def describe(self) -> str:
        """One line for the startup log: which defaults are in force and where from."""
        if not self.sampling:
            where = f" ({self.source} sets none)" if self.source else ""
            return f"sampling defaults: pagedserve's own{where}"
        fields = ", ".join(f"{k}={v}" for k, v in sorted(self.sampling.items()))
        return f"sampling defaults from {self.source}: {fields}"


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise GenerationConfigError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise GenerationConfigError(f"{path} must hold a JSON object")
    return data


def load_generation_defaults(model_dir: str | Path, mode: str = "auto") -> GenerationDefaults:
    """Read the generation config that ``mode`` (``auto``, ``vllm`` or a folder) points at.

    A model folder without the file gives empty defaults; a folder given explicitly must hold it.
    """
    if mode in ("auto", "vllm"):
        path = Path(model_dir) / GENERATION_CONFIG_FILE
        if not path.is_file():
            return GenerationDefaults()
    else:
        folder = Path(mode)
        path = folder / GENERATION_CONFIG_FILE if folder.is_dir() else folder
        if not path.is_file():
            raise GenerationConfigError(
                f"generation_config {mode!r}: no {GENERATION_CONFIG_FILE} there "
                "(give 'auto', 'vllm', or a folder holding that file)"
            )
    data = _read(path)
    eos = _as_ids(data.get("eos_token_id"))
    if mode == "vllm":
        return GenerationDefaults(eos_token_ids=eos)
    sampling = {
        ours: data[theirs]
        for theirs, ours in SAMPLING_FIELDS.items()
        if data.get(theirs) is not None
    }
    return GenerationDefaults(eos_token_ids=eos, sampling=sampling, source=str(path))
