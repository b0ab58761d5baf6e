"""The one place that decides, per call, which implementation of a kernel runs.

- Triton on CUDA tensors and, under ``TRITON_INTERPRET=1``, on CPU tensors through Triton's
  interpreter (that is how CI exercises the kernels without a GPU);
- on CPU otherwise, the numba path where a kernel has one (paged attention) and numba is
  installed, else the plain-PyTorch reference: together they are the CPU engine's real path.

``PAGEDSERVE_KERNELS=ref``, ``=numba`` or ``=triton`` forces a path; a kernel without a numba
path (or a CUDA tensor) runs its reference when numba is forced. The environment is read on
every call (a dictionary lookup) so that tests can flip it without re-importing anything.
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache
from typing import Literal

import torch

_FORCE_ENV = "PAGEDSERVE_KERNELS"
KernelPath = Literal["triton", "numba", "ref"]


@cache
def numba_available() -> bool:
    """numba is importable (it is a declared dependency; a stripped install may lack it)."""
    return importlib.util.find_spec("numba") is not None


def kernel_path(t: torch.Tensor, has_numba: bool = False) -> KernelPath:
    """Which implementation handles a call whose main operand is ``t``; ``has_numba`` says
    whether the kernel has a numba path."""
    forced = os.environ.get(_FORCE_ENV, "").strip().lower()
    if forced in ("ref", "triton"):
        return forced
    numba_ok = has_numba and not t.is_cuda and numba_available()
    if forced == "numba":
        return "numba" if numba_ok else "ref"
    if forced not in ("", "auto"):
        raise ValueError(f"{_FORCE_ENV}={forced!r}: expected 'ref', 'numba', 'triton' or unset")
    if t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return "triton"
    return "numba" if numba_ok else "ref"


def use_triton(t: torch.Tensor) -> bool:
    """True when the Triton kernel should handle a call whose main operand is ``t``."""
    return kernel_path(t) == "triton"
