"""What a multimodal config.json nests: the decoder's config under ``text_config``, the vision
tower's under ``vision_config``, and the image placeholder token.

A llava-hf config.json names only the fields that differ from the defaults of the config
classes it nests (``text_config`` of a LLaVA-1.5 may hold seven keys: no hidden size, no layer
count), so pagedserve reads it through transformers' own config class, which fills the
defaults exactly as transformers does when it builds the reference model. ModelConfig then
takes the decoder's dimensions from the completed ``text_config``.
"""

from __future__ import annotations

from typing import Any

# The decoders a multimodal checkpoint may nest (``text_config.model_type``): the classes of
# the Llama family whose layers need nothing architecture-specific (llama.py).
DECODER_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}


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

    if not isinstance(hf_config.get("text_config"), dict):
        return hf_config, hf_config, None
    text_type = hf_config["text_config"].get("model_type", "llama")
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
