"""The launches a serving engine makes, for the head layouts that matter, by calling the real
launch wrappers the way the models and the sampler call them.

Attention comes in the four shapes a step can take: decode (one new token per sequence,
short contexts), split-KV decode (few sequences, long contexts: flash-decoding's partials and
merge), mixed prefill (decodes beside a prefill chunk over a cached prefix) and a single whole
prompt. Everything else a forward or the sampler launches comes once per model and dtype.
Tensors are small (a few blocks, a few tokens): only shapes, dtypes and strides decide what
is compiled, and the grid is recorded as the wrapper computed it for these tensors.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.kernels.kv_q8 import zeros_cache
from pagedserve.kernels.testing import make_paged_batch


@dataclass(frozen=True)
class ModelShape:
    name: str
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    gpt2: bool = False  # layer_norm + gelu_tanh, no rotary; else rms_norm + rotary + silu
    sliding_window: int | None = None  # every attention step also launched with this window
    logits_soft_cap: float | None = None  # ... and with scores soft-capped (Gemma 2)
    sinks: bool = False  # every attention launch with a sink per query head (gpt-oss)

    @property
    def group(self) -> int:
        return self.n_q_heads // self.n_kv_heads


MODELS = [
    ModelShape("smollm2", 9, 3, 64, 576, 1536, 49152),
    ModelShape("llama3-8b", 32, 8, 128, 4096, 14336, 128256),
    ModelShape("qwen3-0.6b", 16, 8, 128, 1024, 3072, 151936),
    ModelShape("gpt2", 12, 12, 64, 768, 3072, 50257, gpt2=True),
    # Mistral 7B v0.1: llama3-8b's heads, every layer windowed (its own attention variants)
    ModelShape("mistral-7b", 32, 8, 128, 4096, 14336, 32000, sliding_window=4096),
    # gpt-oss-20b: attention sinks on every layer, every other layer a 128-token window; its
    # MLP is all experts (MOE_SHAPES), so the dense activation launched here stands unused
    ModelShape("gpt-oss-20b", 64, 8, 64, 2880, 2880, 201088, sliding_window=128, sinks=True),
]
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
BLOCK_SIZES = [16, 32]
# Models whose attention is also launched over narrower caches (--kv-cache-dtype float16 /
# bfloat16 under an fp32 model, fp8 under any): SmolLM2's head_dim 64 and llama's 128 cover
# the tile shapes.
HALF_CACHE_MODELS = ("smollm2", "llama3-8b")
BYTE_CACHES = {"fp8": torch.float8_e4m3fn, "q8_0": torch.int8}

_MODULES = (
    "paged_attention", "store_kv", "rms_norm", "layer_norm", "rotary_embedding",
    "silu_and_mul", "swigluoai_and_mul", "gelu_tanh", "copy_blocks", "sampling", "penalties", "weight_only_linear",
    "rejection_sample", "token_bitmask", "fused_moe", "lora", "int4_linear", "gguf_linear",
    "encoder_attention", "gelu", "linear", "mla_decode", "store_latent", "quick_gelu",
)  # fmt: skip
# Encoder models (pooling: embeddings, cross-encoders): (name, heads, head_dim, hidden,
# intermediate). all-MiniLM-L6-v2; BERT-base / bge-base / XLM-RoBERTa-base.
ENCODER_SHAPES = [("minilm-l6", 12, 32, 384, 1536), ("bert-base", 12, 64, 768, 3072)]
# (name, experts, top_k): Mixtral 8x7B, Qwen3-30B-A3B. Hidden and intermediate sizes are cut
# to 256 / 512: the variant depends on the tile choices (the same from 64 features up), the
# dtypes and the strides' divisibility, not on the sizes themselves.
MOE_SHAPES = [("mixtral-8x7b", 8, 2), ("qwen3-30b-a3b", 128, 8)]
# gpt-oss-20b's experts: 32, top 4, biased, the clamped SwiGLU (its own variants of both GEMMs)
GPT_OSS_MOE = ("gpt-oss-20b", 32, 4)


# (name, heads a rank, kv_lora_rank, rope_dim): DeepSeek-V2-Lite has 16 heads, V3 128 (16 a
# rank over 8); both cache 512 + 64 latent values. Heads are a runtime size: one shape covers.
MLA_SHAPE = ("deepseek-v3-tp8", 16, 512, 64)


def launch_wrappers():
    return {name: importlib.import_module(f"pagedserve.kernels.{name}") for name in _MODULES}


def attention_steps(block_size: int) -> dict[str, list[tuple[int, int]]]:
    """(seq_len, q_len) per sequence for each shape of step."""
    bs = block_size
    return {
        "decode": [(3 * bs + 1, 1), (bs, 1), (5, 1)],
        "split-kv": [(4096, 1), (1500, 1)],
        "mixed-prefill": [(2 * bs + 3, 1), (4 * bs, 2 * bs + 1), (bs + 1, 1)],
        "prompt": [(3 * bs + 7, 3 * bs + 7)],
    }


def attention_launches(
    m: ModelShape,
    dtype: torch.dtype,
    block_size: int,
    record: Callable,
    label: str,
    cache_dtype: torch.dtype | None = None,
) -> None:
    """Every attention step shape through paged_attention_triton, then store_kv; with
    ``cache_dtype``, over a cache of that type (``--kv-cache-dtype``)."""
    mods = launch_wrappers()
    sinks = dict(sinks=torch.randn(m.n_q_heads)) if m.sinks else {}  # fp32, as models hold them
    for step, seqs in attention_steps(block_size).items():
        batch = make_paged_batch(
            seqs, m.n_q_heads, m.n_kv_heads, m.head_dim, block_size, dtype,
            cache_dtype=cache_dtype,
        )  # fmt: skip
        mods["paged_attention"].paged_attention_triton(*batch.args(), **sinks)
        record(f"{label} {step}")
        if m.sliding_window is not None:  # windowed (and capped) layers: variants of their own
            window = dict(sliding_window=m.sliding_window, logits_soft_cap=m.logits_soft_cap)
            mods["paged_attention"].paged_attention_triton(*batch.args(), **window, **sinks)
            record(f"{label} {step} window")
    store_launches(m, dtype, block_size, n_tokens=3, cache_dtype=cache_dtype)
    record(f"{label} store")


def batch_invariant_launches(m: ModelShape, dtype: torch.dtype, block_size: int, record, label):
    """What ``--batch-invariant`` launches instead: the attention with its one tile and fixed
    KV splits for every step shape (split-KV decodes fold their partials in order), and the
    fixed-tile GEMM of each projection, the lm_head and a MoE router (a decode's rows and a
    prefill's: one variant)."""
    mods = launch_wrappers()
    sinks = dict(sinks=torch.randn(m.n_q_heads)) if m.sinks else {}  # their fold starts there
    windows = [{}]
    if m.sliding_window is not None:
        windows.append(dict(sliding_window=m.sliding_window, logits_soft_cap=m.logits_soft_cap))
    for step, seqs in attention_steps(block_size).items():
        batch = make_paged_batch(seqs, m.n_q_heads, m.n_kv_heads, m.head_dim, block_size, dtype)
        for window in windows:
            mods["paged_attention"].paged_attention_triton(
                *batch.args(), batch_invariant=True, **window, **sinks
            )
            record(f"{label} {step} batch-invariant" + (" window" if window else ""))
    shapes = [*projection_shapes(m).values(), (m.vocab, m.hidden), (8, m.hidden)]
    for n, k in shapes:  # recorded, not run: untouched weights (the lm_head's is GBs)
        weight = torch.empty(n, k, dtype=dtype)
        bias = torch.empty(n, dtype=dtype) if m.gpt2 else None
        for n_tokens in (1, 64):
            mods["linear"].linear_triton(torch.empty(n_tokens, k, dtype=dtype), weight, bias)
    record(f"{label} batch-invariant linear")


def store_launches(
    m: ModelShape,
    dtype: torch.dtype,
    block_size: int,
    n_tokens: int,
    cache_dtype: torch.dtype | None = None,
) -> None:
    """store_kv with key and value as the models hand them over: llama's key is a strided
    view of the fused qkv output, the value (and qwen3's / gpt2's key) contiguous."""
    width = m.n_q_heads * m.head_dim + 2 * m.n_kv_heads * m.head_dim
    qkv = torch.randn(n_tokens, width).to(dtype)
    key = qkv[:, m.n_q_heads * m.head_dim :][:, : m.n_kv_heads * m.head_dim]
    key = key.reshape(n_tokens, m.n_kv_heads, m.head_dim)
    value = torch.randn(n_tokens, m.n_kv_heads, m.head_dim).to(dtype)
    cache = zeros_cache((4, block_size, m.n_kv_heads, m.head_dim), cache_dtype or dtype)
    slots = torch.randint(-1, 4 * block_size, (n_tokens,))
    mods = launch_wrappers()
    mods["store_kv"].store_kv_triton(key, value, cache, cache.clone(), slots)
    mods["store_kv"].store_kv_triton(value, value, cache, cache.clone(), slots)


def layer_launches(m: ModelShape, dtype: torch.dtype, block_size: int, n_tokens: int = 3) -> None:
    """Norms, rotary and activations of one decoder layer, and copy-on-write's block copy."""
    mods = launch_wrappers()
    x = torch.randn(n_tokens, m.hidden).to(dtype)
    weight = torch.randn(m.hidden).to(dtype)
    if m.gpt2:
        mods["layer_norm"].layer_norm_triton(x, weight, weight.clone(), 1e-5)
        mods["gelu_tanh"].gelu_tanh_triton(torch.randn(n_tokens, m.intermediate).to(dtype))
    else:
        mods["rms_norm"].rms_norm_triton(x, weight, 1e-6)
        mods["rms_norm"].rms_norm_triton(x, weight, 1e-6, x.clone())
        head = torch.randn(n_tokens, m.n_q_heads, m.head_dim).to(dtype)  # qwen3's q/k norm
        mods["rms_norm"].rms_norm_triton(head, torch.randn(m.head_dim).to(dtype), 1e-6)
        q = torch.randn(n_tokens, m.n_q_heads, m.head_dim).to(dtype)
        k = torch.randn(n_tokens, m.n_kv_heads, m.head_dim).to(dtype)
        cos_sin = torch.randn(64, m.head_dim)
        mods["rotary_embedding"].rotary_embedding_triton(torch.arange(n_tokens), q, k, cos_sin)
        gate_up = torch.randn(n_tokens, 2 * m.intermediate).to(dtype)
        mods["silu_and_mul"].silu_and_mul_triton(gate_up)
        if m.sinks:  # gpt-oss's experts' activation (its one launch per model and dtype)
            mods["swigluoai_and_mul"].swigluoai_and_mul_triton(gate_up, 1.702, 7.0)
    caches = [torch.empty(6, block_size, m.n_kv_heads, m.head_dim, dtype=dtype) for _ in range(2)]
    pairs = torch.tensor([[1, 4], [2, 5], [3, 0]])[: 1 + n_tokens % 3]
    mods["copy_blocks"].copy_blocks_triton(caches[:1], caches[1:], pairs)


def projection_shapes(m: ModelShape) -> dict[str, tuple[int, int]]:
    """(out, in) features of a decoder layer's four linear layers, fused as the models fuse them."""
    q, kv = m.n_q_heads * m.head_dim, m.n_kv_heads * m.head_dim
    return {
        "qkv": (q + 2 * kv, m.hidden),
        "o": (m.hidden, q),
        "gate_up": ((1 if m.gpt2 else 2) * m.intermediate, m.hidden),
        "down": (m.hidden, m.intermediate),
    }


def quantized_linear_launches(m: ModelShape, dtype: torch.dtype, record: Callable, label: str):
    """A layer's projections with int8 and fp8 weights (``--quantization int8|fp8``), for a
    decode step's few rows and a prefill's many (the two tiles the wrapper picks). Kept out of
    layer_launches: its tile follows the token count, which the warm-up check forbids there."""
    mods = launch_wrappers()
    for fmt in ("int8", "fp8"):
        for n, k in projection_shapes(m).values():
            qweight, scale = mods["weight_only_linear"].quantize_per_channel(torch.randn(n, k), fmt)
            bias = torch.randn(n).to(dtype) if m.gpt2 else None
            for n_tokens in (1, 64):
                x = torch.randn(n_tokens, k).to(dtype)
                mods["weight_only_linear"].weight_only_linear_triton(x, qweight, scale, bias)
        record(f"{label} {fmt}")
    if not m.gpt2:  # AWQ / GPTQ checkpoints load for the Llama family and Gemma
        int4_linear_launches(m, dtype)
        record(f"{label} int4")


def int4_linear_launches(m: ModelShape, dtype: torch.dtype, group_size: int = 128) -> None:
    """A layer's projections as 4-bit groups (AWQ and GPTQ checkpoints, group size 128) for
    decode and prefill; o also with the sorted g_idx of an act-order checkpoint's row-parallel
    shard (groups of uneven length) and a bias, so both constexpr branches compile."""
    mod = launch_wrappers()["int4_linear"]
    for name, (n, k) in projection_shapes(m).items():
        groups = -(-k // group_size)
        qweight = torch.zeros(k // mod.PACK, n, dtype=torch.int32)
        scales, zeros = torch.ones(groups, n), torch.zeros(groups, n, dtype=torch.uint8)
        extras = [(None, None)]
        if name == "o":
            g_idx = torch.sort(torch.randint(0, groups, (k,))).values.to(torch.int32)
            extras.append((g_idx, torch.randn(n).to(dtype)))
        for n_tokens in (1, 64):
            x = torch.randn(n_tokens, k).to(dtype)
            for groups_of, bias in extras:
                mod.int4_linear_triton(x, qweight, scales, zeros, group_size, groups_of, bias)


def lora_launches(m: ModelShape, dtype: torch.dtype, record: Callable, label: str) -> None:
    """A layer's projections with LoRA adapters (``--enable-lora``): one shrink over the
    parts' A stacked along the rank, one expand per part (q, k, v; gate, up) into its columns,
    with rows of several slots and rows without an adapter. The rank tile is fixed, so the rank
    changes only the strides' divisibility: 8 (not a multiple of 16) and 16 cover it."""
    mods = launch_wrappers()
    n_tokens, slots = 3, 4
    token_slot = torch.tensor([0, -1, 2])
    q, kv = m.n_q_heads * m.head_dim, m.n_kv_heads * m.head_dim
    parts = {"qkv": [q, kv, kv], "o": [m.hidden], "down": [m.hidden]}
    parts["gate_up"] = [m.intermediate] * (1 if m.gpt2 else 2)
    inputs = {"qkv": m.hidden, "o": q, "gate_up": m.hidden, "down": m.intermediate}
    for rank in (8, 16):
        for name, widths in parts.items():
            x = torch.randn(n_tokens, inputs[name]).to(dtype)
            a = torch.randn(slots, len(widths) * rank, inputs[name]).to(dtype)
            y = mods["lora"].lora_shrink_triton(x, a, token_slot, 1.0)
            out = torch.randn(n_tokens, sum(widths)).to(dtype)
            for i, width in enumerate(widths):
                b = torch.randn(slots, width, rank).to(dtype)
                y_part = y[:, i * rank : (i + 1) * rank]
                mods["lora"].lora_expand_triton(y_part, b, token_slot, out, sum(widths[:i]))
        record(f"{label} lora r{rank}")


GGUF_MODEL = "llama3-8b"  # every projection whole blocks of every type


def gguf_linear_launches(m: ModelShape, dtype: torch.dtype, record: Callable, label: str):
    """A layer's projections with their weights in each GGUF block type (``pagedserve serve
    model.gguf``), for a decode step's rows and a prefill's. The kernel's sizes are not
    specialised, so one model's shapes give every variant (type x dtype x tile): launched for
    GGUF_MODEL, in fp16 and bf16 only (a GGUF's config asks for bf16 on a GPU; fp32 runs
    the same code, and each of the 16 more variants costs the check seconds of compiling)."""
    from pagedserve.kernels.gguf_dequant import GGUF_TYPE_IDS, gguf_type, row_bytes

    if m.name != GGUF_MODEL or dtype == torch.float32:
        return
    mods = launch_wrappers()
    for name, qtype in GGUF_TYPE_IDS.items():
        for n, k in projection_shapes(m).values():
            if k % gguf_type(qtype).block_size:
                continue
            qweight = torch.empty(n, row_bytes(qtype, k), dtype=torch.uint8)  # bytes unread
            for n_tokens in (1, 64):
                x = torch.randn(n_tokens, k).to(dtype)
                mods["gguf_linear"].gguf_linear_triton(x, qweight, qtype)
        record(f"{label} gguf {name}")


def sampler_launches(m: ModelShape, rows: int = 2) -> None:
    """Penalties, the structured-output mask (every row, and some rows by index), token
    sampling and speculative decoding's rejection sampling over fp32 logits of the model's
    vocabulary."""
    mods = launch_wrappers()
    logits = torch.randn(rows, m.vocab)
    counts = torch.zeros(rows, m.vocab, dtype=torch.int32)
    per_row = [torch.ones(rows) for _ in range(3)]
    mods["penalties"].apply_penalties_triton(logits, counts > 0, counts, *per_row)
    bitmask = torch.full((rows, (m.vocab + 31) // 32), -1, dtype=torch.int32)
    mods["token_bitmask"].apply_token_bitmask_triton(logits, bitmask)
    mods["token_bitmask"].apply_token_bitmask_triton(logits, bitmask, torch.tensor([rows - 1]))
    noise = torch.ones(rows, m.vocab)
    temperature = torch.tensor([0.0, 0.8]).repeat(rows)[:rows]
    top_k = torch.tensor([0, 20], dtype=torch.int32).repeat(rows)[:rows]
    top_p, min_p = torch.full((rows,), 0.9), torch.full((rows,), 0.05)
    mods["sampling"].sample_tokens_triton(logits, temperature, top_k, top_p, min_p, noise)
    spec_decode_launches(m, rows)


def spec_decode_launches(m: ModelShape, rows: int, k: int = 3) -> None:
    """The verify step's rejection sampling, with (draft model) and without (n-gram) draft
    probabilities, as the engine calls it over the model's vocabulary."""
    mods = launch_wrappers()
    probs = torch.softmax(torch.randn(rows, k, m.vocab), dim=-1)
    draft = torch.randint(m.vocab, (rows, k))
    num_draft = torch.full((rows,), k, dtype=torch.int32)
    bonus = torch.randint(m.vocab, (rows,))
    uniform, noise = torch.rand(rows, k), torch.ones(rows, k, m.vocab)
    for draft_probs in (None, probs.clone()):
        mods["rejection_sample"].rejection_sample_triton(
            draft, num_draft, draft_probs, probs, bonus, uniform, noise
        )


def _mxfp4_experts(shape: torch.Size):
    """Packed experts of ``shape [E, out, in]``: code bytes and scale bytes (kernels/mxfp4.py)."""
    from pagedserve.kernels.mxfp4 import MXFP4Experts

    e, n, k = shape
    blocks = torch.randint(0, 256, (e, n, k // 32, 16), dtype=torch.uint8)
    return MXFP4Experts(blocks, torch.full((e, n, k // 32), 127, dtype=torch.uint8))


def moe_launches(dtype: torch.dtype, record: Callable, label: str) -> None:
    """The two grouped GEMMs (gate_up per token, down per pair with the routing weight) of
    each MoE shape, with routing that leaves some experts empty; gpt-oss's with its biases and
    clamped SwiGLU."""
    mods = launch_wrappers()
    for name, n_experts, top_k in [*MOE_SHAPES, GPT_OSS_MOE]:
        n_tokens, hidden, inter = 5, 256, 512
        x = torch.randn(n_tokens, hidden).to(dtype)
        w13 = torch.randn(n_experts, 2 * inter, hidden).to(dtype)
        w2 = torch.randn(n_experts, hidden, inter).to(dtype)
        ids = torch.stack([torch.randperm(n_experts)[:top_k] for _ in range(n_tokens)])
        weights = torch.rand(n_tokens, top_k)
        extra = {}
        if (name, n_experts, top_k) == GPT_OSS_MOE:
            extra = dict(
                w13_bias=torch.randn(n_experts, 2 * inter).to(dtype),
                w2_bias=torch.randn(n_experts, hidden).to(dtype), activation="swigluoai",
            )  # fmt: skip
        mods["fused_moe"].fused_moe_triton(x, w13, w2, weights, ids, **extra)
        record(f"{name} {label}")
        if extra:  # gpt-oss's experts held in MXFP4 (kernels/mxfp4.py), decoded in the tile
            packed = [_mxfp4_experts(w.shape) for w in (w13, w2)]
            mods["fused_moe"].fused_moe_triton(x, *packed, weights, ids, **extra)
            record(f"{name} {label} mxfp4")


def encoder_launches(dtype: torch.dtype, record: Callable, label: str) -> None:
    """An encoder layer's own launches (a pooling model's: no cache, no rotary): bidirectional
    attention over a step of whole sequences of several lengths (the tile follows the head
    dim only), its LayerNorms and its exact GELU."""
    mods = launch_wrappers()
    for name, heads, head_dim, hidden, intermediate in ENCODER_SHAPES:
        lengths = [7, 40, 1]
        starts = torch.tensor([0, 7, 47, 48], dtype=torch.int32)
        qkv = torch.randn(sum(lengths), 3 * heads * head_dim).to(dtype)
        q, k, v = (t.view(-1, heads, head_dim) for t in qkv.split(heads * head_dim, dim=-1))
        mods["encoder_attention"].encoder_attention_triton(q, k, v, starts, 40, head_dim**-0.5)
        x, weight = torch.randn(3, hidden).to(dtype), torch.randn(hidden).to(dtype)
        mods["layer_norm"].layer_norm_triton(x, weight, weight.clone(), 1e-12)
        mods["gelu"].gelu_triton(torch.randn(3, intermediate).to(dtype))
        record(f"{name} {label}")


def mla_launches(dtype: torch.dtype, block_size: int, record: Callable, label: str) -> None:
    """Multi-head latent attention's own launches: the absorbed decode over the latent cache
    (plain and split-KV), the latent store (k_pe a strided view of the kv_a projection), the
    interleaved (GPT-J) rotary on q_pe / k_pe views, the latent norm, and copy-on-write of
    caches without values."""
    mods = launch_wrappers()
    name, heads, kv_lora_rank, rope_dim = MLA_SHAPE
    width = kv_lora_rank + rope_dim
    for step in ("decode", "split-kv"):
        seqs = attention_steps(block_size)[step]
        batch = make_paged_batch(seqs, heads, 1, width, block_size, dtype)
        mods["mla_decode"].mla_paged_decode_triton(
            batch.query, batch.k_cache, batch.block_tables, batch.seq_lens, 192**-0.5,
            kv_lora_rank,
        )  # fmt: skip
        record(f"{name} {label} bs{block_size} {step}")
    n_tokens, nope = 3, 128
    kv_a = torch.randn(n_tokens, width).to(dtype)
    cache = torch.empty(4, block_size, 1, width, dtype=dtype)
    slots = torch.randint(-1, 4 * block_size, (n_tokens,))
    kv_c = mods["rms_norm"].rms_norm_triton(
        kv_a[:, :kv_lora_rank], torch.ones(kv_lora_rank).to(dtype), 1e-6
    )
    k_pe = kv_a[:, kv_lora_rank:].view(n_tokens, 1, rope_dim)
    q_pe = torch.randn(n_tokens, heads, nope + rope_dim).to(dtype)[..., nope:]
    cos_sin = torch.randn(64, rope_dim)
    mods["rotary_embedding"].rotary_embedding_triton(
        torch.arange(n_tokens), q_pe, k_pe, cos_sin, False
    )
    mods["store_latent"].store_latent_triton(kv_c, k_pe, cache, slots)
    mods["copy_blocks"].copy_blocks_triton([cache], [], torch.tensor([[1, 3]]))
    record(f"{name} {label} bs{block_size} layer")


def narrow_cache_launches(m: ModelShape, block_sizes: dict[str, list[int]], record) -> None:
    """``--kv-cache-dtype``: an fp32 model over 16-bit caches, and every model dtype over an
    fp8 cache (read and written as bytes: kv_fp8.py) and a q8_0 one (kv_q8.py)."""
    caches = {dtype_name: ["fp8", "q8_0"] for dtype_name in block_sizes}
    if "fp32" in block_sizes:
        caches["fp32"] += ["fp16", "bf16"]
    for dtype_name, names in caches.items():
        block_size = block_sizes[dtype_name][0]
        for name in names:
            label = f"{m.name} {dtype_name} kv-{name} bs{block_size}"
            cache_dtype = BYTE_CACHES.get(name) or DTYPES[name]
            attention_launches(m, DTYPES[dtype_name], block_size, record, label, cache_dtype)


def engine_launches(
    models: list[ModelShape], block_sizes: dict[str, list[int]], record: Callable
) -> None:
    """Drive every wrapper for each model, dtype (``block_sizes``' keys) and block size;
    ``record(variant)`` labels what was launched since its last call."""
    for m in models:
        for dtype_name, sizes in block_sizes.items():
            for block_size in sizes:
                label = f"{m.name} {dtype_name} bs{block_size}"
                attention_launches(m, DTYPES[dtype_name], block_size, record, label)
                batch_invariant_launches(m, DTYPES[dtype_name], block_size, record, label)
            layer_launches(m, DTYPES[dtype_name], sizes[0])
            record(f"{m.name} {dtype_name}")
            quantized_linear_launches(m, DTYPES[dtype_name], record, f"{m.name} {dtype_name}")
            lora_launches(m, DTYPES[dtype_name], record, f"{m.name} {dtype_name}")
            gguf_linear_launches(m, DTYPES[dtype_name], record, f"{m.name} {dtype_name}")
        sampler_launches(m)
        record(f"{m.name} fp32 logits")
        if m.name in HALF_CACHE_MODELS:
            narrow_cache_launches(m, block_sizes, record)
    for dtype_name, sizes in block_sizes.items():
        moe_launches(DTYPES[dtype_name], record, dtype_name)
        encoder_launches(DTYPES[dtype_name], record, dtype_name)
        for block_size in sizes:
            mla_launches(DTYPES[dtype_name], block_size, record, dtype_name)
        vision_language_launches(DTYPES[dtype_name], sizes, record, dtype_name)


def vision_language_launches(dtype: torch.dtype, sizes: list[int], record: Callable, label: str):
    """What vision-language models add (engine_launches_vision.py)."""
    from engine_launches_vision import vision_language_launches as launches

    launches(dtype, sizes, record, label)
