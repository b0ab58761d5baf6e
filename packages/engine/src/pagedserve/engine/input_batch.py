"""What the model runner keeps across steps: each live sequence's sampling state, and the
block-table array (vLLM V1's persistent ``InputBatch`` and ``BlockTable``).

Sampling state: the engine registers a sequence's ``SamplingState`` when it joins (its params,
its seeded generator, later its grammar matcher) and the scheduler reports it in
``SchedulerOutput.finished`` once it has left; the runner then forgets it. So a step reads
what each row needs from objects that already exist, and a step of plain rows (greedy, no
processor, no logprobs: most of a busy server) reads nothing per row at all: the batch counts
how many live sequences need more (``num_special``) and builds per-row metadata only then.

A pooling request (prefill only) registers a ``PoolingState`` instead: its params, its
token types, and what its pooling has gathered from its chunks so far (pooling_runner.py).

Block tables: every step needs the scheduled sequences' tables as one ``[B, max_blocks]`` int32
array. Building it afresh walks every block id of every sequence at every step, though a
decode adds a block only once every ``block_size`` steps. So the array persists between steps,
one row per batch position, and a row is rewritten only when the list it was written from
changes: the KVCacheManager's ``block_ids`` lists are replaced, never changed in place, whenever
a table changes, so a row whose source is the very same list object (``is``) is up to date.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import compress
from operator import is_not

import numpy as np
import torch

from pagedserve.blockmgr.slot_mapping import PagedBatch
from pagedserve.engine.pooling_params import PoolingParams
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.structured_output.backend import GrammarMatcher
from pagedserve.kernels.sampling import GREEDY_TEMPERATURE
from pagedserve.models import AttentionMetadata
from pagedserve.scheduler import Request


@dataclass(eq=False, slots=True)
class SamplingState:
    """One sequence's sampling inputs, registered in the ``InputBatch`` while it lives.

    ``request``: the scheduler's sequence (its prompt and output so far, which the penalties
    read; its stop ids and ``min_tokens``, which the min_tokens mask reads). ``forks``: the
    other sequences of an ``n > 1`` request before its first sample, as (request id,
    generator): the runner draws each one's first token from this row too, and the engine
    starts them with it. ``beam``: a beam-search sequence, whose row is not sampled: the
    runner returns its log-probabilities for the group's beam step. ``bad_words_token_ids``:
    ``params.bad_words`` as token ids (the engine tokenizes them once).

    ``greedy``, ``processed`` and ``special`` are read from ``params`` once: ``processed``
    when a logits processor applies (logits_processors.py), ``special`` when the row needs
    anything beyond an argmax.
    """

    request: Request
    params: SamplingParams
    generator: torch.Generator
    grammar_matcher: GrammarMatcher | None = None
    forks: list[tuple[str, torch.Generator]] = field(default_factory=list)
    beam: bool = False
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    greedy: bool = field(init=False)
    processed: bool = field(init=False)
    special: bool = field(init=False)

    def __post_init__(self) -> None:
        params = self.params
        self.greedy = params.temperature < GREEDY_TEMPERATURE
        self.processed = (
            params.structured_outputs is not None
            or params.allowed_token_ids is not None
            or bool(self.bad_words_token_ids)
            or params.thinking_token_budget is not None
            or bool(params.logit_bias)
            or params.min_tokens > 0
            or params.repetition_penalty != 1.0
            or params.presence_penalty != 0.0
            or params.frequency_penalty != 0.0
        )
        self.special = self._needs_more_than_argmax()

    def _needs_more_than_argmax(self) -> bool:
        return (
            not self.greedy
            or self.processed
            or self.params.logprobs is not None
            or bool(self.forks)
        )

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def history(self) -> list[int]:
        """The output tokens the penalties and the min_tokens mask read."""
        return self.request.output_token_ids


@dataclass(eq=False, slots=True)
class PoolingState:
    """One pooling request's runner state, registered in the ``InputBatch`` while it lives.

    ``token_type_ids``: each prompt token's segment (a sentence pair's second half is 1), for
    models that read them (BERT); None: all 0. ``partial``: what its pooling has gathered
    from the chunks computed so far (the sum of their rows for MEAN, the first row for CLS),
    so a prompt chunked over several steps pools as if read at once. ``group``: the engine's
    request (pooling.py), which the runner never reads.
    """

    request: Request
    params: PoolingParams
    token_type_ids: list[int] | None = None
    partial: torch.Tensor | None = None
    group: object = None

    @property
    def request_id(self) -> str:
        return self.request.request_id


class InputBatch:
    """The live sequences' sampling states, by request id (see the module docstring)."""

    def __init__(self) -> None:
        self.states: dict[str, SamplingState] = {}
        self.pooling: dict[str, PoolingState] = {}
        self.num_special = 0  # live states that need more than an argmax
        self.num_beams = 0
        self.num_forking = 0

    def add(self, state: SamplingState) -> None:
        """Register a sequence (a reused id replaces the finished sequence's state)."""
        old = self.states.get(state.request_id)
        if old is not None:
            self._count(old, -1)
        self.states[state.request_id] = state
        self._count(state, 1)

    def add_pooling(self, state: PoolingState) -> None:
        """Register a pooling request (a reused id replaces the finished request's state)."""
        self.pooling[state.request_id] = state

    def remove(self, request: Request) -> None:
        """Forget a sequence that has left (only its own state: an id may have been reused)."""
        if request.pooling:
            pooled = self.pooling.get(request.request_id)
            if pooled is not None and pooled.request is request:
                del self.pooling[request.request_id]
            return
        state = self.states.get(request.request_id)
        if state is not None and state.request is request:
            del self.states[request.request_id]
            self._count(state, -1)

    def take_forks(self, state: SamplingState) -> list[tuple[str, torch.Generator]]:
        """The forks of ``state``'s first sample, once: the runner draws them now."""
        self._count(state, -1)
        forks, state.forks = state.forks, []
        state.special = state._needs_more_than_argmax()
        self._count(state, 1)
        return forks

    def states_of(self, request_ids: Sequence[str]) -> list[SamplingState] | None:
        """The states of ``request_ids`` in order; None when every live sequence is plain
        (nothing per row to read)."""
        if not self.num_special and not self.num_beams:
            return None
        return list(map(self.states.__getitem__, request_ids))

    def _count(self, state: SamplingState, sign: int) -> None:
        self.num_special += sign * state.special
        self.num_beams += sign * state.beam
        self.num_forking += sign * bool(state.forks)


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


def token_slice(request: Request, start: int, count: int) -> list[int]:
    """Tokens ``[start, start + count)`` of prompt + output, without concatenating the two
    (``all_token_ids`` would copy the whole sequence for every request at every step)."""
    prompt, end = request.prompt_token_ids, start + count
    if end <= len(prompt):
        return prompt[start:end]
    output = request.output_token_ids
    if start >= len(prompt):
        return output[start - len(prompt) : end - len(prompt)]
    return prompt[start:] + output[: end - len(prompt)]


def token_at(request: Request, position: int) -> int:
    """Token ``position`` of prompt + output."""
    prompt = request.prompt_token_ids
    if position < len(prompt):
        return prompt[position]
    return request.output_token_ids[position - len(prompt)]


def prompt_logit_positions(request: Request, start: int, count: int) -> range:
    """Positions of a chunk ``[start, start + count)`` whose logits score the next prompt token,
    for a request that asked for prompt logprobs (``Request.needs_prompt_logits``): such a
    request bypasses the prefix cache, so every prompt position is computed at least once."""
    return range(start, min(start + count, request.num_prompt_tokens - 1))


def attention_metadata(
    batch: PagedBatch, device: torch.device, key_limits: np.ndarray | None = None
) -> AttentionMetadata:
    """A step's layout (``layout_paged_batch``) as the tensors every attention layer reads;
    ``key_limits``: each row's bound on the keys it reads, where it is not causal."""
    return AttentionMetadata(
        slot_mapping=to_device(batch.slot_mapping, device),
        block_tables=to_device(batch.block_tables, device),
        seq_lens=to_device(batch.seq_lens, device),
        query_start_loc=to_device(batch.query_start_loc, device),
        query_start_loc_cpu=torch.from_numpy(batch.query_start_loc),
        seq_lens_cpu=torch.from_numpy(batch.seq_lens),
        key_limits=None if key_limits is None else to_device(key_limits, device),
    )


def int64_array(values: Sequence[int]) -> np.ndarray:
    """A list of ints as an int64 numpy array: through the C ``array`` type, about 3x faster
    than ``np.array(values, dtype=np.int64)`` on the hundreds of entries of a busy step."""
    return np.frombuffer(array("q", values), dtype=np.int64)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as a tensor on ``device``: on CPU the array itself (no copy); on CUDA through
    pinned memory, copied without blocking the host (vLLM's pinned CPU staging tensors).

    ``pin_memory`` draws from torch's caching host allocator, which keeps a pinned block from
    reuse until the copy that reads it has completed (it records an event on the stream), so
    the step's host arrays may be dropped at once and the next step cannot overwrite an
    in-flight copy; the kernels that read the result run on the same stream, after the copy.
    """
    tensor = torch.from_numpy(array)
    if device.type == "cpu":
        return tensor
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
