"""GET /tokenizer_info: what a client needs to tokenize as the server does, as vLLM returns it.

The tokenizer's class, and its configuration (``init_kwargs``: special tokens, padding side,
model_max_length...) where a value is JSON; the chat template when it has one; added tokens as
``{id: {content, special}}``. It can reveal a local path (``name_or_path``) and the template, so
vLLM and pagedserve serve it only with ``--enable-tokenizer-info-endpoint``.
"""

from __future__ import annotations

import json

from pagedserve.server.protocol import TokenizerInfoResponse


def _json_safe(value) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def tokenizer_info_of(tokenizer) -> TokenizerInfoResponse:
    config = {
        key: value
        for key, value in getattr(tokenizer, "init_kwargs", {}).items()
        if not key.startswith("_") and key != "added_tokens_decoder" and _json_safe(value)
    }
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        config["chat_template"] = template
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    config["added_tokens_decoder"] = {
        str(index): {"content": str(token), "special": bool(getattr(token, "special", False))}
        for index, token in added.items()
    }
    return TokenizerInfoResponse(tokenizer_class=type(tokenizer).__name__, **config)
