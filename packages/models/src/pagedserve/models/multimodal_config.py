"""What a multimodal config.json nests: the decoder's config under ``text_config``, the vision
tower's under ``vision_config``, and the image placeholder token.

A llava-hf config.json names only the fields that differ from the defaults of the config
classes it nests (``text_config`` of a LLaVA-1.5 may hold seven keys: no hidden size, no layer
count), so pagedserve reads it through transformers' own config class, which fills the
defaults exactly as transformers does when it builds the reference model. ModelConfig then
takes the decoder's dimensions from the completed ``text_config``.
"""

from __future__ import annotations

import copy
from typing import Any

# The decoders a multimodal checkpoint may nest (``text_config.model_type``): the classes of
# the Llama family whose layers need nothing architecture-specific (llama.py). Qwen2-VL's
# decoder is Qwen2's (qkv bias), its rotary M-RoPE (``rope_parameters.mrope_section``); Gemma
# 3's is gemma.py's Gemma 3 text model.
DECODER_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2_vl_text": "Qwen2ForCausalLM",
    "qwen2_5_vl_text": "Qwen2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
# Multimodal model types whose older config.json is flat (the decoder's fields at the top,
# beside ``vision_config``): transformers' config class nests them under ``text_config``.
FLAT_MULTIMODAL_TYPES = ("qwen2_vl", "qwen2_5_vl")


def read_nested_configs(
    hf_config: dict[str, Any],
) -> tuple[dict[str, Any], dict[str, Any], int | None]:
    """``(hf_config, text_config, image_token_id)``: for a model that nests its decoder
    (``text_config``), config.json completed at transformers' defaults, the decoder's part of
    it, and the placeholder id an image's rows replace in a prompt (``image_token_index``, or
    ``image_token_id`` as newer configs spell it); for a text model, ``(hf_config, hf_config,
    None)``. A decoder pagedserve does not build, or a config transformers cannot read, is a
    ``ModelLoadError`` naming the field."""
    from pagedserve.models.config import ModelLoadError  # config.py imports this module

    flat = hf_config.get("model_type") in FLAT_MULTIMODAL_TYPES
    if not isinstance(hf_config.get("text_config"), dict) and not flat:
        return hf_config, hf_config, None
    text_type = (hf_config.get("text_config") or {}).get(
        "model_type", f"{hf_config['model_type']}_text" if flat else "llama"
    )
    if text_type not in DECODER_ARCHITECTURES:
        raise ModelLoadError(
            f"text_config.model_type = {text_type!r}: pagedserve builds the language model of a "
            f"multimodal checkpoint from one of {sorted(DECODER_ARCHITECTURES)}"
        )
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        completed = AutoConfig.for_model(**hf_config).to_dict()
    except (KeyError, TypeError, ValueError, StrictDataclassError) as e:  # the last: a field's type
        model_type = hf_config.get("model_type")
        raise ModelLoadError(f"config.json cannot be read as a {model_type}: {e}") from e
    text_config = completed["text_config"]
    text_config.setdefault("model_type", text_type)
    token = completed.get("image_token_id", completed.get("image_token_index"))
    return completed, text_config, None if token is None else int(token)


def decoder_architecture(text_config: dict[str, Any]) -> str:
    """The causal-LM class whose layers the language model of a multimodal checkpoint is."""
    return DECODER_ARCHITECTURES[text_config["model_type"]]


def language_model_config(config, decoders: tuple[str, ...], arch: str = "llama"):
    """``config`` seen as its decoder's: ``hf_config`` the nested ``text_config``, the
    architecture the decoder's and the family ``arch`` (the loader's key of the class that
    builds it: llama.py's, or gemma.py's), so it is built as a text model is. ``decoders``:
    the ``text_config.model_type`` values the multimodal model is built with; another is a
    ``ModelLoadError`` naming the field. Tied embeddings are the multimodal model's own setting
    (it takes the decoder's as well)."""
    from pagedserve.models.config import ModelLoadError  # config.py imports this module

    text_type = config.text_config.get("model_type")
    if text_type not in decoders:
        raise ModelLoadError(
            f"text_config.model_type = {text_type!r}: {config.hf_architecture} is built with "
            f"a decoder of {list(decoders)}"
        )
    text = dict(config.text_config)
    text["tie_word_embeddings"] = bool(config.hf_config.get("tie_word_embeddings"))
    view = copy.copy(config)
    view.hf_config = view.text_config = text
    view.architecture = view.hf_architecture = decoder_architecture(text)
    view.arch, view.image_token_id = arch, None
    return view


def refuse_what_images_do_not_run_with(config, par, name: str) -> None:
    """A vision-language model runs on one rank and one stage, unquantized, generative, from a
    Hugging Face folder: anything else is refused at load, by the field that asks for it."""
    if par.tp_size > 1:
        raise ValueError(f"tensor_parallel_size = {par.tp_size}: {name} runs on one rank")
    if par.stage.count > 1:
        raise ValueError(f"pipeline_parallel_size = {par.stage.count}: {name} runs on one stage")
    if config.quantization is not None:
        raise ValueError(f"quantization = {config.quantization!r} is not supported for {name}")
    if config.runner_type != "generate":
        raise ValueError(f"convert = {config.convert!r}: {name} runs as a generative model")
    if config.gguf_file is not None:
        raise ValueError(f"model = {config.model!r}: {name} loads from a Hugging Face folder")
