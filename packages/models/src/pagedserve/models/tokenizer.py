"""The tokenizer and chat template, read from the model folder through transformers."""

from __future__ import annotations

from typing import Any

from pagedserve.models.config import ModelLoadError


def load_tokenizer(model_dir: str):
    """A transformers fast tokenizer for ``model_dir`` (tokenizer.json; never downloads), or
    for a ``.gguf`` file the one transformers builds from its ``tokenizer.ggml.*`` metadata
    (vocabulary, merges, special ids, ``tokenizer.chat_template``)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    path = Path(model_dir)
    try:
        if path.suffix == ".gguf":
            return _gguf_tokenizer(path)
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {model_dir}: {e}") from e


def _gguf_tokenizer(path):
    """transformers' tokenizer for the file; where transformers reads no config for the
    file's architecture (DeepSeek's ``deepseek2``) and so refuses the file whole, or fails to
    read it (its ``gpt-oss`` reader takes a rope key's length field for its value: a
    TypeError), the same tokenizer built from the ``tokenizer.*`` keys alone, as transformers
    builds it."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    try:
        return AutoTokenizer.from_pretrained(
            str(path.parent), gguf_file=path.name, local_files_only=True
        )
    except ValueError as e:
        if "architecture" not in str(e):
            raise
    except TypeError:  # transformers' gpt-oss reader (above); any other TypeError is a bug
        from pagedserve.models.gguf_config import field, open_gguf

        if field(open_gguf(path), "general.architecture") != "gpt-oss":
            raise
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    arch, tokenizer, tokenizer_config = get_gguf_tokenizer(str(path))
    backend, extra = convert_gguf_tokenizer(arch, tokenizer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)


def apply_chat_template(
    tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs
) -> list[int]:
    """Prompt token ids for a chat, through the tokenizer's own template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template; use a plain completion prompt")
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)
