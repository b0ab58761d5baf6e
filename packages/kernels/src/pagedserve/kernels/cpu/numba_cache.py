"""numba's disk cache for pagedserve's kernels, invalidated by an edit to any of them.

``@numba.njit(cache=True)`` keys a compiled function on its own source file alone (a hash of
that file). But a compiled function carries the machine code of every jitted function it
calls, inlined or linked in: the fused decoder layer carries the GEMM, the small ops and the
attention, the attention carries its tile loops, from other files. After an edit to a
callee's file, numba would load the caller's stale code from disk: in a working tree the edit
silently does nothing, and a package upgraded in place over an old ``__pycache__`` could run
the old kernels under the new wrappers.

Here every cached function of ``pagedserve.kernels`` is stamped with one hash over all the
package's files that use numba (their names and contents): an edit to any of them recompiles
them all once (a minute or two), and nothing stale is ever loaded. The locators are numba's
own (in the package's ``__pycache__``, under ``NUMBA_CACHE_DIR`` when that is set, or in the
user's cache directory when the package's is read-only) with the stamp replaced; functions
outside this package keep numba's rules. Every module here that caches imports this one
before its first ``@numba.njit``, since numba picks a function's locator when it decorates.
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path

from numba.core import caching

KERNELS_DIR = Path(__file__).resolve().parent


@cache
def _stamp(directory: Path, files: tuple[tuple[str, float, int], ...]) -> str:
    digest = hashlib.sha256()
    for name, _, _ in files:
        source = (directory / name).read_bytes()
        if b"numba" in source:
            digest.update(name.encode() + b"\0" + source)
    return digest.hexdigest()


def numba_sources_stamp(directory: Path = KERNELS_DIR) -> str:
    """A hash of every ``.py`` file of the package (``directory``) that mentions numba, re-read
    only when a file's name, mtime or size changes (numba asks for the stamp of every cached
    function)."""
    files = []
    for path in sorted(directory.glob("*.py")):
        st = path.stat()
        files.append((path.name, st.st_mtime, st.st_size))
    return _stamp(directory, tuple(files))


def stamps(py_file: str) -> bool:
    """Whether a function defined in ``py_file`` takes the package-wide stamp (this package's
    files only; numba's own rules elsewhere)."""
    return Path(py_file).resolve().parent == KERNELS_DIR


def source_stamp_of(dispatcher):
    """The source stamp numba keys a compiled function's disk cache on (its locator's; numba
    keeps that behind its cache objects), or None for a function without a disk cache."""
    impl = getattr(dispatcher._cache, "_impl", None)
    return None if impl is None else impl._locator.get_source_stamp()


class _KernelsStamp:
    """A locator mixin: this package's functions only, stamped with the shared hash."""

    @classmethod
    def from_function(cls, py_func, py_file):
        if not stamps(py_file):
            return None
        return super().from_function(py_func, py_file)

    def get_source_stamp(self):
        return numba_sources_stamp()


class _UserProvidedLocator(_KernelsStamp, caching.UserProvidedCacheLocator):
    pass


class _InTreeLocator(_KernelsStamp, caching.InTreeCacheLocator):
    pass


class _UserWideLocator(_KernelsStamp, caching.UserWideCacheLocator):
    pass


def _register() -> None:
    """Put the three locators first, in numba's own order (idempotent)."""
    locators = caching.CacheImpl._locator_classes
    if _InTreeLocator not in locators:
        locators[:0] = [_UserProvidedLocator, _InTreeLocator, _UserWideLocator]


_register()
