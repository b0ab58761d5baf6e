"""Writes the README's table of supported architectures from the registry
(pagedserve.models.registry: each architecture's examples, notes, and what it is served with:
HF folder, GGUF, quantized checkpoints, LoRA, tensor and pipeline parallelism, the CPU fused
path, images in prompts).

    python tools/architecture_table.py           # rewrite the table between its markers
    python tools/architecture_table.py --check   # exit 1 when the README's table is stale

tests/models/test_registry_and_formats.py runs the same comparison, so a capability declared
or withdrawn in the registry fails the suite until the table is written again.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pagedserve.models.registry import replace_readme_table

README = Path(__file__).resolve().parents[1] / "README.md"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    parser.add_argument("--readme", type=Path, default=README, help="the file to write")
    args = parser.parse_args(argv)
    text = args.readme.read_text()
    table = replace_readme_table(text)
    if args.check:
        current = table == text
        print(
            f"{args.readme.name}: the architecture table is " + ("current" if current else "stale")
        )
        return 0 if current else 1
    args.readme.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
