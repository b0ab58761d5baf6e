"""Speculative decoding: propose k tokens per sequence cheaply, verify them in one forward of
the target model, keep a prefix plus one token of the target's own, roll back the rest.

config.py (SpeculativeConfig, vLLM's dict), ngram.py (the prompt-lookup proposer),
draft_model.py (the draft-model proposer and its KV cache on the target's blocks),
verify.py (the acceptance rule over a step's rows), speculator.py (the engine's glue).
"""

from pagedserve.engine.spec_decode.config import SpeculativeConfig, SpeculativeConfigError
from pagedserve.engine.spec_decode.draft_model import DraftModelProposer
from pagedserve.engine.spec_decode.ngram import NgramProposer
from pagedserve.engine.spec_decode.speculator import Speculator
from pagedserve.engine.spec_decode.verify import VerificationBatch, VerifyCounts

__all__ = [
    "DraftModelProposer",
    "NgramProposer",
    "SpeculativeConfig",
    "SpeculativeConfigError",
    "Speculator",
    "VerificationBatch",
    "VerifyCounts",
]
