"""The ahead-of-time compile check: every launch the engine makes, compiled for real GPUs.

The launch wrappers run on CPU tensors as they would on each target's GPU
(``launch_capture``); each distinct compiled variant (Triton's own cache key) is compiled for
the target with the Triton wheel's ptxas (or AMD's built-in linker) and no device. One table:
kernel, variant, target, registers, shared memory, spills. It fails on any compile error, on
any spill in a fp16/bf16 variant and on shared memory beyond what the target gives a block.

    python kernels/compile_check.py                       # sm80 + sm90, the CI grid
    python kernels/compile_check.py --targets all --grid full

Registers: per thread (AMD: VGPRs per lane). Spills: bytes of spill stores per thread as
ptxas reports them (AMD: VGPRs spilled to scratch memory). Shared: bytes of dynamic shared memory
(AMD: LDS) one block asks for.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import engine_launches as grid_def
import torch
from launch_capture import (
    TARGETS,
    Launch,
    Target,
    compile_launch,
    compiling_for,
    recording_launches,
    variant_key,
)
from triton import knobs

GRIDS = {  # name: block sizes per dtype, for every model of engine_launches.MODELS
    # CI: the second block size only where it could matter most, the tensor-core path.
    "ci": {"fp16": [16, 32], "bf16": [16], "fp32": [16]},
    "full": {"fp16": [16, 32], "bf16": [16, 32], "fp32": [16, 32]},
}
HALF = (torch.float16, torch.bfloat16)


@dataclass
class Row:
    kernel: str
    variant: str
    target: str
    launches: int
    half: bool
    regs: int | None = None
    shared: int | None = None
    spills: int | None = None
    seconds: float = 0.0
    error: str | None = None


def capture(target: Target, grid: str) -> list[Launch]:
    """The launches of the grid as ``target``'s GPU would get them, each labelled."""
    with compiling_for(target), recording_launches() as launches:
        labelled = 0

        def record(variant: str) -> None:
            nonlocal labelled
            for launch in launches[labelled:]:
                launch.variant = variant
            labelled = len(launches)

        grid_def.engine_launches(grid_def.MODELS, GRIDS[grid], record)
    return launches


def distinct_variants(launches: list[Launch], target: Target) -> list[tuple[Launch, int]]:
    """One launch per compiled variant, with how many of the grid's launches it serves."""
    by_key: dict[tuple[str, str], list[Launch]] = {}
    for launch in launches:
        by_key.setdefault((launch.name, variant_key(launch, target)), []).append(launch)
    return [(group[0], len(group)) for group in by_key.values()]


_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores")


def _cuda_resources(kernel, log: str) -> tuple[int, int]:
    """(registers, spill-store bytes) from ptxas -v, rerun on the PTX if the compile's own log
    is missing (a binary from Triton's cache, or a Triton without the log knob)."""
    if not _PTXAS_REGS.search(log):
        from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

        arch = kernel.metadata.target.arch
        with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
            ptx.write(kernel.asm["ptx"])
            ptx.flush()
            cmd = [get_ptxas(arch).path, "-v", f"--gpu-name={sm_arch_from_capability(arch)}"]
            log = subprocess.run(
                [*cmd, ptx.name, "-o", os.devnull], capture_output=True, text=True, check=True
            ).stderr
    return int(_PTXAS_REGS.search(log).group(1)), int(_PTXAS_SPILLS.search(log).group(1))


def _amd_resources(kernel) -> tuple[int, int]:
    """(VGPRs, VGPRs spilled to scratch memory). SGPR spills are not counted: they go to VGPR
    lanes (v_writelane), not to memory, and the code generator makes a few of them freely."""
    asm = kernel.asm["amdgcn"]

    def field(name: str) -> int:
        return int(re.search(rf"\.{name}:\s+(\d+)", asm).group(1))

    return field("vgpr_count"), field("vgpr_spill_count")


def computes_in_half(launch: Launch) -> bool:
    """Whether a launch computes in fp16/bf16 (whose variants must not spill): the compute
    dtype its label names (engine_launches labels each launch with the model's dtype; a 16-bit
    KV cache under an fp32 model is "fp32 kv-fp16" and computes in fp32), else whether any
    tensor argument is 16-bit."""
    named = {"fp16", "bf16", "fp32"} & set(launch.variant.split())
    if named:
        return named != {"fp32"}
    return any(torch.is_tensor(a) and a.dtype in HALF for a in launch.args)


def compile_row(launch: Launch, count: int, target: Target) -> Row:
    row = Row(launch.name, launch.variant, target.name, count, computes_in_half(launch))
    start = time.perf_counter()
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            kernel = compile_launch(launch, target)
        row.shared = int(kernel.metadata.shared)
        if target.target.backend == "cuda":
            row.regs, row.spills = _cuda_resources(kernel, log.getvalue())
        else:
            row.regs, row.spills = _amd_resources(kernel)
    except Exception as error:  # every failure is a row of the table, not a crash of the run
        row.error = f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:200]}"
    row.seconds = time.perf_counter() - start
    return row


def violations(rows: list[Row]) -> list[str]:
    """What fails the check: compile errors, fp16/bf16 spills, shared memory over the limit."""
    found = []
    for r in rows:
        where = f"{r.kernel} [{r.variant}] on {r.target}"
        if r.error:
            found.append(f"{where}: compile error: {r.error}")
        elif r.half and r.spills:
            found.append(f"{where}: spills {r.spills} (fp16/bf16 variants must not spill)")
        elif r.shared > TARGETS[r.target].max_shared_bytes:
            limit = TARGETS[r.target].max_shared_bytes
            found.append(f"{where}: shared memory {r.shared} B > {limit} B")
    return found


def table(rows: list[Row]) -> list[str]:
    head = f"{'kernel':<22} {'variant':<34} {'target':<7} {'regs':>5} {'shared':>7} {'spills':>6}"
    lines = [head + "  launches  compile", "-" * (len(head) + 19)]
    for r in sorted(rows, key=lambda r: (r.kernel, r.variant, r.target)):
        if r.error:
            lines.append(f"{r.kernel:<22} {r.variant:<34} {r.target:<7} ERROR {r.error}")
            continue
        lines.append(
            f"{r.kernel:<22} {r.variant:<34} {r.target:<7} {r.regs:>5} {r.shared:>7} "
            f"{r.spills:>6}  {r.launches:>8}  {r.seconds:6.1f}s"
        )
    return lines


_JOBS: list[tuple[Launch, int, Target]] = []  # filled before the pool forks


def _compile_job(index: int) -> Row:
    return compile_row(*_JOBS[index])


def run(targets: list[Target], grid: str, jobs: int, kernels: str = "") -> list[Row]:
    for target in targets:
        launches = [x for x in capture(target, grid) if not kernels or x.name in kernels.split(",")]
        for launch, count in distinct_variants(launches, target):
            _JOBS.append((launch, count, target))
    order = sorted(range(len(_JOBS)), key=lambda i: _JOBS[i][0].name != "paged_attention")
    if jobs <= 1:
        return [_compile_job(i) for i in order]
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        return list(pool.map(_compile_job, order))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", default="sm80,sm90", help=f"comma list of {list(TARGETS)}")
    parser.add_argument("--grid", default="ci", choices=list(GRIDS))
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--kernels", default="", help="comma list of kernel names (default all)")
    args = parser.parse_args(argv)
    names = list(TARGETS) if args.targets == "all" else args.targets.split(",")
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("the compile check compiles: run it without TRITON_INTERPRET=1")
    knobs.nvidia.dump_ptxas_log = True  # registers and spills come from ptxas -v
    start = time.perf_counter()
    rows = run([TARGETS[n] for n in names], args.grid, args.jobs, args.kernels)
    print("\n".join(table(rows)))
    failed = violations(rows)
    print(
        f"\ncompile check: {len(rows)} variants for {','.join(names)} in "
        f"{time.perf_counter() - start:.0f}s: {'FAILED' if failed else 'ok'}"
    )
    for line in failed:
        print("  " + line)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
