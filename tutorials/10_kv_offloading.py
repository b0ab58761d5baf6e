"""KV offloading: a prefix evicted from the KV cache, kept in RAM and on disk, loaded back.

Prefix caching (lesson 04) keeps a freed prompt's blocks in the pool until the pool needs them:
a busy server evicts them within seconds, and a restart forgets every one. KV offloading puts
a second and a third level behind the pool. Every full block the engine computes is also
copied, under its prefix hash, into host memory (``kv_offload_memory``) and into a folder
(``kv_offload_dir``). When a prompt's prefix has left the pool, admission finds its blocks in
those tiers and loads them into fresh blocks instead of recomputing them. This lesson serves
SmolLM2 with a pool of 24 blocks, asks two questions about one document with other traffic
in between, and watches the document's blocks leave the pool, come back from RAM, and, after
a restart, from disk; then it corrupts one block file and watches it be refused.
"""

import shutil
import tempfile
import time
from pathlib import Path

import torch

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.kv_connector.block_record import HEADER
from pagedserve.models.default_model import ensure_default_model

torch.set_num_threads(2)

# ## 1. An engine with a small pool and two offload tiers
#
# 24 blocks of 16 tokens hold 384 tokens: one 250-token document and little else. The RAM tier
# gets 256 MiB (some 360 of SmolLM2's 0.7 MB blocks in fp32), the disk tier a temporary folder.

model = str(ensure_default_model())
folder = Path(tempfile.mkdtemp(prefix="pagedserve-kv-"))
options = dict(num_gpu_blocks_override=24, max_model_len=384, max_num_seqs=4)
llm = LLM(model=model, kv_offload_memory=256 << 20, kv_offload_dir=str(folder), **options)
kv = llm.engine.kv_cache_manager
greedy = SamplingParams(temperature=0, max_tokens=4)

document = " ".join(
    f"Clause {i}: the tenant keeps the garden tidy and the gate shut." for i in range(16)
)
tokens = llm.get_tokenizer().encode(document)
print(f"== 1. A pool of {kv.num_blocks} blocks; a document of {len(tokens)} tokens ==")


def ask(question: str):
    """One question about the document: its answer, how many prompt tokens were not
    computed, and the time to the answer."""
    prompt = {"prompt_token_ids": tokens + llm.get_tokenizer().encode(question)}
    start = time.perf_counter()
    (out,) = llm.generate([prompt], greedy, use_tqdm=False)
    return out.outputs[0].text, out.num_cached_tokens, time.perf_counter() - start


def tiers(engine) -> str:
    s = engine.get_stats().kv_connector
    return f"hit tokens {dict(s.hit_tokens)}, blocks held {dict(s.tier_blocks)}"


# ## 2. Cold, then evicted from the pool
#
# The first question computes the whole document; its full blocks are saved to both tiers
# after the forward that computed them (the disk tier's writer thread writes behind, so it may
# still be writing the last ones when the counts are read). Then other prompts need the pool, and the document's
# blocks, free but still cached, are evicted, least recently used first. A finished request
# frees its blocks tail first, so the document's head stays longest: the pool's own lookup
# still finds its first blocks, and nothing after them.

cold_text, cold_cached, cold_s = ask(" Who keeps the garden tidy?")
print(f"== 2. Cold: {cold_cached} tokens from cache, {cold_s:.2f} s; {tiers(llm.engine)}")
for i in range(2):
    noise = llm.get_tokenizer().encode(f"Write about topic {i}: " + "rivers and mountains " * 45)
    llm.generate([{"prompt_token_ids": noise}], greedy, use_tqdm=False)
_, in_pool = kv.get_computed_blocks(tokens)
print(f"   after other traffic, the pool still holds {in_pool} of the document's tokens")

# ## 3. Loaded back from RAM
#
# The second question finds the document's head in the pool and the rest of its blocks in the
# RAM tier, which it loads into fresh blocks before the step's forward: only the question (and
# the last partial block) is computed.

warm_text, warm_cached, warm_s = ask(" Who keeps the gate shut?")
print(f"== 3. Warm: {warm_cached} tokens loaded, {warm_s:.2f} s; {tiers(llm.engine)}")
llm.engine.shutdown()  # the disk writer's queue is written out

# ## 4. A restart, and the disk tier
#
# A new engine on the same folder reads the folder's hash root, so the document hashes to the
# same names as before: its first question is loaded from disk (asynchronously: the request
# waits while loader threads read and check the files), and answers exactly as the cold run.

files = sorted(folder.rglob("*.kv"))
print(f"== 4. Restart: {len(files)} block files of {files[0].stat().st_size} bytes each")
llm = LLM(model=model, kv_offload_dir=str(folder), **options)
again_text, again_cached, again_s = ask(" Who keeps the garden tidy?")
print(f"   {again_cached} tokens loaded from disk, {again_s:.2f} s; {tiers(llm.engine)}")
print(f"   same answer as the cold run: {again_text == cold_text}")

# ## 5. A block file that is not what it says is never loaded
#
# Each file starts with a header: the model's fingerprint, the cache dtype, the block's shape,
# the key it was saved under and a checksum of the bytes. Flip one byte of the keys and values
# of the document's fifth block, and the next engine refuses that file (counted, deleted),
# loads the four blocks before it and recomputes the rest.

llm.engine.shutdown()
key = llm.engine.kv_cache_manager.hash_prefix(tokens, len(tokens))[4]  # as the folder names it
fifth = next(f for f in files if f.stem == key.hex())
data = bytearray(fifth.read_bytes())
data[HEADER.size + 1000] ^= 0xFF
fifth.write_bytes(bytes(data))
llm = LLM(model=model, kv_offload_dir=str(folder), **options)
text, cached, _ = ask(" Who keeps the garden tidy?")
stats = llm.engine.get_stats().kv_connector
print(f"== 5. One flipped byte: rejected {dict(stats.rejected_blocks)}, {cached} tokens loaded,")
print(f"   the answer still the cold run's: {text == cold_text}")
llm.engine.shutdown()
shutil.rmtree(folder)  # the lesson's temporary folder, left behind by no run
