"""Kernel-correctness suite: every Triton kernel against its ``*_ref``, over a grid.

On a machine without CUDA the kernels run in Triton's interpreter. ``@triton.jit`` reads
TRITON_INTERPRET when it decorates, i.e. when a kernel module is imported, so this file
sets it first thing, before any test module imports a kernel. If kernel modules were
imported earlier in the same process (``pytest tests kernels``), they are reloaded in
place, so even functions imported before now see interpreted kernels.

Outside this folder the variable is restored after collection, so in a mixed run the other
tests keep the reference path that dispatch picks on CPU.

``--impl CONTRACT=MODULE:FUNCTION`` points a contract's tests at another implementation
(``contracts.py``); the run ends with a report of what passed, per contract. Tests that
need compiled kernels (the ahead-of-time compile check) run them in a subprocess, and
hand lines for the final summary to the ``summary_lines`` fixture.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections import defaultdict

import pytest
import torch

ON_CUDA = torch.cuda.is_available()
_INTERPRET_BEFORE = os.environ.get("TRITON_INTERPRET")
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

_KERNEL_MODULES = ("pagedserve.kernels.",)


def _reload_kernel_modules_imported_too_early() -> None:
    if ON_CUDA or _INTERPRET_BEFORE == "1":
        return
    for name in sorted(sys.modules):
        if name.startswith(_KERNEL_MODULES):
            importlib.reload(sys.modules[name])


_reload_kernel_modules_imported_too_early()

import contracts  # noqa: E402  (after the environment is set)
import suite_grid  # noqa: E402
import tolerances  # noqa: E402

_OUTCOMES = pytest.StashKey[dict]()
_SUMMARY = pytest.StashKey[list]()


def pytest_addoption(parser) -> None:
    parser.addoption(
        "--impl",
        action="append",
        default=[],
        metavar="CONTRACT=MODULE:FUNCTION",
        help=f"test another implementation of a contract ({', '.join(contracts.DEFAULTS)})",
    )


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "contract(name): the test holds an implementation of name")
    contracts.OVERRIDES.update(contracts.parse_overrides(config.getoption("impl")))
    config.stash[_OUTCOMES] = defaultdict(lambda: defaultdict(int))
    config.stash[_SUMMARY] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Tally each contract test's outcome (a setup skip or failure counts, a setup pass not)."""
    report = yield
    marker = item.get_closest_marker("contract")
    if marker is not None and (report.when == "call" or report.outcome != "passed"):
        item.config.stash[_OUTCOMES][marker.args[0]][report.outcome] += 1
    return report


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    """The CPU's numba GEMMs follow torch's thread count (cpu/threads.py): a test that takes
    this fixture runs under one thread and under two."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture
def summary_lines(pytestconfig) -> list[str]:
    """Lines a test wants printed in the run's final summary (the compile check's table)."""
    return pytestconfig.stash[_SUMMARY]


def _set_interpret(value: str | None) -> None:
    if ON_CUDA:
        return
    if value is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = value


def pytest_collection_finish(session) -> None:
    _set_interpret(_INTERPRET_BEFORE)


def pytest_runtest_setup(item) -> None:
    _set_interpret("1")


def pytest_runtest_teardown(item, nextitem) -> None:
    _set_interpret(_INTERPRET_BEFORE)


def pytest_report_header(config) -> list[str]:
    mode = "compiled" if ON_CUDA else "TRITON_INTERPRET=1 (interpreter)"
    device = torch.cuda.get_device_name() if ON_CUDA else "cpu"
    return [
        f"kernel suite: device={device}, triton {mode}, grid={suite_grid.GRID} "
        f"(set {suite_grid.GRID_ENV}=tiny|full), dtypes={suite_grid.DTYPE_NAMES}",
        *tolerances.table_lines(),
    ]


def pytest_terminal_summary(terminalreporter) -> None:
    """Repeat the header at the end (``-q``, as CI runs the suite, hides report headers), then
    what tests handed over, then which implementation answered each contract and how."""
    config = terminalreporter.config
    lines = pytest_report_header(config) if terminalreporter.verbosity < 0 else []
    lines += config.stash[_SUMMARY]
    if config.stash[_OUTCOMES]:
        lines += contracts.report_lines(config.stash[_OUTCOMES])
    for line in lines:
        terminalreporter.write_line(line)
