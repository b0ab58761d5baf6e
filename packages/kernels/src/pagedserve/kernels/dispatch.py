"""The one place that decides, per call, which implementation of a kernel runs.

- Triton on CUDA tensors and, under ``TRITON_INTERPRET=1``, on CPU tensors through Triton's
  interpreter (that is how CI exercises the kernels without a GPU);
- on CPU otherwise, the numba path where a kernel has one (paged attention) and numba is
  installed, else the plain-PyTorch reference: together they are the CPU engine's real path.

``PAGEDSERVE_KERNELS=ref``, ``=numba`` or ``=triton`` forces a path; a kernel without a numba
path (or a CUDA tensor) runs its reference when numba is forced. The environment is read on
every call so that tests can flip it without re-importing anything: from the dictionary
behind ``os.environ`` (:func:`_getenv`), since a CPU decode step asks ~300 times.

It is also the one place where a launch wrapper asks whether it launches for a GPU
(:func:`is_cuda`) and how many SMs that GPU has (:func:`multi_processor_count`). The
ahead-of-time compile check runs the real wrappers on CPU tensors inside
:func:`taken_as_cuda`, so every choice a wrapper makes for CUDA (the tensor-core attention
branch, the split-KV count) is the one it compiles.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache
from typing import Literal

import torch

_FORCE_ENV = "PAGEDSERVE_KERNELS"
KernelPath = Literal["triton", "numba", "ref"]

# The SM count of the GPU that CPU tensors stand for, inside taken_as_cuda(); None outside.
_STAND_IN_SMS: ContextVar[int | None] = ContextVar("pagedserve_stand_in_sms", default=None)


@cache
def numba_available() -> bool:
    """numba is importable (it is a declared dependency; a stripped install may lack it)."""
    return importlib.util.find_spec("numba") is not None


# os.environ keeps its variables in this dict (encoded names and values; setenv and pytest's
# monkeypatch update it). os.environ.get costs ~0.5 us (encode the name, decode the value): at
# two reads per kernel call, ~0.6 ms of a 30 ms batch-1 decode step on CPU.
_ENVIRON_DATA = getattr(os.environ, "_data", None)


def _getenv(name: str, encoded: bytes) -> str:
    """``os.environ.get(name, "")``; when unset (the usual case), one dictionary lookup."""
    if _ENVIRON_DATA is None:  # not CPython's POSIX os.environ
        return os.environ.get(name, "")
    value = _ENVIRON_DATA.get(encoded)
    return "" if value is None else os.fsdecode(value)


def kernel_path(t: torch.Tensor, has_numba: bool = False) -> KernelPath:
    """Which implementation handles a call whose main operand is ``t``; ``has_numba`` says
    whether the kernel has a numba path."""
    forced = _getenv(_FORCE_ENV, b"PAGEDSERVE_KERNELS")
    if forced:
        forced = forced.strip().lower()
    if forced in ("ref", "triton"):
        return forced
    cuda = is_cuda(t)
    numba_ok = has_numba and not cuda and numba_available()
    if forced == "numba":
        return "numba" if numba_ok else "ref"
    if forced not in ("", "auto"):
        raise ValueError(f"{_FORCE_ENV}={forced!r}: expected 'ref', 'numba', 'triton' or unset")
    if cuda or _getenv("TRITON_INTERPRET", b"TRITON_INTERPRET") == "1":
        return "triton"
    return "numba" if numba_ok else "ref"


def use_triton(t: torch.Tensor) -> bool:
    """True when the Triton kernel should handle a call whose main operand is ``t``."""
    return kernel_path(t) == "triton"


def is_cuda(t: torch.Tensor) -> bool:
    """Whether a wrapper launching on ``t`` takes its CUDA choices (see :func:`taken_as_cuda`)."""
    return t.is_cuda or _STAND_IN_SMS.get() is not None


def multi_processor_count(t: torch.Tensor) -> int:
    """SMs of the GPU that ``t`` lives on (or that it stands for)."""
    stand_in = _STAND_IN_SMS.get()
    if stand_in is not None:
        return stand_in
    return torch.cuda.get_device_properties(t.device).multi_processor_count


@contextmanager
def taken_as_cuda(multi_processor_count: int) -> Iterator[None]:
    """Within this block, launch wrappers decide for CPU tensors as they would for tensors on a
    GPU with ``multi_processor_count`` SMs. For the compile check and the kernel warm-up test:
    the launches they make must be those a real GPU would get."""
    token = _STAND_IN_SMS.set(multi_processor_count)
    try:
        yield
    finally:
        _STAND_IN_SMS.reset(token)
