"""Every registered architecture implements ModelForCausalLM, the interface the runner relies on."""

from __future__ import annotations

import inspect

import pytest
import torch

from pagedserve.models import ModelConfig, ModelForCausalLM, load_model
from pagedserve.models.loader import MODEL_CLASSES
from pagedserve.models.testing import TINY_ARCHS

METHODS = ["forward", "compute_logits", "load_weights"]


def parameter_names(function) -> list[str]:
    return list(inspect.signature(function).parameters)[1:]  # without self


@pytest.mark.parametrize("arch", sorted(MODEL_CLASSES))
@pytest.mark.parametrize("method", METHODS)
def test_each_registered_class_has_the_interface_signatures(arch, method):
    ours = getattr(ModelForCausalLM, method)
    theirs = getattr(MODEL_CLASSES[arch], method)
    assert parameter_names(theirs) == parameter_names(ours)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_load_model_returns_a_model_for_causal_lm(tiny_checkpoint, arch):
    config = ModelConfig(model=tiny_checkpoint(arch), dtype="bfloat16")
    model = load_model(config)
    assert isinstance(model, ModelForCausalLM)
    hidden = torch.randn(3, config.hidden_size, dtype=torch.bfloat16)
    logits = model.compute_logits(hidden)
    # float32 whatever the model's dtype: the sampler's precision
    assert logits.dtype == torch.float32 and logits.shape == (3, config.vocab_size)


def test_an_object_without_load_weights_is_not_a_model():
    class Half(torch.nn.Module):
        def forward(self, input_ids, positions, kv_caches, attn_metadata):
            return input_ids

        def compute_logits(self, hidden):
            return hidden

    assert not isinstance(Half(), ModelForCausalLM)
