"""Beam search over shared blocks: the live beams are sequences that fork from each other.

One step of a beam group, as transformers' ``generate(num_beams=k, do_sample=False)`` does it
(with its default ``early_stopping=False``), so the two agree token for token:

1. every live beam b has a cumulative log-probability s_b; the candidates are ``s_b + log p(t |
   beam b)`` over all beams and tokens; keep the best ``2k`` (``max(2, 1 + #eos) * k``);
2. a candidate among the best ``k`` that ends the sequence (an EOS token, or the max_tokens-th
   token) becomes a finished hypothesis, scored ``sum logprob / length ** length_penalty``; the
   best ``k`` hypotheses are kept;
3. the best ``k`` candidates that do not end become the next live beams: the first candidate
   taken from beam b continues beam b itself (one token appended); each further one forks beam
   b (the child shares all of b's blocks; copy-on-write covers the partly filled last block);
   a beam no candidate came from is dropped and its blocks freed;
4. the search ends when every kept candidate ended, or when the best live beam can no longer
   beat the worst of ``k`` finished hypotheses (transformers' heuristic, at the current length).

All beams advance together: a step where only some beams got logits (a sibling was preempted
and is recomputing) is not a beam step; those beams wait, their last token recomputed next step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagedserve.engine.input_batch import InputBatch, SamplingState
from pagedserve.engine.outputs import CompletionOutput, RequestOutput
from pagedserve.engine.sequence_group import SequenceGroup
from pagedserve.scheduler import Request, RequestStatus, Scheduler


@dataclass
class BeamSearchParams:
    """vLLM's separate beam-search entry point takes these (``LLM.beam_search``)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")


@dataclass
class Hypothesis:
    """A finished beam: its output tokens, log-probability sum and length-penalised score."""

    token_ids: list[int]
    cumulative_logprob: float
    score: float
    ended_by_eos: bool


@dataclass
class Continuation:
    beam: Request
    token: int
    cumulative_logprob: float


@dataclass
class BeamStep:
    """What one beam step decided: tokens for continuing beams, forks, and beams to drop."""

    sampled: dict[str, int] = field(default_factory=dict)
    forks: list[tuple[Request, list[int], float]] = field(default_factory=list)
    dropped: list[Request] = field(default_factory=list)
    scores: dict[str, float] = field(default_factory=dict)


@dataclass(eq=False)
class BeamSearchGroup(SequenceGroup):
    """A request decoded by beam search; ``sequences`` are its live beams, best first."""

    beam_width: int = 1
    eos_token_ids: frozenset[int] = frozenset()
    max_tokens: int = 16
    hypotheses: list[Hypothesis] = field(default_factory=list)
    beam_scores: dict[str, float] = field(default_factory=dict)
    may_improve: bool = True
    done: bool = False
    next_beam_index: int = 1
    tokenizer: Any = None

    @property
    def is_finished(self) -> bool:
        return self.done or self.aborted

    def step_beams(self, beam_logprobs: dict[str, torch.Tensor]) -> BeamStep | list[Request]:
        """One beam step when every live beam has its log-probabilities in ``beam_logprobs``
        (the runner's rows); otherwise the beams that have them, which must wait (a sibling
        was preempted and is recomputing): they are rewound by one token after the update, so
        that they recompute it with their siblings."""
        live = [s for s in self.sequences if not s.is_finished]
        rows = [beam_logprobs.get(s.request_id) for s in live]
        if any(row is None for row in rows):
            return [s for s, row in zip(live, rows) if row is not None]
        plan = self.step(live, torch.stack(rows))
        self.beam_scores.update(plan.scores)
        return plan

    def step(self, beams: list[Request], logprobs: torch.Tensor) -> BeamStep:
        """One beam step from the live ``beams`` (all of them) and their log-probabilities
        ``[m, V]``."""
        k, vocab = self.beam_width, logprobs.shape[1]
        scores = torch.tensor([self.beam_scores.get(b.request_id, 0.0) for b in beams])
        candidates = (scores[:, None] + logprobs.cpu()).flatten()
        num_keep = min(max(2, 1 + len(self.eos_token_ids)) * k, candidates.numel())
        top_scores, top_index = candidates.topk(num_keep)
        new_length = beams[0].num_output_tokens + 1
        continuing: list[Continuation] = []
        for rank, (score, index) in enumerate(zip(top_scores.tolist(), top_index.tolist())):
            beam, token = beams[index // vocab], index % vocab
            if token in self.eos_token_ids or new_length >= self.max_tokens:
                if rank < k and self.may_improve:
                    self._add_hypothesis(beam, token, score, new_length)
            elif len(continuing) < k:
                continuing.append(Continuation(beam, token, score))
        if not continuing:
            self.done = True
        elif len(self.hypotheses) == k and self.params.early_stopping:
            self.done = True  # early_stopping=True: k finished hypotheses end the search
        elif len(self.hypotheses) == k:
            best = continuing[0].cumulative_logprob / new_length**self.params.length_penalty
            self.may_improve = self.may_improve and best > self.hypotheses[-1].score
            self.done = not self.may_improve
        return self._plan(beams, continuing)

    def _add_hypothesis(self, beam: Request, token: int, score: float, length: int) -> None:
        self.hypotheses.append(
            Hypothesis(
                token_ids=list(beam.output_token_ids) + [token],
                cumulative_logprob=score,
                score=score / length**self.params.length_penalty,
                ended_by_eos=token in self.eos_token_ids,
            )
        )
        self.hypotheses.sort(key=lambda h: h.score, reverse=True)
        del self.hypotheses[self.beam_width :]

    def _plan(self, beams: list[Request], continuing: list[Continuation]) -> BeamStep:
        plan = BeamStep()
        if self.done:
            plan.dropped = list(beams)
            return plan
        for c in continuing:
            beam_id = c.beam.request_id
            if beam_id not in plan.sampled:
                plan.sampled[beam_id] = c.token
                plan.scores[beam_id] = c.cumulative_logprob
            else:
                plan.forks.append(
                    (c.beam, list(c.beam.output_token_ids) + [c.token], c.cumulative_logprob)
                )
        plan.dropped = [b for b in beams if b.request_id not in plan.sampled]
        return plan

    def apply_step(self, plan: BeamStep, scheduler: Scheduler, input_batch: InputBatch) -> None:
        """After the update appended the continuing beams' tokens: start the forks (each
        shares its parent's blocks), drop the beams no candidate came from, keep the live
        beams best first."""
        for parent, output_ids, score in plan.forks:
            child = Request(
                request_id=self.next_child_id(),
                prompt_token_ids=list(self.prompt_token_ids),
                max_tokens=parent.max_tokens,
                priority=parent.priority,
                arrival_time=parent.arrival_time,
                lora_int_id=parent.lora_int_id,
                images=parent.images,
            )
            child.output_token_ids.extend(output_ids)
            sampling = SamplingState(
                child, self.params, parent.payload.sampling.generator, beam=True
            )
            child.payload = self.sequence_state(0, sampling, self.tokenizer)
            scheduler.add_forked_request(parent.request_id, child)
            input_batch.add(sampling)
            self.sequences.append(child)
            self.beam_scores[child.request_id] = score
        scheduler.finish_requests(
            [r.request_id for r in plan.dropped], RequestStatus.FINISHED_ABORTED
        )
        live = [s for s in self.sequences if not s.is_finished]
        live.sort(key=lambda s: self.beam_scores[s.request_id], reverse=True)
        self.sequences = live

    def next_child_id(self) -> str:
        child_id = f"{self.request_id}#beam{self.next_beam_index}"
        self.next_beam_index += 1
        return child_id

    def make_output(self) -> RequestOutput:
        """Finished: the best ``n`` hypotheses. Running: the best ``n`` live beams so far."""
        if self.done:
            outputs = [self._hypothesis_output(i, h) for i, h in enumerate(self.hypotheses)]
        else:
            outputs = [self._beam_output(i, b) for i, b in enumerate(self.sequences)]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs[: self.params.n],
            finished=self.is_finished,
            num_cached_tokens=0,
            metrics=self.metrics,
        )

    def _beam_output(self, index: int, beam: Request) -> CompletionOutput:
        return CompletionOutput(
            index=index,
            text=self.tokenizer.decode(
                beam.output_token_ids, skip_special_tokens=self.params.skip_special_tokens
            ),
            token_ids=list(beam.output_token_ids),
            cumulative_logprob=self.beam_scores.get(beam.request_id, 0.0),
            finish_reason=beam.status.finish_reason,
        )

    def _hypothesis_output(self, index: int, hypothesis: Hypothesis) -> CompletionOutput:
        text = self.tokenizer.decode(
            hypothesis.token_ids, skip_special_tokens=self.params.skip_special_tokens
        )
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=list(hypothesis.token_ids),
            cumulative_logprob=hypothesis.cumulative_logprob,
            finish_reason="stop" if hypothesis.ended_by_eos else "length",
            stop_reason=_stop_token(hypothesis, self.params.stop_token_ids),
        )


def _stop_token(hypothesis: Hypothesis, stop_token_ids: list[int]) -> int | None:
    """A hypothesis ended by a token of ``stop_token_ids`` names it; one ended by EOS does not."""
    last = hypothesis.token_ids[-1]
    return last if hypothesis.ended_by_eos and last in stop_token_ids else None
