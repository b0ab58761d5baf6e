"""The docs site builds with --strict, documents every engine option, and shows tutorials faithfully."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "build_docs"))

from tutorial_pages import find_tutorials, render_tutorial, split_tutorial  # noqa: E402


def test_mkdocs_build_strict(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1", HF_HUB_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for path in find_tutorials(ROOT):
        page = tmp_path / "tutorials" / path.stem / "index.html"
        assert page.is_file(), f"{path.name} was not rendered into the site"
    config_page = (tmp_path / "configuration" / "index.html").read_text()
    assert "pagedserve generate" in config_page and "--max-num-seqs" in config_page
    assert_works_offline(tmp_path)


def assert_works_offline(site: Path) -> None:
    """No page loads a script, a stylesheet or a font from elsewhere (no CDN: many deployments
    reach none), and the pages with diagrams load mermaid's bundle from the site itself."""
    external = re.compile(r'<(?:script[^>]*\ssrc|link[^>]*\shref)="(?:https?:)?//[^"]*"')
    for page in site.rglob("*.html"):
        html = page.read_text(encoding="utf-8")
        links = [m for m in external.findall(html) if "stylesheet" in m or "<script" in m]
        assert not links, f"{page.relative_to(site)} loads {links}"
        assert "fonts.googleapis.com" not in html, page
        if 'class="mermaid"' in html:
            assert "javascripts/mermaid.min.js" in html, page


def test_every_engine_and_server_option_is_in_the_configuration_reference():
    from pagedserve.engine import EngineArgs
    from pagedserve.server.config import ServerConfig

    page = (ROOT / "docs" / "configuration.md").read_text()
    rows = {
        line.split("|")[1].strip().strip("`")
        for line in page.splitlines()
        if line.startswith("| `")
    }
    names = [f.name for f in fields(EngineArgs)] + [f.name for f in fields(ServerConfig)]
    missing = [name for name in names if name not in rows]
    assert not missing, f"docs/configuration.md lacks rows for {missing}"


LESSON = '''"""A lesson title.

What it teaches.
"""

# Prose before code,
# over two lines.
#
# A second paragraph.

import math

radius = 2.0  # an inline comment stays in the code
area = math.pi * radius**2

# More prose.
print(f"area = {area:.2f}")
'''


def test_split_tutorial_keeps_prose_and_code_apart_and_in_order():
    blocks = split_tutorial(LESSON)
    assert [b.kind for b in blocks] == ["prose", "prose", "code", "prose", "code"]
    assert blocks[0].text.startswith("A lesson title.")
    assert blocks[1].text == "Prose before code,\nover two lines.\n\nA second paragraph."
    assert "# an inline comment" in blocks[2].text
    assert blocks[4].text == 'print(f"area = {area:.2f}")'


def test_indented_comment_runs_after_a_blank_line_are_prose():
    source = '"""T."""\n\nwith open(__file__) as f:\n    text = f.read()\n\n    # Explained here.\n    n = len(text)  # inline\n    # hugging comment\n    print(n)\n'
    blocks = split_tutorial(source)
    assert [b.kind for b in blocks] == ["prose", "code", "prose", "code"]
    assert blocks[2].text == "Explained here."
    assert blocks[3].text == "    n = len(text)  # inline\n    # hugging comment\n    print(n)"


def _code_lines(text: str) -> list[str]:
    """Lines that are neither blank nor comment-only."""
    return [line for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


@pytest.mark.parametrize("path", find_tutorials(ROOT), ids=lambda p: p.stem)
def test_rendered_tutorial_holds_every_line_of_code(path):
    """Every code line of the script appears, in order, inside the page's code blocks."""
    page = render_tutorial(path, f"tutorials/{path.name}")
    code_in_page = "\n".join(chunk.split("```", 1)[0] for chunk in page.split("```python\n")[1:])
    source = path.read_text().split('"""', 2)[2]
    assert _code_lines(code_in_page) == _code_lines(source)
