"""KV cache sizing: blocks from a byte budget, the GPU budget after profiling, the start-up line."""

from __future__ import annotations

import logging

import pytest
import torch

from pagedserve.engine.kv_cache import (
    allocate_kv_caches,
    bytes_per_block,
    gpu_kv_cache_budget,
    log_cache_size,
    num_blocks_for_memory,
)
from pagedserve.models import KVCacheSpec, ModelConfig, kv_cache_spec

GIB = 1 << 30


def test_bytes_per_block_counts_keys_and_values_of_every_layer():
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, fp32, 16-token blocks.
    smollm2 = KVCacheSpec(num_layers=30, num_kv_heads=3, head_size=64, tensors_per_layer=2)
    assert bytes_per_block(smollm2, 16, torch.float32) == 2 * 30 * 16 * 3 * 64 * 4
    assert bytes_per_block(smollm2, 16, torch.bfloat16) == 2 * 30 * 16 * 3 * 64 * 2
    assert bytes_per_block(smollm2, 16, torch.float8_e4m3fn) == 2 * 30 * 16 * 3 * 64
    # q8_0 (int8 tensors): 64 int8 elements and two 2-byte scales a head's row
    assert bytes_per_block(smollm2, 16, torch.int8) == 2 * 30 * 16 * 3 * (64 + 4)
    caches = allocate_kv_caches(
        smollm2, num_blocks=2, block_size=16, dtype=torch.int8, device="cpu"
    )
    assert caches[0][0].shape == (2, 16, 3, 68) and caches[0][0].dtype == torch.int8


def test_a_latent_cache_is_one_tensor_of_the_latent_per_layer():
    # DeepSeek-V3: 61 layers, each token caches kv_lora_rank 512 + rope 64 values, once
    v3 = KVCacheSpec(num_layers=61, num_kv_heads=1, head_size=576, tensors_per_layer=1)
    assert bytes_per_block(v3, 16, torch.bfloat16) == 61 * 16 * 576 * 2
    caches = allocate_kv_caches(v3, num_blocks=3, block_size=16, dtype=torch.bfloat16, device="cpu")
    assert len(caches) == 61 and all(len(layer) == 1 for layer in caches)
    assert caches[0][0].shape == (3, 16, 1, 576)
    for dtype in (torch.float8_e4m3fn, torch.int8):
        with pytest.raises(ValueError, match="latent attention's cache is not stored in 8 bits"):
            allocate_kv_caches(v3, 3, 16, dtype, "cpu")


def test_num_blocks_for_memory_floors_and_refuses_zero():
    assert num_blocks_for_memory(10_000, 3_000) == 3
    with pytest.raises(ValueError, match="raise kv_cache_memory"):
        num_blocks_for_memory(100, 3_000)


def test_gpu_budget_is_utilised_memory_minus_peak_and_non_torch():
    assert gpu_kv_cache_budget(80 * GIB, 0.9, 10 * GIB, 1 * GIB) == int(72 * GIB) - 11 * GIB
    with pytest.raises(ValueError, match="raise gpu_memory_utilization"):
        gpu_kv_cache_budget(16 * GIB, 0.5, 7 * GIB, 1 * GIB)


def test_start_up_line_gives_blocks_tokens_and_concurrency(caplog):
    with caplog.at_level(logging.INFO, logger="pagedserve.engine"):
        log_cache_size(1456, 16, 2048)
    (record,) = caplog.records
    assert "1456 blocks of 16 tokens (23296 tokens)" in record.getMessage()
    assert "2048 tokens per request: 11.38x" in record.getMessage()


def test_a_cache_smaller_than_max_model_len_is_warned_about(caplog):
    with caplog.at_level(logging.INFO, logger="pagedserve.engine"):
        log_cache_size(10, 8, 512)
    assert [r.levelname for r in caplog.records] == ["WARNING", "INFO"]
    assert "fewer than max_model_len (512)" in caplog.records[0].getMessage()


def test_engine_sizes_the_cache_from_kv_cache_memory(tiny_checkpoint):
    from pagedserve.engine import LLM

    llm = LLM(model=tiny_checkpoint("llama"), block_size=16, kv_cache_memory=1 << 20)
    runner = llm.engine.runner
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # K+V, 2 layers, 16 tokens, 2 KV heads of 16, fp32
    assert runner.num_blocks == (1 << 20) // block_bytes
    k_cache, v_cache = runner.kv_caches[0]
    assert k_cache.shape == v_cache.shape == (runner.num_blocks, 16, 2, 16)
    assert llm.engine.kv_cache_manager.num_blocks == runner.num_blocks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_sizing_profiles_then_fills_the_utilised_memory(tiny_checkpoint):
    from pagedserve.engine import LLM

    llm = LLM(model=tiny_checkpoint("llama"), device="cuda", gpu_memory_utilization=0.3)
    _, total = torch.cuda.mem_get_info()
    assert llm.engine.runner.num_blocks > 0
    assert torch.cuda.memory_allocated() <= 0.3 * total


def test_the_gpu_profile_step_is_the_schedulers_token_budget(tiny_checkpoint):
    from pagedserve.engine.config import EngineArgs

    path = tiny_checkpoint("llama")
    _, cache, scheduler = EngineArgs(model=path, max_num_batched_tokens=384).create_configs()
    assert cache.profile_num_tokens == scheduler.max_num_batched_tokens == 384
    _, cache, scheduler = EngineArgs(model=path).create_configs()
    assert cache.profile_num_tokens == scheduler.max_num_batched_tokens


def test_a_models_spec_holds_its_ranks_share_of_the_kv_heads(tiny_checkpoint):
    config = ModelConfig(model=tiny_checkpoint("llama"))  # 2 layers, 2 KV heads of 16
    assert kv_cache_spec(config) == KVCacheSpec(2, 2, 16, tensors_per_layer=2)
    assert kv_cache_spec(config, tp_size=2) == KVCacheSpec(2, 1, 16, tensors_per_layer=2)
    assert not kv_cache_spec(config).is_latent


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_a_vision_models_profile_step_runs_the_most_images_a_step_encodes(family, tmp_path):
    """What a GPU's memory profile runs for a vision-language model, checked on the CPU: the
    largest image as many times as the encoder cache lets one step encode it, through the
    tower in one call, its rows written over the profiling step's first tokens."""
    from pagedserve.engine import LLM
    from pagedserve.engine.gpu_profile import profile_inputs_embeds
    from pagedserve.models.testing_multimodal import (
        make_tiny_llava_checkpoint,
        make_tiny_qwen2_vl_checkpoint,
    )

    folder = (
        make_tiny_llava_checkpoint(tmp_path / family)
        if family == "llava"
        else make_tiny_qwen2_vl_checkpoint(tmp_path / family)
    )
    llm = LLM(model=str(folder), dtype="float32", max_model_len=256, encoder_cache_size=100)
    runner, processor = llm.engine.runner, llm.engine.image_processor
    assert not runner.profile_images  # profiled (on a GPU) at start-up, then let go of
    runner.profile_images = processor.take_profile_images(llm.engine.scheduler_config)
    largest = processor.max_image_tokens  # LLaVA: 16 rows; Qwen2-VL: 36 (max_pixels)
    assert len(runner.profile_images) == 100 // largest  # the encoder cache bounds a step
    input_ids = torch.zeros(200, dtype=torch.long)
    with torch.inference_mode():
        rows, embeds = profile_inputs_embeds(runner, input_ids)
    assert [len(r) for r in rows] == [largest] * (100 // largest)
    written = min(200, sum(len(r) for r in rows))
    torch.testing.assert_close(embeds[:written], torch.cat(rows)[:written])
    text = runner.model.embed_input_ids(input_ids[written:])
    torch.testing.assert_close(embeds[written:], text)
