"""The interface the engine uses a grammar engine through, so that another can replace it.

A backend compiles a request's constraint once into a ``CompiledGrammar`` (shared, immutable,
cached by the constraint's text); each sequence that decodes under it owns a ``GrammarMatcher``
(its position in the grammar). Per step the matcher writes its row of the packed int32 bitmask
(bit ``t % 32`` of word ``t // 32`` = token t allowed; a stop token only where the grammar may
end), then accepts the sampled token. ``rollback`` undoes accepted tokens (speculative
decoding's rejected proposals).
"""

from __future__ import annotations

from typing import Protocol

import torch

from pagedserve.engine.structured_output.params import StructuredOutputsParams


class GrammarMatcher(Protocol):
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row ``row`` of ``bitmask`` (CPU int32)."""
        ...

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (and no change) when the grammar forbids it."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        ...

    def is_terminated(self) -> bool:
        """The grammar has ended (its stop token accepted): nothing more may follow."""
        ...


class CompiledGrammar(Protocol):
    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start, for one sequence."""
        ...


class StructuredOutputBackend(Protocol):
    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Compile the constraint; ``InvalidRequestError`` naming the field when it cannot be
        (an invalid or unsupported schema, a bad regex, a grammar syntax error)."""
        ...
