"""The issue's full check of sampled structured outputs: 200 samples at temperature 1.0 (50 per
schema, four schemas) on SmolLM2, each validated with jsonschema, plus regex and choice samples.

The suite runs the same test with 10 samples per schema (it takes about 160 s with all 200 on
two shared cores); this runs it with all of them:

    python tools/check_structured_sampling.py [--per-schema 50]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEST = "tests/e2e/test_structured_outputs_smollm2.py::test_sampled_outputs_validate_and_regex_and_choice_hold"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-schema", type=int, default=50)
    args = parser.parse_args()
    env = {**os.environ, "PAGEDSERVE_STRUCTURED_SAMPLES_PER_SCHEMA": str(args.per_schema)}
    command = [sys.executable, "-m", "pytest", TEST, "-q", "-p", "no:cacheprovider"]
    return subprocess.call(command, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
