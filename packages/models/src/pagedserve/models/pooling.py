"""Pooling heads: how a pooling model turns a sequence's hidden states into its output.

A pooling model (``--runner pooling``) runs each prompt once and returns one vector per
request instead of tokens: an embedding (``task="embed"``) or class scores
(``task="classify"``; a cross-encoder's relevance score is one class). Its ``Pooler`` says:

- which rows of the sequence make the vector (``PoolingType``): the mean of all of them
  (``MEAN``, most sentence-transformers embedders), the first (``CLS``, BERT's [CLS] token,
  cross-encoders) or the last (``LAST``, decoder embedders such as Qwen3-Embedding and
  gte-Qwen2, whose last token has seen the whole prompt through causal attention);
- what the model's head does with it (``head``: a classifier, or nothing for an embedding);
- and its defaults: an embedding is L2-normalised when the model says so (sentence-transformers'
  ``Normalize`` module; decoder embedders always); class scores go through softmax (sigmoid
  for one class, a cross-encoder's score or a reward).

Reducing the rows is the model runner's work (a long prompt may arrive in several chunks), the
head and the defaults are the model's. Sentence-transformers folders describe their pooling in
``modules.json`` and ``1_Pooling/config.json``: ``read_pooler_config`` reads them.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pagedserve.models.config import ModelLoadError

POOLING_TASKS = ("embed", "classify")


class PoolingType(enum.Enum):
    MEAN = "MEAN"
    CLS = "CLS"
    LAST = "LAST"


@dataclass(frozen=True)
class PoolerConfig:
    """The pooling a checkpoint asks for (vLLM's name): its rows and whether to normalise."""

    pooling_type: PoolingType
    normalize: bool


# sentence-transformers' Pooling flags -> ours; the others (max, mean_sqrt_len, weighted
# mean) are refused at load time rather than served as something else.
_ST_MODES = {
    "pooling_mode_mean_tokens": PoolingType.MEAN,
    "pooling_mode_cls_token": PoolingType.CLS,
    "pooling_mode_lasttoken": PoolingType.LAST,
}
_ST_UNSERVED = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)


def read_pooler_config(model_dir: str | Path, default: PoolerConfig) -> PoolerConfig:
    """The pooling a sentence-transformers folder describes (``modules.json``: a Pooling
    module and its config; a Normalize module), or ``default`` for a folder without one."""
    modules_file = Path(model_dir) / "modules.json"
    if not modules_file.is_file():
        return default
    modules = json.loads(modules_file.read_text())
    kinds = {m.get("type", "").rsplit(".", 1)[-1]: m for m in modules}
    unserved = set(kinds) - {"Transformer", "Pooling", "Normalize"}
    if unserved:
        raise ModelLoadError(
            f"{modules_file} lists sentence-transformers modules pagedserve does not run: "
            f"{sorted(unserved)} (it runs Transformer, Pooling and Normalize)"
        )
    pooling_type = default.pooling_type
    if "Pooling" in kinds:
        config_file = Path(model_dir) / kinds["Pooling"].get("path", "") / "config.json"
        pooling_type = _st_pooling_type(json.loads(config_file.read_text()), config_file)
    return PoolerConfig(pooling_type, normalize="Normalize" in kinds)


def _st_pooling_type(config: dict, source: Path) -> PoolingType:
    for flag in _ST_UNSERVED:
        if config.get(flag):
            raise ModelLoadError(f"{source}: {flag} is not supported (mean, cls and lasttoken are)")
    modes = [kind for flag, kind in _ST_MODES.items() if config.get(flag)]
    if "pooling_mode" in config:  # newer sentence-transformers: one string
        modes = [PoolingType[str(config["pooling_mode"]).upper().replace("LASTTOKEN", "LAST")]]
    if len(modes) != 1:
        raise ModelLoadError(f"{source}: expected exactly one pooling mode, found {modes}")
    return modes[0]


class Pooler(nn.Module):
    """A pooling model's output side (see the module docstring).

    ``head``: the module from the pooled hidden state ``[N, H]`` to the output ``[N, D]``
    (a classifier: ``D = num_labels``); None for an embedding (the pooled state itself).
    ``id2label``: the classes' names (config.json's), for /classify.
    """

    def __init__(
        self,
        task: str,
        pooling_type: PoolingType,
        normalize: bool = False,
        head: nn.Module | None = None,
        num_labels: int = 0,
        id2label: dict[int, str] | None = None,
    ) -> None:
        super().__init__()
        if task not in POOLING_TASKS:
            raise ValueError(f"pooling task {task!r}: one of {POOLING_TASKS}")
        self.task = task
        self.pooling_type = pooling_type
        self.normalize = normalize
        self.head = head
        self.num_labels = num_labels
        self.id2label = id2label or {}

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        """The outputs of the pooled rows, in float32 (the precision outputs are served in)."""
        out = pooled if self.head is None else self.head(pooled)
        return out.float()

    def activation(self, scores: torch.Tensor) -> torch.Tensor:
        """Class scores -> probabilities: softmax over several classes, sigmoid for one."""
        if self.num_labels == 1:
            return torch.sigmoid(scores)
        return torch.softmax(scores, dim=-1)


def id2label_of(hf_config: dict, num_labels: int) -> dict[int, str]:
    labels = hf_config.get("id2label") or {}
    return {int(k): str(v) for k, v in labels.items() if int(k) < num_labels}


def num_labels_of(hf_config: dict) -> int:
    """config.json's class count: ``num_labels``, else its ``id2label``'s size."""
    if hf_config.get("num_labels"):
        return int(hf_config["num_labels"])
    return len(hf_config.get("id2label") or {}) or 2
