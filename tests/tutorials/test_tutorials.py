"""Every tutorial runs to completion (each is a runnable lesson that prints what it shows)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TUTORIALS = sorted((Path(__file__).resolve().parents[2] / "tutorials").glob("[0-9][0-9]_*.py"))


@pytest.mark.slow
@pytest.mark.parametrize("path", TUTORIALS, ids=[p.stem for p in TUTORIALS])
def test_tutorial_runs(path: Path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    result = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, (
        f"{path.name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    )
    assert result.stdout.strip(), f"{path.name} printed nothing"
