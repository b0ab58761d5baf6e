"""Speculative decoding: propose, verify, accept, roll back — one step drawn out on SmolLM2.

A decode step computes one token per sequence, and on a GPU it is limited by reading the
weights, not by arithmetic: running 1 + k tokens of a sequence costs little more than running
one. Speculative decoding spends that slack. A cheap proposer guesses k tokens; the target
model scores the last token and the k guesses in one forward; a prefix of the guesses is kept,
plus one token of the target's own, and the rest is rolled back. The outputs are exactly the
target's (greedy) or distributed exactly as its draws (sampling). This lesson draws one such
step out on the real default model with the n-gram proposer, then checks the whole answer
against plain decoding, and ends with a draft model proposing instead (its own KV cache on the
target's blocks).
"""

import torch

from pagedserve.engine import LLMEngine, SamplingParams
from pagedserve.engine.config import EngineArgs
from pagedserve.engine.spec_decode.ngram import propose_ngram_literal
from pagedserve.kernels.rejection_sample import rejection_sample
from pagedserve.models.default_model import ensure_default_model

torch.set_num_threads(1)
path = str(ensure_default_model())
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}
PROMPT = (
    "Copy the list exactly.\nList: apple, banana, cherry, date, elderberry, fig, grape.\n"
    "Copy: apple, banana,"
)
engine = LLMEngine(
    EngineArgs(model=path, block_size=8, num_gpu_blocks_override=32, speculative_config=NGRAM)
)
tokenizer = engine.tokenizer
kv = engine.kv_cache_manager
prompt_ids = tokenizer(PROMPT).input_ids
params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
engine.add_request("r", prompt_ids, params)
request = engine.scheduler.requests["r"]


def show(ids) -> str:
    return repr(tokenizer.decode(ids))


# ## 1. Propose
#
# The first step reads the prompt and samples one token. Right after it, the engine proposes the
# next tokens for every sequence that will decode: prompt lookup takes the sequence's last n
# tokens (n from 4 down to 2), finds their earliest earlier occurrence in the prompt and output,
# and proposes the (up to) 4 tokens that followed it. No model runs for this.

engine.step()
tokens = list(request.all_token_ids)
print("== 1. Propose ==")
print(f"  the sequence ends with {show(tokens[-6:])}")
print(f"  proposals on the request: {request.spec_token_ids} = {show(request.spec_token_ids)}")
assert request.spec_token_ids == propose_ngram_literal(tokens, 4, 2, 4)
print("  the same as the literal rule (propose_ngram_literal): True")

# ## 2. Verify: one forward over the last token and the proposals
#
# We watch the next steps from outside: wrapping the scheduler's schedule and update and the
# runner's forward (``execute_model``: the step's logits, before the runner verifies them)
# records what each saw, and the engine runs as it always does. We step on
# until a step rejects proposals that had spilled into a block of their own, and draw it out.


def recording(seen: dict):
    """Wrappers that fill ``seen`` with one step's plan, logits and update."""

    def recording_schedule():
        seen["before"] = (request.num_computed_tokens, kv.num_free_blocks)
        plan = schedule()
        item = plan.scheduled[0]
        seen["plan"] = (item.num_computed_tokens, item.num_new_tokens, list(item.spec_token_ids))
        seen["blocks during"] = (len(item.block_table), kv.num_free_blocks)
        return plan

    def recording_execute(model_input, blocks_to_copy):
        logits = execute(model_input, blocks_to_copy)
        seen["logits"] = logits.clone()  # the runner's sampler may change its rows in place
        return logits

    def recording_update(plan, sampled):
        seen["sampled"] = sampled["r"]
        updated = update(plan, sampled)
        seen["after"] = (request.num_computed_tokens, len(kv.block_tables["r"]), kv.num_free_blocks)
        return updated

    return recording_schedule, recording_execute, recording_update


schedule, execute, update = (
    engine.scheduler.schedule,
    engine.runner.execute_model,
    engine.scheduler.update,
)
print("\n== 2. Verify ==")
while True:
    seen = {}
    engine.scheduler.schedule, engine.runner.execute_model, engine.scheduler.update = recording(
        seen
    )
    engine.step()
    sampled = seen["sampled"]
    if isinstance(sampled, int):  # a step with no proposals samples one token, an int
        sampled = [sampled]
    print(f"  a step proposed {show(seen['plan'][2])}, emitted {show(sampled)}")
    rejected = len(sampled) <= len(seen["plan"][2])  # fewer than all proposals + 1
    spilled = seen["after"][1] < seen["blocks during"][0]  # a block only rejected tokens used
    if rejected and (spilled or not engine.has_unfinished_requests()):
        break
engine.scheduler.schedule, engine.runner.execute_model, engine.scheduler.update = (
    schedule,
    execute,
    update,
)
computed_before, free_before = seen["before"]
start, count, drafts = seen["plan"]
print(
    f"  drawn out: scheduled {count} tokens from position {start}: the last token, then the {len(drafts)} "
    "proposals (the token budget counts all of them)"
)
k = len(drafts)
logits = seen["logits"]
rows = logits  # one row per proposal, then the bonus row (the runner's layout of this step)
target = rows.argmax(dim=-1).tolist()
for j, draft in enumerate(drafts):
    verdict = "accepted" if target[j] == draft else "rejected"
    print(
        f"  position {start + 1 + j}: proposed {show([draft]):12} target's argmax {show([target[j]]):12} {verdict}"
    )
print(f"  after the last proposal the target would say {show([target[k]])} (the bonus token)")

# ## 3. Accept
#
# Greedy keeps the longest prefix of proposals that equal the target's argmax, then adds the
# target's own token at the first mismatch (or the bonus token when every proposal was kept).
# That is what plain decoding would have produced, one step at a time.

accepted = 0
while accepted < k and drafts[accepted] == target[accepted]:
    accepted += 1
expected = drafts[:accepted] + [target[accepted]]
print("\n== 3. Accept ==")
print(f"  emitted {sampled} = {show(sampled)}: {accepted} proposal(s), then 1 of its own")
assert sampled == expected

# With sampling the rule is Leviathan et al.'s: keep proposal j with probability
# min(1, p_j(d) / q_j(d)); at the first rejection draw from (p - q)+ renormalised. An n-gram
# proposer is sure of its guess (q is one-hot), so a proposal survives with probability p_j(d)
# and a rejection draws from p without d. The emitted token is then distributed exactly as p.

top = torch.topk(rows[accepted] / 0.8, 20)  # the rejected position, temperature 0.8, top_k 20
p0 = torch.softmax(top.values, dim=-1)  # over those 20 tokens
p_draft = torch.softmax(rows[accepted] / 0.8, dim=-1)[drafts[accepted]]
print(
    f"  sampled at temperature 0.8, the rejected {show(drafts[accepted : accepted + 1])} would "
    f"be kept with probability p = {p_draft:.4f}"
)
proposal = 1  # suppose the proposer had guessed the target's second most likely token
draws = 50000
gen = torch.Generator().manual_seed(0)
out = rejection_sample(
    torch.full((draws, 1), proposal),  # every row proposes the same token
    torch.ones(draws, dtype=torch.int32),
    None,  # one-hot q: the n-gram proposer
    p0.expand(draws, 1, 20).contiguous(),
    torch.zeros(draws, dtype=torch.long),
    torch.rand(draws, 1, generator=gen),
    torch.empty(draws, 1, 20).exponential_(generator=gen),
)
frequencies = torch.bincount(out[:, 0], minlength=20).float() / draws
print(
    f"  had it proposed the target's runner-up (token {int(top.indices[proposal])}, top_k 20): "
    f"p = {p0[proposal]:.3f}, kept in {frequencies[proposal]:.3f} of {draws} draws; the emitted "
    f"tokens' frequencies differ from p by at most {(frequencies - p0).abs().max():.4f}"
)

# ## 4. Roll back
#
# The verify step wrote keys and values for every proposal. The rejected ones are garbage: the
# scheduler rewinds the request past them (they will be computed again only if they really come)
# and the block manager gives back any block that only they used. Full blocks enter the prefix
# cache only once their tokens are known, so a proposal never does.

computed_after, blocks_after, free_after = seen["after"]
blocks_during, free_during = seen["blocks during"]
print("\n== 4. Roll back ==")
print(
    f"  computed tokens: {computed_before} before, {start + count} in the forward, "
    f"{computed_after} kept ({k - accepted} rejected proposals rewound)"
)
print(
    f"  blocks held: {blocks_during} during the step, {blocks_after} after; free blocks "
    f"{free_before} -> {free_during} -> {free_after}"
)
assert computed_after == request.num_tokens - 1

# ## 5. The whole answer, against plain decoding
#
# Run the request to its end and compare with an engine without speculation.


def run_to_the_end(llm: LLMEngine):
    """Step until the request is done; its last output."""
    last = None
    while llm.has_unfinished_requests():
        last = llm.step() or last
    return last[0].outputs[0]


final = run_to_the_end(engine)
plain = LLMEngine(EngineArgs(model=path, block_size=8, num_gpu_blocks_override=32))
plain.add_request("r", prompt_ids, params)
plain_final = run_to_the_end(plain)
stats = engine.get_stats()
print("\n== 5. The whole answer ==")
print(f"  {final.text!r}")
same = final.token_ids == plain_final.token_ids
print(f"  token for token the same as without speculation: {same}")
print(
    f"  {stats.spec_decode_num_accepted_tokens} of {stats.spec_decode_num_draft_tokens} proposals "
    f"accepted; {stats.spec_decode_mean_acceptance_length:.2f} tokens per verify step"
)
assert same and kv.num_free_blocks == kv.num_blocks

# ## 6. A draft model instead
#
# With ``{"method": "draft_model", "model": PATH}`` a small model sharing the target's tokenizer
# proposes: k autoregressive steps of its own at the start of each step, before the target
# verifies. Here the draft is SmolLM2 itself, the simplest draft that shares its tokenizer (a
# deployment picks a far smaller one), so every proposal is accepted. The draft has its own KV
# tensors with as many blocks as the target's pool, addressed by the same block tables; in every
# step it writes exactly the slots the target writes, with the same tokens, so after each step
# its cache holds its keys and values for every token the target has computed.

DRAFT = {"method": "draft_model", "model": path, "num_speculative_tokens": 4}
drafted = LLMEngine(
    EngineArgs(model=path, block_size=8, num_gpu_blocks_override=32, speculative_config=DRAFT)
)
short = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
drafted.add_request("d", prompt_ids, short)
draft = drafted.speculator.draft
print("\n== 6. A draft model ==")
print(
    f"  target KV cache per layer {tuple(drafted.runner.kv_caches[0][0].shape)}, draft's "
    f"{tuple(draft.kv_caches[0][0].shape)}: the same blocks"
)
drafted.step()  # the prompt, through both models; placeholders for the next step's proposals
placeholders = list(drafted.scheduler.requests["d"].spec_token_ids)
out = drafted.step()[0].outputs[0]  # the draft proposes 4, the target verifies them
print(f"  after the prefill: {placeholders} (slots to budget; the draft fills them next step)")
print(f"  the first verify step emitted {len(out.token_ids) - 1} tokens: {show(out.token_ids[1:])}")
d_request = drafted.scheduler.requests["d"]
table = torch.tensor(drafted.kv_cache_manager.block_ids("d"))
positions = torch.arange(d_request.num_computed_tokens)
slots = table[positions // 8] * 8 + positions % 8
gap = max(
    (target_cache.flatten(0, 1)[slots] - draft_cache.flatten(0, 1)[slots]).abs().max().item()
    for (tk, tv), (dk, dv) in zip(drafted.runner.kv_caches, draft.kv_caches, strict=True)
    for target_cache, draft_cache in ((tk, dk), (tv, dv))
)
print(
    f"  draft cache against target cache over the {len(slots)} computed slots: max |diff| "
    f"{gap:.1e} (the same model, the same tokens, the same slots)"
)
drafted_final = run_to_the_end(drafted)
same = drafted_final.token_ids == plain_final.token_ids[:16]
print(f"  16 tokens, the same as without speculation: {same}")
assert same and gap < 1e-3 and len(out.token_ids) == 6
