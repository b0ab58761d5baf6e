"""ModelRunner: turns one scheduler step into one forward pass and the step's sampled tokens.

``execute(scheduler_output) -> ModelRunnerOutput``. The scheduled requests' new tokens are laid
end to end (no padding). For each token we compute its position and its cache slot
(``block_table[pos // block_size] * block_size + pos % block_size``); for each sequence its block
table, its length in the cache after this step, and where its tokens start in the flat batch.
The model returns hidden states for every token; only the rows the step needs are turned into
logits (``LogitsLayout``: the last token of each sequence that reached the end of its known
tokens, prompt positions whose logprobs were asked for, proposals to verify), and the runner
samples them (sample_step.py) from the sequences' sampling state, which it keeps across steps
(``InputBatch``). The engine never sees a logits row.

Pure-decode steps can instead run from persistent buffers padded to a batch-size bucket, replayed
as CUDA graphs on a GPU (cuda_graph.py); the logits are those of the real rows either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedserve.blockmgr import CacheConfig
from pagedserve.blockmgr.slot_mapping import PagedBatch, layout_paged_batch
from pagedserve.engine.cuda_graph import CUDAGraphConfig, DecodeCUDAGraphs, DecodeInputBuffers
from pagedserve.engine.encoder_cache import EncoderCache, embeddings_with_images, image_layout
from pagedserve.engine.gpu_profile import profile_gpu_kv_cache_budget
from pagedserve.engine.input_batch import (
    BlockTable,
    InputBatch,
    attention_metadata,
    int64_array,
    prompt_logit_positions,
    to_device,
    token_at,
    token_slice,
)
from pagedserve.engine.kv_cache import (
    DEFAULT_CPU_KV_CACHE_MEMORY,
    allocate_kv_caches,
    bytes_per_block,
    copy_cache_blocks,
    kv_cache_torch_dtype,
    log_cache_size,
    num_blocks_for_memory,
    warm_up_attention,
)
from pagedserve.engine.lora import LoRAConfig, LoRAManager
from pagedserve.engine.model_input import ModelInput
from pagedserve.engine.outputs import ModelRunnerOutput
from pagedserve.engine.sample_step import LogitsLayout, sample_step
from pagedserve.engine.sampler import Sampler
from pagedserve.kernels.dispatch import use_triton
from pagedserve.models import (
    ModelConfig,
    ParallelContext,
    kv_cache_spec,
    load_model,
)
from pagedserve.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from pagedserve.engine.spec_decode.draft_model import DraftModelProposer


class ModelRunner:
    """Owns the model and the KV cache tensors; runs one forward per step.

    Under tensor parallelism there is one runner per rank, built with that rank's
    ``ParallelContext``: it holds the rank's shard of the weights and of the KV heads (or the
    whole latent, for multi-head latent attention: ``kv_cache_spec``), and every rank agrees on
    the smallest block count any of them can hold.

    With a ``graph_config`` whose padding is on for this device, the cache holds one block more
    than ``num_blocks`` (the one the KVCacheManager hands out): block ``num_blocks`` is the
    padding rows' own (cuda_graph.py). Without one (tensor-parallel ranks, tools), every step
    runs eagerly and unpadded.

    ``extra_block_bytes``: KV bytes per block kept elsewhere for the same block ids (a draft
    model's cache, spec_decode/draft_model.py); a memory budget is split between both.
    ``drafter``: that draft model, which proposes at the start of each step, once the
    scheduler has allocated its proposals' slots.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        par: ParallelContext | None = None,
        graph_config: CUDAGraphConfig | None = None,
        lora_config: LoRAConfig | None = None,
        extra_block_bytes: int = 0,
        drafter: DraftModelProposer | None = None,
        profile_images: Sequence = (),
    ) -> None:
        self.model_config = model_config
        self.profile_images = profile_images  # the most a step encodes (gpu_profile.py)
        self.cache_config = cache_config
        self.par = par or ParallelContext()
        self.extra_block_bytes = extra_block_bytes
        self.device = model_config.torch_device
        torch.manual_seed(model_config.seed)
        self.kv_cache_dtype = kv_cache_torch_dtype(
            cache_config.cache_dtype, model_config.torch_dtype
        )
        self.kv_cache_spec = kv_cache_spec(model_config, self.par.tp_size, self.par.stage)
        self.model = self._load_model()
        self.lora_manager = (  # its slots are allocated before the KV cache is sized
            LoRAManager(self.model, model_config, lora_config) if lora_config else None
        )
        self.num_blocks = self.par.min_over_ranks(self._num_blocks())
        self.profile_images = ()  # profiled: let go of them
        pads = graph_config is not None and graph_config.pads_decode(self.device)
        self.kv_caches = self.new_kv_caches(self.num_blocks + int(pads))
        if self.num_blocks:  # none: an encoder, which has no KV cache (pooling_runner.py)
            log_cache_size(self.num_blocks, cache_config.block_size, model_config.max_model_len)
        if self.device.type == "cpu":  # numba compiles (or loads its cache) now, not mid-request
            from pagedserve.kernels.cpu.warmup import warm_up

            warm_up((self.kv_cache_dtype,))
        if self.num_blocks:  # on a GPU: every attention variant compiled now, not mid-serving
            warm_up_attention(
                model_config,
                self.kv_cache_spec,
                model_config.num_attention_heads // self.par.tp_size,
                cache_config.block_size,
                self.kv_cache_dtype,
                self.device,
            )
        self.drafter = drafter
        self.kv_connector = None  # a KV connector's runner side, attached by the engine
        self.input_batch = InputBatch()
        self.encoder_cache = (  # a vision-language model's image embeddings
            EncoderCache(self.model, self.device) if hasattr(self.model, "embed_images") else None
        )
        self.sampler = Sampler()
        self.block_table = BlockTable(-(-model_config.max_model_len // cache_config.block_size))
        self.decode_buffers: DecodeInputBuffers | None = None
        self.cuda_graphs: DecodeCUDAGraphs | None = None
        if pads:
            self._init_padded_decode(graph_config)

    def _init_padded_decode(self, graph_config: CUDAGraphConfig) -> None:
        """The persistent decode buffers, and on CUDA the graphs that replay from them."""
        mc, block_size = self.model_config, self.cache_config.block_size
        self.decode_buffers = DecodeInputBuffers(
            graph_config.capture_sizes(),
            max_blocks_per_seq=-(-mc.max_model_len // block_size),
            block_size=block_size,
            padding_block=self.num_blocks,
            device=self.device,
        )
        if graph_config.captures(self.device) and use_triton(self.kv_caches[0][0]):
            with torch.inference_mode():
                self.cuda_graphs = DecodeCUDAGraphs(self.model, self.kv_caches, self.decode_buffers)

    def _load_model(self):
        return load_model(self.model_config, self.par)

    def new_kv_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, ...]]:
        return allocate_kv_caches(
            self.kv_cache_spec,
            num_blocks,
            self.cache_config.block_size,
            self.kv_cache_dtype,
            self.device,
        )

    def _num_blocks(self) -> int:
        """KV cache blocks: ``num_blocks`` if given, else ``kv_cache_memory`` bytes, else on a GPU
        what a profiling step leaves of ``gpu_memory_utilization``, else (CPU) 1 GiB."""
        cc = self.cache_config
        if cc.num_blocks is not None:
            return cc.num_blocks
        block_bytes = bytes_per_block(self.kv_cache_spec, cc.block_size, self.kv_cache_dtype)
        if cc.kv_cache_memory is not None:
            budget = cc.kv_cache_memory
        elif self.device.type == "cuda":
            budget = profile_gpu_kv_cache_budget(self, block_bytes)
        else:
            budget = DEFAULT_CPU_KV_CACHE_MEMORY
        return num_blocks_for_memory(budget, block_bytes + self.extra_block_bytes)

    def output_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The rows' logits (a pooling runner: its pooler's outputs); profiling counts it."""
        return self.model.compute_logits(hidden)

    # ---- one step ------------------------------------------------------------------------

    max_steps_in_flight = 1  # one process computes a step whole (a pipeline: executor.py)

    def submit(self, output: SchedulerOutput) -> SchedulerOutput:
        """Hand a step over; ``collect`` runs it (one process has nothing to overlap)."""
        return output

    def collect(self, submitted: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute(submitted)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: its tokens and logprobs by request id. A KV connector
        (kv_connector/base.py) loads blocks before the forward and saves them after it."""
        connector = self.kv_connector
        loaded = connector.start_step(output) if connector is not None else None
        if output.is_empty:  # nothing runnable: only forget what finished
            self.begin_step(output)
            return ModelRunnerOutput(finished_kv_loads=loaded)
        model_input, layout = self.begin_step(output)
        logits = self.execute_model(model_input, output.blocks_to_copy)
        if connector is not None:
            connector.wait_for_save(output.kv_connector_metadata)
        result = self.sample(layout, logits)
        result.finished_kv_loads = loaded
        return result

    def begin_step(self, output: SchedulerOutput) -> tuple[ModelInput, LogitsLayout] | None:
        """Forget the sequences that have left, let the draft model propose into the slots the
        scheduler allocated (filling ``output.spec_token_ids``), and lay out the batch (None for
        an empty step)."""
        for request in output.finished:
            self.input_batch.remove(request)
        if self.encoder_cache is not None:
            self.encoder_cache.update(output)
        if output.is_empty:
            return None
        if self.drafter is not None:
            self.drafter.propose(output, self.input_batch)
        return self.prepare_input(output)

    def sample(self, layout: LogitsLayout, logits: torch.Tensor) -> ModelRunnerOutput:
        """The step's tokens and logprobs by request id, from the rows ``layout`` describes."""
        draft_probs = self.drafter.draft_probs if self.drafter is not None else None
        return sample_step(logits, layout, self.input_batch, self.sampler, draft_probs)

    def prepare_input(self, output: SchedulerOutput) -> tuple[ModelInput, LogitsLayout]:
        """The flat batch of a step and the layout of the rows it scores (``LogitsLayout``).

        Most items of a busy step are decodes (one token, the last known one, sampled), whose
        token the scheduler wrote down (``decode_token_ids``): the runs of them between the
        step's other items (a prefill chunk, prompt logprobs, proposals to verify; the
        scheduler lists them in ``other_entries``) are laid out a run at a time, each other
        item by ``_lay_out_item``. A sampled item's row is its last token's, so the sampled
        rows come from the batch layout's ``query_start_loc`` in one numpy step."""
        requests, fed = output.requests, output.decode_token_ids
        tokens: list[int] = []
        layout = LogitsLayout()
        rows: tuple[list[int], list[int]] = ([], [])  # prompt-logprob and proposal rows
        unsampled: list[int] = []  # entries whose chunk is not sampled
        offset = run_start = 0
        for index in (*output.other_entries, len(requests)):
            tokens += fed[run_start:index]  # the run of decodes before entry ``index``
            offset += index - run_start
            if index < len(requests):
                start, count = output.num_computed_tokens[index], output.num_new_tokens[index]
                if not self._lay_out_item(
                    output, index, start, count, offset, tokens, layout, rows
                ):
                    unsampled.append(index)
                offset += count
            run_start = index + 1
        batch = self._layout_batch(output)
        sample_rows = batch.query_start_loc[1:] - 1
        layout.sampled = [request.request_id for request in requests]
        if unsampled:
            sample_rows = np.delete(sample_rows, unsampled)
            layout.sampled = [layout.sampled[i] for i in np.delete(np.arange(len(fed)), unsampled)]
        logits_rows = np.concatenate([sample_rows, int64_array(rows[0] + rows[1])])
        return self._model_input(output, int64_array(tokens), batch, logits_rows), layout

    def _layout_batch(self, output: SchedulerOutput) -> PagedBatch:
        """Positions, slots and block tables of the step (``layout_paged_batch``)."""
        starts = int64_array(output.num_computed_tokens)
        one_each = output.num_scheduled_tokens == len(starts)
        counts = None if one_each else int64_array(output.num_new_tokens)
        tables = self.block_table.fill(output.block_ids)
        return layout_paged_batch(tables, starts, counts, self.cache_config.block_size)

    @staticmethod
    def _lay_out_item(output, index, start, count, offset, tokens, layout, rows) -> bool:
        """``prepare_input`` for entry ``index`` when it is not a plain decode: its tokens, and
        the prompt-logprob or proposal rows it scores (``rows``). Whether its last row is
        sampled."""
        request = output.requests[index]
        prompt_rows, spec_rows = rows
        drafts = output.spec_token_ids.get(request.request_id)
        if drafts:  # the last known token, then the proposals to verify
            tokens.append(token_at(request, start))
            tokens.extend(drafts)
            layout.spec.append((request.request_id, drafts))
            spec_rows.extend(range(offset, offset + count))
            return False
        tokens.extend(token_slice(request, start, count))
        if request.needs_prompt_logits:
            positions = prompt_logit_positions(request, start, count)
            if positions:
                layout.prompt.append((request.request_id, positions.start, len(positions)))
                prompt_rows.extend(offset + p - start for p in positions)
        return start + count == request.num_tokens

    def _model_input(self, output, token_ids, batch, rows: np.ndarray) -> ModelInput:
        """A laid-out step as tensors: into the padded decode buffers when it is a pure-decode
        step with a bucket, else one tensor per input."""
        dev = self.device
        logits_indices = to_device(rows, dev)
        image_rows = (
            self.encoder_cache.step_rows(output, batch.query_start_loc)
            if self.encoder_cache is not None
            else None
        )
        positions, key_limits = image_layout(self.model, output, batch)
        bucket = self._decode_bucket(len(token_ids), output.num_scheduled_seqs)
        if bucket is not None and image_rows is None and positions.ndim == 1:
            input_ids, positions, meta = self.decode_buffers.load(token_ids, batch, bucket)
            return ModelInput(input_ids, positions, meta, logits_indices, bucket)
        return ModelInput(
            input_ids=to_device(token_ids, dev),
            positions=to_device(positions, dev),
            attn_metadata=attention_metadata(batch, dev, key_limits),
            logits_indices=logits_indices,
            lora_token_slot=self._lora_token_slot(output),
            image_rows=image_rows,
        )

    def _lora_token_slot(self, output: SchedulerOutput) -> torch.Tensor | None:
        """Each token's adapter slot, the step's adapters put into slots first."""
        if self.lora_manager is None:
            return None
        lora_ids = [request.lora_int_id for request in output.requests]
        return self.lora_manager.token_slots(lora_ids, output.num_new_tokens)

    def _decode_bucket(self, num_tokens: int, num_seqs: int) -> int | None:
        """The padded batch size of a pure-decode step (one new token per sequence), or None
        when this step runs unpadded (padding off, a prefill in the batch, too many rows)."""
        if self.decode_buffers is None or num_tokens != num_seqs:
            return None
        return self.decode_buffers.bucket_for(num_seqs)

    @torch.inference_mode()
    def execute_model(
        self, model_input: ModelInput, blocks_to_copy: list[tuple[int, int]]
    ) -> torch.Tensor | None:
        """Copy-on-write copies, the forward and the logits for a prepared batch (None on a
        pipeline stage before the last, which hands its hidden states on instead).

        Split from ``execute`` so that the other ranks (distributed/worker.py), which receive
        the prepared batch from rank 0 instead of a scheduler output, run exactly the same code.
        """
        if blocks_to_copy:
            pairs = torch.tensor(blocks_to_copy, dtype=torch.long, device=self.device)
            copy_cache_blocks(self.kv_caches, pairs)
        bucket = model_input.padded_batch_size
        if self.lora_manager is not None:
            self.lora_manager.set_batch(model_input.lora_token_slot)
        if self.cuda_graphs is not None and bucket in self.cuda_graphs.graphs:
            hidden = self.cuda_graphs.replay(bucket)
        else:
            hidden = self.forward(model_input)
        if hidden is None:
            return None
        return self.model.compute_logits(hidden[model_input.logits_indices])

    def forward(self, model_input: ModelInput) -> torch.Tensor | None:
        """The model's hidden states for every token of the step. A pipeline stage after the
        first starts from what the previous stage sent; one before the last sends its output
        to the next stage and returns None."""
        stage, extra = self.par.stage, {}
        if not stage.is_first:
            num_tokens = model_input.input_ids.shape[0]
            extra["intermediate"] = self.par.receive_from_previous_stage(num_tokens)
        if model_input.image_rows is not None:
            extra["inputs_embeds"] = embeddings_with_images(
                self.model, model_input.input_ids, model_input.image_rows
            )
        output = self.model(
            model_input.input_ids,
            model_input.positions,
            self.kv_caches,
            model_input.attn_metadata,
            **extra,
        )
        if stage.is_last:
            return output
        self.par.send_to_next_stage(output)
        return None
