"""Continuous batching: scheduling at every step instead of every batch.

A static batch runs until its longest request is done, so the slots of requests that finished
early sit idle while other requests wait in the queue. Continuous (iteration-level) batching, from
Orca and vLLM, decides again at every step: a request that finishes frees its slot and its KV
blocks at once, and a waiting request takes the slot on the next step. This lesson counts the
idle slots of both on the classic example, then watches pagedserve's real scheduler admit,
run and retire requests step by step on a tiny model — and checks that batching changes no token.
"""

import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from pagedserve.engine import LLMEngine, SamplingParams
from pagedserve.engine.config import EngineArgs
from pagedserve.models.testing import make_tiny_checkpoint, transformers_greedy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from slot_utilization import (  # noqa: E402
    SEED_LENGTHS,
    continuous_batching,
    format_table,
    percent,
    static_batching,
    workload,
)

torch.set_num_threads(1)

# ## 1. The idle slots of static batching
#
# Eight requests that generate 50, 100, ..., 400 tokens share a batch of eight slots. Statically,
# the batch runs 400 steps; the request that wanted 50 tokens holds an idle slot for 350 of them.
# Slots used over slots offered: 1800 / (8 x 400).

first = static_batching(SEED_LENGTHS, 8)
print("== 1. One static batch of the eight requests ==")
print(
    f"  {first.busy_slot_steps} slot-steps used of {first.offered_slot_steps}: {percent(first.overall)}"
)

# Now 24 more requests of the same lengths wait behind the first eight. tools/slot_utilization.py
# runs them through static batches and through pagedserve's real Scheduler and KVCacheManager
# (no model: every sampled token is a constant). While requests are queued, continuous batching
# keeps every slot busy.

lengths = workload(24)
static, ours = static_batching(lengths, 8), continuous_batching(lengths, 8)
print(f"\n== 2. 32 requests, batch size 8 ==\n{format_table([static, ours])}")
print(
    f"  static batching needs {static.steps / ours.steps:.2f}x the steps to finish the same work\n"
)

# ## 3. The live scheduler, step by step
#
# Now the real engine on a tiny random-weight Llama. Eight requests with different prompt and
# output lengths, but room for only three sequences at a time (max_num_seqs=3), and a token budget
# of 16 tokens per step (max_num_batched_tokens=16), so long prompts are read in chunks. To see
# each step's plan we wrap the scheduler's schedule() and keep its output; the engine is unchanged.

prompt_lens = [12, 30, 5, 20, 8, 26, 3, 15]
output_lens = [6, 3, 9, 4, 7, 2, 5, 8]
plans = []

with tempfile.TemporaryDirectory() as tmp:
    path = make_tiny_checkpoint("llama", tmp)
    engine = LLMEngine(
        EngineArgs(model=str(path), max_num_seqs=3, max_num_batched_tokens=16, block_size=8)
    )
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=generator).tolist() for n in prompt_lens]
    for i, (prompt, n) in enumerate(zip(prompts, output_lens)):
        engine.add_request(
            f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        )

    # Each line is one step: every scheduled request with the tokens it computes this step —
    # "prefill a..b" while it reads its prompt (a chunk when the budget is short), "decode" once it
    # generates. A request that finishes leaves; the next step a waiting one joins.

    print("== 3. The scheduler's plan, step by step (max_num_seqs=3, budget 16 tokens) ==")
    results = {}
    while engine.has_unfinished_requests():
        outputs = engine.step()
        plan = plans[-1]
        parts = []
        for item in plan.scheduled:
            rid, start, count = (
                item.request.request_id,
                item.num_computed_tokens,
                item.num_new_tokens,
            )
            in_prompt = start < item.request.num_prompt_tokens
            step_kind = f"prefill {start}..{start + count}" if in_prompt else "decode"
            parts.append(f"{rid}:{step_kind}")
        done = [o.request_id for o in outputs if o.finished]
        results.update({o.request_id: o.outputs[0].token_ids for o in outputs if o.finished})
        print(
            f"  step {len(plans):2d} [{plan.num_scheduled_tokens:2d} tokens] {'  '.join(parts)}"
            + (f"   -> finished {', '.join(done)}" if done else "")
        )
    total_steps = len(plans)
    print(f"  {total_steps} steps for {sum(output_lens)} output tokens of 8 requests")

    # ## 4. Batching changes no token
    #
    # Whatever company a request keeps in a step, each sequence attends only to its own blocks, so
    # its output must be exactly what transformers' own greedy loop gives for it alone.

    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    same = all(
        results[f"r{i}"] == transformers_greedy(reference, prompt, n)
        for i, (prompt, n) in enumerate(zip(prompts, output_lens))
    )
    print("\n== 4. Against transformers, one request at a time ==")
    print(f"  every request's tokens equal transformers' greedy output: {same}")
    assert same
