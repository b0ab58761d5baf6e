"""pagedserve.models: model architectures over the paged KV cache, the loader, the tokenizer."""

from pagedserve.models.config import SUPPORTED_ARCHITECTURES, ModelConfig, ModelLoadError
from pagedserve.models.image_inputs import ProcessedImage, processed_images
from pagedserve.models.interface import ModelForCausalLM, ModelForPooling
from pagedserve.models.kv_cache_spec import KVCacheSpec, kv_cache_spec
from pagedserve.models.layers.attention import AttentionMetadata, EncoderAttentionMetadata
from pagedserve.models.loader import load_model
from pagedserve.models.parallel import ParallelContext
from pagedserve.models.pooling import Pooler, PoolingType
from pagedserve.models.tokenizer import apply_chat_template, load_tokenizer

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "AttentionMetadata",
    "EncoderAttentionMetadata",
    "KVCacheSpec",
    "ModelConfig",
    "ModelForCausalLM",
    "ModelForPooling",
    "ModelLoadError",
    "ParallelContext",
    "Pooler",
    "PoolingType",
    "ProcessedImage",
    "apply_chat_template",
    "processed_images",
    "kv_cache_spec",
    "load_model",
    "load_tokenizer",
]
