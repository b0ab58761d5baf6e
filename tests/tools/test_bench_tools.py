"""The benchmark tools measure what they say: workloads, accounting, percentiles, phase timing."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import bench_engine_overhead  # noqa: E402
import bench_serving  # noqa: E402
import bench_throughput  # noqa: E402


def workload_args(**overrides) -> argparse.Namespace:
    base = dict(seed=0, num_requests=20, min_prompt=3, max_prompt=9, min_output=2, max_output=7)
    return argparse.Namespace(**{**base, **overrides})


def test_throughput_workload_is_seeded_and_within_its_ranges():
    first = bench_throughput.make_workload(workload_args(), vocab_size=50)
    again = bench_throughput.make_workload(workload_args(), vocab_size=50)
    assert first == again
    assert all(3 <= len(p) <= 9 and all(0 <= t < 50 for t in p) for p in first.prompts)
    assert all(2 <= n <= 7 for n in first.output_lens)
    assert first != bench_throughput.make_workload(workload_args(seed=1), vocab_size=50)


def test_token_passes_count_padding_and_idle_slots_of_static_batches():
    workload = bench_throughput.Workload(prompts=[[1] * 3, [1] * 5, [1] * 2], output_lens=[4, 1, 2])
    # pagedserve: every prompt token once, every output token but the last once.
    assert bench_throughput.model_token_passes(workload, None) == (3 + 5 + 2) + (4 + 1 + 2) - 3
    # static batches of 2: [3, 5] prompts with [4, 1] outputs, then [2] with [2].
    assert bench_throughput.model_token_passes(workload, 2) == 2 * (5 + 4 - 1) + 1 * (2 + 2 - 1)


@pytest.mark.parametrize("values", [[5.0], [3.0, 1.0], list(np.random.default_rng(0).random(37))])
def test_percentile_matches_numpy(values):
    for q in (0, 50, 90, 99, 100):
        assert bench_serving.percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_summary_derives_tpot_and_throughput_from_the_requests():
    results = [
        bench_serving.RequestResult(ok=True, ttft=0.1, e2e=0.5, itl=[0.2, 0.2], output_tokens=5),
        bench_serving.RequestResult(ok=False, error="HTTP 503"),
    ]
    summary = bench_serving.summarize("c=1", results, duration=2.0)
    assert (summary.completed, summary.failed) == (1, 1)
    assert summary.output_throughput == pytest.approx(2.5)
    assert summary.percentiles["tpot"]["p50"] == pytest.approx(100.0)  # (0.5 - 0.1) / 4 s
    assert summary.percentiles["itl"]["p99"] == pytest.approx(200.0)


def test_phase_timer_accounts_wrapped_calls_only_while_enabled():
    class Thing:
        def work(self, x):
            return x + 1

    thing, timer = Thing(), bench_engine_overhead.PhaseTimer()
    timer.wrap(thing, "work", "work")
    assert thing.work(1) == 2 and timer.seconds["work"] == 0.0
    timer.enabled = True
    assert thing.work(2) == 3
    assert timer.seconds["work"] > 0.0


@pytest.mark.slow
def test_engine_overhead_tool_runs_on_a_tiny_model(tiny_checkpoint):
    model = tiny_checkpoint("llama")
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_engine_overhead.py"), "--model", model,
         "--num-seqs", "4", "--steps", "3", "--prompt-len", "8", "--threads", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "engine overhead" in result.stdout and "model forward" in result.stdout


def test_host_overhead_tool_times_every_phase_with_a_stand_in_forward(tiny_checkpoint, capsys):
    import bench_host_overhead

    model = tiny_checkpoint("llama")
    results = {n: bench_host_overhead.measure(model, n, steps=3, prompt_len=8) for n in (2, 4)}
    results[3] = bench_host_overhead.measure(model, 3, steps=3, prompt_len=8, pad_decode=True)
    for ms in results.values():
        for phase in ("schedule", "build inputs", "sampling", "scheduler update",
                      "outputs + detokenize", "  of which sampler",
                      "  of which make outputs", "  of which detokenize + stops"):  # fmt: skip
            assert ms[phase] > 0.0, phase
        # the top-level phases are disjoint parts of the step: what is left over is not negative
        assert ms["other (step glue)"] >= 0.0
        assert ms["forward (stand-in)"] < ms["step"] / 4
        assert ms["  of which sampler"] <= ms["sampling"]
        nested = ms["  of which make outputs"] + ms["  of which detokenize + stops"]
        assert nested <= ms["outputs + detokenize"]
    bench_host_overhead.print_table(results)
    table = capsys.readouterr().out
    assert "step / floor" in table and "4 seqs" in table and "3 seqs" in table


def test_host_overhead_tool_outer_timers_time_only_the_step_and_its_sampler(tiny_checkpoint):
    import bench_host_overhead

    ms = bench_host_overhead.measure(tiny_checkpoint("llama"), 3, steps=3, prompt_len=8, outer=True)
    host = bench_host_overhead.HOST_TOTAL
    assert set(ms) == {"  of which sampler", "step", host, "floor: argmax of the logits"}
    assert 0.0 < ms["  of which sampler"] < ms["step"]
    assert ms[host] == ms["step"] - ms["  of which sampler"]


def test_bench_embeddings_runs_on_a_tiny_workload(tiny_pooling_checkpoint, capsys):
    """The embeddings benchmark's whole path (both sides, the table, the ratio) on a tiny model
    and a few sentences; its figures are measured by hand, not here."""
    import bench_embeddings

    path = tiny_pooling_checkpoint("bert")
    argv = ["--model", path, "--num-sentences", "12", "--warmup", "4", "--threads", "1"]
    assert bench_embeddings.main(argv) == 0
    out = capsys.readouterr().out
    assert "sentences/s" in out and "ratio:" in out
    assert float(out.split("min cosine ")[1]) > 0.9999


def test_bench_kv_offload_runs_on_a_tiny_workload(tiny_checkpoint, capsys):
    """Not a timing: the tool runs both configurations and the restart on a tiny model, and
    its report says the outputs with and without offloading are identical."""
    import bench_kv_offload

    argv = ["--model", tiny_checkpoint("llama"), "--conversations", "6", "--turns", "2"]
    argv += ["--first-prompt", "24", "--user-tokens", "8", "--max-tokens", "4"]
    argv += ["--pool-conversations", "2", "--concurrency", "2", "--block-size", "8"]
    argv += ["--kv-offload-memory", str(1 << 20), "--restart-prefix", "64"]
    assert bench_kv_offload.main(argv) == 0
    out = capsys.readouterr().out
    assert "outputs identical: True" in out and "6 conversations x 2 turns" in out
    assert "after a restart from disk" in out
