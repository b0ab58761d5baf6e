"""Verification: every speculative decode of a step, accepted or rejected in one pass.

A verify step ran each such sequence's last token and its k proposals through the target model
at once, so there are k + 1 rows of logits per sequence: row j scores proposal j, row k the
bonus token. Each row is processed as the sampler would process it at that point of the
sequence (logit bias, the min_tokens stop mask and the penalties see the output *plus the
proposals before it*), turned into the distribution the sampler draws from
(``sampling_probs``: temperature, top-k, top-p, min-p; one-hot at the argmax for greedy), and
``rejection_sample`` keeps a prefix of the proposals plus one token of the target's own. So
the emitted tokens are distributed exactly as the target model alone would draw them, and a
greedy request emits exactly its non-speculative tokens.

Randomness comes from each request's own generator, in a fixed order per step (k uniforms,
the recovery noise ``[k, V]``, the bonus token's noise ``[V]``); greedy rows draw nothing. A
seeded request is reproducible alone or in any batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pagedserve.engine.decisions import StepContext
from pagedserve.engine.sampler import (
    BatchSettings,
    SamplingMetadata,
    apply_logit_processors,
    penalise,
)
from pagedserve.kernels.rejection_sample import rejection_sample
from pagedserve.kernels.sampling import sample_tokens, sampling_probs
from pagedserve.scheduler import Request

if TYPE_CHECKING:
    from pagedserve.engine.sequence_group import SequenceGroup, SequenceState


@dataclass
class VerifyCounts:
    """One step's verification outcome, for the metrics (``SpecDecodeStats``)."""

    num_drafts: int = 0  # sequences verified
    num_draft_tokens: int = 0  # proposals verified
    num_accepted_tokens: int = 0  # proposals accepted
    accepted_per_position: list[int] = field(default_factory=list)


@dataclass
class VerificationBatch:
    """The speculative decodes of one step: ``add`` each, ``verify`` all, read ``tokens``."""

    logits: torch.Tensor  # every row of the step's logits: sampled, prompt and proposal rows
    # a draft model's distributions [n, V] per request id, for its sampling rows; a request
    # without (n-gram proposals, greedy rows) has a one-hot q at each proposal
    draft_probs: dict[str, torch.Tensor] = field(default_factory=dict)
    _entries: list[tuple[Request, SequenceState, list[int], list[int]]] = field(
        default_factory=list
    )
    _tokens: list[list[int]] = field(default_factory=list)
    _logprobs: list[list[dict[int, float]] | None] = field(default_factory=list)

    def add(self, request: Request, drafts: list[int], rows: list[int]) -> SpeculativeDecision:
        """``rows``: the logits rows of proposal 0..k-1, then the bonus row."""
        state = request.payload
        self._entries.append((request, state, list(drafts), rows))
        slot = len(self._entries) - 1
        return SpeculativeDecision(state.group, self, request, slot, request.num_output_tokens)

    def tokens(self, slot: int) -> list[int]:
        return self._tokens[slot]

    def logprobs(self, slot: int, index: int) -> dict[int, float] | None:
        rows = self._logprobs[slot]
        return None if rows is None else rows[index]

    def verify(self) -> VerifyCounts:
        """Accept or reject every proposal of the batch; fills ``tokens`` and ``logprobs``."""
        entries = self._entries
        if not entries:
            return VerifyCounts()
        rows = [row for *_, entry_rows in entries for row in entry_rows]
        raw = self.logits[torch.tensor(rows, device=self.logits.device)].float()
        meta = self._position_metadata()
        settings = BatchSettings(meta.params)
        logits = penalise(apply_logit_processors(raw, meta, settings), meta, settings)
        columns = settings.columns(("temperature", "top_k", "top_p", "min_p"), logits.device)
        temperature, top_k, top_p, min_p = columns
        probs = sampling_probs(logits, temperature, top_k.int(), top_p, min_p)
        draws = self._draws(settings, logits.shape[1], logits.device)
        is_bonus = self._bonus_positions(logits.device)
        bonus = sample_tokens(
            logits[is_bonus], temperature[is_bonus], top_k[is_bonus].int(),
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
        self._tokens = [row[row >= 0].tolist() for row in out.cpu()]
        self._record_logprobs(raw)
        return self._counts()

    def _position_metadata(self) -> SamplingMetadata:
        """One row per position: position j sees the output and the proposals before j."""
        params, generators, prompts, outputs, masked = [], [], [], [], []
        for request, state, drafts, _ in self._entries:
            output = request.output_token_ids
            for j in range(len(drafts) + 1):
                params.append(state.params)
                generators.append(state.generator)
                prompts.append(request.prompt_token_ids)
                history = output + drafts[:j]
                outputs.append(history)
                early = len(history) < request.min_tokens  # masked_tokens at this position
                masked.append(request.stop_token_ids if early else frozenset())
        return SamplingMetadata(params, generators, prompts, outputs, masked)

    def _bonus_positions(self, device: torch.device) -> torch.Tensor:
        flags = []
        for _, _, drafts, _ in self._entries:
            flags.extend([False] * len(drafts) + [True])
        return torch.tensor(flags, device=device)

    def _padded_drafts(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        k = max(len(d) for _, _, d, _ in self._entries)
        padded = [d + [0] * (k - len(d)) for _, _, d, _ in self._entries]
        counts = [len(d) for _, _, d, _ in self._entries]
        return (
            torch.tensor(padded, dtype=torch.int64, device=device),
            torch.tensor(counts, dtype=torch.int32, device=device),
        )

    def _padded_draft_probs(self, vocab: int, device: torch.device) -> torch.Tensor | None:
        """``[R, K, V]`` draft distributions, or None when every proposal's q is one-hot (the
        kernel's default): a draft model's sampling rows, one-hot rows for the rest."""
        if not self.draft_probs:
            return None
        k = max(len(d) for _, _, d, _ in self._entries)
        out = torch.zeros(len(self._entries), k, vocab, device=device)
        for r, (request, _, drafts, _) in enumerate(self._entries):
            q = self.draft_probs.get(request.request_id)
            if q is not None:
                out[r, : len(drafts)] = q[: len(drafts)]
            else:
                index = torch.tensor(drafts, dtype=torch.long, device=device)[:, None]
                out[r, : len(drafts)].scatter_(1, index, 1.0)
        return out

    def _padded(self, flat: torch.Tensor, fill: float) -> torch.Tensor:
        """``[R, K, V]`` from the proposal positions' rows, rows without K proposals padded."""
        k = max(len(d) for _, _, d, _ in self._entries)
        out = flat.new_full((len(self._entries), k, flat.shape[-1]), fill)
        start = 0
        for r, (_, _, drafts, _) in enumerate(self._entries):
            out[r, : len(drafts)] = flat[start : start + len(drafts)]
            start += len(drafts)
        return out

    def _draws(self, settings: BatchSettings, vocab: int, device: torch.device) -> _Draws:
        """Each sampling row's uniforms, recovery noise and bonus noise, from its generator."""
        num = len(self._entries)
        k = max(len(d) for _, _, d, _ in self._entries)
        uniform = torch.ones(num, k, device=device)
        recovery = torch.ones(num, k, vocab, device=device)
        bonus = torch.ones(num, vocab, device=device)
        position = 0
        for r, (_, state, drafts, _) in enumerate(self._entries):
            n = len(drafts)
            if not settings.greedy[position]:
                generator = state.generator
                uniform[r, :n] = torch.rand(n, generator=generator, device=device)
                recovery[r, :n].exponential_(generator=generator)
                bonus[r].exponential_(generator=generator)
            position += n + 1
        return _Draws(uniform, recovery, bonus)

    def _record_logprobs(self, raw: torch.Tensor) -> None:
        """The raw logprobs (as the sampler reports them) of every position of the rows that
        asked, top-N and the emitted token's; read only for the tokens actually emitted."""
        self._logprobs = [None] * len(self._entries)
        wanted = [state.params.logprobs for _, state, _, _ in self._entries]
        if all(n is None for n in wanted):
            return
        logprobs = torch.log_softmax(raw, dim=-1)
        top = logprobs.topk(max(max(n or 0 for n in wanted), 1), dim=-1)
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
        start = 0
        for slot, (_, _, drafts, _) in enumerate(self._entries):
            num = wanted[slot]
            if num is not None:
                rows = []
                for j, token in enumerate(self._tokens[slot]):
                    entry = dict(zip(top_ids[start + j][:num], top_values[start + j][:num]))
                    entry.setdefault(token, logprobs[start + j, token].item())
                    rows.append(entry)
                self._logprobs[slot] = rows
            start += len(drafts) + 1

    def _counts(self) -> VerifyCounts:
        counts = VerifyCounts(num_drafts=len(self._entries))
        for (_, _, drafts, _), tokens in zip(self._entries, self._tokens, strict=True):
            accepted = len(tokens) - 1
            counts.num_draft_tokens += len(drafts)
            counts.num_accepted_tokens += accepted
            while len(counts.accepted_per_position) < len(drafts):
                counts.accepted_per_position.append(0)
            for j in range(accepted):
                counts.accepted_per_position[j] += 1
        return counts


@dataclass
class _Draws:
    uniform: torch.Tensor  # [R, K]
    recovery_noise: torch.Tensor  # [R, K, V]
    bonus_noise: torch.Tensor  # [R, V]


@dataclass
class SpeculativeDecision:
    """One speculative decode's step (a ``StepDecision``): the tokens it emits, applied in
    order after ``scheduler.update`` appended them (which already cut the run at EOS or
    max_tokens). A stop string inside the run ends the output at the token that completes it."""

    group: SequenceGroup
    batch: VerificationBatch
    request: Request
    slot: int
    num_output: int  # output tokens before this step

    def sampled_tokens(self) -> dict[str, list[int]]:
        return {self.request.request_id: self.batch.tokens(self.slot)}

    def apply(self, ctx: StepContext) -> bool:
        request = self.request
        if request.request_id not in ctx.updated:
            return False
        state = request.payload
        output = request.output_token_ids
        for index in range(self.num_output, len(output)):
            logprobs = self.batch.logprobs(self.slot, index - self.num_output)
            state.process_new_token(request, logprobs, ctx, token_index=index)
            if state.stop_string_hit is not None:
                del output[index + 1 :]  # the request is finished: its blocks are freed
                break
        return True
