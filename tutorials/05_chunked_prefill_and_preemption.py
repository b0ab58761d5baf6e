"""Chunked prefill and preemption: staying fair and staying alive under pressure.

Two things go wrong in a naive continuous batcher. A long prompt that arrives while others are
generating is read in one enormous step, and every running request waits for it (a latency
spike). And when the KV cache fills up, sequences that are already running cannot get their next
block. pagedserve answers the first with one token budget per step, shared by decodes and
*prefill chunks*, and the second with *preemption by recompute*: the newest running request gives
its blocks back and is recomputed later. This lesson shows both on a tiny model, and checks that
neither changes a single output token.
"""

import tempfile

import torch
from transformers import AutoModelForCausalLM

from pagedserve.engine import LLMEngine, SamplingParams
from pagedserve.engine.config import EngineArgs
from pagedserve.models.testing import make_tiny_checkpoint, transformers_greedy

torch.set_num_threads(1)
generator = torch.Generator().manual_seed(0)


def random_prompt(n: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=generator).tolist()


class Step:
    """What one step's plan held, copied when it was made (requests change afterwards)."""

    def __init__(self, plan) -> None:
        self.tokens = plan.num_scheduled_tokens
        self.scheduled = [
            (s.request.request_id, s.num_computed_tokens, s.num_new_tokens) for s in plan.scheduled
        ]
        self.preempted = [(r.request_id, r.num_tokens) for r in plan.preempted]


def run(path: str, requests: list[tuple[list[int], int]], arrive_late: int = 0, **engine_args):
    """Run requests to completion; returns (outputs by id, a Step per step).

    The last ``arrive_late`` requests are added after three steps, when the others are decoding.
    We record each step's plan by wrapping the scheduler's schedule(); the engine is unchanged.
    """
    engine = LLMEngine(EngineArgs(model=path, block_size=8, **engine_args))
    steps = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        plan = schedule()
        steps.append(Step(plan))
        return plan

    engine.scheduler.schedule = recording_schedule
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in requests]
    first_late = len(requests) - arrive_late
    for i in range(first_late):
        engine.add_request(f"r{i}", requests[i][0], params[i])
    outputs = {}
    while engine.has_unfinished_requests() or len(steps) < 3 < first_late + 3:
        if len(steps) == 3:
            for i in range(first_late, len(requests)):
                engine.add_request(f"r{i}", requests[i][0], params[i])
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    return outputs, steps


with tempfile.TemporaryDirectory() as tmp:
    path = str(make_tiny_checkpoint("llama", tmp))
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    # ## 1. Chunked prefill: one budget for decodes and prompt chunks
    #
    # Three requests are decoding when a 300-token prompt arrives. Without chunked prefill the
    # whole prompt is one step of 300+ tokens, and the three decodes wait for it. With a token
    # budget of 32 tokens per step (max_num_batched_tokens), the decodes take 3 tokens of every
    # step and the prompt is read in chunks of the other 29 — nobody waits for more than a small
    # step. On a GPU a step's time grows with its tokens, so the largest step is the worst pause
    # a generating request sees.

    requests = [
        (random_prompt(10), 24),
        (random_prompt(12), 24),
        (random_prompt(9), 24),
        (random_prompt(300), 4),
    ]
    print("== 1. A 300-token prompt arrives while three requests decode ==")
    for chunked in (False, True):
        budget = 32 if chunked else 512
        outputs, steps = run(
            path,
            requests,
            arrive_late=1,
            enable_chunked_prefill=chunked,
            max_num_batched_tokens=budget,
            max_model_len=512,
        )
        sizes = [step.tokens for step in steps]
        prefill_steps = [
            step
            for step in steps
            if any(rid == "r3" and done < 300 for rid, done, _ in step.scheduled)
        ]
        print(
            f"  chunked prefill {'on, budget 32 ' if chunked else 'off           '}: largest step {max(sizes):3d} tokens; "
            f"the prompt was read in {len(prefill_steps)} step(s); step sizes {sizes[:12]}..."
        )
        same = all(
            outputs[f"r{i}"] == transformers_greedy(reference, p, n)
            for i, (p, n) in enumerate(requests)
        )
        print(f"      outputs equal transformers' greedy, request by request: {same}")
        assert same

    # ## 2. Preemption: when the cache runs dry
    #
    # Six requests, each growing to about 60 tokens (8 blocks of 8), but a pool of only 20 blocks.
    # They are all admitted while their prompts are short; as they grow, the pool empties. When a
    # running request needs a block and none is free, the scheduler preempts the *newest* running
    # request: frees all its blocks and puts it back at the head of the waiting queue. When room
    # returns, it is recomputed — prompt plus the tokens it had already generated — mostly from the
    # prefix cache, since its freed blocks keep their hashes until they are reused.

    requests = [(random_prompt(n), 40) for n in (14, 20, 11, 17, 9, 16)]
    outputs, steps = run(
        path, requests, num_gpu_blocks_override=20, max_num_batched_tokens=64, max_model_len=128
    )
    print("\n== 2. Six requests, 20 blocks of 8 tokens: preemption by recompute ==")
    preempted_at = {}
    for number, step in enumerate(steps, 1):
        for rid, known in step.preempted:
            print(
                f"  step {number:3d}: preempted {rid} with {known} tokens known; its blocks are freed"
            )
            preempted_at[rid] = known
        for rid, computed, new in step.scheduled:
            if rid in preempted_at and new > 1:
                print(
                    f"  step {number:3d}: {rid} readmitted: {computed} of its {preempted_at.pop(rid)} tokens "
                    f"found in the prefix cache, {new} recomputed in this step"
                )
    preemptions = sum(len(step.preempted) for step in steps)
    print(f"  {preemptions} preemptions in {len(steps)} steps")
    same = all(
        outputs[f"r{i}"] == transformers_greedy(reference, p, n)
        for i, (p, n) in enumerate(requests)
    )
    print(f"  every output still equals transformers' greedy output: {same}")
    assert same and preemptions > 0
