"""Make a draft model for speculative decoding: a checkpoint cut down to its first N layers.

The truncated model keeps the target's embeddings, final norm, LM head and tokenizer (copied
as they are), so it shares the target's vocabulary exactly, and its first layers are the
target's own: a draft with no training. How good a draft that is depends on the model: deep
models whose early layers already predict well make good ones; SmolLM2-135M does not (its first
2 to 20 of 30 layers alone write nonsense, and greedy acceptance was under 1%: see
docs/benchmarks.md), so for it the tool mostly serves to test the machinery on a real model. Llama-family checkpoints
(``model.layers.{i}.``) and GPT-2 (``h.{i}.``) are cut; ``layer_types`` is cut alike.

    .venv/bin/python tools/make_draft_model.py --model PATH --num-layers 4 --out DRAFT
    pagedserve serve --model PATH \\
        --speculative-config '{"method": "draft_model", "model": "DRAFT", "num_speculative_tokens": 4}'
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

LAYER = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def truncate_layers(model: str | Path, num_layers: int, out: str | Path) -> Path:
    """Write ``model`` with only its first ``num_layers`` decoder layers to ``out``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, dst = Path(model), Path(out)
    config = json.loads((src / "config.json").read_text())
    key = "num_hidden_layers" if "num_hidden_layers" in config else "n_layer"
    if not 1 <= num_layers <= config[key]:
        raise ValueError(f"num_layers must be in 1..{config[key]}, got {num_layers}")
    config[key] = num_layers
    if config.get("layer_types"):
        config["layer_types"] = config["layer_types"][:num_layers]
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        weights = path.suffix in WEIGHT_SUFFIXES or path.name.endswith(".index.json")
        if path.is_file() and not weights and path.name != "config.json":
            shutil.copy2(path, dst / path.name)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {}
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                match = LAYER.search(name)
                if match is None or int(match.group(1)) < num_layers:
                    tensors[name] = f.get_tensor(name)
    if not tensors:
        raise ValueError(f"{src} has no .safetensors weights to cut")
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M)")
    parser.add_argument("--num-layers", type=int, required=True, help="first layers kept")
    parser.add_argument("--out", required=True, help="folder to write the draft to")
    args = parser.parse_args(argv)
    if args.model is None:
        from pagedserve.engine import ensure_default_model

        args.model = str(ensure_default_model())
    out = truncate_layers(args.model, args.num_layers, args.out)
    print(f"wrote {out}: the first {args.num_layers} layers of {args.model}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
