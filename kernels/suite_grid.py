"""The one switch that sizes the kernel suite's grid, and the device and dtypes it runs on.

``PAGEDSERVE_KERNEL_GRID=tiny|full``: tiny by default on CPU (the interpreter costs
milliseconds per program), full by default on CUDA. bf16 runs on CUDA only: numpy, under
the interpreter, has no bf16 arithmetic.
"""

from __future__ import annotations

import os

import torch

GRID_ENV = "PAGEDSERVE_KERNEL_GRID"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GRID = os.environ.get(GRID_ENV, "full" if DEVICE == "cuda" else "tiny").strip().lower()
if GRID not in ("tiny", "full"):
    raise ValueError(f"{GRID_ENV}={GRID!r}: expected 'tiny' or 'full'")
FULL = GRID == "full"

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
DTYPE_NAMES = ",".join(str(d).removeprefix("torch.") for d in DTYPES)


def pick(tiny, full):
    """The tiny or the full variant of a grid axis."""
    return full if FULL else tiny
