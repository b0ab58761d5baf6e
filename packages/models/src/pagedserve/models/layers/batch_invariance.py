"""Whether a model's layers run their kernels batch invariantly, decided when it is built.

The engine's batch-invariant mode (``--batch-invariant``; docs/batch_invariance.md) makes each
row's result independent of the other rows of its step: the same prompt gives the same bits
alone or among 63 others, in one prefill or in chunks, from the prefix cache or computed. It
is not a second model: it is how the kernels of the layers that have a batch-dependent choice
(the linear layers' GEMM, the LM head's, attention's KV splits and tiles, the MoE router and
experts) pick their reduction order, fixed for the model's life.

Like the linear method (``linear_methods_for``), it is set while a model is constructed:
``batch_invariant_layers(True)`` around the constructor (``load_model`` does it from
``ModelConfig.batch_invariant``), and each such layer reads ``building_batch_invariant()``
once, in its own constructor, and passes it to every kernel call. Never read during a step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F

_BUILD_BATCH_INVARIANT: ContextVar[bool] = ContextVar(
    "pagedserve_build_batch_invariant", default=False
)


@contextmanager
def batch_invariant_layers(enabled: bool) -> Iterator[None]:
    """Build the layers constructed inside to run their kernels batch invariantly (or not)."""
    token = _BUILD_BATCH_INVARIANT.set(enabled)
    try:
        yield
    finally:
        _BUILD_BATCH_INVARIANT.reset(token)


def building_batch_invariant() -> bool:
    """Whether the layer being constructed now is to run batch invariantly."""
    return _BUILD_BATCH_INVARIANT.get()


# A row this long (in floats) is whole vectors for torch's CPU elementwise kernels at any vector
# width up to AVX-512's (their loop takes two vectors at a time).
VECTOR_ROW = 64
# torch runs an elementwise op of fewer values than this (at::internal::GRAIN_SIZE) in one
# thread; a larger one is cut among the threads wherever the division falls.
SERIAL_VALUES = 32768


def on_whole_vectors(op: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``op(x)`` for an elementwise op (``torch.sigmoid``) over ``x [T, n]``, each row computed
    by the same code whatever ``T``. torch's elementwise kernels on a CPU run a tensor's whole
    vectors with vector code and its last elements with scalar libm, which may round one ulp
    differently; in a ``[T, 8]`` router's scores the last tokens of a batch would land on the
    scalar tail and the same tokens in a longer batch would not. Rows padded (with zeros) to a
    multiple of ``VECTOR_ROW`` all land on vector code, and the op runs on slabs of whole rows
    small enough for one thread (three threads would cut a large tensor mid-row, and the end of
    each thread's share would take the scalar code again)."""
    width = x.shape[-1]
    padded = F.pad(x, (0, -width % VECTOR_ROW))
    slab = max(1, SERIAL_VALUES // padded.shape[-1])
    return torch.cat([op(rows) for rows in padded.split(slab)])[..., :width]
