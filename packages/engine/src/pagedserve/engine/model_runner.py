"""ModelRunner: turns one scheduler step into one forward pass over a flat varlen batch.

The scheduled requests' new tokens are laid end to end (no padding). For each token we compute
its position and its cache slot (``block_table[pos // block_size] * block_size + pos %
block_size``); for each sequence its block table, its length in the cache after this step, and
where its tokens start in the flat batch. The model returns hidden states for every token; only
the last token of each sequence that reached the end of its known tokens is turned into logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.blockmgr import CacheConfig
from pagedserve.blockmgr.kv_cache import (
    DEFAULT_CPU_KV_CACHE_MEMORY,
    allocate_kv_caches,
    bytes_per_block,
    log_cache_size,
    num_blocks_for_memory,
)
from pagedserve.models import AttentionMetadata, ModelConfig, load_model
from pagedserve.scheduler import SchedulerOutput


@dataclass
class ModelInput:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sample_request_ids: list[str]


class ModelRunner:
    """Owns the model and the KV cache tensors; runs one forward per step."""

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.device = model_config.torch_device
        torch.manual_seed(model_config.seed)
        self.model = load_model(model_config)
        self.num_blocks = self._num_blocks()
        self.kv_caches = allocate_kv_caches(
            model_config.num_layers,
            self.num_blocks,
            cache_config.block_size,
            self._kv_heads_per_rank(),
            model_config.head_dim,
            model_config.torch_dtype,
            self.device,
        )
        log_cache_size(self.num_blocks, cache_config.block_size, model_config.max_model_len)

    def _kv_heads_per_rank(self) -> int:
        return self.model_config.num_kv_heads

    def _num_blocks(self) -> int:
        cc, mc = self.cache_config, self.model_config
        if cc.num_blocks is not None:
            return cc.num_blocks
        block_bytes = bytes_per_block(
            mc.num_layers, cc.block_size, self._kv_heads_per_rank(), mc.head_dim, mc.torch_dtype
        )
        if self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            budget = int(free * cc.gpu_memory_utilization)
        else:
            budget = cc.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY
        return num_blocks_for_memory(cc.kv_cache_memory or budget, block_bytes)

    # ---- one step ------------------------------------------------------------------------

    def prepare_input(self, output: SchedulerOutput) -> ModelInput:
        block_size = self.cache_config.block_size
        token_chunks, starts, counts, tables, sample_ids, logits_rows = [], [], [], [], [], []
        offset = 0
        for item in output.scheduled:
            start, count = item.num_computed_tokens, item.num_new_tokens
            token_chunks.append(item.request.all_token_ids[start : start + count])
            starts.append(start)
            counts.append(count)
            tables.append(item.block_table)
            offset += count
            if item.needs_sample:
                sample_ids.append(item.request.request_id)
                logits_rows.append(offset - 1)

        counts_np = np.asarray(counts, dtype=np.int64)
        seq_index = np.repeat(np.arange(len(counts)), counts_np)
        query_start_loc = np.zeros(len(counts) + 1, dtype=np.int32)
        np.cumsum(counts_np, out=query_start_loc[1:])
        positions = np.asarray(starts, dtype=np.int64)[seq_index] + (
            np.arange(offset, dtype=np.int64) - query_start_loc[:-1][seq_index]
        )
        max_blocks = max(len(t) for t in tables)
        block_tables = np.zeros((len(tables), max_blocks), dtype=np.int32)
        for row, table in enumerate(tables):
            block_tables[row, : len(table)] = table
        slot_mapping = (
            block_tables[seq_index, positions // block_size].astype(np.int64) * block_size
            + positions % block_size
        )
        seq_lens = np.asarray(starts, dtype=np.int32) + counts_np.astype(np.int32)

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping).to(dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            seq_lens=torch.from_numpy(seq_lens).to(dev),
            query_start_loc=torch.from_numpy(query_start_loc).to(dev),
            max_query_len=int(counts_np.max()),
            max_seq_len=int(seq_lens.max()),
        )
        input_ids = torch.from_numpy(
            np.fromiter((t for c in token_chunks for t in c), dtype=np.int64, count=offset)
        )
        return ModelInput(
            input_ids=input_ids.to(dev),
            positions=torch.from_numpy(positions).to(dev),
            attn_metadata=meta,
            logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=dev),
            sample_request_ids=sample_ids,
        )

    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> tuple[torch.Tensor, list[str]]:
        """Run one step; returns float32 logits ``[num_sampled, vocab]`` and their request ids."""
        if output.blocks_to_copy:
            from pagedserve.blockmgr.copy_blocks import copy_blocks

            pairs = torch.tensor(output.blocks_to_copy, dtype=torch.long, device=self.device)
            copy_blocks([k for k, _ in self.kv_caches], [v for _, v in self.kv_caches], pairs)
        model_input = self.prepare_input(output)
        hidden = self.model(
            model_input.input_ids, model_input.positions, self.kv_caches, model_input.attn_metadata
        )
        logits = self.model.compute_logits(hidden[model_input.logits_indices])
        return logits, model_input.sample_request_ids
