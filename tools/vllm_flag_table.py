"""Writes the table of vLLM's `vllm serve` flags in docs/configuration.md from what
`pagedserve serve --help` shows (pagedserve.server.vllm_flags says why for each flag;
pagedserve.server.vllm_flag_inventory lists them).

    python tools/vllm_flag_table.py           # rewrite the table between its markers
    python tools/vllm_flag_table.py --check   # exit 1 when the page's table is not the help's

tests/server/test_vllm_flags.py runs the same comparison, so a flag added to or removed from the
command line fails the suite until the table is written again.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from pagedserve.server.vllm_flag_inventory import flag_table

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
BEGIN, END = "<!-- vllm-flags:begin -->", "<!-- vllm-flags:end -->"


def serve_help() -> str:
    """The text of `pagedserve serve --help`, from the command line itself."""
    command = [sys.executable, "-m", "pagedserve.server.cli", "serve", "--help"]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout


def page_table(page: str) -> str:
    """The table between the markers of ``page``."""
    return page.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args()
    page = PAGE.read_text()
    table = flag_table(serve_help())
    if args.check:
        same = page_table(page) == table
        print("docs/configuration.md: the vLLM flag table is " + ("current" if same else "stale"))
        return 0 if same else 1
    head, rest = page.split(BEGIN, 1)
    PAGE.write_text(f"{head}{BEGIN}\n{table}\n{END}{rest.split(END, 1)[1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
