"""PoolingModelRunner: the runner of a pooling model (``--runner pooling``): embeddings,
classes, scores.

A step is laid out as any prefill step (the flat batch of the scheduled chunks), runs the model
once, and instead of logits gives, for each pooling request whose last chunk ran, its output:
the pooled row (``Pooler.pooling_type``) through the model's head, with the request's options
applied (``dimensions``, normalisation or activation), as a host tensor in
``ModelRunnerOutput.pooler_output``.

Two kinds of model:

- a decoder (``--convert embed|classify``) runs over the paged KV cache with the same kernels
  as generation: a long prompt is chunked, each chunk reading the earlier ones' keys and
  values through the block table. Its pooling gathers across chunks (``PoolingState.partial``:
  the running sum for MEAN, the first row for CLS; LAST needs the last chunk only).
- an encoder (BERT family) reads each prompt whole, in one step, with bidirectional attention,
  so there is nothing to cache: no KV tensors, no block table (the engine gives it a
  ``NoKVCacheManager``), only ``EncoderAttentionMetadata``. Why vLLM runs encoders this way
  too: a token's keys and values depend on the tokens after it only through the layers below,
  so nothing a step computes is reusable by a later one, and paging would only add reads.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from pagedserve.engine.input_batch import PoolingState, to_device
from pagedserve.engine.model_runner import ModelInput, ModelRunner
from pagedserve.engine.outputs import ModelRunnerOutput
from pagedserve.models import EncoderAttentionMetadata, Pooler, PoolingType
from pagedserve.scheduler import SchedulerOutput

# one step's pooled chunk: (state, offset in the flat batch, first position, token count)
Chunk = tuple[PoolingState, int, int, int]


class PoolingModelRunner(ModelRunner):
    """A ``ModelRunner`` whose steps pool instead of sample (see the module docstring)."""

    def __init__(self, model_config, cache_config, **kwargs) -> None:
        self.encoder = model_config.is_encoder_only  # read by _num_blocks during __init__
        super().__init__(model_config, cache_config, **kwargs)
        self.pooler: Pooler = self.model.pooler
        self.uses_token_types = bool(getattr(self.model, "uses_token_type_ids", False))

    def _num_blocks(self) -> int:
        return 0 if self.encoder else super()._num_blocks()

    def new_kv_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [] if self.encoder else super().new_kv_caches(num_blocks)

    def output_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.pooler(hidden)

    # ---- one step ------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: the pooled outputs of the requests whose last chunk ran."""
        for request in output.finished:
            self.input_batch.remove(request)
        if output.is_empty:
            return ModelRunnerOutput()
        model_input, chunks = self.prepare_pooling_input(output)
        hidden = self.forward(model_input)
        return ModelRunnerOutput(pooler_output=self.pool(hidden, chunks))

    def prepare_pooling_input(self, output: SchedulerOutput) -> tuple[ModelInput, list[Chunk]]:
        """The step's flat batch, and where each request's chunk sits in it."""
        states = self.input_batch.pooling
        tokens: list[int] = []
        types: list[int] | None = [] if self.uses_token_types else None
        chunks: list[Chunk] = []
        offset = 0
        for request, start, count in zip(
            output.requests, output.num_computed_tokens, output.num_new_tokens
        ):
            state = states[request.request_id]
            tokens += request.prompt_token_ids[start : start + count]
            if types is not None:
                own = state.token_type_ids
                types += own[start : start + count] if own is not None else [0] * count
            chunks.append((state, offset, start, count))
            offset += count
        token_ids = np.array(tokens, dtype=np.int64)
        if self.encoder:
            starts = np.array(output.num_computed_tokens, dtype=np.int64)
            counts = np.array(output.num_new_tokens, dtype=np.int64)
            model_input = self._encoder_input(token_ids, starts, counts)
        else:  # no row is scored: the pooler reads the hidden states
            no_rows = np.empty(0, dtype=np.int64)
            model_input = self._model_input(output, token_ids, self._layout_batch(output), no_rows)
        if types is not None and any(types):
            model_input.token_type_ids = to_device(np.array(types, dtype=np.int64), self.device)
        return model_input, chunks

    def _encoder_input(self, token_ids, starts, counts) -> ModelInput:
        """Whole sequences end to end: positions from 0 within each, and where each starts."""
        if starts.any():
            raise RuntimeError("an encoder step must hold whole prompts (it is never chunked)")
        query_start_loc = np.zeros(len(counts) + 1, dtype=np.int32)
        np.cumsum(counts, out=query_start_loc[1:])
        positions = np.arange(len(token_ids), dtype=np.int64) - np.repeat(
            query_start_loc[:-1].astype(np.int64), counts
        )
        dev = self.device
        meta = EncoderAttentionMetadata(to_device(query_start_loc, dev), int(counts.max()))
        empty = torch.empty(0, dtype=torch.long, device=dev)
        return ModelInput(to_device(token_ids, dev), to_device(positions, dev), meta, empty)

    def forward(self, model_input: ModelInput) -> torch.Tensor:
        if model_input.token_type_ids is None:
            return super().forward(model_input)
        return self.model(
            model_input.input_ids,
            model_input.positions,
            self.kv_caches,
            model_input.attn_metadata,
            token_type_ids=model_input.token_type_ids,
        )

    # ---- pooling -------------------------------------------------------------------------

    def pool(self, hidden: torch.Tensor, chunks: list[Chunk]) -> dict[str, torch.Tensor]:
        """Each finished request's output: its pooled row through the head, its options
        applied, on the host (one transfer for the step)."""
        finished, rows = self._pooled_rows(hidden, chunks)
        if not finished:
            return {}
        outputs = self.pooler(torch.stack(rows).to(hidden.device)).cpu()
        return {
            state.request_id: self._apply_options(out, state)
            for state, out in zip(finished, outputs, strict=True)
        }

    def _pooled_rows(self, hidden: torch.Tensor, chunks: list[Chunk]):
        """Fold each chunk into its request's pooling; the pooled row of each request whose
        prompt is now complete (MEAN: ``_running_sums``)."""
        kind = self.pooler.pooling_type
        sums = self._running_sums(hidden, chunks) if kind is PoolingType.MEAN else None
        finished, rows = [], []
        for i, (state, offset, start, count) in enumerate(chunks):
            prompt_len = state.request.num_prompt_tokens
            if kind is PoolingType.MEAN:
                part = sums[i]
            elif kind is PoolingType.CLS:
                part = hidden[offset] if start == 0 else state.partial
            else:
                part = hidden[offset + count - 1]
            if start + count < prompt_len:
                state.partial = part
                continue
            finished.append(state)
            rows.append(part / prompt_len if kind is PoolingType.MEAN else part)
        return finished, rows

    def _running_sums(self, hidden: torch.Tensor, chunks: list[Chunk]) -> torch.Tensor:
        """Each chunk's rows added onto its request's running sum (zeros at its first chunk)
        in one ``index_add_``. On a CPU that adds the rows one after another, in the prompt's
        order, so a prompt's sum is the same bits read whole or in chunks of any size (adding
        a chunk's own sum to the earlier ones' would not be). A GPU's ``index_add_`` adds with
        atomics, in whatever order they land: in the batch-invariant mode the rows are summed
        on the host instead."""
        if self.model_config.batch_invariant:
            hidden = hidden.cpu()
        sums = torch.zeros(len(chunks), hidden.shape[1], device=hidden.device)
        for i, (state, _, start, _) in enumerate(chunks):
            if state.partial is not None and start > 0:  # a prompt read again starts afresh
                sums[i] = state.partial
        counts = torch.tensor([c[3] for c in chunks], device=hidden.device)
        segment = torch.repeat_interleave(torch.arange(len(chunks), device=hidden.device), counts)
        return sums.index_add_(0, segment, hidden.float())

    def _apply_options(self, out: torch.Tensor, state: PoolingState) -> torch.Tensor:
        """A request's own options: an embedding cut to ``dimensions`` and normalised, class
        scores through the activation (each unless ``use_activation`` is False)."""
        params, pooler = state.params, self.pooler
        if pooler.task == "embed":
            if params.dimensions is not None:
                out = out[: params.dimensions]
            normalize = pooler.normalize if params.use_activation is None else params.use_activation
            return F.normalize(out, dim=-1) if normalize else out
        if params.use_activation is False:
            return out
        return pooler.activation(out)
