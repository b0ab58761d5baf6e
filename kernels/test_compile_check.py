"""The ahead-of-time compile check and the warm-up coverage check, as part of the suite.

Both need kernels compiled, not interpreted, so each runs as a script in a process without
``TRITON_INTERPRET`` (this suite's own process interprets). The compile check's table is
printed in the run's final summary.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from compile_check import Row, computes_in_half, violations
from launch_capture import Launch

SUITE = Path(__file__).parent


def run_script(*args: str, timeout: int = 1500) -> subprocess.CompletedProcess:
    """Run a suite script compiled (no TRITON_INTERPRET) in its own process group, so a
    timeout also ends the compile check's worker processes."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with subprocess.Popen(
        [sys.executable, *args], cwd=SUITE, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    ) as proc:  # fmt: skip
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.slow
def test_every_launch_compiles_for_sm80_and_sm90(summary_lines):
    result = run_script("compile_check.py", "--targets", "sm80,sm90")
    summary_lines.extend(["", "ahead-of-time compile check:", *result.stdout.splitlines()])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line.split() for line in result.stdout.splitlines()]
    for kernel in (
        "sample_tokens", "paged_attention", "merge_kv_splits", "rms_norm", "weight_only_linear",
        "lora_shrink", "lora_expand", "int4_linear", "gguf_linear", "encoder_attention", "gelu",
        "linear", "fold_kv_splits",
        "mla_decode", "store_latent", "quick_gelu", "rotary_embedding",
    ):  # fmt: skip
        targets = {r[-6] for r in rows if r and r[0] == kernel}
        assert targets == {"sm80", "sm90"}, (kernel, targets)


@pytest.mark.slow
def test_warm_up_covers_every_variant_serving_meets():
    result = run_script("warmup_coverage.py")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "warm-up coverage on sm90: ok" in result.stdout


def test_a_kernel_the_code_generator_rejects_is_a_compile_error_row(tmp_path):
    """The sampler's old bug (``_`` bound to fp32 in one branch and int64 in the other) runs
    in the interpreter and fails only when compiled; the check reports it as a row's error."""
    (tmp_path / "broken.py").write_text(
        textwrap.dedent('''
        import triton, triton.language as tl

        @triton.jit
        def pair(x):
            return x.to(tl.int64), x.to(tl.float32)

        @triton.jit
        def broken_kernel(x_ptr, out_ptr):
            x = tl.load(x_ptr)
            if x > 0:
                token, _ = pair(x)
            else:
                _, token = pair(x)
            tl.store(out_ptr, token)
        ''')
    )  # fmt: skip
    probe = f"""
import sys, torch
sys.path.insert(0, {str(tmp_path)!r})
import broken
from compile_check import compile_row, violations
from launch_capture import TARGETS, Launch
launch = Launch(broken.broken_kernel, (1,), (torch.ones(1), torch.ones(1)), {{}}, "probe")
row = compile_row(launch, 1, TARGETS["sm90"])
print(row.error)
print(violations([row]))
"""
    result = run_script("-c", probe, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Mismatched type for _" in result.stdout
    assert "compile error" in result.stdout


def _row(**kw) -> Row:
    base = dict(kernel="k", variant="v", target="sm80", launches=1, half=True, regs=64)
    return Row(**{**base, "shared": 1024, "spills": 0, **kw})


def test_what_fails_the_check():
    assert violations([_row(), _row(half=False, spills=400)]) == []  # fp32 spills: reported
    assert "spills 8" in violations([_row(spills=8)])[0]
    assert "shared memory 170000 B > 166912 B" in violations([_row(shared=170000)])[0]
    assert violations([_row(shared=170000, target="sm90")]) == []  # sm90 gives 227 KB
    assert "compile error" in violations([_row(error="PTXASError: boom")])[0]


def test_a_16_bit_cache_under_an_fp32_model_computes_in_fp32():
    """Its launches hold 16-bit tensors (the cache) but compute in fp32, whose spills are
    allowed; the label's dtype decides, the tensors only where a label names none."""
    half, full = torch.empty(2, dtype=torch.float16), torch.empty(2)

    def launch(variant: str, *args) -> Launch:
        return Launch(kernel=None, grid=(1,), args=args, kwargs={}, variant=variant)

    assert computes_in_half(launch("llama3-8b bf16 bs16 decode", full))
    assert not computes_in_half(launch("llama3-8b fp32 kv-fp16 bs16 decode", full, half))
    assert computes_in_half(launch("unlabelled", full, half))
    assert not computes_in_half(launch("unlabelled", full))
