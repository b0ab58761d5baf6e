"""Block tables and the paged attention kernel.

Lesson 01 split the KV cache into blocks. This one follows one step of the engine through the
cache: three sequences in one flat batch (a decode, a whole prompt, and a prefill chunk over
tokens already cached), their blocks scattered through the pool, the slot mapping that says where
each new token's key and value go, and the paged attention kernel that reads them back through
the block tables. We run the Triton kernel in Triton's interpreter (no GPU needed), next to its
PyTorch reference and to naive dense attention, and check that all three agree.
"""

import os

# The interpreter is chosen when a @triton.jit kernel is defined, so this must come before any
# pagedserve.kernels import. On a GPU you would leave it unset and the kernel would be compiled.
os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from pagedserve.blockmgr import KVCacheManager  # noqa: E402
from pagedserve.kernels import paged_attention, paged_attention_ref, store_kv  # noqa: E402

torch.manual_seed(0)

# ## 1. The pool, and block tables
#
# One layer's cache is two tensors, k_cache and v_cache, of shape
# [num_blocks, block_size, num_kv_heads, head_dim]. We fill the whole pool with NaN first: any
# read of a slot that no sequence owns then poisons the output, so a kernel that reads one slot
# too far cannot go unnoticed. Grouped-query attention: 4 query heads share 2 KV heads.

num_blocks, block_size, n_heads, n_kv_heads, head_dim = 16, 4, 4, 2, 8
k_cache = torch.full((num_blocks, block_size, n_kv_heads, head_dim), float("nan"))
v_cache = torch.full_like(k_cache, float("nan"))

# The block manager hands out blocks. To make the tables non-contiguous, as they are in a busy
# engine, six one-block "filler" sequences come and go around our three sequences.

manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False, watermark=0.0)
for i in range(6):
    manager.allocate_slots(f"filler{i}", list(range(4)), 0, 4)
for i in (0, 2, 4):
    manager.free(f"filler{i}")
manager.allocate_slots("A", list(range(9)), 0, 9)  # A: 9 tokens already cached
manager.allocate_slots("C", list(range(6)), 0, 6)  # C: 6 tokens already cached
for i in (1, 3):
    manager.free(f"filler{i}")

# Now one step. A decodes one token (its 10th); B is a new 7-token prompt; C reads a 5-token prefill
# chunk on top of its 6 cached tokens. Each sequence first gets the slots its new tokens need.

new_tokens = {"A": 1, "B": 7, "C": 5}
cached = {"A": 9, "B": 0, "C": 6}
for seq in ("A", "C"):
    manager.allocate_slots(
        seq, list(range(cached[seq] + new_tokens[seq])), cached[seq], new_tokens[seq]
    )
manager.allocate_slots("B", list(range(7)), 0, 7)
tables = {seq: manager.get_block_table(seq) for seq in "ABC"}
print("== 1. Block tables (block_size 4) ==")
for seq in "ABC":
    print(
        f"  {seq}: {cached[seq]:2d} cached + {new_tokens[seq]} new tokens -> blocks {tables[seq]}"
    )

# ## 2. Filling the cache: slot mapping and store_kv
#
# Sequence b's token at position p lives in slot block_table[p // block_size] * block_size +
# p % block_size. The cached tokens were written in earlier steps; we write them now the same
# way. Then the step's new tokens: the model runner lays them end to end (no padding), with
# query_start_loc marking where each sequence starts and seq_lens counting each sequence's tokens
# in the cache *including* the new ones, because store_kv runs before attention.


def slots(seq: str, positions: range) -> torch.Tensor:
    table = tables[seq]
    return torch.tensor([table[p // block_size] * block_size + p % block_size for p in positions])


keys = {s: torch.randn(cached[s] + new_tokens[s], n_kv_heads, head_dim) for s in "ABC"}
values = {s: torch.randn(cached[s] + new_tokens[s], n_kv_heads, head_dim) for s in "ABC"}
for s in "AC":  # the earlier steps
    past = range(cached[s])
    store_kv(keys[s][: cached[s]], values[s][: cached[s]], k_cache, v_cache, slots(s, past))

new_positions = {s: range(cached[s], cached[s] + new_tokens[s]) for s in "ABC"}
slot_mapping = torch.cat([slots(s, new_positions[s]) for s in "ABC"])
store_kv(
    torch.cat([keys[s][cached[s] :] for s in "ABC"]),
    torch.cat([values[s][cached[s] :] for s in "ABC"]),
    k_cache,
    v_cache,
    slot_mapping,
)
query = torch.randn(sum(new_tokens.values()), n_heads, head_dim)
query_start_loc = torch.tensor([0, 1, 8, 13], dtype=torch.int32)
seq_lens = torch.tensor([cached[s] + new_tokens[s] for s in "ABC"], dtype=torch.int32)
width = max(len(t) for t in tables.values()) + 1  # padded; padding entries are never read
block_tables = torch.tensor(
    [tables[s] + [0] * (width - len(tables[s])) for s in "ABC"], dtype=torch.int32
)
print("\n== 2. One step's flat batch ==")
print(f"  slot_mapping    {slot_mapping.tolist()}")
print(f"  query_start_loc {query_start_loc.tolist()}   seq_lens {seq_lens.tolist()}")
print(
    f"  slots still NaN (owned by nobody): {int(k_cache.isnan().any(-1).any(-1).sum())} of {num_blocks * block_size}"
)

# ## 3. Paged attention: the Triton kernel, its reference, and naive attention
#
# New token j of sequence b sits at position seq_lens[b] - q_len[b] + j and attends to every cached
# position up to its own: one rule covers decode, prefill and chunked prefill. The Triton kernel
# walks each sequence's block table tile by tile with an online softmax; the reference gathers
# the blocks and calls PyTorch's attention. Neither knows about the others' layout tricks.

scale = head_dim**-0.5
args = (query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
out_triton = paged_attention(*args)  # TRITON_INTERPRET=1: the Triton kernel, interpreted
out_ref = paged_attention_ref(*args)

# Naive attention knows nothing about paging: each sequence's keys and values, contiguous, a
# causal mask, a softmax. Query heads 0-1 read KV head 0, heads 2-3 read KV head 1.


def naive(seq: str, q: torch.Tensor) -> torch.Tensor:
    k = keys[seq].repeat_interleave(n_heads // n_kv_heads, dim=1)  # [S, Hq, D]
    v = values[seq].repeat_interleave(n_heads // n_kv_heads, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    q_pos = torch.tensor(list(new_positions[seq]))
    mask = torch.arange(k.shape[0])[None, :] > q_pos[:, None]
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)


out_naive = torch.cat(
    [naive(s, query[query_start_loc[i] : query_start_loc[i + 1]]) for i, s in enumerate("ABC")]
)
print("\n== 3. Three implementations, one answer ==")
print(f"  NaN in the Triton output: {bool(out_triton.isnan().any())}")
print(f"  max |triton - reference| = {(out_triton - out_ref).abs().max():.2e}")
print(f"  max |triton - naive|     = {(out_triton - out_naive).abs().max():.2e}")
torch.testing.assert_close(out_triton, out_ref, atol=1e-4, rtol=1.3e-6)
torch.testing.assert_close(out_triton, out_naive, atol=1e-4, rtol=1e-4)
print("  all three agree within fp32 attention tolerance (atol 1e-4)")

# ## 4. The block table is the only thing that matters
#
# Move sequence C's blocks somewhere else in the pool, rewrite its block table, and attention
# gives the same answer: physical placement is invisible to the math. This is what lets the block
# manager put a sequence's blocks anywhere, share them between sequences, and copy them on write.

held = {b for seq in manager.block_tables for b in manager.get_block_table(seq)}
free = [b for b in range(num_blocks) if b not in held]
moved = free[: len(tables["C"])]
k_cache[moved], v_cache[moved] = k_cache[tables["C"]].clone(), v_cache[tables["C"]].clone()
k_cache[tables["C"]] = float("nan")
v_cache[tables["C"]] = float("nan")
block_tables[2, : len(moved)] = torch.tensor(moved, dtype=torch.int32)
out_moved = paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale)
print("\n== 4. Relocating a sequence ==")
print(f"  C's blocks {tables['C']} -> {moved}, old blocks poisoned with NaN")
print(f"  output unchanged: {torch.equal(out_moved, out_triton)}")
