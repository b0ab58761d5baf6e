"""What the scheduler does with a step's sampled tokens: ``Scheduler.update``.

Kept apart from the deciding half (scheduler.py) as a base class of ``Scheduler``: it reads and
changes the same state (``running``, the KV cache manager, ``_finish``, ``rewind``).

Every running request passes through here at every step, so the common one, a decode that ran
its one last token, takes a tight loop (``_update_decodes``), as vLLM V1's
``Scheduler.update_from_output``; everything else takes the general path (``_update_one``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.scheduler.output import ScheduledRequest, SchedulerOutput
from pagedserve.scheduler.request import _FINISHED_VALUES, Request, RequestStatus

if TYPE_CHECKING:
    from pagedserve.blockmgr import KVCacheManager


class StepUpdate:
    """``update`` and its two paths; the base of ``Scheduler``, which provides the state below
    and the methods ``_finish`` (free a finished request's blocks) and ``rewind``."""

    running: list[Request]
    kv: KVCacheManager
    decode_fast_path: bool

    def update(self, output: SchedulerOutput, sampled: dict[str, int | list[int]]) -> list[Request]:
        """Advance computed counts, append sampled tokens, and finish requests that stop.

        ``sampled`` maps request id -> next token for the requests whose chunk reached their
        last known token (``needs_sample``); for a speculative decode, the list of its accepted
        proposals and then the target's own token (``_update_verified``). A request finished
        between ``schedule`` and here (an abort, a stop string) is skipped. Returns the requests
        that got new tokens, finished ones included; finished requests have already freed their
        blocks.
        """
        if self.decode_fast_path:
            updated, stopped = self._update_decodes(output, sampled)
        else:
            updated, stopped = [], False
            for item in output.scheduled:
                stopped |= self._update_one(item, sampled, updated)
        if stopped:
            self.running = [r for r in self.running if not r.is_finished]
        return updated

    def _update_decodes(
        self, output: SchedulerOutput, sampled: dict[str, int | list[int]]
    ) -> tuple[list[Request], bool]:
        """The decode fast path of ``update``: a request that ran its one last token (no
        proposals) appends its sampled token and meets the stop rules (``check_stop``, inline)
        in one tight loop; every other item goes through ``_update_one``. A step whose every
        item the scheduler's decode fast path made is read from ``output.decodes``, so no
        item is made unless one needs the general path. True when any request stopped."""
        if output.all_decodes:
            decodes = output.decodes
            requests, starts = decodes.requests, decodes.num_computed_tokens
            item_at = decodes.item
        else:
            items = output.scheduled
            requests = [item.request for item in items]
            starts = [  # -1: not a decode of the last token, which the loop hands on
                -1 if item.num_new_tokens != 1 or item.spec_token_ids else item.num_computed_tokens
                for item in items
            ]
            item_at = items.__getitem__
        updated: list[Request] = []
        append = updated.append
        stopped = False
        finished = _FINISHED_VALUES
        for index, (request, start) in enumerate(zip(requests, starts)):
            output_ids = request.output_token_ids
            num_computed = start + 1
            if (
                num_computed != len(request.prompt_token_ids) + len(output_ids)
                or request.status._value_ in finished
            ):
                stopped |= self._update_one(item_at(index), sampled, updated)
                continue
            request.num_computed_tokens = num_computed
            token = sampled.get(request.request_id)
            if token is None:
                continue
            output_ids.append(token)
            append(request)
            num_output = len(output_ids)
            if token in request.stop_token_ids and num_output >= request.min_tokens:
                request.stop_reason = token
                self._finish(request, RequestStatus.FINISHED_STOPPED)
                stopped = True
            elif num_output >= request.max_tokens:
                self._finish(request, RequestStatus.FINISHED_LENGTH)
                stopped = True
        return updated, stopped

    def _update_one(
        self, item: ScheduledRequest, sampled: dict[str, int | list[int]], updated: list[Request]
    ) -> bool:
        """The general path of ``update`` for one scheduled item: True when it stopped."""
        request = item.request
        if request.is_finished:
            return False
        if item.spec_token_ids:
            updated.append(request)
            return self._update_verified(item, sampled[request.request_id])
        request.num_computed_tokens += item.num_new_tokens
        if request.num_computed_tokens < request.num_tokens:
            return False  # a prefill chunk short of the last known token: nothing to sample
        token = sampled.get(request.request_id)
        if token is None:
            return False
        request.append_output_token(token)
        updated.append(request)
        stop = request.check_stop()
        if stop is not None:
            self._finish(request, stop)
            return True
        return False

    def _update_verified(self, item: ScheduledRequest, tokens: list[int]) -> bool:
        """A speculative decode's outcome: ``tokens`` are the accepted proposals, then one token
        of the target's own (the first rejection's resample, or the bonus token).

        They are appended in order and each meets the stop rules (EOS, stop ids, max_tokens):
        a stop inside the run ends the output there. Otherwise the request is rewound past the
        rejected proposals (their keys and values are garbage) and the blocks that only they
        used go back to the pool. True when the request finished.
        """
        request = item.request
        request.num_computed_tokens += item.num_new_tokens
        for token in tokens:
            request.append_output_token(token)
            stop = request.check_stop()
            if stop is not None:
                self._finish(request, stop)
                return True
        num_rejected = len(item.spec_token_ids) - (len(tokens) - 1)
        self.rewind(request.request_id, num_rejected)
        self.kv.free_blocks_beyond(request.request_id, request.num_computed_tokens)
        return False
