"""The engine's side of speculative decoding: propose after a step, verify inside the next.

After each step the ``Speculator`` proposes up to k tokens for every running sequence that is
decoding (``Request.spec_token_ids``); the scheduler gives such a sequence 1 + k tokens in its
next step (the token budget counts them, the block manager allocates their slots) and the
model runner scores every proposed position in the same forward and verifies them
(``VerificationBatch``, verify.py), and ``scheduler.update`` appends what was accepted, rewinds
past what was not and frees the blocks only rejected tokens used. A draft model
(draft_model.py) proposes inside the next step instead: after a step only placeholders are
set, and the runner has the draft fill them at the start of the step, before the target's
forward.

A proposal never runs past what the sequence may still emit: with r tokens left under
``max_tokens``, at most r - 1 are proposed (the step adds one token of the target's own), so
the verify step never writes a KV slot beyond what admission reserved.
"""

from __future__ import annotations

from pagedserve.engine.spec_decode.config import SpeculativeConfig
from pagedserve.engine.spec_decode.draft_model import DraftModelProposer
from pagedserve.engine.spec_decode.ngram import NgramProposer
from pagedserve.models import ModelConfig
from pagedserve.scheduler import Request


class Speculator:
    """The proposer, and the bridge from a step's rows to the verification batch.

    With the n-gram proposer the proposals are made after each step, on the host. With a
    draft model (draft_model.py) only the number of proposals is decided then (placeholders
    the scheduler budgets and allocates slots for); the model runner runs the draft model at
    the start of the next step, once those slots exist, and it fills them in.
    """

    def __init__(
        self,
        config: SpeculativeConfig,
        model_config: ModelConfig,
        tokenizer: object,
        cache_dtype: str = "auto",
    ) -> None:
        self.config = config
        self.proposer: NgramProposer | None = None
        self.draft: DraftModelProposer | None = None
        if config.method == "draft_model":  # its cache stores what the target's stores
            self.draft = DraftModelProposer(config, model_config, tokenizer, cache_dtype)
        else:
            self.proposer = NgramProposer(
                config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
            )

    def kv_block_bytes(self, block_size: int) -> int:
        """KV bytes per block that live beside the target's (the draft's cache), so that the
        memory budget gives both caches the same number of blocks."""
        return 0 if self.draft is None else self.draft.block_bytes(block_size)

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> None:
        """The draft's KV tensors, once the target's block count is known."""
        if self.draft is not None:
            self.draft.allocate_kv_caches(num_blocks, block_size)

    def propose(self, running: list[Request]) -> None:
        """Proposals for every running sequence whose next step is a decode. A sequence under
        a structured-output grammar gets none: its proposals would be verified without the
        grammar's mask at each position."""
        propose = self.proposer.propose if self.proposer is not None else None
        for request in running:
            num_tokens = request.num_tokens
            if request.num_computed_tokens + 1 != num_tokens or request.spec_token_ids:
                continue
            if request.payload.params.structured_outputs is not None:
                continue
            room = request.max_tokens - request.num_output_tokens - 1
            if room > 0 and propose is None:
                request.spec_token_ids = self.draft.placeholders(room)
            elif room > 0:
                request.spec_token_ids = propose(
                    request.prompt_token_ids, request.output_token_ids, room
                )
