"""Every weight format on one table: bytes held against fp32 and fp16, and CPU decode speed.

The default model (SmolLM2-135M-Instruct) served once per way pagedserve can hold its weights,
one after the other in one process, on the same greedy workload:

- ``fp32``: the converted folder (``make model``), the baseline of every ratio;
- ``int8`` and ``fp8``: the same folder quantized at load (``--quantization int8|fp8``);
- ``awq`` and ``gptq``: the folder written here as an AWQ (GEMM) and a GPTQ (act-order)
  checkpoint with the tests' round-to-nearest quantizer (``--group-size``, 64 by default);
- ``gguf``: the shipped Q4_1 ``.gguf``, served in its blocks.

"weight MiB" is every parameter and buffer of the loaded model (embedding and LM head
included; they stay unquantized except in the GGUF, whose embedding is Q8_0). The fp16 column
is what the same model would hold in 16-bit. Throughput: ``--num-prompts`` prompts of
``--prompt-len`` random token ids, ``--max-tokens`` greedy tokens each (EOS ignored), batched
by the engine; tokens/s over the whole generate call, and the ratio to fp32. The agreement
column counts the prompts whose greedy tokens equal fp32's (a lossy format drifts away). Then
one stream's TPOT (what a decode step costs alone): the first prompt generating
``--tpot-tokens`` tokens and one token, the difference per token, best of 3, and fp32's TPOT
over it (a speed-up: above 1 is faster).

``--folder`` serves another fp32 folder instead of the default model (e.g. the 1B model of
``tools/make_llama_1b.py``); the ``gguf`` method is the default model's shipped file, so it
is refused there.

    python tools/bench_quantization.py
    python tools/bench_quantization.py --methods fp32,int8,gguf --max-tokens 64
    python tools/bench_quantization.py --folder /tmp/llama-1b --methods fp32,awq,gptq
"""

from __future__ import annotations

import argparse
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

METHODS = ("fp32", "int8", "fp8", "awq", "gptq", "gguf")


def model_bytes(llm) -> int:
    model = llm.engine.runner.model
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def num_weights(llm) -> int:
    """Parameters as an unquantized model counts them (for the fp16 column)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(llm.engine.model_config.model)
    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


def model_for(method: str, folder: Path, scratch: Path, group_size: int) -> tuple[str, dict]:
    """(model path, extra LLM arguments) for one way of holding the weights."""
    from pagedserve.models.default_model import find_default_gguf
    from pagedserve.models.testing_quantized import Int4Layout, quantize_int4_checkpoint

    if method == "fp32":
        return str(folder), {}
    if method in ("int8", "fp8"):
        return str(folder), {"quantization": method}
    if method == "gguf":
        return str(find_default_gguf()), {}
    layout = Int4Layout(method, group_size=group_size, act_order=method == "gptq")
    return str(quantize_int4_checkpoint(folder, scratch / method, layout)), {}


def one_stream_tpot(llm, prompt: dict, tokens: int) -> float:
    """Seconds per decode step of one stream: ``tokens + 1`` greedy tokens less one token's
    run (prefill and first token), over ``tokens``; best of 3."""
    from pagedserve.engine import SamplingParams

    def seconds(n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        return time.perf_counter() - start

    return min(seconds(tokens + 1) - seconds(1) for _ in range(3)) / tokens


def run(method: str, path: str, extra: dict, prompts: list, params, tpot_tokens: int) -> dict:
    from pagedserve.engine import LLM

    llm = LLM(model=path, dtype="float32", **extra)
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm (numba, workspaces)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outs]
    result = {"bytes": model_bytes(llm), "seconds": seconds, "tokens": tokens}
    result["tpot"] = one_stream_tpot(llm, prompts[0], tpot_tokens)
    result["weights"] = num_weights(llm) if method == "fp32" else None
    del llm
    return result


def table(results: dict[str, dict]) -> list[str]:
    base = results["fp32"]
    fp16 = 2 * base["weights"]
    rate = {m: sum(len(t) for t in r["tokens"]) / r["seconds"] for m, r in results.items()}
    lines = [
        "| weights | weight MiB | x fp32 | x fp16 | tokens/s | x fp32 | greedy = fp32 "
        "| TPOT ms | fp32's / it |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for method, r in results.items():
        same = sum(a == b for a, b in zip(r["tokens"], base["tokens"], strict=True))
        lines.append(
            f"| {method} | {r['bytes'] / 2**20:.1f} | {r['bytes'] / base['bytes']:.2f} | "
            f"{r['bytes'] / fp16:.2f} | {rate[method]:.1f} | {rate[method] / rate['fp32']:.2f} | "
            f"{same}/{len(r['tokens'])} | {1e3 * r['tpot']:.1f} | {base['tpot'] / r['tpot']:.2f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--methods", default=",".join(METHODS), help="comma list of " + str(METHODS)
    )
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--tpot-tokens", type=int, default=64)
    parser.add_argument("--folder", help="an fp32 HF folder (default: SmolLM2-135M-Instruct)")
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    if methods[0] != "fp32" or any(m not in METHODS for m in methods):
        parser.error(f"--methods starts with fp32 (the baseline) and takes {METHODS}")
    if args.folder and "gguf" in methods:
        parser.error("--folder with the gguf method: that method is the default model's file")
    from pagedserve.engine import SamplingParams
    from pagedserve.models.default_model import ensure_default_model

    gen = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(100, 40000, (args.prompt_len,), generator=gen).tolist()}
        for _ in range(args.num_prompts)
    ]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    folder = Path(args.folder) if args.folder else ensure_default_model()
    print(
        f"{folder.name}; {args.num_prompts} prompts x {args.prompt_len} tokens, "
        f"{args.max_tokens} greedy tokens each; fp32 activations; {platform.machine()}, "
        f"{os.cpu_count()} cores, {torch.get_num_threads()} torch threads, load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    with tempfile.TemporaryDirectory() as scratch:
        results = {}
        for method in methods:
            path, extra = model_for(method, folder, Path(scratch), args.group_size)
            results[method] = run(method, path, extra, prompts, params, args.tpot_tokens)
    print("\n".join(table(results)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
