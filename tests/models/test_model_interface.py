"""Every registered architecture implements ModelForCausalLM, the interface the runner relies on;
every pooling architecture (and every generative one converted) ModelForPooling."""

from __future__ import annotations

import inspect

import pytest
import torch

from pagedserve.models import ModelConfig, ModelForCausalLM, ModelForPooling, load_model
from pagedserve.models.loader import MODEL_CLASSES, POOLING_FAMILIES
from pagedserve.models.registry import ARCHITECTURES
from pagedserve.models.testing import TINY_ARCHS
from pagedserve.models.testing_pooling import TINY_POOLING_ARCHS

METHODS = ["forward", "compute_logits", "load_weights"]


def parameter_names(function) -> list[str]:
    return list(inspect.signature(function).parameters)[1:]  # without self


@pytest.mark.parametrize("arch", sorted(set(MODEL_CLASSES) - POOLING_FAMILIES))
@pytest.mark.parametrize("method", METHODS)
def test_each_registered_class_has_the_interface_signatures(arch, method):
    ours = parameter_names(getattr(ModelForCausalLM, method))
    theirs = parameter_names(getattr(MODEL_CLASSES[arch], method))
    if method != "forward":
        assert theirs == ours
        return
    # the optional fifth, exactly where the registry says the family takes pipeline stages,
    # then inputs_embeds where the decoder can start from embeddings; a model that takes
    # images has both (interface.py)
    generative = [a for a in ARCHITECTURES.values() if a.family == arch and a.task is None]
    staged = {a.pipeline_parallel for a in generative}
    assert theirs[:4] == ours
    optional = inspect.signature(MODEL_CLASSES[arch].forward).parameters
    assert all(optional[name].default is None for name in theirs[4:])
    if {a.images for a in generative} == {True}:
        assert theirs[4:] == ["intermediate", "inputs_embeds"]
        return
    if theirs[-1] == "inputs_embeds":
        theirs = theirs[:-1]
    assert theirs[4:] == (["intermediate"] if staged == {True} else [])


@pytest.mark.parametrize("arch", sorted(set(MODEL_CLASSES) - POOLING_FAMILIES))
def test_a_model_that_takes_images_embeds_them_and_its_ids(arch):
    takes_images = {a.images for a in ARCHITECTURES.values() if a.family == arch}
    cls = MODEL_CLASSES[arch]
    for method, arguments in [
        ("embed_images", ["pixel_values", "grid_thw"]),
        ("embed_input_ids", ["input_ids"]),
    ]:
        if takes_images == {True}:
            assert parameter_names(getattr(cls, method)) == arguments
        else:
            assert not hasattr(cls, method)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_load_model_returns_a_model_for_causal_lm(tiny_checkpoint, arch):
    config = ModelConfig(model=tiny_checkpoint(arch), dtype="bfloat16")
    model = load_model(config)
    assert isinstance(model, ModelForCausalLM)
    hidden = torch.randn(3, config.hidden_size, dtype=torch.bfloat16)
    logits = model.compute_logits(hidden)
    # float32 whatever the model's dtype: the sampler's precision
    assert logits.dtype == torch.float32 and logits.shape == (3, config.vocab_size)


@pytest.mark.parametrize("arch", sorted(POOLING_FAMILIES))
def test_each_pooling_class_has_the_pooling_interface(arch):
    cls = MODEL_CLASSES[arch]
    forward = parameter_names(cls.forward)
    assert forward[:4] == parameter_names(ModelForPooling.forward)
    assert forward[4:] == ["token_type_ids"]  # optional: BERT's sentence pairs
    assert parameter_names(cls.load_weights) == parameter_names(ModelForPooling.load_weights)


@pytest.mark.parametrize("arch", TINY_POOLING_ARCHS)
def test_load_model_returns_a_model_for_pooling(tiny_pooling_checkpoint, arch):
    model = load_model(ModelConfig(model=tiny_pooling_checkpoint(arch)))
    assert isinstance(model, ModelForPooling)
    assert model.pooler.task == ("embed" if arch in ("bert", "xlm_roberta") else "classify")


def test_a_converted_decoder_is_a_model_for_pooling(tiny_checkpoint):
    model = load_model(ModelConfig(model=tiny_checkpoint("llama"), convert="embed"))
    assert isinstance(model, ModelForPooling) and not hasattr(model, "lm_head")
    with pytest.raises(TypeError, match="pooling model"):
        model.compute_logits(torch.zeros(1, 64))


def test_an_object_without_load_weights_is_not_a_model():
    class Half(torch.nn.Module):
        def forward(self, input_ids, positions, kv_caches, attn_metadata):
            return input_ids

        def compute_logits(self, hidden):
            return hidden

    assert not isinstance(Half(), ModelForCausalLM)
