"""The rotary cos/sin cache is built once per setting and shared by the layers that use it
(a cache per layer would cost ``[max_position, rotary_dim]`` fp32 each: SmolLM2's 30 layers held
60 MB of copies). Gemma 3's local and global layers have two settings, so two caches."""

from __future__ import annotations

from pagedserve.engine import LLM
from pagedserve.models.layers.rotary import RotaryEmbedding


def _caches(path: str) -> tuple[int, set[int]]:
    model = LLM(model=path, block_size=8, kv_cache_memory=1 << 20).engine.runner.model
    ropes = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    return len(ropes), {r.cos_sin_cache.data_ptr() for r in ropes}


def test_layers_with_one_rotary_setting_share_one_cache(tiny_checkpoint):
    layers, caches = _caches(tiny_checkpoint("llama", num_hidden_layers=3))
    assert layers == 3 and len(caches) == 1


def test_gemma3_local_and_global_layers_hold_one_cache_each(tiny_checkpoint):
    _, caches = _caches(tiny_checkpoint("gemma3"))  # (its model shares a module per kind)
    assert len(caches) == 2
