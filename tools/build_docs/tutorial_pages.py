"""Turn the runnable tutorials (tutorials/NN_topic.py) into Markdown pages for the docs site.

A tutorial is a Python script written as a lesson: its module docstring is the introduction, and
runs of full-line comments at the left margin are the prose between pieces of code. This module
splits a script into those two kinds of block, so the rendered page reads as the script does,
top to bottom, and every line of code on the page is a line that CI runs.

Invariant: concatenating the code blocks of a page gives back every non-prose line of the script,
in order (tests/docs checks it), so the page can never show code that the script does not run.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

TUTORIAL_GLOB = "[0-9][0-9]_*.py"


@dataclass
class Block:
    kind: str  # "prose" or "code"
    text: str


def tutorial_title(path: Path) -> str:
    """The first line of the module docstring, else the file name made readable."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    if doc:
        return doc.strip().splitlines()[0].rstrip(".")
    return path.stem[3:].replace("_", " ").capitalize()


def _split_docstring(source: str) -> tuple[str, list[str]]:
    """(module docstring, the source lines after it)."""
    tree = ast.parse(source)
    lines = source.splitlines()
    first = tree.body[0] if tree.body else None
    is_doc = (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    )
    if not is_doc:
        return "", lines
    return ast.get_docstring(tree) or "", lines[first.end_lineno :]


def _comment_text(line: str) -> str | None:
    """The text of a full-line comment (any indentation), or None for code, blanks, directives."""
    stripped = line.strip()
    if not (stripped.startswith("# ") or stripped == "#"):
        return None
    if re.match(r"#\s*(noqa|type:|fmt:)", stripped):
        return None
    return stripped[2:]


def split_tutorial(source: str) -> list[Block]:
    """The docstring, then alternating prose and code blocks, in file order.

    A run of full-line comments is prose when it starts the file or follows a blank line, at any
    indentation (a lesson may go on inside a ``with`` block); a comment that hugs the code above
    it stays in the code, where it explains that line.
    """
    doc, lines = _split_docstring(source)
    blocks: list[Block] = [Block("prose", doc)] if doc else []
    kind, current = None, []

    def flush() -> None:
        text = "\n".join(current).strip("\n")
        if text:
            blocks.append(Block(kind, text))
        current.clear()

    previous_blank = True
    for line in lines:
        comment = _comment_text(line)
        if comment is not None and (kind == "prose" or previous_blank):
            if kind != "prose":
                flush()
                kind = "prose"
            current.append(comment)
        elif not line.strip() and kind == "prose":
            current.append("")  # a blank line ends a paragraph but not the prose run
        else:
            if kind != "code":
                flush()
                kind = "code"
            current.append(line)
        previous_blank = not line.strip()
    flush()
    return blocks


def render_tutorial(path: Path, repo_relative: str) -> str:
    """The Markdown page of one tutorial."""
    blocks = split_tutorial(path.read_text(encoding="utf-8"))
    title = tutorial_title(path)
    parts = [
        f"# {title}",
        f'!!! tip "Run it"\n    `.venv/bin/python {repo_relative}` — every line below is '
        "in that script, and CI runs it.",
    ]
    for index, block in enumerate(blocks):
        if block.kind == "code":
            parts.append(f"```python\n{block.text}\n```")
        elif index == 0:
            parts.append(_drop_first_line(block.text))
        else:
            parts.append(block.text)
    return "\n\n".join(p for p in parts if p.strip()) + "\n"


def _drop_first_line(text: str) -> str:
    """The docstring without its first line, which is already the page title."""
    return "\n".join(text.splitlines()[1:]).strip()


def find_tutorials(repo_root: Path) -> list[Path]:
    return sorted((repo_root / "tutorials").glob(TUTORIAL_GLOB))
