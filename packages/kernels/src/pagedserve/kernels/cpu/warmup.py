"""Compile every CPU kernel at engine start, not in the first request.

numba compiles a function on its first call for each signature (``cache=True`` keeps the
machine code on disk, so a later start loads it in seconds). The engine calls :func:`warm_up`
once, with the KV cache's dtype, before it serves: each kernel module compiles the signatures
the models pass. A no-op where dispatch would not pick numba anyway (``PAGEDSERVE_KERNELS``).
"""

from __future__ import annotations

import torch

from pagedserve.kernels.dispatch import kernel_path


def warm_up(cache_dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> None:
    """The attention (both kernels), the small ops, the decode GEMM and the fused layer."""
    if kernel_path(torch.empty(0), has_numba=True) != "numba":
        return
    from pagedserve.kernels.cpu import decoder_layer, dense_linear, layer_ops, paged_attention

    paged_attention.warm_up(cache_dtypes)
    layer_ops.warm_up(cache_dtypes)
    dense_linear.warm_up()
    decoder_layer.warm_up(cache_dtypes)
