"""bench_spec_decode's workloads are what its docstring says, and a tiny run checks equality."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import bench_spec_decode  # noqa: E402


def test_repeat_prompts_quote_their_passage_and_are_seeded():
    prompts = bench_spec_decode.repeat_prompts(3, words=12, seed=0)
    assert prompts == bench_spec_decode.repeat_prompts(3, words=12, seed=0)
    assert prompts != bench_spec_decode.repeat_prompts(3, words=12, seed=1)
    for prompt in prompts:
        passage = prompt.split("Passage: ")[1].split("\n")[0]
        assert len(passage.split()) == 12
        assert prompt.endswith("Copy: " + passage[:40])  # the answer starts copying it


def test_random_prompts_are_token_ids_in_the_vocabulary():
    prompts = bench_spec_decode.random_prompts(4, length=9, vocab_size=50, seed=0)
    assert all(len(p["prompt_token_ids"]) == 9 for p in prompts)
    assert all(0 <= t < 50 for p in prompts for t in p["prompt_token_ids"])


def test_a_tiny_run_prints_the_table_and_checks_equality(tiny_checkpoint, capsys):
    argv = ["--model", tiny_checkpoint("llama"), "--requests-per-run", "2", "--max-tokens", "6"]
    argv += ["--concurrency", "2", "--passage-words", "8", "--random-prompt-len", "8"]
    argv += ["--num-gpu-blocks-override", "64"]
    assert bench_spec_decode.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("repeat ") == 1 and out.count("random ") == 1
    assert "identical with and without speculation: True" in out


def test_a_tiny_run_with_a_truncated_draft_model(tiny_checkpoint, capsys):
    argv = ["--model", tiny_checkpoint("llama"), "--requests-per-run", "2", "--max-tokens", "6"]
    argv += ["--concurrency", "2", "--passage-words", "8", "--random-prompt-len", "8"]
    argv += ["--num-gpu-blocks-override", "64", "--method", "draft_model", "--draft-layers", "1"]
    assert bench_spec_decode.main(argv) == 0
    out = capsys.readouterr().out
    assert "draft_model k=4: the model's first 1 layers" in out
    assert "identical with and without speculation: True" in out
