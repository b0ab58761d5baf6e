"""The contracts the suite tests, and which implementation answers each one in this run.

By default each contract is answered by pagedserve's Triton launch wrapper. ``--impl
CONTRACT=MODULE:FUNCTION`` (repeatable) points the suite's tests for that contract at another
implementation with the same signature (see DESIGN's contracts, or each ``*_ref``): your own
kernel, or another library's behind a thin adapter. It meets the same grid, NaN-filled cache
slots and tolerance table; the run ends with a report of what passed, per contract.
Tests that turn a knob of pagedserve's own wrapper (e.g. a forced split-KV count) skip for
another implementation.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import pytest

DEFAULTS = {
    "paged_attention": "pagedserve.kernels.paged_attention:paged_attention_triton",
    "store_kv": "pagedserve.kernels.store_kv:store_kv_triton",
    "rms_norm": "pagedserve.kernels.rms_norm:rms_norm_triton",
    "layer_norm": "pagedserve.kernels.layer_norm:layer_norm_triton",
    "rotary_embedding": "pagedserve.kernels.rotary_embedding:rotary_embedding_triton",
    "silu_and_mul": "pagedserve.kernels.silu_and_mul:silu_and_mul_triton",
    "swigluoai_and_mul": "pagedserve.kernels.swigluoai_and_mul:swigluoai_and_mul_triton",
    "gelu_tanh": "pagedserve.kernels.gelu_tanh:gelu_tanh_triton",
    "gelu": "pagedserve.kernels.gelu:gelu_triton",
    "quick_gelu": "pagedserve.kernels.quick_gelu:quick_gelu_triton",
    "encoder_attention": "pagedserve.kernels.encoder_attention:encoder_attention_triton",
    "copy_blocks": "pagedserve.kernels.copy_blocks:copy_blocks_triton",
    "sample_tokens": "pagedserve.kernels.sampling:sample_tokens_triton",
    "apply_penalties": "pagedserve.kernels.penalties:apply_penalties_triton",
    "weight_only_linear": "pagedserve.kernels.weight_only_linear:weight_only_linear_triton",
    "int4_linear": "pagedserve.kernels.int4_linear:int4_linear_triton",
    "rejection_sample": "pagedserve.kernels.rejection_sample:rejection_sample_triton",
    "apply_token_bitmask": "pagedserve.kernels.token_bitmask:apply_token_bitmask_triton",
    "fused_moe": "pagedserve.kernels.fused_moe:fused_moe_triton",
    "lora_shrink": "pagedserve.kernels.lora:lora_shrink_triton",
    "lora_expand": "pagedserve.kernels.lora:lora_expand_triton",
    "gguf_linear": "pagedserve.kernels.gguf_linear:gguf_linear_triton",
    "mla_paged_decode": "pagedserve.kernels.mla_decode:mla_paged_decode_triton",
    "store_latent": "pagedserve.kernels.store_latent:store_latent_triton",
}
OVERRIDES: dict[str, str] = {}  # set once, from the command line, before collection


def parse_overrides(values: list[str]) -> dict[str, str]:
    """``["paged_attention=mypkg.ops:fn", ...]`` -> ``{"paged_attention": "mypkg.ops:fn"}``."""
    overrides = {}
    for value in values:
        contract, _, target = value.partition("=")
        if contract not in DEFAULTS:
            raise pytest.UsageError(
                f"--impl {value!r}: unknown contract {contract!r}; one of {sorted(DEFAULTS)}"
            )
        if ":" not in target:
            raise pytest.UsageError(f"--impl {value!r}: expected {contract}=MODULE:FUNCTION")
        overrides[contract] = target
    return overrides


def target(contract: str) -> str:
    return OVERRIDES.get(contract, DEFAULTS[contract])


def implementation(contract: str) -> Callable:
    """The function under test for ``contract`` in this run."""
    module, _, name = target(contract).partition(":")
    return getattr(importlib.import_module(module), name)


def is_default(contract: str) -> bool:
    return contract not in OVERRIDES


def own_wrapper_only(contract: str) -> None:
    """Skip the calling test unless ``contract`` is answered by pagedserve's own wrapper."""
    if not is_default(contract):
        pytest.skip(f"turns a knob of pagedserve's own {contract} wrapper")


def report_lines(outcomes: dict[str, dict[str, int]]) -> list[str]:
    """One line per contract that ran: its implementation and its test outcomes."""
    lines = ["implementations under test:"]
    for contract in sorted(outcomes):
        counts = outcomes[contract]
        summary = ", ".join(f"{counts.get(k, 0)} {k}" for k in ("passed", "failed", "skipped"))
        lines.append(f"  {contract} = {target(contract)}: {summary}")
    return lines
