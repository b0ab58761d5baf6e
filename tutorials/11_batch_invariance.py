"""Batch invariance: the same request, the same bits, whatever else is in the batch.

A server computes a request together with whatever else arrived: its rows go through GEMMs,
attention and reductions whose blocking and summation order follow the size of the batch. The
results differ in their last bits, and where two tokens are nearly tied, that is enough to
change the answer: the same prompt, the same greedy parameters, another token. This lesson
provokes exactly that on a tiny model, then turns on ``batch_invariant=True`` (the engine's
``--batch-invariant``, vLLM's ``VLLM_BATCH_INVARIANT=1``), under which every kernel computes a
row in an order that depends on that row alone, and shows the tie holding.
"""

import shutil
import struct
import tempfile
from pathlib import Path

import torch

from pagedserve.engine import LLM, SamplingParams
from pagedserve.models.testing import make_tiny_checkpoint

torch.set_num_threads(1)
work = Path(tempfile.mkdtemp(prefix="bi-tutorial-"))
model = str(make_tiny_checkpoint("llama", work))
gen = torch.Generator().manual_seed(0)
target = torch.randint(3, 512, (12,), generator=gen).tolist()
others = [torch.randint(3, 512, (30,), generator=gen).tolist() for _ in range(20)]

# ## 1. One request, alone and in a batch
#
# The target's prompt is 12 tokens. Alone, its prefill is a 12-row step: on a CPU the linear
# layers take the numba GEMM that a decode step takes. Inside a batch of 21 prompts the step has
# some 600 rows, and the GEMMs go to MKL, which blocks and sums differently. Prefix caching is
# off so that every run computes the prompt the same way.


def engine(batch_invariant: bool) -> LLM:
    return LLM(model=model, block_size=8, kv_cache_memory=16 << 20,
               enable_prefix_caching=False, batch_invariant=batch_invariant)  # fmt: skip


def first_token(llm: LLM, in_batch: bool, bias: dict[int, float] | None = None):
    """The target's first greedy token (and its top-2 logprobs), alone or among ``others``."""
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=2, logit_bias=bias)
    prompts = [{"prompt_token_ids": p} for p in ([*others[:10], target, *others[10:]]
                                                 if in_batch else [target])]  # fmt: skip
    outs = llm.generate(prompts, params, use_tqdm=False)
    out = outs[10 if in_batch else 0].outputs[0]
    return out.token_ids[0], dict(out.logprobs[0])


default = engine(batch_invariant=False)
token, alone = first_token(default, in_batch=False)
_, together = first_token(default, in_batch=True)
a, b = sorted(alone, key=alone.get, reverse=True)[:2]  # the two most likely tokens
for name, logprobs in (("alone", alone), ("in a batch of 21", together)):
    print(
        f"{name:>17}: logprob of {a} = {float(logprobs[a]):.9f}, of {b} = {float(logprobs[b]):.9f}"
    )
print("the same request, the same model: its logprobs differ in the last bits")

# ## 2. A near-tie, made on purpose
#
# A real near-tie (two tokens within ~1e-6 of each other) is rare in one token and common over
# millions. Here we make one: ``logit_bias`` raises token b's logit. For each way of running
# the request there is a smallest bias at which the greedy choice moves from a to b; we find it
# by bisection over the float32 values (their bit patterns are ordered like the values).


def bits(x: float) -> int:
    return struct.unpack("<i", struct.pack("<f", x))[0]


def from_bits(i: int) -> float:
    return struct.unpack("<f", struct.pack("<i", i))[0]


def threshold(llm: LLM, in_batch: bool) -> float:
    """The smallest float32 bias on token b that makes b the target's greedy first token."""
    lo, hi = bits(0.0), bits(64.0)  # a at no bias, b at a bias of 64 (assumed below)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        chosen, _ = first_token(llm, in_batch, {b: from_bits(mid)})
        lo, hi = (lo, mid) if chosen == b else (mid, hi)
    return from_bits(hi)


t_alone, t_batch = threshold(default, False), threshold(default, True)
print(f"bias that flips the answer: alone {t_alone!r}, in the batch {t_batch!r}")
bias = {b: from_bits((bits(t_alone) + bits(t_batch)) // 2)}  # between the two
answers = (first_token(default, False, bias)[0], first_token(default, True, bias)[0])
print(f"with bias {bias[b]!r}: alone -> token {answers[0]}, in the batch -> token {answers[1]}")
assert t_alone != t_batch and answers[0] != answers[1], "no flip: the batch changed no bit here"
print("the same request, the same greedy parameters: another token because of its neighbours")

# ## 3. The batch-invariant mode
#
# With ``batch_invariant=True`` the linear layers take the numba GEMM at every row count (one
# dot-product order per element), attention takes the numba kernel for every row with no KV
# splits, and every other op of the forward already computed a row on its own. The row's logits
# are then the same bits in both runs, so the threshold is one number: no bias separates them.
invariant = engine(batch_invariant=True)
_, alone = first_token(invariant, in_batch=False)
_, together = first_token(invariant, in_batch=True)
assert alone == together
print(f"batch invariant: logprob of {a} = {float(alone[a]):.9f} alone and in the batch")
t_alone, t_batch = threshold(invariant, False), threshold(invariant, True)
print(f"bias that flips the answer: alone {t_alone!r}, in the batch {t_batch!r}")
assert t_alone == t_batch
answers = (first_token(invariant, False, bias)[0], first_token(invariant, True, bias)[0])
print(f"with bias {bias[b]!r}: alone -> token {answers[0]}, in the batch -> token {answers[1]}")
assert answers[0] == answers[1]
print("the tie holds: the request's answer no longer depends on what it was batched with")

# What it costs: the mode gives up MKL's faster GEMM for many rows and SDPA for long prefills
# (docs/batch_invariance.md says where, and tools/bench_batch_invariant.py measures it).

shutil.rmtree(work)  # the lesson's tiny checkpoint
