"""The n-gram proposer's vectorised path against the literal rule, and its caps."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.engine.spec_decode.ngram import NgramProposer, propose_ngram, propose_ngram_literal


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 4), min_size=1, max_size=40),
    k=st.integers(1, 5),
    low=st.integers(1, 4),
    extra=st.integers(0, 3),
)
def test_vectorised_proposals_follow_the_literal_rule(tokens, k, low, extra):
    got = propose_ngram(np.array(tokens, dtype=np.int64), k, low, low + extra).tolist()
    assert got == propose_ngram_literal(tokens, k, low, low + extra)


def test_longest_match_first_then_earliest():
    # suffix [1, 2, 3]: the 3-gram occurs once (at 4), the 2-gram [2, 3] earlier (at 0)
    tokens = [2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert propose_ngram_literal(tokens, 2, 2, 3) == [7, 8]
    assert propose_ngram_literal(tokens, 2, 2, 2) == [9, 9]
    assert propose_ngram(np.array(tokens), 2, 2, 3).tolist() == [7, 8]
    assert propose_ngram(np.array([1, 2, 3]), 2, 1, 3).tolist() == []  # no earlier match


def test_the_proposer_caps_at_k_and_at_what_may_still_be_emitted():
    proposer = NgramProposer(num_speculative_tokens=3, lookup_min=1, lookup_max=2)
    prompt, output = [5, 6, 7, 8, 9, 10], [5]
    assert proposer.propose(prompt, output, max_tokens=10) == [6, 7, 8]
    assert proposer.propose(prompt, output, max_tokens=2) == [6, 7]
    assert proposer.propose(prompt, output, max_tokens=0) == []
