"""numba's disk cache for the kernels is stamped with every numba file of the package, so an
edit to a callee's file (the GEMM, the attention's tile loops) invalidates the cached callers
that carry its code (the fused decoder layer, the attention), not only its own functions."""

from __future__ import annotations

import importlib
import time

import numba
import pytest
from numba.core import caching

from pagedserve.kernels import numba_cache

NUMBA_MODULES = [
    "decoder_layer_numba", "dense_linear_numba", "int4_linear_numba", "layer_ops_numba",
    "paged_attention_numba", "paged_attention_numba_tile", "paged_attention_plan",
]  # fmt: skip


def _cached_dispatchers(module):
    for value in vars(module).values():
        if isinstance(value, numba.core.registry.CPUDispatcher) and value.__module__ == (
            module.__name__
        ):
            if isinstance(value._cache, caching.FunctionCache):  # cache=True
                yield value


@pytest.mark.parametrize("name", NUMBA_MODULES)
def test_every_cached_kernel_takes_the_package_wide_stamp(name):
    module = importlib.import_module(f"pagedserve.kernels.{name}")
    dispatchers = list(_cached_dispatchers(module))
    assert dispatchers, f"{name} has no cached kernels?"
    for dispatcher in dispatchers:
        locator = dispatcher._cache._impl._locator
        assert isinstance(locator, numba_cache._KernelsStamp), (dispatcher, type(locator))
        assert locator.get_source_stamp() == numba_cache.numba_sources_stamp()


def test_functions_outside_the_package_keep_numbas_rules(tmp_path):
    source = tmp_path / "elsewhere.py"
    source.write_text("def f():\n    return 1\n")
    namespace: dict = {}
    exec(compile(source.read_text(), str(source), "exec"), namespace)
    assert numba_cache._InTreeLocator.from_function(namespace["f"], str(source)) is None


def test_the_stamp_follows_every_numba_file_and_only_those(tmp_path, monkeypatch):
    monkeypatch.setattr(numba_cache, "_KERNELS_DIR", tmp_path)
    callee, caller, other = (tmp_path / n for n in ("callee.py", "caller.py", "other.py"))
    callee.write_text("import numba\nK = 1\n")
    caller.write_text("import numba\nfrom callee import K\n")
    other.write_text("import torch\n")
    before = numba_cache.numba_sources_stamp()
    other.write_text("import torch  # an edit elsewhere\n")
    assert numba_cache.numba_sources_stamp() == before
    time.sleep(0.01)  # a new mtime even on coarse clocks (the size changes anyway)
    callee.write_text("import numba\nK = 2\n")  # the callee's file alone
    assert numba_cache.numba_sources_stamp() != before
