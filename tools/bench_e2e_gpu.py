"""End-to-end generation on a random-weight model of Qwen3-0.6B's shape (tools/gpu_check.sh).

Two checks in one table:
1. wiring: a 2-layer fp32 slice of the shape generates the same greedy tokens on the Triton path
   as on the reference path (both on the same device);
2. throughput: the full shape in bf16 (fp32 on CPU), a seeded workload of random-token prompts:
   the Triton path with CUDA graphs for decode and without (``--enforce-eager``, vLLM's name),
   the reference path, and transformers' ``generate`` on the same device, in one process.
   Where the engine has no ``enforce_eager`` yet, the graphs row says so and one Triton row runs.

No download: transformers builds the model from its config class with random weights, and the
tokenizer is the tiny one from pagedserve.models.testing (prompts are token ids). Usage:
    python tools/bench_e2e_gpu.py [--layers 28] [--num-prompts 32] [--prompt-len 256] [--output-len 64]
On CPU it runs too, slowly: pass --layers 2 --num-prompts 4 for a smoke run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import tempfile
import time
from pathlib import Path

import torch

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.config import EngineArgs
from pagedserve.models.testing import build_tiny_tokenizer

QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=4096,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    initializer_range=0.02,
    bos_token_id=1,
    eos_token_id=2,
)


def make_checkpoint(out_dir: Path, layers: int, dtype: torch.dtype, device: str) -> str:
    """A random-weight Qwen3 of the 0.6B shape (``layers`` of them) saved as an HF folder."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(**{**QWEN3_0_6B, "num_hidden_layers": layers})
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out_dir, safe_serialization=True)
    build_tiny_tokenizer(out_dir)
    return str(out_dir)


def workload(num_prompts: int, prompt_len: int, vocab: int = 1000) -> list[dict]:
    rng = random.Random(0)
    return [
        {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(prompt_len)]}
        for _ in range(num_prompts)
    ]


def _timed(fn) -> tuple[object, float]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def run(
    path: str, kernels: str, prompts: list[dict], output_len: int, dtype: str, **engine: object
) -> tuple[list[list[int]], float]:
    os.environ["PAGEDSERVE_KERNELS"] = kernels
    llm = LLM(model=path, dtype=dtype, max_num_seqs=256, max_model_len=2048, **engine)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(
        prompts[:2], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False
    )  # warm-up
    outputs, elapsed = _timed(lambda: llm.generate(prompts, params, use_tqdm=False))
    return [o.outputs[0].token_ids for o in outputs], elapsed


def run_transformers(path: str, prompts: list[dict], output_len: int, dtype: str) -> float:
    """transformers' generate on one batch (every prompt has the same length: no padding)."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device)
    ids = torch.tensor([p["prompt_token_ids"] for p in prompts], device=device)
    kwargs = dict(
        attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=output_len,
        min_new_tokens=output_len, pad_token_id=0,
    )  # fmt: skip
    model.generate(
        ids[:2], attention_mask=torch.ones_like(ids[:2]), max_new_tokens=2, pad_token_id=0
    )
    _, elapsed = _timed(lambda: model.generate(ids, **kwargs))
    return elapsed


def engine_variants() -> list[tuple[str, dict]]:
    """The Triton path with CUDA graphs on and off, where the engine has the switch."""
    if "enforce_eager" not in {f.name for f in dataclasses.fields(EngineArgs)}:
        return [("triton", {})]
    return [("triton graphs", {"enforce_eager": False}), ("triton eager", {"enforce_eager": True})]


def throughput_rows(path: str, args, dtype: str) -> list[tuple[str, str, str]]:
    prompts = workload(args.num_prompts, args.prompt_len)
    tokens = args.num_prompts * args.output_len
    timings = {}
    for name, engine in [*engine_variants(), ("ref", {})]:
        kernels = "ref" if name == "ref" else "triton"
        _, timings[name] = run(path, kernels, prompts, args.output_len, dtype, **engine)
    if not args.skip_transformers:
        timings["transformers"] = run_transformers(path, prompts, args.output_len, dtype)
    rows = [
        (f"{name} {dtype}", f"{tokens / t:.0f} generated tok/s", f"{t:.2f}s")
        for name, t in timings.items()
    ]
    if len(engine_variants()) == 1:
        rows.append(("triton graphs", "not measured: the engine has no enforce_eager yet", ""))
    fastest = min(t for name, t in timings.items() if name.startswith("triton"))
    for baseline in ("ref", "transformers"):
        if baseline in timings:
            rows.append((f"triton / {baseline}", f"{timings[baseline] / fastest:.2f}x", ""))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--skip-transformers", action="store_true", help="no transformers row")
    args = parser.parse_args()
    on_cuda = torch.cuda.is_available()
    device = "cuda" if on_cuda else "cpu"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        small = make_checkpoint(Path(tmp) / "wiring", 2, torch.float32, device)
        prompts = workload(4, 48)
        ref, _ = run(small, "ref", prompts, 16, "float32")
        tri, _ = run(small, "triton", prompts, 16, "float32")
        same = sum(a == b for a, b in zip(ref, tri, strict=True))
        rows.append(
            ("wiring fp32 2 layers", f"{same}/{len(ref)} prompts identical greedy tokens", "")
        )

        dtype = "bfloat16" if on_cuda else "float32"
        full = make_checkpoint(Path(tmp) / "full", args.layers, getattr(torch, dtype), device)
        rows += throughput_rows(full, args, dtype)

    print(
        f"\nQwen3-0.6B shape ({args.layers} layers), random weights, device={torch.cuda.get_device_name() if on_cuda else 'cpu'}"
    )
    print(
        f"workload: {args.num_prompts} prompts x {args.prompt_len} random tokens, {args.output_len} greedy tokens each (ignore EOS)"
    )
    for name, value, extra in rows:
        print(f"  {name:<24} {value:<48} {extra}")
    if same != len(ref):
        raise SystemExit("e2e: the Triton path generated different tokens than the reference path")
    ratios = ", ".join(f"{value} {name}" for name, value, _ in rows if " / " in name)
    print(f"e2e ok: {ratios}")


if __name__ == "__main__":
    main()
