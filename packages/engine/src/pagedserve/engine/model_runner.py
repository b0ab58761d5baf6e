"""ModelRunner: turns one scheduler step into one forward pass over a flat varlen batch.

The scheduled requests' new tokens are laid end to end (no padding). For each token we compute
its position and its cache slot (``block_table[pos // block_size] * block_size + pos %
block_size``); for each sequence its block table, its length in the cache after this step, and
where its tokens start in the flat batch. The model returns hidden states for every token; only
the last token of each sequence that reached the end of its known tokens is turned into logits.

Pure-decode steps can instead run from persistent buffers padded to a batch-size bucket, replayed
as CUDA graphs on a GPU (cuda_graph.py); the logits are those of the real rows either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.blockmgr import CacheConfig
from pagedserve.blockmgr.slot_mapping import PagedBatch, build_paged_batch
from pagedserve.engine.cuda_graph import CUDAGraphConfig, DecodeCUDAGraphs, DecodeInputBuffers
from pagedserve.engine.input_batch import (
    BlockTable,
    _attention_metadata,
    _token_slice,
    decode_batch,
    prompt_logit_positions,
    to_device,
)
from pagedserve.engine.kv_cache import (
    DEFAULT_CPU_KV_CACHE_MEMORY,
    allocate_kv_caches,
    bytes_per_block,
    gpu_kv_cache_budget,
    kv_cache_torch_dtype,
    log_cache_size,
    num_blocks_for_memory,
)
from pagedserve.engine.lora import LoRAConfig, LoRAManager
from pagedserve.kernels import copy_blocks, paged_attention_warmup
from pagedserve.kernels.dispatch import use_triton
from pagedserve.models import AttentionMetadata, ModelConfig, ParallelContext, load_model
from pagedserve.models.parallel import kv_heads_per_rank
from pagedserve.scheduler import SchedulerOutput


@dataclass
class ModelInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sample_request_ids: list[str]
    # the decode bucket this batch was padded to (its tensors are views of the runner's
    # persistent buffers); None for an unpadded batch
    padded_batch_size: int | None = None
    # each token's LoRA slot (-1: the base model); None when no row has an adapter
    lora_token_slot: torch.Tensor | None = None


class ModelRunner:
    """Owns the model and the KV cache tensors; runs one forward per step.

    Under tensor parallelism there is one runner per rank, built with that rank's
    ``ParallelContext``: it holds the rank's shard of the weights and of the KV heads, and every
    rank agrees on the smallest block count any of them can hold.

    With a ``graph_config`` whose padding is on for this device, the cache holds one block more
    than ``num_blocks`` (the one the KVCacheManager hands out): block ``num_blocks`` is the
    padding rows' own (cuda_graph.py). Without one (tensor-parallel ranks, tools), every step
    runs eagerly and unpadded.

    ``extra_block_bytes``: KV bytes per block kept elsewhere for the same block ids (a draft
    model's cache, spec_decode/draft_model.py); a memory budget is split between both.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        par: ParallelContext | None = None,
        graph_config: CUDAGraphConfig | None = None,
        lora_config: LoRAConfig | None = None,
        extra_block_bytes: int = 0,
    ) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.par = par or ParallelContext()
        self.extra_block_bytes = extra_block_bytes
        self.device = model_config.torch_device
        torch.manual_seed(model_config.seed)
        self.kv_cache_dtype = kv_cache_torch_dtype(
            cache_config.cache_dtype, model_config.torch_dtype
        )
        self.model = self._load_model()
        self.lora_manager = (  # its slots are allocated before the KV cache is sized
            LoRAManager(self.model, model_config, lora_config) if lora_config else None
        )
        self.num_blocks = self.par.min_over_ranks(self._num_blocks())
        pads = graph_config is not None and graph_config.pads_decode(self.device)
        self.kv_caches = self._allocate_kv_caches(self.num_blocks + int(pads))
        log_cache_size(self.num_blocks, cache_config.block_size, model_config.max_model_len)
        if self.device.type == "cpu":  # numba compiles (or loads its cache) now, not mid-request
            from pagedserve.kernels.paged_attention_numba import warm_up

            warm_up((self.kv_cache_dtype,))
        if self.device.type == "cuda":  # compile every attention variant now, not mid-serving
            mc, heads = model_config, model_config.num_attention_heads // self.par.tp_size
            paged_attention_warmup(
                heads,
                self._kv_heads_per_rank(),
                mc.head_dim,
                mc.torch_dtype,
                cache_config.block_size,
                mc.max_model_len,
                self.device,
                layer_windows=mc.sliding_windows,
                logits_soft_cap=mc.attention_logits_soft_cap,
                cache_dtype=self.kv_cache_dtype,
            )
        # Pure-decode steps build their inputs on the fast path (tests turn it off to hold it
        # equal to the general path), their block tables in the persistent array.
        self.decode_fast_path = True
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

    def _allocate_kv_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        mc = self.model_config
        return allocate_kv_caches(
            mc.num_layers,
            num_blocks,
            self.cache_config.block_size,
            self._kv_heads_per_rank(),
            mc.head_dim,
            self.kv_cache_dtype,
            self.device,
        )

    def _kv_heads_per_rank(self) -> int:
        return kv_heads_per_rank(self.model_config.num_kv_heads, self.par.tp_size)

    def _num_blocks(self) -> int:
        """KV cache blocks: ``num_blocks`` if given, else ``kv_cache_memory`` bytes, else on a GPU
        what a profiling step leaves of ``gpu_memory_utilization``, else (CPU) 1 GiB."""
        cc, mc = self.cache_config, self.model_config
        if cc.num_blocks is not None:
            return cc.num_blocks
        block_bytes = bytes_per_block(
            mc.num_layers,
            cc.block_size,
            self._kv_heads_per_rank(),
            mc.head_dim,
            self.kv_cache_dtype,
        )
        if cc.kv_cache_memory is not None:
            budget = cc.kv_cache_memory
        elif self.device.type == "cuda":
            budget = self._profile_gpu_kv_cache_budget(block_bytes)
        else:
            budget = DEFAULT_CPU_KV_CACHE_MEMORY
        return num_blocks_for_memory(budget, block_bytes + self.extra_block_bytes)

    @torch.inference_mode()
    def _profile_gpu_kv_cache_budget(self, block_bytes: int) -> int:
        """Run the largest step once on dummy tokens; the KV cache gets what is left.

        The step is ``profile_num_tokens`` tokens (the scheduler's token budget) as prefills of
        up to ``max_model_len`` each, through the real attention path over a throwaway cache
        just large enough to hold them; that cache's bytes are taken off the measured peak.
        """
        mc, cc, dev = self.model_config, self.cache_config, self.device
        num_tokens = cc.profile_num_tokens
        lengths = [mc.max_model_len] * (num_tokens // mc.max_model_len)
        if num_tokens % mc.max_model_len:
            lengths.append(num_tokens % mc.max_model_len)
        tables, num_blocks = [], 0
        for length in lengths:
            count = -(-length // cc.block_size)
            tables.append(range(num_blocks, num_blocks + count))
            num_blocks += count
        batch = build_paged_batch(tables, [0] * len(lengths), lengths, cc.block_size)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        caches = allocate_kv_caches(
            mc.num_layers,
            num_blocks,
            cc.block_size,
            self._kv_heads_per_rank(),
            mc.head_dim,
            self.kv_cache_dtype,
            dev,
        )
        meta = _attention_metadata(batch, dev)
        input_ids = torch.zeros(num_tokens, dtype=torch.long, device=dev)
        positions = torch.from_numpy(batch.positions).to(dev)
        hidden = self.model(input_ids, positions, caches, meta)
        last_rows = torch.from_numpy(batch.query_start_loc[1:].astype(np.int64) - 1).to(dev)
        self.model.compute_logits(hidden[last_rows])
        torch.cuda.synchronize(dev)
        peak_torch = torch.cuda.max_memory_allocated(dev) - num_blocks * block_bytes
        free, total = torch.cuda.mem_get_info(dev)
        non_torch = max(0, total - free - torch.cuda.memory_reserved(dev))
        del caches, hidden, meta, input_ids, positions
        torch.cuda.empty_cache()
        return gpu_kv_cache_budget(total, cc.gpu_memory_utilization, peak_torch, non_torch)

    # ---- one step ------------------------------------------------------------------------

    def prepare_input(self, output: SchedulerOutput) -> ModelInput:
        """The flat batch of a step: a pure-decode step (every request runs its one last token)
        through a decode fast path, from the scheduler's ``decodes`` lists when it made every
        item, else from the requests; any other through ``_prepare_general``."""
        num_seqs = output.num_scheduled_seqs
        if (
            self.decode_fast_path
            and num_seqs
            and output.num_scheduled_tokens == num_seqs
            and not output.num_spec_tokens
        ):
            if output.all_decodes:
                return self._prepare_scheduled_decodes(output)
            model_input = self._prepare_decodes(output)
            if model_input is not None:
                return model_input
        return self._prepare_general(output)

    def _prepare_scheduled_decodes(self, output: SchedulerOutput) -> ModelInput:
        """The decode fast path from the scheduler's ``decodes`` lists (vLLM V1's cached
        requests): every item runs its last known token, which the scheduler listed with its
        position and blocks while it scheduled it, so no request is read again here."""
        decodes = output.decodes
        starts = np.array(decodes.num_computed_tokens, dtype=np.int64)
        token_ids = np.array(decodes.token_ids, dtype=np.int64)
        return self._decode_input(output, starts, token_ids, decodes.block_ids, decodes.req_ids)

    def _prepare_decodes(self, output: SchedulerOutput) -> ModelInput | None:
        """The decode fast path for any pure-decode step: one list comprehension per field. None
        (the general path) unless every request runs one token, its last known one (it needs a
        sample; no prompt-logits row can remain at that position)."""
        items = output.scheduled
        requests = [item.request for item in items]
        starts = np.array([item.num_computed_tokens for item in items], dtype=np.int64)
        num_tokens = [len(r.prompt_token_ids) + len(r.output_token_ids) for r in requests]
        if not np.array_equal(starts + 1, num_tokens):
            return None
        token_ids = np.array(
            [(r.output_token_ids or r.prompt_token_ids)[-1] for r in requests], dtype=np.int64
        )
        tables, req_ids = [item.block_table for item in items], [r.request_id for r in requests]
        return self._decode_input(output, starts, token_ids, tables, req_ids)

    def _decode_input(self, output, starts, token_ids, block_ids, req_ids) -> ModelInput:
        """A pure-decode step's inputs (``decode_batch``), one tensor per input."""
        batch = decode_batch(starts, block_ids, self.block_table, self.cache_config.block_size)
        rows, counts = np.arange(len(starts)), [1] * len(starts)
        return self._model_input(output, token_ids, batch, rows, counts, req_ids)

    def _prepare_general(self, output: SchedulerOutput) -> ModelInput:
        """The flat batch of any step (prefill chunks, prompt logprobs, proposals to verify).
        A decode (one new token, an output token) takes its token without slicing."""
        tokens, starts, counts, tables, sample_ids, logits_rows = [], [], [], [], [], []
        prompt_rows: list[int] = []
        spec_rows: list[int] = []
        offset = 0
        for item in output.scheduled:
            request = item.request
            start, count = item.num_computed_tokens, item.num_new_tokens
            if request.needs_prompt_logits:
                prompt_rows.extend(offset + p - start for p in prompt_logit_positions(item))
            num_prompt = len(request.prompt_token_ids)
            if item.spec_token_ids:  # the last known token, then the proposals to verify
                tokens.extend(_token_slice(request, start, 1))
                tokens.extend(item.spec_token_ids)
                spec_rows.extend(range(offset, offset + count - 1))
                starts.append(start)
                counts.append(count)
                tables.append(item.block_table)
                offset += count
                sample_ids.append(request.request_id)
                logits_rows.append(offset - 1)
                continue
            if count == 1 and start >= num_prompt:
                tokens.append(request.output_token_ids[start - num_prompt])
            else:
                tokens.extend(_token_slice(request, start, count))
            starts.append(start)
            counts.append(count)
            tables.append(item.block_table)
            offset += count
            if start + count == num_prompt + len(request.output_token_ids):  # needs_sample
                sample_ids.append(request.request_id)
                logits_rows.append(offset - 1)
        batch = build_paged_batch(tables, starts, counts, self.cache_config.block_size)
        token_ids = np.array(tokens, dtype=np.int64)
        rows = logits_rows + prompt_rows + spec_rows if spec_rows else logits_rows + prompt_rows
        return self._model_input(output, token_ids, batch, rows, counts, sample_ids)

    def _model_input(
        self,
        output: SchedulerOutput,
        token_ids: np.ndarray,
        batch: PagedBatch,
        rows: list[int] | np.ndarray,
        counts: list[int],
        sample_ids: list[str],
    ) -> ModelInput:
        """A laid-out step as tensors: into the padded decode buffers when it is a pure-decode
        step with a bucket, else one tensor per input."""
        dev = self.device
        logits_indices = to_device(np.asarray(rows, dtype=np.int64), dev)
        bucket = self._decode_bucket(len(token_ids), len(counts))
        if bucket is not None:
            input_ids, positions, meta = self.decode_buffers.load(token_ids, batch, bucket)
            return ModelInput(input_ids, positions, meta, logits_indices, sample_ids, bucket)
        return ModelInput(
            input_ids=to_device(token_ids, dev),
            positions=to_device(batch.positions, dev),
            attn_metadata=_attention_metadata(batch, dev),
            logits_indices=logits_indices,
            sample_request_ids=sample_ids,
            lora_token_slot=self._lora_token_slot(output, counts),
        )

    def _lora_token_slot(self, output: SchedulerOutput, counts: list[int]) -> torch.Tensor | None:
        """Each token's adapter slot, the step's adapters put into slots first."""
        if self.lora_manager is None:
            return None
        lora_ids = [item.request.lora_int_id for item in output.scheduled]
        return self.lora_manager.token_slots(lora_ids, counts)

    def _decode_bucket(self, num_tokens: int, num_seqs: int) -> int | None:
        """The padded batch size of a pure-decode step (one new token per sequence), or None
        when this step runs unpadded (padding off, a prefill in the batch, too many rows)."""
        if self.decode_buffers is None or num_tokens != num_seqs:
            return None
        return self.decode_buffers.bucket_for(num_seqs)

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> tuple[torch.Tensor, list[str]]:
        """Run one step; returns float32 logits and the request ids of their first rows.

        Row i < len(ids) gives request ids[i]'s next token; the rows after them are the
        prompt-logprobs rows (``prompt_logit_positions``, in scheduled order), then the rows
        that score a speculative decode's proposals (``num_spec_tokens`` of them: proposal j
        of each such request, in scheduled order; its row in ids scores the bonus token).
        """
        model_input = self.prepare_input(output)
        logits = self.execute_model(model_input, output.blocks_to_copy)
        return logits, model_input.sample_request_ids

    @torch.inference_mode()
    def execute_model(
        self, model_input: ModelInput, blocks_to_copy: list[tuple[int, int]]
    ) -> torch.Tensor:
        """Copy-on-write copies, the forward and the logits for a prepared batch.

        Split from ``execute`` so that tensor-parallel workers, which receive the prepared
        batch from rank 0 instead of a scheduler output, run exactly the same code.
        """
        if blocks_to_copy:
            pairs = torch.tensor(blocks_to_copy, dtype=torch.long, device=self.device)
            copy_blocks([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches], pairs)
        bucket = model_input.padded_batch_size
        if self.lora_manager is not None:
            self.lora_manager.set_batch(model_input.lora_token_slot)
        if self.cuda_graphs is not None and bucket in self.cuda_graphs.graphs:
            hidden = self.cuda_graphs.replay(bucket)
        else:
            hidden = self.model(
                model_input.input_ids,
                model_input.positions,
                self.kv_caches,
                model_input.attn_metadata,
            )
        return self.model.compute_logits(hidden[model_input.logits_indices])
