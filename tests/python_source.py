"""``ast.parse`` for the tests that read the source tree (house rules, layering).

CPython 3.11 keeps the AST constructor's recursion counter in state that any other
``ast.parse`` shares; a garbage-collector finalizer that runs one in the middle (a log record's
traceback formatting does) fails the outer parse with "SystemError: AST constructor recursion
depth mismatch". Pausing the collector for the parse keeps finalizers out of it.
"""

from __future__ import annotations

import ast
import gc


def parse_source(source: str, filename: str = "<unknown>") -> ast.Module:
    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(source, filename=filename)
    finally:
        if enabled:
            gc.enable()
