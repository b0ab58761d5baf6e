"""`make demo`: offline chat generation on the default model, printed with timing."""

from __future__ import annotations

import sys

from pagedserve.server.cli import main

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences what a KV cache is.",
    "Give me three tips for learning Python.",
]

if __name__ == "__main__":
    sys.exit(main(["generate", "--chat", "--max-tokens", "96", *PROMPTS]))
