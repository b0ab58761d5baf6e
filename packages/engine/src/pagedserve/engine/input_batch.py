"""The host side of a step's inputs: the persistent block-table array (vLLM V1's
``BlockTable``), the tokens read from a request, and the arrays' way to the device.

Every step needs the scheduled sequences' block tables as one ``[B, max_blocks]`` int32 array.
Building it afresh walks every block id of every sequence at every step, though a decode adds a
block only once every ``block_size`` steps. So the array persists between steps, one row per
batch position, and a row is rewritten only when the list it was written from changes: the
KVCacheManager's ``block_ids`` lists are replaced, never changed in place, whenever a table
changes, so a row whose source is the very same list object (``is``) is still up to date.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress
from operator import is_not

import numpy as np
import torch

from pagedserve.blockmgr.slot_mapping import PagedBatch
from pagedserve.models import AttentionMetadata
from pagedserve.scheduler import Request, ScheduledRequest


class BlockTable:
    """``[rows, max_blocks]`` int32, row i holding the table last written to batch position i.

    Invariant: ``array[i, :lengths[i]]`` is ``sources[i]`` and the rest of row i is 0, so the
    first B rows, cut to the longest table, equal ``block_table_array`` of the same tables.
    The array grows (doubling its rows) when a batch has more sequences than rows.
    """

    def __init__(self, max_blocks_per_seq: int, rows: int = 64) -> None:
        self.array = np.zeros((rows, max_blocks_per_seq), dtype=np.int32)
        self._sources: list[Sequence[int] | None] = [None] * rows
        self._lengths = [0] * rows

    def fill(self, tables: Sequence[Sequence[int]]) -> np.ndarray:
        """Rows ``[0, len(tables))`` hold ``tables``; a copy of them, cut to the longest table
        (a copy, so that a step's array stays that step's when the next step rewrites rows)."""
        num_seqs = len(tables)
        if num_seqs > len(self._sources):
            self._grow(num_seqs)
        array, sources, lengths = self.array, self._sources, self._lengths
        # the rows whose list changed, found without a Python loop over the batch (a decode
        # step changes about one row in block_size)
        for row in compress(range(num_seqs), map(is_not, tables, sources)):
            ids = tables[row]
            length, old = len(ids), lengths[row]
            if length > array.shape[1]:
                array = self._widen(length)
            array[row, :length] = ids
            if old > length:
                array[row, length:old] = 0
            sources[row], lengths[row] = ids, length
        width = max(lengths[:num_seqs], default=0)
        return array[:num_seqs, :width].copy()

    def _grow(self, num_seqs: int) -> None:
        rows = max(num_seqs, 2 * len(self._sources))
        grown = np.zeros((rows, self.array.shape[1]), dtype=np.int32)
        grown[: len(self.array)] = self.array
        self.array = grown
        self._sources += [None] * (rows - len(self._sources))
        self._lengths += [0] * (rows - len(self._lengths))

    def _widen(self, width: int) -> np.ndarray:
        """Room for a table longer than any so far (``max_blocks_per_seq`` was an estimate)."""
        wider = np.zeros((len(self.array), width), dtype=np.int32)
        wider[:, : self.array.shape[1]] = self.array
        self.array = wider
        return wider


def decode_batch(
    starts: np.ndarray, block_ids: Sequence[Sequence[int]], block_table: BlockTable, block_size: int
) -> PagedBatch:
    """The layout of a pure-decode step (one token per sequence, at ``starts``), as vLLM's
    persistent ``InputBatch`` makes it: block tables from the persistent ``BlockTable`` (a row is
    rewritten only when its sequence's table changed), each token's slot from its table row and
    position, numpy for the arithmetic. Equal to ``build_paged_batch`` of the same step."""
    num_seqs = len(starts)
    tables = block_table.fill(block_ids)
    slots = tables[np.arange(num_seqs), starts // block_size].astype(np.int64) * block_size
    return PagedBatch(
        positions=starts,
        slot_mapping=slots + starts % block_size,
        block_tables=tables,
        seq_lens=(starts + 1).astype(np.int32),
        query_start_loc=np.arange(num_seqs + 1, dtype=np.int32),
    )


def _token_slice(request: Request, start: int, count: int) -> list[int]:
    """Tokens ``[start, start + count)`` of prompt + output, without concatenating the two
    (``all_token_ids`` would copy the whole sequence for every request at every step)."""
    prompt, end = request.prompt_token_ids, start + count
    if end <= len(prompt):
        return prompt[start:end]
    output = request.output_token_ids
    if start >= len(prompt):
        return output[start - len(prompt) : end - len(prompt)]
    return prompt[start:] + output[: end - len(prompt)]


def _attention_metadata(batch: PagedBatch, device: torch.device) -> AttentionMetadata:
    """A step's layout (``build_paged_batch``) as the tensors every attention layer reads."""
    return AttentionMetadata(
        slot_mapping=to_device(batch.slot_mapping, device),
        block_tables=to_device(batch.block_tables, device),
        seq_lens=to_device(batch.seq_lens, device),
        query_start_loc=to_device(batch.query_start_loc, device),
    )


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as a tensor on ``device``: on CPU the array itself (no copy); on CUDA through
    pinned memory, copied without blocking the host (vLLM's pinned CPU staging tensors).

    ``pin_memory`` draws from torch's caching host allocator, which keeps a pinned block from
    reuse until the copy that reads it has completed (it records an event on the stream), so
    the step's host arrays may be dropped at once and the next step cannot overwrite an
    in-flight copy; the kernels that read the result run on the same stream, after the copy.
    """
    tensor = torch.from_numpy(array)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def prompt_logit_positions(item: ScheduledRequest) -> range:
    """Positions of this chunk whose logits score the next prompt token, for a request that
    asked for prompt logprobs (``Request.needs_prompt_logits``); empty for every other one."""
    if not item.request.needs_prompt_logits:
        return range(0)
    start = item.num_computed_tokens
    return range(start, min(start + item.num_new_tokens, item.request.num_prompt_tokens - 1))
