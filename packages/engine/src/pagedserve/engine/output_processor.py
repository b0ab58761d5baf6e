"""A step of plain requests after the update, in one pass (vLLM's ``OutputProcessor``).

Once ``scheduler.update`` has appended a step's tokens, each request needs three things: its
token detokenized, its token time stamped (with the inter-token latency since its last one),
and its output made as its ``output_kind`` asks. The general path does these in two passes of
calls per request (``SamplingBatch.apply_plain`` -> ``SequenceState.process_new_token`` ->
``StepContext.record_token``, then ``LLMEngine._group_output`` -> ``make_output``). At 256
running requests each microsecond per request is a quarter of a millisecond per step, so a
step whose rows are all plain (decisions.py: no decisions at all) takes one loop instead, as
vLLM's ``OutputProcessor.process_outputs`` does: for each request, its stats, detokenizer and
output in turn.

The common request there, a *plain decode* (a plain sequence that is still running and already
has its first token: no logprobs, grammar or stop strings to apply, no prompt-logprob news),
is handled inline: the latency and time stamp, the detokenizer's ``add_token``, and the output
of ``make_output``'s lean path, or nothing at all for a FINAL_ONLY request (which has no output
until it finishes). Every other request in the loop (its first token, its last, a stop string
to look for) takes the general path's calls, in the same order, so the outputs, the metrics and
the stats are exactly those of the general path (tests/engine/test_output_processor.py holds the
two equal with ``LLMEngine.output_fast_path`` off).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedserve.engine.sampling_params import RequestOutputKind
from pagedserve.scheduler import Request, RequestStatus

if TYPE_CHECKING:
    from pagedserve.engine.decisions import StepContext
    from pagedserve.engine.outputs import RequestOutput
    from pagedserve.engine.sequence_group import SequenceGroup

_RUNNING = RequestStatus.RUNNING
_FINAL_ONLY = RequestOutputKind.FINAL_ONLY


def process_plain_step(
    updated: list[Request],
    ctx: StepContext,
    group_output: Callable[[SequenceGroup, float], RequestOutput],
) -> list[RequestOutput]:
    """The outputs of a step whose every updated request is plain (one sequence each, in
    ``updated``'s order). ``group_output`` is the engine's ``_group_output`` (a finished
    request's bookkeeping), for the requests that are not plain decodes."""
    now = ctx.now
    latencies = ctx.inter_token_latencies
    outputs: list[RequestOutput] = []
    num_plain_decodes = 0
    for request in updated:
        state = request.payload
        group = state.group
        metrics = group.metrics
        last = metrics.last_token_time  # None until the request's first token
        if (
            last is not None
            and state.plain
            and request.status is _RUNNING
            and group.prompt_logprobs is None
        ):  # a plain decode: StepContext.record_token's and process_new_token's lean path
            if now > last:
                latencies.append(now - last)
            metrics.last_token_time = now
            state.detokenizer.add_token(request.output_token_ids[-1])
            num_plain_decodes += 1
            if group.output_kind is not _FINAL_ONLY:
                outputs.append(group._running_plain_output(request, state))
        else:
            state.process_new_token(request, None, ctx)
            if group.has_new_output:
                outputs.append(group_output(group, now))
    ctx.num_generation_tokens += num_plain_decodes
    return outputs
