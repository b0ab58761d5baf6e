"""pagedserve.kernels: the engine's device kernels, each a Triton kernel with a PyTorch reference.

Every public function dispatches per call (see :mod:`pagedserve.kernels.dispatch`): Triton on
CUDA tensors or under ``TRITON_INTERPRET=1``; on CPU the numba path where one exists (paged
attention), the ``*_ref`` reference otherwise.
"""

from pagedserve.kernels.copy_blocks import copy_blocks, copy_blocks_ref
from pagedserve.kernels.dispatch import use_triton
from pagedserve.kernels.encoder_attention import encoder_attention, encoder_attention_ref
from pagedserve.kernels.fused_moe import fused_moe, fused_moe_ref
from pagedserve.kernels.gelu import gelu, gelu_ref
from pagedserve.kernels.gelu_tanh import gelu_tanh, gelu_tanh_ref
from pagedserve.kernels.layer_norm import layer_norm, layer_norm_ref
from pagedserve.kernels.lora import lora_expand, lora_expand_ref, lora_shrink, lora_shrink_ref
from pagedserve.kernels.mla_decode import mla_paged_decode, mla_paged_decode_ref
from pagedserve.kernels.paged_attention import paged_attention, paged_attention_ref
from pagedserve.kernels.penalties import apply_penalties, apply_penalties_ref
from pagedserve.kernels.quick_gelu import quick_gelu, quick_gelu_ref
from pagedserve.kernels.rms_norm import rms_norm, rms_norm_ref
from pagedserve.kernels.rotary_embedding import rotary_embedding, rotary_embedding_ref
from pagedserve.kernels.sampling import sample_tokens, sample_tokens_ref
from pagedserve.kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref
from pagedserve.kernels.store_kv import store_kv, store_kv_ref
from pagedserve.kernels.store_latent import store_latent, store_latent_ref
from pagedserve.kernels.swigluoai_and_mul import swigluoai_and_mul, swigluoai_and_mul_ref
from pagedserve.kernels.token_bitmask import apply_token_bitmask, apply_token_bitmask_ref
from pagedserve.kernels.warmup import mla_decode_warmup, paged_attention_warmup

__all__ = [
    "apply_penalties",
    "apply_penalties_ref",
    "apply_token_bitmask",
    "apply_token_bitmask_ref",
    "copy_blocks",
    "copy_blocks_ref",
    "encoder_attention",
    "encoder_attention_ref",
    "fused_moe",
    "fused_moe_ref",
    "gelu",
    "gelu_ref",
    "gelu_tanh",
    "gelu_tanh_ref",
    "layer_norm",
    "layer_norm_ref",
    "lora_expand",
    "lora_expand_ref",
    "lora_shrink",
    "lora_shrink_ref",
    "mla_decode_warmup",
    "mla_paged_decode",
    "mla_paged_decode_ref",
    "paged_attention",
    "paged_attention_ref",
    "paged_attention_warmup",
    "quick_gelu",
    "quick_gelu_ref",
    "rms_norm",
    "rms_norm_ref",
    "rotary_embedding",
    "rotary_embedding_ref",
    "sample_tokens",
    "sample_tokens_ref",
    "silu_and_mul",
    "silu_and_mul_ref",
    "store_kv",
    "store_kv_ref",
    "store_latent",
    "store_latent_ref",
    "swigluoai_and_mul",
    "swigluoai_and_mul_ref",
    "use_triton",
]
