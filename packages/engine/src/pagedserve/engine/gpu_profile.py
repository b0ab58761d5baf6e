"""How many KV blocks a GPU holds: run the largest step once, give the cache what is left.

vLLM sizes its KV cache the same way: whatever ``gpu_memory_utilization`` of the device the
weights and the peak activations of the largest step leave. The activations' peak is measured,
not estimated, by running that step through the real attention path before the cache exists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedserve.blockmgr.slot_mapping import build_paged_batch
from pagedserve.engine.input_batch import attention_metadata
from pagedserve.engine.kv_cache import gpu_kv_cache_budget
from pagedserve.models.pipeline import IntermediateTensors

if TYPE_CHECKING:
    from pagedserve.engine.model_runner import ModelRunner


@torch.inference_mode()
def profile_gpu_kv_cache_budget(runner: ModelRunner, block_bytes: int) -> int:
    """The bytes ``runner``'s KV cache may take on its GPU.

    The step is ``profile_num_tokens`` tokens (the scheduler's token budget) as prefills of up
    to ``max_model_len`` each, through the real attention path over a throwaway cache just
    large enough to hold them; that cache's bytes are taken off the measured peak. A pipeline
    stage after the first starts from stand-in hidden states; only the last runs the head. A
    vision-language model first runs the most images a step encodes through its tower, and its
    step starts from their rows, held meanwhile as the encoder cache holds them
    (``profile_inputs_embeds``).
    """
    mc, cc, dev = runner.model_config, runner.cache_config, runner.device
    stage = runner.par.stage
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
    caches = runner.new_kv_caches(num_blocks)
    meta = attention_metadata(batch, dev)
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=dev)
    positions = torch.from_numpy(batch.positions).to(dev)
    extra = {}
    held_images = None
    if runner.profile_images:
        held_images, extra["inputs_embeds"] = profile_inputs_embeds(runner, input_ids)
    if not stage.is_first:
        hidden = torch.zeros(num_tokens, mc.hidden_size, dtype=mc.torch_dtype, device=dev)
        extra["intermediate"] = IntermediateTensors(hidden, hidden.clone())
    hidden = runner.model(input_ids, positions, caches, meta, **extra)
    if stage.is_last:
        last_rows = torch.from_numpy(batch.query_start_loc[1:].astype(np.int64) - 1)
        runner.output_head(hidden[last_rows.to(dev)])
    torch.cuda.synchronize(dev)
    peak_torch = torch.cuda.max_memory_allocated(dev) - num_blocks * block_bytes
    free, total = torch.cuda.mem_get_info(dev)
    non_torch = max(0, total - free - torch.cuda.memory_reserved(dev))
    del caches, hidden, meta, input_ids, positions, extra, held_images
    torch.cuda.empty_cache()
    return gpu_kv_cache_budget(total, cc.gpu_memory_utilization, peak_torch, non_torch)


def profile_inputs_embeds(
    runner: ModelRunner, input_ids: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """``(image rows, inputs_embeds)`` of a vision-language model's profiling step: the tower
    over ``runner.profile_images`` (the largest image, as many times as one step encodes it:
    one call, as the encoder cache's ``update`` makes it), and the step's text embeddings with
    as many of those rows written over its first tokens as fit."""
    images = runner.profile_images
    grids = None if images[0].grid_thw is None else [image.grid_thw for image in images]
    rows = runner.model.embed_images([image.pixel_values for image in images], grids)
    embeds = runner.model.embed_input_ids(input_ids)
    flat = torch.cat(rows)[: len(input_ids)]
    embeds[: len(flat)] = flat.to(embeds.dtype)
    return rows, embeds
