"""mkdocs hooks: render the tutorials into pages and the CLI's help into the configuration page.

Both are generated at build time from the code itself, so the site cannot drift from it:
- every tutorials/NN_topic.py becomes tutorials/NN_topic.md (see tutorial_pages.py) and is
  appended to the "Tutorials" section of the nav;
- the marker ``<!-- cli-help -->`` in a page is replaced by ``pagedserve <command> --help`` for
  every subcommand of the real argument parser.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mkdocs.structure.files import File

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tutorial_pages import find_tutorials, render_tutorial, tutorial_title  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
CLI_HELP_MARKER = "<!-- cli-help -->"


def on_config(config, **kwargs):
    """Append one nav entry per tutorial under the nav section titled "Tutorials"."""
    for entry in config["nav"] or []:
        if isinstance(entry, dict) and "Tutorials" in entry:
            section = entry["Tutorials"]
            for path in find_tutorials(REPO_ROOT):
                section.append({tutorial_title(path): f"tutorials/{path.stem}.md"})
    return config


def on_files(files, config, **kwargs):
    for path in find_tutorials(REPO_ROOT):
        content = render_tutorial(path, f"tutorials/{path.name}")
        files.append(File.generated(config, f"tutorials/{path.stem}.md", content=content))
    return files


def on_page_markdown(markdown, page, config, files, **kwargs):
    if CLI_HELP_MARKER in markdown:
        markdown = markdown.replace(CLI_HELP_MARKER, cli_help_markdown())
    return markdown


def cli_help_markdown() -> str:
    """``pagedserve <command> --help`` for every subcommand, as fenced text blocks."""
    from pagedserve.server.cli import build_parser

    parser = build_parser()
    parts = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                sub.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=100)
                parts.append(f"### `pagedserve {name}`\n\n```text\n{sub.format_help()}```")
    return "\n\n".join(parts)
