"""From a Hugging Face folder to a ready model: pick the architecture, build it, load weights.

Every class in ``MODEL_CLASSES`` implements ``ModelForCausalLM`` or ``ModelForPooling``
(interface.py); a generative class converted to a pooling model (``--convert``) is built by
adapters.py."""

from __future__ import annotations

import torch

from pagedserve.models.adapters import as_pooling_model
from pagedserve.models.bert import BertForSequenceClassification, BertModel
from pagedserve.models.config import ModelConfig
from pagedserve.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from pagedserve.models.gemma import GemmaForCausalLM
from pagedserve.models.gemma3_mm import Gemma3ForConditionalGeneration
from pagedserve.models.gguf_loader import load_gguf_model
from pagedserve.models.gpt2 import GPT2LMHeadModel
from pagedserve.models.gpt_oss import GptOssForCausalLM
from pagedserve.models.interface import ModelForCausalLM
from pagedserve.models.layers.batch_invariance import batch_invariant_layers
from pagedserve.models.layers.linear_method import linear_methods_for
from pagedserve.models.llama import LlamaForCausalLM
from pagedserve.models.llava import LlavaForConditionalGeneration
from pagedserve.models.mixtral import (
    MixtralForCausalLM,
    Qwen2MoeForCausalLM,
    Qwen3MoeForCausalLM,
)
from pagedserve.models.parallel import ParallelContext
from pagedserve.models.phi3 import Phi3ForCausalLM
from pagedserve.models.pipeline import stage_weights
from pagedserve.models.quantization import (
    checkpoint_linear_methods,
    process_weights_after_loading,
    quantize_linear_layers,
)
from pagedserve.models.qwen2_vl import Qwen2VLForConditionalGeneration
from pagedserve.models.weights import iterate_weights

MODEL_CLASSES: dict[str, type] = {
    "llama": LlamaForCausalLM,
    "gemma": GemmaForCausalLM,
    "phi3": Phi3ForCausalLM,
    "mixtral": MixtralForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "qwen2_moe": Qwen2MoeForCausalLM,
    "deepseek_v2": DeepseekV2ForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "gpt_oss": GptOssForCausalLM,
    "gpt2": GPT2LMHeadModel,
    "llava": LlavaForConditionalGeneration,
    "qwen2_vl": Qwen2VLForConditionalGeneration,
    "gemma3_mm": Gemma3ForConditionalGeneration,
    "bert": BertModel,
    "bert_classifier": BertForSequenceClassification,
}
POOLING_FAMILIES = frozenset({"bert", "bert_classifier"})  # built as pooling models


def model_class(config: ModelConfig) -> type:
    """The class that builds ``config``'s model: its family's, converted to a pooling model
    when a generative architecture runs as one."""
    model_cls = MODEL_CLASSES[config.arch]
    if config.runner_type == "pooling" and config.arch not in POOLING_FAMILIES:
        return as_pooling_model(model_cls, config.pooling_task)
    return model_cls


def load_model(config: ModelConfig, par: ParallelContext | None = None) -> ModelForCausalLM:
    """Build the model on ``config.torch_device`` in ``config.torch_dtype`` and load its weights."""
    model_cls = model_class(config)
    if config.gguf_file is not None:
        return load_gguf_model(config, model_cls, par)
    stored_quantized = checkpoint_linear_methods(config)
    with (
        torch.device(config.torch_device),
        linear_methods_for(stored_quantized),
        batch_invariant_layers(config.batch_invariant),
    ):
        model = model_cls(config, par)
    stage = (par or ParallelContext()).stage  # a pipeline stage reads its own tensors only
    weights = stage_weights(iterate_weights(config.model), stage, config.num_layers)
    if stored_quantized is None:  # integers (gpt-oss's MXFP4 expert blocks) stay as stored
        model.load_weights(
            (name, _in_dtype(tensor, config.torch_dtype)) for name, tensor in weights
        )
    else:  # packed integers and fp8 stay as stored; each parameter's copy casts the rest
        model.load_weights(weights)
        process_weights_after_loading(model)
    if config.quantization is not None and stored_quantized is None:
        quantize_linear_layers(model, config.quantization)
    if config.quantization is not None and config.torch_device.type == "cuda":
        torch.cuda.empty_cache()  # the freed full-precision weights count for the KV cache
    return model.eval()


def _in_dtype(tensor, dtype: torch.dtype):
    """A floating-point checkpoint tensor in the model's dtype (lazily, for a handle); any
    other left as stored."""
    return tensor.to(dtype) if tensor.dtype.is_floating_point else tensor
