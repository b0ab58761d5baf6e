"""The one place that decides, per call, whether a kernel runs in Triton or in PyTorch.

Triton runs on CUDA tensors and, under ``TRITON_INTERPRET=1``, on CPU tensors through
Triton's interpreter (that is how CI exercises the kernels without a GPU). Everywhere else
the plain-PyTorch reference runs: it is the CPU engine's real path, not a fallback.

``PAGEDSERVE_KERNELS=ref`` or ``=triton`` forces a path. The environment is read on every
call (a dictionary lookup) so that tests can flip it without re-importing anything.
"""

from __future__ import annotations

import os

import torch

_FORCE_ENV = "PAGEDSERVE_KERNELS"


def use_triton(t: torch.Tensor) -> bool:
    """True when the Triton kernel should handle a call whose main operand is ``t``."""
    forced = os.environ.get(_FORCE_ENV, "").strip().lower()
    if forced == "ref":
        return False
    if forced == "triton":
        return True
    if forced not in ("", "auto"):
        raise ValueError(f"{_FORCE_ENV}={forced!r}: expected 'ref', 'triton' or unset")
    return t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"
