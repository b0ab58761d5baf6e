"""Verification: every speculative decode of a step, accepted or rejected in one pass.

A verify step ran each such sequence's last token and its k proposals through the target model
at once, so there are k + 1 rows of logits per sequence: row j scores proposal j, row k the
bonus token. Each row goes through the sampler's pipeline as the sampler would process it at
that point of the sequence (sampler.py: raw logprobs, then logit bias, the min_tokens stop mask
and the penalties, which see the output *plus the proposals before it*), is turned into the
distribution the sampler draws from (``sampling_probs``: temperature, top-k, top-p, min-p;
one-hot at the argmax for greedy), and ``rejection_sample`` keeps a prefix of the proposals
plus one token of the target's own. So the emitted tokens are distributed exactly as the target
model alone would draw them, and a greedy request emits exactly its non-speculative tokens.

Randomness comes from each request's own generator, in a fixed order per step (k uniforms,
the recovery noise ``[k, V]``, the bonus token's noise ``[V]``); greedy rows draw nothing. A
seeded request is reproducible alone or in any batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.engine.input_batch import SamplingState
from pagedserve.engine.sampler import Sampler, SamplingMetadata, sampling_columns, top_logprobs
from pagedserve.kernels.rejection_sample import rejection_sample
from pagedserve.kernels.sampling import sample_tokens, sampling_probs


@dataclass
class VerifyCounts:
    """One step's verification outcome, for the metrics (``SpecDecodeStats``)."""

    num_drafts: int = 0  # sequences verified
    num_draft_tokens: int = 0  # proposals verified
    num_accepted_tokens: int = 0  # proposals accepted
    accepted_per_position: list[int] = field(default_factory=list)


@dataclass
class _Entry:
    state: SamplingState
    drafts: list[int]
    rows: list[int]  # the logits rows of proposal 0..k-1, then the bonus row


@dataclass
class VerificationBatch:
    """The speculative decodes of one step: ``add`` each, ``verify`` all, then read ``tokens``
    (accepted proposals, then the target's own token) and ``logprobs`` per entry."""

    logits: torch.Tensor  # the step's logits, proposal and bonus rows among them
    # a draft model's distributions [n, V] per request id, for its sampling rows; a request
    # without (n-gram proposals, greedy rows) has a one-hot q at each proposal
    draft_probs: dict[str, torch.Tensor] = field(default_factory=dict)
    entries: list[_Entry] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    logprobs: list[list[dict[int, float]] | None] = field(default_factory=list)

    def add(self, state: SamplingState, drafts: list[int], rows: list[int]) -> None:
        self.entries.append(_Entry(state, list(drafts), rows))

    def verify(self) -> VerifyCounts:
        """Accept or reject every proposal of the batch; fills ``tokens`` and ``logprobs``."""
        if not self.entries:
            return VerifyCounts()
        rows = [row for entry in self.entries for row in entry.rows]
        logits = self.logits[torch.tensor(rows, device=self.logits.device)].float()
        meta = self._position_metadata()
        raw_logprobs = self._raw_logprobs(logits)
        Sampler.process(logits, meta)
        temperature, top_k, top_p, min_p = sampling_columns(meta, logits.device)
        probs = sampling_probs(logits, temperature, top_k, top_p, min_p)
        draws = self._draws(meta.greedy, logits.shape[1], logits.device)
        is_bonus = self._bonus_positions(logits.device)
        bonus = sample_tokens(
            logits[is_bonus], temperature[is_bonus], top_k[is_bonus],
            top_p[is_bonus], min_p[is_bonus], draws.bonus_noise,
        )  # fmt: skip
        out = rejection_sample(
            *self._padded_drafts(logits.device),
            self._padded_draft_probs(logits.shape[1], logits.device),
            self._padded(probs[~is_bonus], 0.0),
            bonus,
            draws.uniform,
            draws.recovery_noise,
        )
        self.tokens = [row[row >= 0].tolist() for row in out.cpu()]
        self._emitted_logprobs(raw_logprobs)
        return self._counts()

    def _position_metadata(self) -> SamplingMetadata:
        """One row per position: position j sees the output and the proposals before j."""
        states, histories = [], []
        for entry in self.entries:
            output = entry.state.history()
            for j in range(len(entry.drafts) + 1):
                states.append(entry.state)
                histories.append(output + entry.drafts[:j])
        return SamplingMetadata(states, histories=histories)

    def _raw_logprobs(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Every position's raw logprobs, when some entry reports logprobs (read before the
        processors change the rows)."""
        if all(entry.state.params.logprobs is None for entry in self.entries):
            return None
        return torch.log_softmax(logits, dim=-1)

    def _bonus_positions(self, device: torch.device) -> torch.Tensor:
        flags = []
        for entry in self.entries:
            flags.extend([False] * len(entry.drafts) + [True])
        return torch.tensor(flags, device=device)

    def _num_proposals(self) -> int:
        return max(len(entry.drafts) for entry in self.entries)

    def _padded_drafts(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        k = self._num_proposals()
        padded = [entry.drafts + [0] * (k - len(entry.drafts)) for entry in self.entries]
        counts = [len(entry.drafts) for entry in self.entries]
        return (
            torch.tensor(padded, dtype=torch.int64, device=device),
            torch.tensor(counts, dtype=torch.int32, device=device),
        )

    def _padded_draft_probs(self, vocab: int, device: torch.device) -> torch.Tensor | None:
        """``[R, K, V]`` draft distributions, or None when every proposal's q is one-hot (the
        kernel's default): a draft model's sampling rows, one-hot rows for the rest."""
        if not self.draft_probs:
            return None
        out = torch.zeros(len(self.entries), self._num_proposals(), vocab, device=device)
        for r, entry in enumerate(self.entries):
            n = len(entry.drafts)
            q = self.draft_probs.get(entry.state.request_id)
            if q is not None:
                out[r, :n] = q[:n]
            else:
                index = torch.tensor(entry.drafts, dtype=torch.long, device=device)[:, None]
                out[r, :n].scatter_(1, index, 1.0)
        return out

    def _padded(self, flat: torch.Tensor, fill: float) -> torch.Tensor:
        """``[R, K, V]`` from the proposal positions' rows, rows without K proposals padded."""
        out = flat.new_full((len(self.entries), self._num_proposals(), flat.shape[-1]), fill)
        start = 0
        for r, entry in enumerate(self.entries):
            n = len(entry.drafts)
            out[r, :n] = flat[start : start + n]
            start += n
        return out

    def _draws(self, greedy: list[bool], vocab: int, device: torch.device) -> _Draws:
        """Each sampling row's uniforms, recovery noise and bonus noise, from its generator."""
        num, k = len(self.entries), self._num_proposals()
        uniform = torch.ones(num, k, device=device)
        recovery = torch.ones(num, k, vocab, device=device)
        bonus = torch.ones(num, vocab, device=device)
        position = 0
        for r, entry in enumerate(self.entries):
            n = len(entry.drafts)
            if not greedy[position]:
                generator = entry.state.generator
                uniform[r, :n] = torch.rand(n, generator=generator, device=device)
                recovery[r, :n].exponential_(generator=generator)
                bonus[r].exponential_(generator=generator)
            position += n + 1
        return _Draws(uniform, recovery, bonus)

    def _emitted_logprobs(self, raw_logprobs: torch.Tensor | None) -> None:
        """The raw logprobs of each emitted token, for the entries that report them."""
        self.logprobs = [None] * len(self.entries)
        if raw_logprobs is None:
            return
        start = 0
        for slot, entry in enumerate(self.entries):
            num = entry.state.params.logprobs
            tokens = self.tokens[slot]
            if num is not None:
                rows = raw_logprobs[start : start + len(tokens)]
                self.logprobs[slot] = top_logprobs(rows, tokens, [num] * len(tokens))
            start += len(entry.drafts) + 1

    def _counts(self) -> VerifyCounts:
        counts = VerifyCounts(num_drafts=len(self.entries))
        for entry, tokens in zip(self.entries, self.tokens, strict=True):
            accepted = len(tokens) - 1
            counts.num_draft_tokens += len(entry.drafts)
            counts.num_accepted_tokens += accepted
            while len(counts.accepted_per_position) < len(entry.drafts):
                counts.accepted_per_position.append(0)
            for j in range(accepted):
                counts.accepted_per_position[j] += 1
        return counts


@dataclass
class _Draws:
    uniform: torch.Tensor  # [R, K]
    recovery_noise: torch.Tensor  # [R, K, V]
    bonus_noise: torch.Tensor  # [R, V]
