"""pagedserve.kernels.cpu: the CPU's compiled kernels (numba), together.

Each kernel keeps the contract of the device op it stands in for and is held to that op's
PyTorch reference (in the parent package, beside the Triton kernel) by the kernel suite:
paged attention (paged_attention.py, its tile loops and per-step work plan), the decode GEMM
(dense_linear.py), the 4-bit group GEMM (int4_linear.py), the layer's small ops (layer_ops.py:
RMSNorm, rotary, store_kv, SiLU), and a whole Llama decoder layer as one call
(decoder_layer.py, which the CPU runner uses: engine/cpu_runner.py). Helpers: 16-bit cache
elements (half.py), a vectorisable exp (fast_exp.py), numba's thread count (threads.py) and
its disk cache (numba_cache.py). ``kernels.dispatch`` picks these on CPU; ``warmup.py``
compiles them at engine start. Importing this package loads no numba: its modules do.
"""
