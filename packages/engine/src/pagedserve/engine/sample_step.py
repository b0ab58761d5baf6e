"""From a step's logits to its ``ModelRunnerOutput``: the runner's last stage.

The runner lays out the rows it asks the model to score (``LogitsLayout``) and only it reads
them back; the engine gets tokens and logprobs by request id. Every draw goes through one
``Sampler`` (sampler.py):

- the sampled rows: one token each, drawn in one call (a beam's row is not drawn: its group
  gets the row's log-probabilities and steps all its beams at once);
- an ``n > 1`` request's first sample: the row is drawn once more for each fork, with the
  fork's own generator, from a copy of the row taken before the processors changed it;
- speculative decodes: their proposal and bonus rows go to the verification batch
  (spec_decode/verify.py), which runs the sampler's processors at each position;
- prompt logprobs: the rows that score the prompt's next tokens, reported as the sampled
  tokens' logprobs are (``top_logprobs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.engine.input_batch import InputBatch, SamplingState
from pagedserve.engine.outputs import ModelRunnerOutput
from pagedserve.engine.sampler import Sampler, SamplingMetadata, top_logprobs
from pagedserve.engine.spec_decode.verify import VerificationBatch


@dataclass
class LogitsLayout:
    """Which row of a step's logits is what, in order:

    - ``sampled``: row i gives request ``sampled[i]``'s next token;
    - ``prompt``: per (request id, first position, count), ``count`` rows, the row at position
      p scoring prompt token p + 1 (a request that asked for prompt logprobs);
    - ``spec``: per (request id, proposals), one row per proposal, then the bonus row.
    """

    sampled: list[str] = field(default_factory=list)
    prompt: list[tuple[str, int, int]] = field(default_factory=list)
    spec: list[tuple[str, list[int]]] = field(default_factory=list)


def sample_step(
    logits: torch.Tensor,
    layout: LogitsLayout,
    batch: InputBatch,
    sampler: Sampler,
    draft_probs: dict[str, torch.Tensor] | None = None,
) -> ModelRunnerOutput:
    """The step's tokens and logprobs by request id (``logits``: float32, the step's own; the
    sampled rows are processed in place)."""
    output = ModelRunnerOutput()
    row = len(layout.sampled)
    if row:
        _sample(output, logits[:row], layout.sampled, batch, sampler)
    if layout.prompt:
        row = _prompt_logprobs(output, logits, row, layout.prompt, batch)
    if layout.spec:
        _verify(output, logits, row, layout.spec, batch, draft_probs or {})
    return output


def _sample(
    output: ModelRunnerOutput,
    logits: torch.Tensor,
    request_ids: list[str],
    batch: InputBatch,
    sampler: Sampler,
) -> None:
    states = batch.states_of(request_ids)
    forks = _fork_rows(logits, states, batch) if batch.num_forking else None
    if batch.num_beams:
        _beam_logprobs(output, logits, request_ids, states)
    result = sampler(logits, SamplingMetadata(states))
    # one device-to-host transfer of the step's tokens, as one-token lists
    output.sampled_token_ids = dict(zip(request_ids, result.token_ids[:, None].tolist()))
    for row, entry in result.logprobs.items():
        output.logprobs[request_ids[row]] = [entry]
    for request_id in output.beam_logprobs:
        del output.sampled_token_ids[request_id]
    if forks is not None:
        _sample_forks(output, *forks, sampler)


def _fork_rows(logits: torch.Tensor, states: list[SamplingState], batch: InputBatch):
    """The rows of this step's forks, copied before the sampled rows are processed: each
    forking sequence's row once per fork, with the fork's id and generator."""
    rows, parents, children = [], [], []
    for row, state in enumerate(states):
        if state.forks:
            for child_id, generator in batch.take_forks(state):
                rows.append(row)
                parents.append(state)
                children.append((child_id, generator))
    if not rows:
        return None
    return logits[rows], parents, children


def _sample_forks(
    output: ModelRunnerOutput,
    logits: torch.Tensor,
    parents: list[SamplingState],
    children: list[tuple[str, torch.Generator]],
    sampler: Sampler,
) -> None:
    """Each fork's first token, drawn as its parent's from the same row: the same params and
    (empty) history, its own generator."""
    generators = [generator for _, generator in children]
    result = sampler(logits, SamplingMetadata(parents, generators=generators))
    for (child_id, _), token in zip(children, result.token_ids.tolist()):
        output.sampled_token_ids[child_id] = [token]
    for row, entry in result.logprobs.items():
        output.logprobs[children[row][0]] = [entry]


def _beam_logprobs(
    output: ModelRunnerOutput,
    logits: torch.Tensor,
    request_ids: list[str],
    states: list[SamplingState],
) -> None:
    """Each beam's raw log-probabilities (its group steps all its beams from them)."""
    rows = [row for row, state in enumerate(states) if state.beam]
    if rows:
        logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
        for i, row in enumerate(rows):
            output.beam_logprobs[request_ids[row]] = logprobs[i]


def _prompt_logprobs(
    output: ModelRunnerOutput,
    logits: torch.Tensor,
    row: int,
    prompt: list[tuple[str, int, int]],
    batch: InputBatch,
) -> int:
    """The prompt rows' logprobs of each actual next prompt token; the row after them."""
    count = sum(n for _, _, n in prompt)
    logprobs = torch.log_softmax(logits[row : row + count].float(), dim=-1)
    targets, nums = [], []
    for request_id, start, n in prompt:
        state = batch.states[request_id]
        targets += state.request.prompt_token_ids[start + 1 : start + n + 1]
        nums += [state.params.prompt_logprobs] * n
    entries = top_logprobs(logprobs, targets, nums)
    offset = 0
    for request_id, start, n in prompt:
        output.prompt_logprobs[request_id] = (start, entries[offset : offset + n])
        offset += n
    return row + count


def _verify(
    output: ModelRunnerOutput,
    logits: torch.Tensor,
    row: int,
    spec: list[tuple[str, list[int]]],
    batch: InputBatch,
    draft_probs: dict[str, torch.Tensor],
) -> None:
    verification = VerificationBatch(logits, draft_probs)
    for request_id, drafts in spec:
        rows = list(range(row, row + len(drafts) + 1))
        verification.add(batch.states[request_id], drafts, rows)
        row += len(drafts) + 1
    output.spec_decode = verification.verify()
    for (request_id, _), tokens, logprobs in zip(
        spec, verification.tokens, verification.logprobs, strict=True
    ):
        output.sampled_token_ids[request_id] = tokens
        if logprobs is not None:
            output.logprobs[request_id] = logprobs
