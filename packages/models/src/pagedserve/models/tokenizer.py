"""The tokenizer and chat template, read from the model folder through transformers."""

from __future__ import annotations

import json
import re
from typing import Any

from pagedserve.models.config import ModelLoadError


def load_tokenizer(model_dir: str):
    """A transformers fast tokenizer for ``model_dir`` (tokenizer.json; never downloads), or
    for a ``.gguf`` file the one transformers builds from its ``tokenizer.ggml.*`` metadata
    (vocabulary, merges, special ids, ``tokenizer.chat_template``). A vision-language model's
    folder often keeps its chat template with its processor (``chat_template.json``), not
    with its tokenizer: the tokenizer takes it from there."""
    from pathlib import Path

    from transformers import AutoTokenizer

    path = Path(model_dir)
    try:
        if path.suffix == ".gguf":
            return _gguf_tokenizer(path)
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {model_dir}: {e}") from e
    if not tokenizer.chat_template and (path / "chat_template.json").is_file():
        tokenizer.chat_template = json.loads((path / "chat_template.json").read_text()).get(
            "chat_template"
        )
    return tokenizer


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
    tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    image_placeholder: str | None = None,
    **kwargs,
) -> list[int]:
    """Prompt token ids for a chat, through the tokenizer's own template (or ``chat_template``
    in ``kwargs``). A template that reads a message's content as a list of parts (OpenAI's
    shape, as vision-language models' templates do) gets every content as parts: the leading
    ``image_placeholder`` lines of a content as ``{"type": "image"}`` parts, the rest as one
    text part; given plain strings, such a template would render no text at all."""
    template = kwargs.get("chat_template") or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("this model has no chat template; use a plain completion prompt")
    if takes_content_parts(template):
        messages = [as_content_parts(m, image_placeholder) for m in messages]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


# a loop over a message's content, or a test of a part's type: the template reads parts
_READS_PARTS = re.compile(
    r"for\s+\w+\s+in\s+\w+(\[['\"]content['\"]\]|\.content)"
    r"|selectattr\(\s*['\"]type['\"]|\[['\"]type['\"]\]\s*==|\.type\s*=="
)


def takes_content_parts(template: str) -> bool:
    """Whether a chat template reads message contents as lists of typed parts."""
    return bool(_READS_PARTS.search(template))


def as_content_parts(message: dict[str, Any], image_placeholder: str | None) -> dict[str, Any]:
    """``message`` with a string content as parts: an image part per leading placeholder
    line, then the text (none when it is empty)."""
    content = message.get("content")
    if isinstance(content, list):
        return message
    text, parts = content or "", []
    line = f"{image_placeholder}\n" if image_placeholder else None
    while line and text.startswith(line):
        parts.append({"type": "image"})
        text = text[len(line) :]
    if text:
        parts.append({"type": "text", "text": text})
    return {**message, "content": parts}
