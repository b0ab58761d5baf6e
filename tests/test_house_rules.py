"""House rules a reader can count: no function over 60 lines (``@triton.jit`` kernels excepted:
a kernel is one launch and reads best whole), and no file over 400 lines in packages/ unless
its module docstring says why it is one idea all the same (a paragraph that starts "Why one
file:"), and none over 600.

A function's length runs from its ``def`` line to its last line, docstring included,
decorators not; a nested function counts inside its parent and on its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from python_source import parse_source

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ROOT / "packages"
MAX_FUNCTION_LINES = 60
MAX_FILE_LINES = 400
MAX_EXPLAINED_FILE_LINES = 600


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int, int]]:
    """``(qualified name, def line, length)`` of each function over ``limit`` lines."""
    found: list[tuple[str, int, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = prefix + child.name
                length = child.end_lineno - child.lineno + 1
                if length > limit and not _is_triton_jit(child):
                    found.append((name, child.lineno, length))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(parse_source(source), "")
    return found


def _is_triton_jit(func: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """``@triton.jit`` or ``@triton.jit(...)``, alone or under other decorators (autotune)."""
    for decorator in func.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if ast.unparse(target) == "triton.jit":
            return True
    return False


def _name(path: Path) -> str:
    """packages/engine/src/pagedserve/engine/x.py -> pagedserve/engine/x.py"""
    return Path(*path.relative_to(PACKAGES).parts[2:]).as_posix()


SOURCES = sorted(PACKAGES.glob("*/src/**/*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=_name)
def test_a_file_past_400_lines_says_why_it_is_one_idea(path):
    source = path.read_text()
    lines = len(source.splitlines())
    if lines <= MAX_FILE_LINES:
        return
    assert lines <= MAX_EXPLAINED_FILE_LINES, f"{path}: {lines} lines: two ideas at least"
    docstring = ast.get_docstring(parse_source(source)) or ""
    assert "Why one file:" in docstring, (
        f"{path}: {lines} lines; past {MAX_FILE_LINES} it is two ideas, or its docstring says "
        "why not (a paragraph that starts 'Why one file:')"
    )


@pytest.mark.parametrize("path", SOURCES, ids=_name)
def test_functions_are_at_most_60_lines(path):
    offenders = long_functions(path.read_text())
    assert not offenders, "\n".join(f"{path}:{line}: {n} is {k} lines" for n, line, k in offenders)


def test_the_rules_cover_every_member():
    assert {p.relative_to(PACKAGES).parts[0] for p in SOURCES} >= {
        "kernels",
        "blockmgr",
        "scheduler",
        "models",
        "engine",
        "server",
    }


# ---- the counting itself ------------------------------------------------------------------


def _function(name: str, lines: int, decorator: str = "") -> str:
    """A function of exactly ``lines`` lines (def line included), optionally decorated."""
    body = "".join(f"    x{i} = {i}\n" for i in range(lines - 1))
    return (decorator + "\n" if decorator else "") + f"def {name}():\n{body}"


def test_a_function_of_61_lines_is_reported_and_one_of_60_is_not():
    source = _function("ok", 60) + "\n\n" + _function("too_long", 61)
    assert long_functions(source) == [("too_long", 63, 61)]


def test_methods_and_nested_functions_are_counted_by_qualified_name():
    method = _function("step", 61).replace("\n", "\n    ")
    source = "class LLMEngine:\n    " + method + "\n"
    assert [name for name, _, _ in long_functions(source)] == ["LLMEngine.step"]
    outer = "def outer():\n    " + _function("inner", 61).replace("\n", "\n    ") + "\n"
    assert [name for name, _, _ in long_functions(outer)] == ["outer", "outer.inner"]


@pytest.mark.parametrize(
    "decorator",
    ["@triton.jit", "@triton.jit(do_not_specialize=['n'])", "@triton.autotune([])\n@triton.jit"],
)
def test_triton_kernels_are_exempt(decorator):
    assert long_functions(_function("_kernel", 100, decorator)) == []


def test_other_decorators_are_not_exempt():
    assert [n for n, _, _ in long_functions(_function("f", 61, "@torch.inference_mode()"))] == ["f"]


def test_test_modules_have_unique_basenames():
    """tests/ has no __init__.py files, so pytest imports each test module by its basename: two
    files of one name in different folders stop the whole run at collection."""
    seen: dict[str, Path] = {}
    clashes = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if path.name in seen:
            clashes.append(f"{seen[path.name].relative_to(ROOT)} and {path.relative_to(ROOT)}")
        seen.setdefault(path.name, path)
    assert not clashes, clashes
