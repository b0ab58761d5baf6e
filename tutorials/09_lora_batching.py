"""LoRA batching: one step, several adapters, the shrink/expand math — drawn out on a tiny Llama.

A LoRA adapter changes a projection ``y = x W^T`` into ``y = x W^T + s * x A^T B^T`` with a
small rank r: ``A`` is ``[r, in]``, ``B`` is ``[out, r]``. Serving many adapters should not
mean one batch per adapter: the base product ``x W^T`` is the same for every row, only the
small correction differs. This lesson builds two PEFT adapters on the spot, shows the two
kernels that apply every adapter of a batch at once, then runs one engine step that mixes both
adapters with the base model and checks each row against transformers + peft.
"""

import shutil
import tempfile
from pathlib import Path

import torch

from pagedserve.engine import LLM, LoRARequest, SamplingParams
from pagedserve.kernels import lora_expand, lora_shrink
from pagedserve.models.testing import make_peft_adapter, make_tiny_checkpoint, peft_greedy

torch.set_num_threads(1)
work = Path(tempfile.mkdtemp(prefix="lora-tutorial-"))
base = str(make_tiny_checkpoint("llama", work / "base"))

# ## 1. Two adapters, made with peft
#
# peft starts B at zero (an untrained adapter changes nothing); these get random A and B so
# that each one visibly moves the model. "attn" adapts the attention projections at rank 8,
# "mlp" the MLP at rank 4.
attn = make_peft_adapter(base, work / "attn", ["q_proj", "k_proj", "v_proj", "o_proj"], r=8)
mlp = make_peft_adapter(base, work / "mlp", ["gate_proj", "up_proj", "down_proj"], r=4, seed=1)
print("adapters:", attn.name, "(r=8, attention)", "and", mlp.name, "(r=4, MLP)")

# ## 2. Shrink and expand: every adapter of a batch in one launch each
#
# The slots hold every resident adapter's A and B stacked; each token carries its slot (-1:
# the base model). lora_shrink gives each token ``x A[slot]^T`` (rank-sized), lora_expand adds
# ``y B[slot]^T`` into the base output in place, each token with its own slot's matrices.
gen = torch.Generator().manual_seed(0)
T, d_in, d_out, r, slots = 5, 16, 12, 4, 2
x = torch.randn(T, d_in, generator=gen)
W = torch.randn(d_out, d_in, generator=gen)
A = torch.randn(slots, r, d_in, generator=gen)
B = torch.randn(slots, d_out, r, generator=gen)
token_slot = torch.tensor([0, -1, 1, 1, 0])
out = x @ W.T
lora_expand(lora_shrink(x, A, token_slot), B, token_slot, out)
for t, slot in enumerate(token_slot.tolist()):
    alone = x[t] @ W.T + (x[t] @ A[slot].T @ B[slot].T if slot >= 0 else 0)
    assert torch.allclose(out[t], alone, atol=1e-5)
print("tokens' slots", token_slot.tolist(), "-> each row equals its adapter applied alone")

# A fused projection (qkv) has one A/B per part: one shrink over the parts' A stacked along
# the rank, then one expand per part into its columns. Rank r < the slots' rank is zero-padded.

# ## 3. One engine step mixing both adapters and the base model
llm = LLM(base, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
          num_gpu_blocks_override=64)  # fmt: skip
requests = {"attn": LoRARequest("attn", 1, str(attn)), "mlp": LoRARequest("mlp", 2, str(mlp))}
prompt = [1, 17, 33, 250, 99, 7]
plan = ["attn", None, "mlp", "attn"]
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
outs = llm.generate([{"prompt_token_ids": prompt}] * len(plan), params, use_tqdm=False,
                    lora_request=[requests.get(n) for n in plan])  # fmt: skip
for name, out in zip(plan, outs, strict=True):
    ours = list(out.outputs[0].token_ids)
    reference = peft_greedy(base, requests[name].lora_path if name else None, prompt, 8)
    assert ours == reference, (name, ours, reference)
    print(f"{name or 'base':>5}: {ours}  == transformers + peft for that adapter alone")
manager = llm.engine.lora_manager
print("device slots after the run (adapter id -> slot):", manager.resident)
ids = [requests[n].lora_int_id if n else 0 for n in plan]
print("a decode step of those rows gets token slots", manager.token_slots(ids, [1] * 4).tolist())

# ## 4. The prefix cache keeps adapters apart
#
# The same prompt under another adapter has other keys and values: the adapter's id is in every
# block's hash, so only a request with the same adapter reuses them.
long_prompt = {"prompt_token_ids": prompt * 4}
short = SamplingParams(temperature=0, max_tokens=1)
for name in ("attn", "mlp", "attn", None):
    cached = llm.generate(long_prompt, short, use_tqdm=False, lora_request=requests.get(name))
    print(f"{name or 'base':>5}: {cached[0].num_cached_tokens} prompt tokens from the cache")

shutil.rmtree(work)  # the lesson's checkpoint and adapters
