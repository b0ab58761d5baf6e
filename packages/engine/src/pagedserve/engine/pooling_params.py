"""PoolingParams: what a pooling request asks for, with vLLM's names (``LLM.embed``,
``LLM.classify``, ``LLM.score``, ``AsyncLLM.encode``; the server's /v1/embeddings, /pooling,
/classify, /score and /rerank).

- ``task``: ``embed`` (a vector), ``classify`` (class probabilities) or ``score`` (one
  relevance score: a cross-encoder's class, or the cosine of two embeddings, which the
  caller computes from two ``embed`` requests); None takes the model's own task.
- ``dimensions``: a Matryoshka embedder's vector cut to its first ``dimensions`` values (then
  normalised); refused for a model not trained for it, as vLLM refuses it.
- ``use_activation``: an embedding's L2 normalisation (when the model normalises), class
  scores' softmax / sigmoid; None is the model's default (on).
- ``truncate_prompt_tokens``: keep only the prompt's last k tokens (-1: ``max_model_len``).
  Text is truncated by whoever tokenizes it (``LLM``, the server), with the tokenizer's own
  truncation, which keeps the special tokens.

``verify`` checks the request against the model once, at ``add_request``; the engine refuses
what does not fit with an ``InvalidRequestError`` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.engine.errors import InvalidRequestError

POOLING_TASKS = ("embed", "classify", "score")


@dataclass
class PoolingParams:
    task: str | None = None
    dimensions: int | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise InvalidRequestError(
                f"task must be one of {list(POOLING_TASKS)}, got {self.task!r}", "task"
            )
        if self.dimensions is not None and self.dimensions < 1:
            raise InvalidRequestError(
                f"dimensions must be at least 1, got {self.dimensions}", "dimensions"
            )
        t = self.truncate_prompt_tokens
        if t is not None and t != -1 and t < 1:
            raise InvalidRequestError(
                f"truncate_prompt_tokens must be -1 or at least 1, got {t}",
                "truncate_prompt_tokens",
            )

    def verify(self, model_task: str, hidden_size: int, matryoshka: list[int] | None) -> None:
        """Refuse what this model cannot give (``model_task``: the pooler's, embed or
        classify; ``matryoshka``: the output sizes it may be cut to, None for none)."""
        task = self.task or model_task
        if task == "embed" and model_task != "embed":
            raise InvalidRequestError(
                "this model is a classifier: it gives class scores, not embeddings "
                "(use /classify or /score)",
                "task",
            )
        if task == "classify" and model_task != "classify":
            raise InvalidRequestError(
                "this model is an embedding model: it has no classifier (use /v1/embeddings)",
                "task",
            )
        if self.dimensions is None or self.dimensions == hidden_size:
            return
        if model_task != "embed" or task != "embed":
            raise InvalidRequestError("dimensions applies to embeddings only", "dimensions")
        if matryoshka is None:
            raise InvalidRequestError(
                "this model does not support Matryoshka representations: its embeddings "
                "cannot be cut to other dimensions",
                "dimensions",
            )
        if self.dimensions not in matryoshka:
            raise InvalidRequestError(
                f"dimensions {self.dimensions} is not one this model was trained for: "
                f"{matryoshka if len(matryoshka) < 20 else f'1..{hidden_size}'}",
                "dimensions",
            )

    def truncated(self, prompt_token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's last ``truncate_prompt_tokens`` tokens (-1: ``max_model_len``)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return prompt_token_ids
        k = max_model_len if k == -1 else k
        return prompt_token_ids[-k:]
