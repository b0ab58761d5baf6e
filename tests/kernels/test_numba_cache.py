"""numba's disk cache for the kernels is stamped with every numba file of the package, so an
edit to a callee's file (the GEMM, the attention's tile loops) invalidates the cached callers
that carry its code (the fused decoder layer, the attention), not only its own functions."""

from __future__ import annotations

import importlib
import time

import numba
import pytest

from pagedserve.kernels.cpu import numba_cache

NUMBA_MODULES = [
    "cache_rows", "decoder_layer", "dense_linear", "gguf_blocks", "gguf_linear", "integer_dot",
    "layer_ops",
    "paged_attention", "paged_attention_tile", "paged_attention_plan",
]  # fmt: skip


def _cached_stamps(module) -> list:
    """The disk-cache stamp of each of the module's own compiled functions with a cache."""
    stamps = []
    for value in vars(module).values():
        if isinstance(value, numba.core.registry.CPUDispatcher) and value.__module__ == (
            module.__name__
        ):
            stamp = numba_cache.source_stamp_of(value)
            if stamp is not None:  # @njit(cache=True)
                stamps.append(stamp)
    return stamps


@pytest.mark.parametrize("name", NUMBA_MODULES)
def test_every_cached_kernel_takes_the_package_wide_stamp(name):
    module = importlib.import_module(f"pagedserve.kernels.cpu.{name}")
    stamps = _cached_stamps(module)
    assert stamps, f"{name} has no cached kernels?"
    assert set(stamps) == {numba_cache.numba_sources_stamp()}


def test_functions_outside_the_package_keep_numbas_rules(tmp_path):
    assert not numba_cache.stamps(str(tmp_path / "elsewhere.py"))
    assert numba_cache.stamps(numba_cache.__file__)


def test_the_stamp_follows_every_numba_file_and_only_those(tmp_path):
    callee, caller, other = (tmp_path / n for n in ("callee.py", "caller.py", "other.py"))
    callee.write_text("import numba\nK = 1\n")
    caller.write_text("import numba\nfrom callee import K\n")
    other.write_text("import torch\n")
    before = numba_cache.numba_sources_stamp(tmp_path)
    other.write_text("import torch  # an edit elsewhere\n")
    assert numba_cache.numba_sources_stamp(tmp_path) == before
    time.sleep(0.01)  # a new mtime even on coarse clocks (the size changes anyway)
    callee.write_text("import numba\nK = 2\n")  # the callee's file alone
    assert numba_cache.numba_sources_stamp(tmp_path) != before
