"""Launches of the real launch wrappers, captured on a CPU for a GPU that is not here.

Triton compiles ahead of time for any target it is told about: a stand-in driver reports a
``GPUTarget`` (and nothing else a compile needs), so ``JITFunction.run(..., warmup=True)``
builds PTX/cubin (or AMD hsaco) with the very arguments a wrapper computed, without a device.

The wrappers run on CPU tensors inside ``dispatch.taken_as_cuda(sms)``, so every choice they
make from "is this CUDA?" (the tensor-core attention branch, the split-KV count from the SM
count) is the one the GPU gets. :func:`recording_launches` swaps each ``@triton.jit`` kernel
of ``pagedserve.kernels`` for a recorder while the wrappers run: it keeps the kernel, grid,
positional arguments and constexprs, and launches nothing. :func:`variant_key` asks Triton
itself (through its ``jit_cache_hook``) which compiled variant a launch needs: two launches
with one key share one binary, whatever their grids.

Needs kernels compiled, not interpreted: run it in a process without ``TRITON_INTERPRET=1``
(the suite's tests start one).
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

import pagedserve.kernels
from pagedserve.kernels.dispatch import taken_as_cuda

# Triton 3.9 warns on every compile that its FP-fusion default will change; compile with the
# default a serving process gets today (fused), and say so once, here.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")


@dataclass(frozen=True)
class Target:
    """A GPU to compile for: its Triton target, SM (CU) count and shared memory per block."""

    name: str
    gpu: str
    target: GPUTarget
    multi_processor_count: int
    max_shared_bytes: int


TARGETS = {
    t.name: t
    for t in (
        Target("sm80", "A100", GPUTarget("cuda", 80, 32), 108, 166912),  # 163 KB opt-in
        Target("sm90", "H100/H200", GPUTarget("cuda", 90, 32), 132, 232448),  # 227 KB
        Target("sm100", "B200", GPUTarget("cuda", 100, 32), 148, 232448),  # 227 KB
        Target("sm120", "RTX 5090", GPUTarget("cuda", 120, 32), 170, 101376),  # 99 KB
        Target("gfx942", "MI300X", GPUTarget("hip", "gfx942", 64), 304, 65536),  # 64 KB LDS
    )
}


class StandInDriver(DriverBase):
    """What a compile asks of a driver, answered for a target with no device behind it."""

    def __init__(self, target: Target) -> None:
        self.target = target

    @classmethod
    def is_active(cls) -> bool:
        return False  # never picked by Triton's own driver discovery

    def get_current_target(self) -> GPUTarget:
        return self.target.target

    def get_current_device(self) -> str:
        return f"stand-in:{self.target.name}"  # one JIT cache per target

    def get_current_stream(self, device) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise NotImplementedError("a stand-in driver builds no launcher")

    def get_benchmarker(self):
        raise NotImplementedError("a stand-in driver runs nothing")


@contextmanager
def compiling_for(target: Target) -> Iterator[None]:
    """Triton compiles for ``target`` and the wrappers decide as for its GPU, in this block."""
    previous = driver._active  # restored as it was: reset_active() would probe for a GPU
    driver.set_active(StandInDriver(target))
    try:
        with taken_as_cuda(target.multi_processor_count):
            yield
    finally:
        driver._active = previous


@dataclass
class Launch:
    """One kernel launch a wrapper made: enough to compile it, and where it came from."""

    kernel: JITFunction
    grid: tuple
    args: tuple
    kwargs: dict
    variant: str = ""

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__.strip("_").removesuffix("_kernel")

    @property
    def constexprs(self) -> dict:
        return dict(self.kwargs)

    @property
    def dtypes(self) -> list[str]:
        return [str(a.dtype).removeprefix("torch.") for a in self.args if torch.is_tensor(a)]


@dataclass
class _Recorder:
    """Stands in a kernel module for one ``@triton.jit`` kernel: ``kernel[grid](...)`` records."""

    kernel: JITFunction
    launches: list[Launch] = field(repr=False)

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            args = tuple(_as_compiled(a) for a in args)
            self.launches.append(Launch(self.kernel, tuple(grid), args, kwargs))

        return record


def _as_compiled(arg):
    """A tensor argument reduced to what a compile reads of it: its dtype and whether its
    pointer is 16-byte aligned (Triton specialises on both, on nothing else of a tensor), in a
    few bytes with the same misalignment. Holding the wrappers' real tensors (an 8B model's
    projections, 151k-token logits) for the whole capture took ~10 GB."""
    if not torch.is_tensor(arg):
        return arg
    misaligned = arg.data_ptr() % 16
    base = torch.empty(48, dtype=torch.uint8)
    start = (misaligned - base.data_ptr()) % 16
    return base[start : start + 16].view(arg.dtype)


def kernel_modules() -> list:
    """Every module of pagedserve.kernels (the package's __init__ re-exports functions whose
    names shadow their modules, so they are imported by full name)."""
    names = sorted(m.name for m in pkgutil.iter_modules(pagedserve.kernels.__path__))
    return [importlib.import_module(f"pagedserve.kernels.{name}") for name in names]


@contextmanager
def recording_launches() -> Iterator[list[Launch]]:
    """Within this block, every launch through a kernel module's jitted kernels is recorded
    instead of run. The originals are back on exit (the kernels' own helpers, such as
    ``_find_sequence``, must be the real functions when a recorded launch is compiled)."""
    launches: list[Launch] = []
    swapped = []
    for module in kernel_modules():
        for attr, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                swapped.append((module, attr, value))
                setattr(module, attr, _Recorder(value, launches))
    try:
        yield launches
    finally:
        for module, attr, value in swapped:
            setattr(module, attr, value)


@contextmanager
def jit_cache_keys() -> Iterator[list[tuple[str, str]]]:
    """Within this block, a jitted kernel that would compile records ``(kernel, key)`` and
    returns without compiling or launching (Triton's own ``jit_cache_hook``). The key is the
    one Triton caches binaries under: dtypes, constexprs and the specialisation of every
    argument (16-divisibility, alignment, ints equal to 1)."""
    keys: list[tuple[str, str]] = []

    def hook(*, key, fn, **_):
        keys.append((fn.name, str(key)))
        return True  # "handled": Triton skips the compile

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    try:
        yield keys
    finally:
        knobs.runtime.jit_cache_hook = previous


def variant_key(launch: Launch, target: Target) -> str:
    """The compiled variant ``launch`` needs on ``target``, as Triton keys it."""
    with compiling_for(target), jit_cache_keys() as keys:
        launch.kernel.run(*launch.args, grid=launch.grid, warmup=True, **launch.kwargs)
    assert len(keys) == 1, keys
    return keys[0][1]


def compile_launch(launch: Launch, target: Target):
    """Compile ``launch`` for ``target``; returns Triton's compiled kernel (no device used)."""
    with compiling_for(target):
        return launch.kernel.run(*launch.args, grid=launch.grid, warmup=True, **launch.kwargs)
