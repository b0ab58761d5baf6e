"""Configuration of the continuous-batching scheduler."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SchedulerConfig:
    """Limits of one step, and of the waiting queue.

    ``max_num_batched_tokens`` is the token budget of a step: decodes cost one token each,
    prefill chunks as many tokens as they carry. ``long_prefill_token_threshold`` caps how much
    of the budget one prompt may take in a step (0 = no cap beyond the budget), so that one long
    prompt cannot crowd out the decodes and the other prompts of a step.

    ``policy`` is ``"fcfs"`` (arrival order) or ``"priority"`` (lower ``Request.priority`` first,
    then arrival; the lowest-priority running request is the one preempted).

    The waiting queue is bounded so that an overloaded server refuses at once (503) instead of
    queueing without end: at most ``max_num_waiting`` requests and ``max_num_waiting_tokens``
    tokens (0 = no token cap) wait at a time.

    ``background_priority`` (None = none) marks background work, under the priority policy:
    a request of this priority value or above (the Batch API's lines) yields every step in which
    a more important request has prompt tokens to read, so that an interactive request's prompt
    never shares its step (and its time to first token) with batch decodes and prompts.

    ``max_loras`` (0 = no cap) is how many distinct LoRA adapters the running requests may use
    at once: the adapter slots of the model runner. A waiting request whose adapter would be
    one too many waits at the head of the queue until a running adapter's requests finish.

    ``encoder_cache_size`` (0 = ``max_num_batched_tokens``) is how many image embedding rows the
    encoder cache keeps between steps, and the most one step encodes (encoder_cache.py).
    ``whole_images``: the model's image tokens attend to each other both ways (Gemma 3), so an
    image's tokens are computed in one chunk, never split across steps (admission.py).
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    max_num_waiting: int = 1024
    max_num_waiting_tokens: int = 0
    max_loras: int = 0
    background_priority: int | None = None
    encoder_cache_size: int = 0
    whole_images: bool = False

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens must be >= max_model_len "
                f"({self.max_num_batched_tokens} < {self.max_model_len})"
            )
        if self.encoder_cache_size == 0:
            self.encoder_cache_size = self.max_num_batched_tokens
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.background_priority is not None and self.policy != "priority":
            raise ValueError(
                "background_priority needs the priority policy (under fcfs a background request "
                "at the head of the queue would hold back every request behind it)"
            )
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if self.max_loras < 0:
            raise ValueError(f"max_loras must be >= 0, got {self.max_loras}")
        if self.max_num_waiting < 1:
            raise ValueError(f"max_num_waiting must be >= 1, got {self.max_num_waiting}")
        if self.max_num_waiting_tokens and self.max_num_waiting_tokens < self.max_model_len:
            raise ValueError(
                "max_num_waiting_tokens must be 0 (no cap) or >= max_model_len "
                f"({self.max_num_waiting_tokens} < {self.max_model_len}): otherwise a long prompt "
                "could never be queued"
            )
