"""``--impl`` points a contract's tests at another implementation: a right one passes the
same grid, a deliberately wrong one fails it, and the run reports which was tested and how."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SUITE = Path(__file__).parent

# Someone else's paged attention: one SDPA per sequence over its gathered cache.
IMPLEMENTATIONS = textwrap.dedent("""
    import torch
    import torch.nn.functional as F

    def _attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                   causal):
        out = torch.zeros_like(query)
        bs, group = k_cache.shape[1], query.shape[1] // k_cache.shape[2]
        for b in range(len(seq_lens)):
            start, end, n = int(query_start_loc[b]), int(query_start_loc[b + 1]), int(seq_lens[b])
            if end == start:
                continue
            slots = block_tables[b].long().repeat_interleave(bs)[:n] * bs + torch.arange(n) % bs
            k = k_cache.flatten(0, 1)[slots].float().transpose(0, 1)
            v = v_cache.flatten(0, 1)[slots].float().transpose(0, 1)
            q = query[start:end].float().transpose(0, 1)
            mask = torch.arange(n)[None, :] <= torch.arange(n - (end - start), n)[:, None]
            out[start:end] = F.scaled_dot_product_attention(
                q, k.repeat_interleave(group, 0), v.repeat_interleave(group, 0),
                attn_mask=mask if causal else None, scale=scale,
            ).transpose(0, 1).to(query.dtype)
        return out

    def right(*args):
        return _attention(*args, causal=True)

    def wrong(*args):  # forgets the causal mask: prompt tokens see the future
        return _attention(*args, causal=False)
""")


def run_suite(tmp_path: Path, impl: str) -> subprocess.CompletedProcess:
    (tmp_path / "other_attention.py").write_text(IMPLEMENTATIONS)
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [
            sys.executable, "-m", "pytest", "test_triton_paged_attention.py", "-q",
            "-p", "no:cacheprovider", "-k", "varlen and gqa2 or split_kv_decode",
            "--impl", f"paged_attention=other_attention:{impl}",
        ],
        cwd=SUITE, env=env, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip


@pytest.mark.slow
def test_a_right_implementation_passes_and_is_reported(tmp_path):
    result = run_suite(tmp_path, "right")
    assert result.returncode == 0, result.stdout[-3000:]
    report = [line for line in result.stdout.splitlines() if "other_attention:right" in line]
    assert report and " 0 failed" in report[0] and "passed" in report[0], result.stdout[-2000:]
    assert "skipped" in report[0] and not report[0].endswith(" 0 skipped")  # split-KV knob


@pytest.mark.slow
def test_a_wrong_implementation_fails(tmp_path):
    result = run_suite(tmp_path, "wrong")
    assert result.returncode == 1, result.stdout[-3000:]
    report = [line for line in result.stdout.splitlines() if "other_attention:wrong" in line]
    assert report and " 0 failed" not in report[0], result.stdout[-2000:]


def test_an_unknown_contract_is_a_usage_error(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "test_tolerances_do_not_exist.py", "-q",
         "--impl", "flash_attention=x:y"],
        cwd=SUITE, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 4, result.stdout + result.stderr  # pytest's usage error
    assert "unknown contract 'flash_attention'" in result.stdout + result.stderr
