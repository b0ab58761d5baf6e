"""The KV cache, and why it is paged.

A decoder attends from each new token to every token before it. Keeping every earlier token's keys
and values (the KV cache) turns each generation step from "recompute the whole sequence" into
"compute one token". This lesson measures what that cache costs in memory, shows how reserving it
contiguously per request wastes most of it, and shows how paging — fixed-size blocks and a block
table per sequence, as in vLLM's PagedAttention — gets that memory back. It ends by watching a
real request's block table grow inside the engine.
"""

import random
import tempfile

from pagedserve.blockmgr import KVCacheManager
from pagedserve.engine import LLMEngine, SamplingParams
from pagedserve.engine.config import EngineArgs
from pagedserve.engine.kv_cache import bytes_per_block
from pagedserve.models import ModelConfig, kv_cache_spec
from pagedserve.models.default_model import ensure_default_model
from pagedserve.models.testing import make_tiny_checkpoint

# ## 1. What one token costs
#
# Every layer keeps a key and a value vector per KV head for every token. For a model with L
# layers, H_kv KV heads of dimension D, in a dtype of b bytes, one token takes
# 2 * L * H_kv * D * b bytes. We read the default model's config (SmolLM2-135M-Instruct) and let
# blockmgr do the arithmetic for a block of one token.

config = ModelConfig(model=str(ensure_default_model()))
per_token = bytes_per_block(kv_cache_spec(config), 1, config.torch_dtype)
print("== 1. The size of the KV cache ==")
print(
    f"SmolLM2-135M: {config.num_layers} layers x {config.num_kv_heads} KV heads x head_dim "
    f"{config.head_dim} x 2 (K and V) x {config.torch_dtype.itemsize} bytes = "
    f"{per_token / 1024:.0f} KiB per token"
)
print(
    f"one 2048-token sequence: {per_token * 2048 / 2**20:.0f} MiB; 64 of them: {per_token * 2048 * 64 / 2**30:.2f} GiB"
)

# Without a cache, generating n tokens after a prompt of p tokens runs the model over p, p+1, ...,
# p+n-1 tokens: quadratic work. With it, each step runs over one new token.

p, n = 256, 256
without = sum(p + i for i in range(n))
print(
    f"tokens pushed through the model for {n} tokens after a {p}-token prompt: "
    f"{without} without a cache, {p + n - 1} with one ({without / (p + n - 1):.0f}x less)\n"
)

# ## 2. Reserving the cache contiguously wastes it
#
# The simplest allocator gives every request one contiguous region big enough for the longest
# sequence it *might* reach (its prompt plus max_tokens, or max_model_len). But a request's final
# length is unknown until it stops, so most of the reservation is never written. We draw a seeded
# workload like a chat service sees: prompts of 32..512 tokens, answers that stop anywhere in
# 16..512 tokens, with max_model_len 2048.

rng = random.Random(0)
max_model_len, block_size = 2048, 16
lengths = [rng.randint(32, 512) + rng.randint(16, 512) for _ in range(64)]
used = sum(lengths)
contiguous = max_model_len * len(lengths)
paged_slots = sum(-(-n // block_size) * block_size for n in lengths)
print("== 2. Contiguous reservation against paging (64 requests) ==")
print(f"tokens actually stored:              {used:7d}")
print(f"slots reserved at max_model_len:     {contiguous:7d}  -> {used / contiguous:5.1%} used")
print(
    f"slots in {block_size}-token blocks, on demand: {paged_slots:7d}  -> {used / paged_slots:5.1%} used"
)
print(
    f"waste with paging is at most one partly filled block per sequence "
    f"(< {block_size} slots): here {(paged_slots - used) / len(lengths):.1f} slots per sequence\n"
)

# ## 3. External fragmentation: free memory you cannot use
#
# Even reserving exactly the right size, a contiguous allocator fragments: after requests of
# different sizes come and go, the free space is scattered in holes, and a request that fits in the
# *total* free space fits in no single hole. We play that out with a first-fit arena of 1024 slots.


def first_fit(holes: list[tuple[int, int]], size: int) -> int | None:
    """Start of the first hole of at least ``size`` slots (holes are (start, length))."""
    for i, (start, length) in enumerate(holes):
        if length >= size:
            holes[i] = (start + size, length - size)
            return start
    return None


arena = [(0, 1024)]
live = {f"r{i}": (first_fit(arena, 128), 128) for i in range(8)}  # eight requests fill the arena
for name in ("r1", "r3", "r5", "r7"):  # every other one finishes: four 128-slot holes
    arena.append(live.pop(name))
free_total = sum(length for _, length in arena)
print("== 3. Fragmentation ==")
print(f"contiguous arena: {free_total} slots free in holes of {sorted(h for _, h in arena if h)}")
print(f"a 300-token request fits? {first_fit(arena, 300) is not None}")

# Paging has no such holes: any free block serves any sequence, because the block table maps a
# sequence's logical blocks to physical blocks anywhere in the pool. Here is the same story with
# the real KVCacheManager: 64 blocks of 16 slots (1024 slots), eight 128-token sequences, half of
# them freed, then a 300-token request.

manager = KVCacheManager(num_blocks=64, block_size=16, enable_prefix_caching=False, watermark=0.0)
for i in range(8):
    assert manager.allocate_slots(f"r{i}", list(range(128)), 0, 128)
for name in ("r1", "r3", "r5", "r7"):
    manager.free(name)
free_before = manager.num_free_blocks
fits = manager.allocate_slots("big", list(range(300)), 0, 300)
print(
    f"paged pool: {free_before} blocks of 16 were free; "
    f"300-token request fits? {fits}; its block table: {manager.get_block_table('big')}"
)
print("(its blocks are not contiguous, and need not be: attention reads through the table)\n")

# ## 4. A block table in the engine
#
# Now the real engine, on a tiny random-weight Llama. We add one request and step the engine by
# hand, printing the request's block table as it grows: a new block is appended only when the
# sequence crosses a block boundary. Token p lives in slot
# block_table[p // block_size] * block_size + p % block_size.

with tempfile.TemporaryDirectory() as tmp:
    path = make_tiny_checkpoint("llama", tmp)
    engine = LLMEngine(EngineArgs(model=str(path), block_size=8, num_gpu_blocks_override=32))
    prompt = list(range(10, 22))  # 12 prompt tokens
    engine.add_request(
        "demo", prompt, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    )
    print("== 4. A request's block table, step by step (block_size 8) ==")
    step = 0
    while engine.has_unfinished_requests():
        table = None
        outputs = engine.step()
        if not outputs[0].finished:
            table = engine.kv_cache_manager.get_block_table("demo")
        tokens = len(prompt) + len(outputs[0].outputs[0].token_ids)
        step += 1
        if step <= 3 or step % 4 == 0 or table is None:
            where = f"block table {table}" if table is not None else "finished: blocks freed"
            print(f"step {step:2d}: {tokens:2d} tokens known -> {where}")
    print(f"free blocks after the request: {engine.kv_cache_manager.num_free_blocks} of 32")
