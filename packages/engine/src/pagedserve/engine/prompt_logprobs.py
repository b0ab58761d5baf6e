"""Prompt logprobs: how likely the model found each prompt token, given the tokens before it.

The model runner adds, after the sampled rows, the logits of every prompt position of a request
that asked for them (``model_runner.prompt_logit_positions``; such a request bypasses the prefix
cache, so no prompt position is skipped), while its ``Request.needs_prompt_logits`` is set: the
engine sets it at admission and clears it here once every prompt position is recorded, so a
recompute after preemption computes no prompt logits again. The row at position p scores prompt
token p + 1. As for sampled tokens, the logprobs are the raw model distribution's: the actual
token's, and the top-N.
"""

from __future__ import annotations

import torch

from pagedserve.engine.model_runner import prompt_logit_positions
from pagedserve.scheduler import SchedulerOutput


def record_prompt_logprobs(scheduled: SchedulerOutput, logits: torch.Tensor) -> None:
    """Append this step's prompt logprobs to each group (``logits``: the prompt rows, in order).

    A position already recorded (a chunk recomputed after preemption) is not recorded twice.
    """
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    row = 0
    for item in scheduled.scheduled:
        positions = prompt_logit_positions(item)
        if not positions:
            continue
        group = item.request.payload.group
        num_top = group.params.prompt_logprobs
        rows = logprobs[row : row + len(positions)]
        row += len(positions)
        prompt = group.prompt_token_ids
        targets = torch.tensor(prompt[positions.start + 1 : positions.stop + 1], device=rows.device)
        actual = rows.gather(1, targets[:, None]).squeeze(1).tolist()
        top = rows.topk(max(num_top, 1), dim=-1)
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
        for i, position in enumerate(positions):
            if position + 1 != len(group.prompt_logprobs):
                continue
            entry = dict(zip(top_ids[i][:num_top], top_values[i][:num_top], strict=True))
            entry.setdefault(prompt[position + 1], actual[i])
            group.prompt_logprobs.append(entry)
        if len(group.prompt_logprobs) == len(prompt):
            item.request.needs_prompt_logits = False  # complete: a recompute needs none
