"""The engine's side of speculative decoding: propose after a step, verify inside the next.

After each step the ``Speculator`` proposes up to k tokens for every running sequence that is
decoding (``Request.spec_token_ids``); the scheduler gives such a sequence 1 + k tokens in its
next step (the token budget counts them, the block manager allocates their slots) and the
model runner scores every proposed position in the same forward. ``verification_batch`` then
collects those rows for ``VerificationBatch.verify`` (verify.py), and ``scheduler.update``
appends what was accepted, rewinds past what was not and frees the blocks only rejected tokens
used.

A proposal never runs past what the sequence may still emit: with r tokens left under
``max_tokens``, at most r - 1 are proposed (the step adds one token of the target's own), so
the verify step never writes a KV slot beyond what admission reserved.
"""

from __future__ import annotations

import torch

from pagedserve.engine.spec_decode.config import SpeculativeConfig, SpeculativeConfigError
from pagedserve.engine.spec_decode.ngram import NgramProposer
from pagedserve.engine.spec_decode.verify import VerificationBatch, VerifyCounts
from pagedserve.models import ModelConfig, load_tokenizer
from pagedserve.models.config import ModelLoadError
from pagedserve.scheduler import Request, SchedulerOutput


def check_draft_model(path: str, target: ModelConfig, target_tokenizer) -> None:
    """A draft proposes token ids the target scores: both must share one vocabulary and one
    tokenizer. Refused at start-up, naming ``speculative_config.model``."""
    try:
        draft = ModelConfig(model=path, dtype=target.dtype, device=target.device)
        draft_tokenizer = load_tokenizer(path)
    except ModelLoadError as e:
        raise SpeculativeConfigError("model", f"cannot load the draft model: {e}") from e
    if draft.vocab_size != target.vocab_size:
        raise SpeculativeConfigError(
            "model",
            f"the draft's vocabulary has {draft.vocab_size} tokens, the target's "
            f"{target.vocab_size}: a draft must share the target's tokenizer",
        )
    if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise SpeculativeConfigError(
            "model", "the draft's tokenizer maps tokens to other ids than the target's"
        )


class Speculator:
    """The proposer, and the bridge from a step's rows to the verification batch."""

    def __init__(
        self, config: SpeculativeConfig, model_config: ModelConfig, tokenizer: object
    ) -> None:
        if config.method == "draft_model":
            check_draft_model(config.model, model_config, tokenizer)
            raise SpeculativeConfigError(
                "method",
                "the draft_model proposer is not available in this build (the draft checks "
                "out against the target); use 'ngram'",
            )
        self.config = config
        self.proposer = NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )

    def propose(self, running: list[Request]) -> None:
        """Proposals for every running sequence whose next step is a decode. A sequence under
        a structured-output grammar gets none: its proposals would be verified without the
        grammar's mask at each position."""
        propose = self.proposer.propose
        for request in running:
            num_tokens = request.num_tokens
            if request.num_computed_tokens + 1 != num_tokens or request.spec_token_ids:
                continue
            if request.payload.params.structured_outputs is not None:
                continue
            room = request.max_tokens - request.num_output_tokens - 1
            if room > 0:
                request.spec_token_ids = propose(
                    request.prompt_token_ids, request.output_token_ids, room
                )

    def verification_batch(
        self, scheduled: SchedulerOutput, logits: torch.Tensor, num_spec_rows: int
    ) -> tuple[VerificationBatch, dict[str, tuple[list[int], list[int]]]]:
        """The batch, and per speculative request its proposals and proposal rows (the last
        ``num_spec_rows`` rows of ``logits``, in scheduled order: model_runner.execute)."""
        row = len(logits) - num_spec_rows
        proposals = {}
        for item in scheduled.scheduled:
            drafts = item.spec_token_ids
            if drafts:
                proposals[item.request.request_id] = (
                    list(drafts),
                    list(range(row, row + len(drafts))),
                )
                row += len(drafts)
        return VerificationBatch(logits), proposals


__all__ = ["Speculator", "VerificationBatch", "VerifyCounts", "check_draft_model"]
