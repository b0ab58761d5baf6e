"""``--batch-invariant`` at the engine's edge: the flag and vLLM's environment variable turn it
on, it reaches the model's config, and every configuration the mode cannot keep invariant is
refused before anything loads, with the field to change."""

from __future__ import annotations

import pytest

from pagedserve.engine import EngineArgs
from pagedserve.server.cli import build_parser, config_kwargs


def test_the_flag_and_vllms_variable_turn_it_on(tiny_checkpoint, monkeypatch):
    path = tiny_checkpoint("llama")
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    args = build_parser().parse_args(["serve", "--batch-invariant"])
    engine_args = EngineArgs(model=path, **config_kwargs(args, EngineArgs, skip=("model",)))
    assert engine_args.create_configs()[0].batch_invariant
    assert not EngineArgs(model=path).create_configs()[0].batch_invariant
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert EngineArgs(model=path).create_configs()[0].batch_invariant
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert not EngineArgs(model=path).batch_invariant
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "yes")
    with pytest.raises(ValueError, match="VLLM_BATCH_INVARIANT='yes'"):
        EngineArgs(model=path)


@pytest.mark.parametrize(
    "options, field",
    [
        (dict(dtype="bfloat16"), "dtype"),
        (dict(quantization="int8"), "quantization"),
    ],
)
def test_what_it_cannot_keep_invariant_is_refused(tiny_checkpoint, options, field):
    args = EngineArgs(model=tiny_checkpoint("llama"), batch_invariant=True, **options)
    with pytest.raises(ValueError, match=f"batch_invariant: {field}: "):
        args.create_configs()


def test_the_reference_kernels_are_refused(tiny_checkpoint, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "ref")
    args = EngineArgs(model=tiny_checkpoint("llama"), batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant: PAGEDSERVE_KERNELS: "):
        args.create_configs()


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_latent_attention_is_covered_on_a_cpu_and_refused_on_triton(
    tiny_checkpoint, arch, monkeypatch
):
    """Multi-head latent attention runs every row through the numba attention in the mode
    (tests/e2e/test_batch_invariance.py holds its bits); the Triton attention's tile cannot
    hold a 576-value latent row, so the kernels a GPU runs are refused, naming the field."""
    assert EngineArgs(model=tiny_checkpoint(arch), batch_invariant=True).create_configs()
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "triton")
    args = EngineArgs(model=tiny_checkpoint(arch), batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant: kv_lora_rank: "):
        args.create_configs()
