"""The throughput cost of multi-LoRA batching: 1, 4 and 16 distinct adapters against the base alone.

Workload (seeded): ``--num-requests`` requests with a random-token prompt of ``--prompt-len``
tokens, each generating exactly ``--max-tokens`` greedy tokens (EOS ignored), all submitted at
once (continuous batching). Adapters: ``--rank`` LoRA adapters made here with peft on every
attention and MLP projection, random A and B. Runs, each after a warm-up:

- base: the base model, LoRA off;
- 1 / 4 / 16 adapters: LoRA on (``max_loras`` = the adapter count), requests spread round-robin
  over that many adapters, so each step mixes them.

Printed: output tokens/s of each run and its ratio to the base run, measured in this process.

    python tools/bench_lora.py [--model DIR] [--num-requests 64] [--max-tokens 32] [--adapters 1,4,16]
"""

from __future__ import annotations

import argparse
import platform
import random
import tempfile
import time
from pathlib import Path

import torch

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def parse_args() -> argparse.Namespace:
    from pagedserve.models.default_model import default_model_dir

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(default_model_dir()))
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", default="1,4,16", help="comma list of adapter counts")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def make_adapters(base: str, count: int, rank: int, out: Path) -> list[str]:
    """``count`` adapters from one peft model, re-drawn and saved one after another."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(
        model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS)
    )
    gen = torch.Generator().manual_seed(0)
    paths = []
    for i in range(count):
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
        peft_model.save_pretrained(out / f"adapter{i}")
        paths.append(str(out / f"adapter{i}"))
    return paths


def run(llm, prompts, params, loras) -> float:
    """Output tokens per second of one generate call over the whole workload."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main() -> None:
    from pagedserve.engine import LLM, LoRARequest, SamplingParams

    args = parse_args()
    counts = [int(c) for c in args.adapters.split(",")]
    rng = random.Random(args.seed)
    prompts = [
        {"prompt_token_ids": [rng.randrange(1000, 20000) for _ in range(args.prompt_len)]}
        for _ in range(args.num_requests)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    common = dict(dtype=args.dtype, max_num_seqs=args.num_requests, seed=args.seed)
    rows = []
    base_llm = LLM(args.model, **common)
    run(base_llm, prompts[:4], params, None)  # warm-up
    base = run(base_llm, prompts, params, None)
    rows.append(("base (LoRA off)", base))
    del base_llm
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(args.model, max(counts), args.rank, Path(tmp))
        for count in counts:
            llm = LLM(args.model, enable_lora=True, max_loras=count, max_lora_rank=args.rank,
                      **common)  # fmt: skip
            loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths[:count])]
            per_prompt = [loras[i % count] for i in range(len(prompts))]
            run(llm, prompts[:4], params, per_prompt[:4])  # warm-up (reads the adapters)
            run(llm, prompts, params, per_prompt)  # every adapter read once
            rows.append(
                (f"{count} adapter{'s' * (count > 1)}", run(llm, prompts, params, per_prompt))
            )
            del llm
    print(f"model {args.model}, dtype {args.dtype}, {args.num_requests} requests, prompt "
          f"{args.prompt_len} tokens, {args.max_tokens} output tokens, rank {args.rank}, seed "
          f"{args.seed}; {platform.processor() or platform.machine()}, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads")  # fmt: skip
    print(f"{'workload':<18} {'tokens/s':>10} {'vs base':>8}")
    for name, tps in rows:
        print(f"{name:<18} {tps:>10.1f} {tps / base:>8.2f}")


if __name__ == "__main__":
    main()
