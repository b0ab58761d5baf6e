"""What an image costs a LLaVA request, and what pagedserve's two caches save of it.

Workload (spelled out in the output): a random-weight LLaVA-1.5 of real shapes, built on the
spot (no download): a CLIP ViT-B/16 tower at 224 px (12 layers of width 768; 196 rows an image)
and a projector into a decoder of SmolLM2-135M's shape (30 layers of width 576), fp32. Each
request is ``USER: <image>\\n<question> ASSISTANT:`` and one greedy token (its time is the time
to first token: the encoder, the prompt's prefill, one sample). Four cases, each timed
``--repeats`` times (median), every one after a warm-up request:

- cold: a picture never seen: the tower runs, the whole prompt is computed;
- prefix hit: the same picture and text again: the prefix cache serves every full block of the
  prompt (the picture's hash is in them), so neither the tower nor the prefill runs again;
- encoder hit: the same picture after other words (in the prompt's first block, so no block is
  shared): the whole prompt is computed, but the picture's embeddings come from the encoder
  cache;
- transformers: ``LlavaForConditionalGeneration`` on the same weights, one forward of the
  processor's inputs (what a request costs without an engine's caches).

The tower's own time for one image (``embed_images``) is printed beside them, so the cold case
splits into encoder and prefill. Ratios are against the cold case of the same run.

    .venv/bin/python tools/bench_images.py
    .venv/bin/python tools/bench_images.py --repeats 5 --threads 2
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from pagedserve.engine import LLM, SamplingParams
from pagedserve.models.testing_multimodal import make_tiny_llava_checkpoint

VIT_B16 = dict(
    hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12
)
SMOLLM2_135M = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=2048,
)  # fmt: skip
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1)


def pictures(count: int, seed: int) -> list:
    """``count`` distinct 320 x 240 RGB noise pictures."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [
        Image.fromarray(rng.integers(0, 256, (240, 320, 3), dtype=np.uint8), "RGB")
        for _ in range(count)
    ]


def timed(llm: LLM, text: str, picture, before: str = "") -> float:
    """Seconds of one request: ``before``, the picture, ``text``, one greedy token."""
    words = f"USER: {before}<image>\n{text} ASSISTANT:"
    prompt = {"prompt": words, "multi_modal_data": {"image": [picture]}}
    start = time.perf_counter()
    llm.generate(prompt, ONE_TOKEN, use_tqdm=False)
    return time.perf_counter() - start


def engine_cases(llm: LLM, args) -> dict[str, float]:
    """Median seconds of each engine case (module docstring)."""
    images = pictures(2 * args.repeats + 1, args.seed)
    timed(llm, "Warm up.", images.pop())
    cold, prefix, encoder = [], [], []
    for i in range(args.repeats):
        picture = images[i]
        cold.append(timed(llm, "Describe the picture.", picture))
        prefix.append(timed(llm, "Describe the picture.", picture))
        before = f"Other words first, {i}. "  # in the first block: no block is shared
        encoder.append(timed(llm, "Describe the picture.", picture, before))
    return {
        "cold": statistics.median(cold),
        "prefix hit": statistics.median(prefix),
        "encoder hit": statistics.median(encoder),
    }


def tower_seconds(llm: LLM, args) -> float:
    """Median seconds of the vision tower and projector on one processed image."""
    processor, model = llm.engine.image_processor, llm.engine.runner.model
    ids = llm.get_tokenizer().encode("USER: <image>\nx ASSISTANT:")
    _, (image,) = processor.process(ids, {"image": pictures(1, args.seed + 7)})
    seconds = []
    with torch.inference_mode():
        for _ in range(args.repeats):
            start = time.perf_counter()
            model.embed_images([image.pixel_values])
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def transformers_seconds(folder: Path, args) -> float:
    """Median seconds of transformers' forward over one request's processed inputs."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    processor = AutoProcessor.from_pretrained(folder)
    model = LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    seconds = []
    with torch.inference_mode():
        for picture in pictures(args.repeats + 1, args.seed + 3):
            start = time.perf_counter()
            inputs = processor(
                text="USER: <image>\nDescribe the picture. ASSISTANT:", images=[picture],
                return_tensors="pt",
            )  # fmt: skip
            model(**inputs).logits[0, -1].argmax()
            seconds.append(time.perf_counter() - start)
    return statistics.median(seconds[1:])  # the first is the warm-up


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch and numba threads")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = Path(tempfile.mkdtemp(prefix="bench-images-")) / "llava"
    make_tiny_llava_checkpoint(
        folder, image_size=224, patch_size=16, vision_sizes=VIT_B16, text_sizes=SMOLLM2_135M
    )
    llm = LLM(model=str(folder), dtype="float32", max_model_len=512, num_cpu_threads=args.threads)
    cases = engine_cases(llm, args)
    tower = tower_seconds(llm, args)
    cases["transformers"] = transformers_seconds(folder, args)
    print(
        f"workload: random LLaVA-1.5 (CLIP ViT-B/16 at 224 px, 196 rows an image; SmolLM2-135M-"
        f"shaped decoder), fp32, one greedy token a request, median of {args.repeats}; "
        f"{platform.processor() or platform.machine()}, {args.threads} threads, "
        f"python {sys.version.split()[0]}"
    )
    print(f"vision tower + projector, one image: {tower * 1000:8.1f} ms")
    print(f"{'case':<14}{'time to first token':>22}{'vs cold':>10}")
    for name, seconds in cases.items():
        print(f"{name:<14}{seconds * 1000:19.1f} ms{seconds / cases['cold']:9.2f}x")
    llm.engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
