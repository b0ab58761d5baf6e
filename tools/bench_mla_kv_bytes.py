"""KV cache bytes per token: multi-head latent attention's latent cache against an expanded one.

No timing: this counts bytes. For each DeepSeek geometry (the published config.json values of
DeepSeek-V2-Lite, V2 and V3, or any model folder given with ``--model``), one token's cache
across every layer:

- latent: what pagedserve caches, ``kv_lora_rank + qk_rope_head_dim`` values per layer
  (``kv_cache_spec``: one tensor per layer, whole on every tensor-parallel rank);
- expanded: what a cache of per-head keys and values would hold, ``num_heads x
  (qk_nope_head_dim + qk_rope_head_dim + v_head_dim)`` per layer (keys and values of
  different widths), split by heads over the ranks.

The ratio is expanded / latent, for one rank of ``--tp`` (1 by default) in ``--dtype`` (bf16).
The last row is measured, not computed: a tiny random DeepSeek-V2 checkpoint loaded by the
engine, the bytes of the cache tensors it allocated divided by the tokens they hold.

    .venv/bin/python tools/bench_mla_kv_bytes.py
    .venv/bin/python tools/bench_mla_kv_bytes.py --tp 8 --model /path/to/DeepSeek-V3
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from dataclasses import dataclass

import torch

from pagedserve.models import KVCacheSpec, ModelConfig, kv_cache_spec

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Geometry:
    name: str
    layers: int
    heads: int
    kv_lora_rank: int = 512
    rope: int = 64
    nope: int = 128
    v: int = 128

    def latent_bytes(self, dtype: torch.dtype) -> int:
        spec = KVCacheSpec(self.layers, 1, self.kv_lora_rank + self.rope, tensors_per_layer=1)
        return spec.bytes_per_token(dtype)

    def expanded_bytes(self, dtype: torch.dtype, tp: int) -> int:
        per_layer = self.heads // tp * (self.nope + self.rope + self.v)
        return self.layers * per_layer * torch.empty((), dtype=dtype).element_size()


PUBLISHED = [  # config.json of each model
    Geometry("DeepSeek-V2-Lite", layers=27, heads=16),
    Geometry("DeepSeek-V2", layers=60, heads=128),
    Geometry("DeepSeek-V3", layers=61, heads=128),
]


def geometry_of(config: ModelConfig) -> Geometry:
    c = config.hf_config
    return Geometry(
        config.model, config.num_layers, config.num_attention_heads, int(c["kv_lora_rank"]),
        int(c["qk_rope_head_dim"]), int(c["qk_nope_head_dim"]), int(c["v_head_dim"]),
    )  # fmt: skip


def measured_row(dtype: torch.dtype) -> tuple[Geometry, int]:
    """A tiny DeepSeek-V2 through the engine: (its geometry, cache bytes per token as
    allocated)."""
    from pagedserve.engine import LLM
    from pagedserve.models.testing import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        path = str(make_tiny_checkpoint("deepseek_v2", tmp))
        name = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
        llm = LLM(model=path, block_size=16, kv_cache_memory=1 << 20, kv_cache_dtype=name[dtype])
        runner = llm.engine.runner
        held = sum(t.numel() * t.element_size() for layer in runner.kv_caches for t in layer)
        tokens = runner.kv_caches[0][0].shape[0] * runner.kv_caches[0][0].shape[1]
        geometry = geometry_of(llm.engine.model_config)
        assert kv_cache_spec(llm.engine.model_config).is_latent
    return dataclasses.replace(geometry, name="tiny DeepSeek-V2 (measured)"), held // tokens


def table(rows: list[tuple[Geometry, int]], dtype: torch.dtype, tp: int) -> list[str]:
    head = f"{'model':<30} {'layers':>6} {'heads':>5} {'latent B/token':>15} "
    head += f"{'expanded B/token':>17} {'ratio':>7}"
    lines = [head, "-" * len(head)]
    for g, latent in rows:
        expanded = g.expanded_bytes(dtype, tp)
        lines.append(
            f"{g.name[-30:]:<30} {g.layers:>6} {g.heads:>5} {latent:>15,} {expanded:>17,} "
            f"{expanded / latent:>6.1f}x"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (per-rank bytes)")
    parser.add_argument("--model", action="append", default=[], help="a DeepSeek model folder")
    args = parser.parse_args(argv)
    dtype = DTYPES[args.dtype]
    geometries = PUBLISHED + [geometry_of(ModelConfig(model=m)) for m in args.model]
    rows = [(g, g.latent_bytes(dtype)) for g in geometries if g.heads % args.tp == 0]
    if args.tp == 1:  # the engine's own allocation, on one rank
        rows.append(measured_row(dtype))
    print(f"KV cache bytes per token, all layers, {args.dtype}, one rank of {args.tp}:")
    print("\n".join(table(rows, dtype, args.tp)))
    print(
        "latent: kv_lora_rank + qk_rope_head_dim values a layer (whole on every rank); "
        "expanded: heads / tp x (qk_nope + qk_rope + v) values a layer"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
