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
from pagedserve.scheduler import Request, SchedulerOutput


class Speculator:
    """The proposer, and the bridge from a step's rows to the verification batch."""

    def __init__(self, config: SpeculativeConfig) -> None:
        if config.method != "ngram":
            raise SpeculativeConfigError(
                "method", f"{config.method!r} is not available in this build; use 'ngram'"
            )
        self.config = config
        self.proposer = NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )

    def propose(self, running: list[Request]) -> None:
        """Proposals for every running sequence whose next step is a decode."""
        propose = self.proposer.propose
        for request in running:
            num_tokens = request.num_tokens
            if request.num_computed_tokens + 1 != num_tokens or request.spec_token_ids:
                continue
            room = request.max_tokens - request.num_output_tokens - 1
            if room > 0:
                request.spec_token_ids = propose(request.all_token_ids, room)

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


__all__ = ["Speculator", "VerificationBatch", "VerifyCounts"]
