"""Imports flow one way: every ``import`` in a member's source keeps to the package map.

The map (docs/architecture.md draws it): cluster -> server, engine; server -> engine; engine -> scheduler, models, kernels,
blockmgr; scheduler -> blockmgr; models -> kernels; blockmgr and kernels import no other member.
blockmgr and the scheduler are host bookkeeping, so they import no torch or triton (and the
scheduler no numba either). The check reads the source (AST), not ``sys.modules``, so it sees
imports inside functions and behind ``TYPE_CHECKING`` as well as at the top of a file, relative
imports, and ``importlib.import_module("...")`` with a literal name.
"""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from python_source import parse_source

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ROOT / "packages"

ALLOWED_MEMBERS: dict[str, set[str]] = {
    "kernels": set(),
    "blockmgr": set(),
    "scheduler": {"blockmgr"},
    "models": {"kernels"},
    "engine": {"scheduler", "models", "kernels", "blockmgr"},
    "server": {"engine"},
    "cluster": {"server", "engine"},
}
FORBIDDEN_LIBRARIES: dict[str, set[str]] = {
    "blockmgr": {"torch", "triton"},
    "scheduler": {"torch", "triton", "numba"},
}


@dataclass(frozen=True)
class Violation:
    path: Path
    lineno: int
    member: str
    imported: str

    def __str__(self) -> str:
        return f"{self.path}:{self.lineno}: pagedserve.{self.member} imports {self.imported}"


def members(packages_dir: Path) -> dict[str, Path]:
    """Each member's name and the folder of its ``pagedserve.<name>`` source."""
    return {d.name: d for d in sorted(packages_dir.glob("*/src/pagedserve/*")) if d.is_dir()}


def imported_modules(path: Path, package: str) -> list[tuple[int, str]]:
    """``(line, absolute module name)`` of every import in one file; ``package`` is the file's
    own package (``pagedserve.engine.distributed``), which relative imports start from."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(parse_source(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve_from(node, package)
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
        elif _is_dynamic_import(node):
            found.append((node.lineno, node.args[0].value))
    return found


def _resolve_from(node: ast.ImportFrom, package: str) -> str:
    if node.level == 0:
        return node.module or ""
    parts = package.split(".")
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_dynamic_import(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call) or not node.args:
        return False
    func = ast.unparse(node.func)
    first = node.args[0]
    is_literal = isinstance(first, ast.Constant) and isinstance(first.value, str)
    return func in ("importlib.import_module", "import_module", "__import__") and is_literal


def _package_of(path: Path, src: Path, member: str) -> str:
    """The package a file's relative imports start from: its folder as a dotted name."""
    return ".".join(("pagedserve", member, *path.relative_to(src).parent.parts))


def import_violations(packages_dir: Path) -> list[Violation]:
    """Every import under ``packages_dir/<member>/src/pagedserve/<member>`` against the map."""
    found: list[Violation] = []
    for member, src in members(packages_dir).items():
        allowed = ALLOWED_MEMBERS.get(member, set()) | {member}
        forbidden = FORBIDDEN_LIBRARIES.get(member, set())
        for path in sorted(src.rglob("*.py")):
            for lineno, module in imported_modules(path, _package_of(path, src, member)):
                parts = module.split(".")
                other = parts[1] if parts[0] == "pagedserve" and len(parts) > 1 else None
                if (other is not None and other not in allowed) or parts[0] in forbidden:
                    imported = f"pagedserve.{other}" if other else parts[0]
                    found.append(Violation(path, lineno, member, imported))
    return list(dict.fromkeys(found))  # `from a.b import c` names a.b and a.b.c: report once


# ---- the real tree ----------------------------------------------------------------------


@pytest.mark.parametrize("member", ALLOWED_MEMBERS)
def test_member_imports_follow_the_map(member):
    broken = [v for v in import_violations(PACKAGES) if v.member == member]
    assert not broken, "imports against the package map:\n" + "\n".join(map(str, broken))


def test_every_member_is_on_the_map():
    assert set(members(PACKAGES)) == set(ALLOWED_MEMBERS)


def _declared_members(member: str) -> set[str]:
    project = tomllib.loads((PACKAGES / member / "pyproject.toml").read_text())["project"]
    names = (d.split(";")[0].strip() for d in project.get("dependencies", []))
    return {n.removeprefix("pagedserve-") for n in names if n.startswith("pagedserve-")}


def _imported_members(member: str) -> set[str]:
    src = members(PACKAGES)[member]
    found = set()
    for path in src.rglob("*.py"):
        for _, module in imported_modules(path, _package_of(path, src, member)):
            parts = module.split(".")
            if parts[0] == "pagedserve" and len(parts) > 1 and parts[1] != member:
                found.add(parts[1])
    return found


@pytest.mark.parametrize("member", sorted(ALLOWED_MEMBERS))
def test_declared_member_dependencies_are_the_members_imported(member):
    """A member's pyproject names exactly the members it imports (edges against the map are
    test_member_imports_follow_the_map's to report), and none the map forbids."""
    declared = _declared_members(member)
    assert declared == _imported_members(member) & ALLOWED_MEMBERS[member]
    assert declared <= ALLOWED_MEMBERS[member]


def test_pagedserve_is_a_namespace_and_the_kernel_suite_is_no_package():
    """No member ships ``pagedserve/__init__.py`` (PEP 420), and kernels/ (the suite) has no
    ``__init__.py``: transformers probes ``import kernels`` and breaks on finding ours."""
    assert not list(PACKAGES.glob("*/src/pagedserve/__init__.py"))
    assert not list((ROOT / "kernels").rglob("__init__.py"))


# ---- the checker itself, on synthetic trees -----------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    """``{"server/app.py": source}`` -> packages/server/src/pagedserve/server/app.py."""
    for name, source in files.items():
        member, _, rest = name.partition("/")
        path = tmp_path / member / "src" / "pagedserve" / member / rest
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return tmp_path


def _reported(tmp_path: Path, files: dict[str, str]) -> set[tuple[str, str]]:
    return {(v.member, v.imported) for v in import_violations(_tree(tmp_path, files))}


def test_checker_passes_a_tree_that_keeps_to_the_map(tmp_path):
    files = {
        "server/app.py": "from pagedserve.engine import AsyncLLM\n",
        "engine/runner.py": "import torch\nfrom pagedserve.models import load_model\n"
        "from pagedserve.scheduler import Scheduler\nimport pagedserve.kernels.sampling\n"
        "from pagedserve.blockmgr import KVCacheManager\nfrom . import config\n",
        "engine/distributed/worker.py": "from ..runner import ModelRunner\n",
        "scheduler/core.py": "from pagedserve.blockmgr import KVCacheManager\nimport numpy\n",
        "models/llama.py": "from pagedserve.kernels import rms_norm\nimport torch\n",
        "blockmgr/pool.py": "import numpy as np\nimport numba\n",
        "kernels/store_kv.py": "import torch\nimport triton\n",
    }
    assert _reported(tmp_path, files) == set()


def test_checker_reports_server_importing_models(tmp_path):
    files = {
        "server/chat.py": "from pagedserve.engine import AsyncLLM\n\n\n"
        "from pagedserve.models import load_tokenizer\n"
    }
    (violation,) = import_violations(_tree(tmp_path, files))
    assert (violation.member, violation.imported, violation.lineno) == (
        "server",
        "pagedserve.models",
        4,
    )
    assert violation.path.name == "chat.py"


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (
            {"server/cli.py": "def main():\n    from pagedserve.models import x\n"},
            "pagedserve.models",
        ),
        ({"server/cli.py": "import pagedserve.scheduler.request\n"}, "pagedserve.scheduler"),
        ({"server/cli.py": "from pagedserve import blockmgr\n"}, "pagedserve.blockmgr"),
        ({"models/a.py": "from pagedserve.engine import LLM\n"}, "pagedserve.engine"),
        ({"models/layers/a.py": "from ...scheduler import Request\n"}, "pagedserve.scheduler"),
        (
            {"kernels/a.py": "from pagedserve.blockmgr import KVCacheManager\n"},
            "pagedserve.blockmgr",
        ),
        ({"blockmgr/a.py": "from pagedserve.scheduler import Request\n"}, "pagedserve.scheduler"),
        ({"blockmgr/a.py": "from pagedserve.kernels import copy_blocks\n"}, "pagedserve.kernels"),
        ({"scheduler/a.py": "from pagedserve.models import ModelConfig\n"}, "pagedserve.models"),
        ({"engine/a.py": "from pagedserve.server import app\n"}, "pagedserve.server"),
        ({"blockmgr/a.py": "def f():\n    import torch\n"}, "torch"),
        ({"blockmgr/a.py": "from triton import language\n"}, "triton"),
        ({"scheduler/a.py": "import torch.nn\n"}, "torch"),
        ({"scheduler/a.py": "from numba import njit\n"}, "numba"),
        ({"scheduler/a.py": "import importlib\nimportlib.import_module('torch')\n"}, "torch"),
    ],
)
def test_checker_reports_each_kind_of_import(tmp_path, files, expected):
    member = next(iter(files)).partition("/")[0]
    assert _reported(tmp_path, files) == {(member, expected)}
