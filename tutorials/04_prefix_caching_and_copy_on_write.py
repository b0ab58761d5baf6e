"""Prefix caching and copy-on-write: computing a shared prefix once.

Requests often start the same way: one system prompt, one few-shot preamble, one document asked
many questions. Paging makes sharing their keys and values cheap: two block tables may point at
the same physical block. pagedserve names every full block by a hash chained over all the tokens
before it, looks new prompts up by those hashes, and shares the blocks it finds (a reference count
per block). A sequence never writes into a block someone else holds: it copies it first. This
lesson shows the hashes, measures the hit rate and time to first token on SmolLM2 with and
without the cache, and watches n=3 samples of one prompt share their blocks until they diverge.
"""

import time

import torch

from pagedserve.blockmgr import KVCacheManager
from pagedserve.engine import LLM, SamplingParams
from pagedserve.models import apply_chat_template
from pagedserve.models.default_model import ensure_default_model

torch.set_num_threads(1)  # one thread: steadier timings when other work shares the cores

# ## 1. Chained block hashes
#
# With 16-token blocks, a 40-token prompt has two full blocks (tokens 0-15 and 16-31) and a
# partial one. Only full blocks are hashed, and block i's hash covers block i-1's hash and its own
# tokens, so a hit on block i means the *whole prefix* up to it matches — not just those 16 tokens.

manager = KVCacheManager(num_blocks=32, block_size=16, watermark=0.0)
system = list(range(1000, 1032))  # a 32-token "system prompt": two full blocks
first = system + [7, 8, 9, 10, 11, 12, 13, 14]
hits, cached = manager.get_computed_blocks(first)
manager.allocate_slots("first", first, cached, len(first) - cached, computed_blocks=hits)
print("== 1. Looking prompts up by chained block hashes (block_size 16) ==")
print(
    f"  first:  {len(first)} tokens, {cached} found cached -> blocks {manager.get_block_table('first')}"
)

second = system + [20, 21, 22, 23, 24, 25]
hits, cached = manager.get_computed_blocks(second)
manager.allocate_slots("second", second, cached, len(second) - cached, computed_blocks=hits)
table = manager.get_block_table("second")
print(f"  second: same 32-token start, {cached} tokens cached -> blocks {table}")
print(
    f"          reference counts of the shared blocks: {[manager.pool.blocks[b].ref_count for b in table[:2]]}"
)

third = [999] + system[1:] + [7, 8]  # differs only in its first token
hits, cached = manager.get_computed_blocks(third)
print(
    f"  third:  differs in token 0 only, {cached} tokens cached (block 1's tokens match, its chain does not)"
)

# When a sequence finishes, its blocks return to the free pool but keep their hashes until they
# are handed out again (least recently freed first), so a later request still finds them.

manager.free("first")
manager.free("second")
hits, cached = manager.get_computed_blocks(second)
print(
    f"  after both finish: {manager.num_free_blocks} blocks free, and 'second' would still find {cached} tokens\n"
)

# ## 2. Hit rate and time to first token on a real model
#
# SmolLM2-135M-Instruct, a system prompt of a few hundred tokens, and four questions asked one
# after the other. With prefix caching the first request computes the system prompt and the next
# three find it in the cache: their prefill shrinks to their own question, and so does their time
# to first token. Greedy outputs must not change.

model = str(ensure_default_model())
system_prompt = (
    "You are a patient teacher of computer systems. You explain how large language model "
    "inference engines work: the KV cache, paged attention with block tables, continuous "
    "batching, prefix caching, chunked prefill and preemption. Keep answers short, concrete and "
    "correct, use numbers when they help, and never invent an API. "
) * 2
questions = [
    "What is a block table?",
    "Why page the KV cache?",
    "What is preemption?",
    "What is a prefill chunk?",
]
params = SamplingParams(temperature=0, max_tokens=4)


def ask_each(llm: LLM) -> tuple[list[float], list[int], list[list[int]]]:
    """Ask the questions one at a time; returns TTFTs (s), cached prompt tokens, output ids."""
    ttfts, cached, outputs = [], [], []
    for question in questions:
        messages = [
            {"role": "system", "content": system_prompt},
            {"role": "user", "content": question},
        ]
        out = llm.chat(messages, params, use_tqdm=False)[0]
        ttfts.append(out.metrics.time_to_first_token)
        cached.append(out.num_cached_tokens)
        outputs.append(out.outputs[0].token_ids)
    return ttfts, cached, outputs


print("== 2. Four questions after one system prompt (SmolLM2-135M, fp32, CPU) ==")
results = {}
for caching in (False, True):
    llm = LLM(model=model, enable_prefix_caching=caching, max_model_len=1024)
    llm.chat([{"role": "user", "content": "warm up"}], SamplingParams(max_tokens=1), use_tqdm=False)
    llm.engine.kv_cache_manager.reset_prefix_cache()  # the warm-up's blocks must not count
    start = time.perf_counter()
    results[caching] = ask_each(llm)
    ttfts, cached, _ = results[caching]
    conversation = [
        {"role": "system", "content": system_prompt},
        {"role": "user", "content": questions[0]},
    ]
    prompt_len = len(apply_chat_template(llm.get_tokenizer(), conversation, True))
    print(
        f"  prefix caching {'on ' if caching else 'off'}: prompts of ~{prompt_len} tokens; cached tokens per request {cached}"
    )
    print(
        f"      time to first token: {', '.join(f'{t * 1000:.0f} ms' for t in ttfts)}  (total {time.perf_counter() - start:.1f} s)"
    )
    stats = llm.engine.kv_cache_manager.prefix_cache_stats
    print(f"      prefix-cache hit rate (tokens found / tokens looked up): {stats.hit_rate:.1%}")

off, on = results[False], results[True]
speedup = sum(off[0][1:]) / sum(on[0][1:])
print(f"  requests 2-4: time to first token {speedup:.1f}x shorter with the cache")
print(f"  greedy outputs identical with and without the cache: {off[2] == on[2]}\n")
assert off[2] == on[2] and all(c > 0 for c in on[1][1:])

# ## 3. n=3 samples share the prompt's blocks, and copy on write
#
# A request with n=3 reads its prompt once, then forks into three sequences whose block tables
# point at the same blocks (reference count 3). The prompt's last block is only partly full, and
# each sample is about to write its next token into it: the first two writers get private copies
# (copy-on-write), the third owns the original once it is alone. Full blocks stay shared for good.

llm = LLM(model=model, block_size=16, max_model_len=1024)
engine = llm.engine
prompt = llm.get_tokenizer().encode(
    "Paged attention stores keys and values in fixed-size blocks, so that " * 3
)
engine.add_request("story", prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12))
manager = engine.kv_cache_manager


def show_tables(label: str) -> None:
    print(f"  {label}")
    for seq_id, blocks in sorted(manager.block_tables.items()):
        ids = [b.block_id for b in blocks]
        refs = [b.ref_count for b in blocks]
        print(f"    {seq_id:>10}: blocks {ids}  refcounts {refs}")


print(
    f"== 3. n=3 over a {len(prompt)}-token prompt ({len(prompt) // 16} full blocks + a partial one) =="
)
engine.step()  # reads the prompt, samples three first tokens: the request forks
show_tables("after the prefill step (forked, nothing copied yet):")
engine.step()  # each sample writes its token into the partial block: copy-on-write
show_tables("after one decode step (the partial block copied for all but one):")
while engine.has_unfinished_requests():
    finished = [o for o in engine.step() if o.finished]
texts = [c.text for c in finished[0].outputs]
print("  three samples, one prompt computed once:")
for text in texts:
    print(f"    - {text!r}")
