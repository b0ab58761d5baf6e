"""Multi-LoRA batching end to end: one batch mixing adapters (several ranks and target sets) and
base rows, each row's greedy tokens equal to transformers + peft running that adapter alone
(fp32), base rows equal to the plain base model; the slot/LRU tiers; the prefix cache never
sharing blocks across adapters."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine import LLM, InvalidRequestError, LoRARequest, SamplingParams
from pagedserve.models.testing import make_peft_adapter, peft_greedy, transformers_greedy

LLAMA_ADAPTERS = {  # name: (rank, alpha, targets, rslora)
    "attn8": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], False),
    "mlp16": (16, 8, ["gate_proj", "up_proj", "down_proj"], True),
    "qv4": (4, 4, ["q_proj", "v_proj", "down_proj"], False),
}
GPT2_ADAPTERS = {
    "all8": (8, 16, ["c_attn", "c_proj", "c_fc"], False),
    "fc4": (4, 8, ["c_fc"], False),
}
PROMPTS = [[1, 17, 33, 250, 99, 7], [1, 5, 6, 300, 41], [1, 200, 201, 202, 203, 204, 205, 9]]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def adapters(tiny_checkpoint, tmp_path_factory):
    """arch -> (base path, {name: LoRARequest})."""
    made = {}
    for arch, specs in (("llama", LLAMA_ADAPTERS), ("gpt2", GPT2_ADAPTERS)):
        base = tiny_checkpoint(arch)
        requests = {}
        for i, (name, (r, alpha, targets, rslora)) in enumerate(specs.items(), start=1):
            path = make_peft_adapter(
                base, tmp_path_factory.mktemp(name), targets, r, alpha, seed=i, use_rslora=rslora
            )
            requests[name] = LoRARequest(name, i, str(path))
        made[arch] = (base, requests)
    return made


def reference_tokens(base: str, adapter: str | None, prompt: list[int]) -> list[int]:
    return peft_greedy(base, adapter, prompt, MAX_TOKENS)


def llm_for(base: str, **kw) -> LLM:
    defaults = dict(dtype="float32", device="cpu", num_gpu_blocks_override=64, max_lora_rank=16)
    return LLM(base, enable_lora=True, **(defaults | kw))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_batch_mixing_adapters_and_base_matches_peft_row_by_row(adapters, arch):
    base, loras = adapters[arch]
    names = list(loras)
    # every adapter twice over the prompts, and base rows between them
    plan = [(p, names[i % len(names)]) for i, p in enumerate(PROMPTS)] + [(PROMPTS[0], None)]
    plan += [(PROMPTS[1], names[-1]), (PROMPTS[2], None)]
    llm = llm_for(base, max_loras=len(names), max_cpu_loras=len(names))
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p, _ in plan],
        greedy,
        use_tqdm=False,
        lora_request=[loras[n] if n else None for _, n in plan],
    )
    seen_different = False
    for (prompt, name), out in zip(plan, outs, strict=True):
        want = reference_tokens(base, loras[name].lora_path if name else None, prompt)
        assert list(out.outputs[0].token_ids) == want, (name, prompt)
        if name is not None:
            seen_different |= want != reference_tokens(base, None, prompt)
    assert seen_different, "the adapters never changed a token: the test could not fail"


def test_more_adapters_than_slots_queue_and_all_finish_correctly(adapters):
    """max_loras=1: three adapters and the base in one call; each request waits for the slot
    (no starvation) and a slot reloaded from host memory or from disk (max_cpu_loras=1) still
    holds the right adapter."""
    base, loras = adapters["llama"]
    llm = llm_for(base, max_loras=1, max_cpu_loras=1)
    order = ["attn8", "mlp16", None, "qv4", "attn8"]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(
        [{"prompt_token_ids": PROMPTS[0]}] * len(order),
        greedy,
        use_tqdm=False,
        lora_request=[loras[n] if n else None for n in order],
    )
    for name, out in zip(order, outs, strict=True):
        want = reference_tokens(base, loras[name].lora_path if name else None, PROMPTS[0])
        assert list(out.outputs[0].token_ids) == want, name
    manager = llm.engine.lora_manager
    assert len(manager.resident) == 1 and len(manager.host) == 1


def test_the_prefix_cache_never_shares_blocks_across_adapters(adapters):
    base, loras = adapters["llama"]
    llm = llm_for(base, max_loras=2, block_size=8)
    prompt = {"prompt_token_ids": PROMPTS[2] * 3}  # 24 tokens: 2 full blocks to share
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    first = llm.generate(prompt, greedy, use_tqdm=False, lora_request=loras["attn8"])[0]
    other = llm.generate(prompt, greedy, use_tqdm=False, lora_request=loras["mlp16"])[0]
    same = llm.generate(prompt, greedy, use_tqdm=False, lora_request=loras["attn8"])[0]
    base_run = llm.generate(prompt, greedy, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert other.num_cached_tokens == 0 and base_run.num_cached_tokens == 0
    assert same.num_cached_tokens == 16


def test_bad_adapters_are_refused_when_they_are_added(adapters, tmp_path):
    base, loras = adapters["llama"]
    llm = llm_for(base, max_lora_rank=8)
    with pytest.raises(InvalidRequestError, match="exceeds max_lora_rank 8"):
        llm.generate("hi", use_tqdm=False, lora_request=loras["mlp16"])
    with pytest.raises(InvalidRequestError, match="does not exist"):
        llm.generate("hi", use_tqdm=False, lora_request=LoRARequest("x", 9, str(tmp_path / "no")))
    llm.engine.add_lora(loras["attn8"])
    with pytest.raises(InvalidRequestError, match="already loaded"):
        llm.engine.add_lora(LoRARequest("attn8", 5, loras["qv4"].lora_path))
    with pytest.raises(InvalidRequestError, match="already used"):
        llm.engine.add_lora(
            LoRARequest("other", loras["attn8"].lora_int_id, loras["qv4"].lora_path)
        )
    assert [r.lora_name for r in llm.engine.list_loras()] == ["attn8"]
    assert not llm.engine.has_unfinished_requests()  # the refused requests left nothing behind


def test_lora_requests_without_enable_lora_are_refused(tiny_checkpoint, adapters):
    base, loras = adapters["llama"]
    llm = LLM(base, dtype="float32", device="cpu", num_gpu_blocks_override=16)
    with pytest.raises(InvalidRequestError, match="LoRA is not enabled"):
        llm.generate("hi", use_tqdm=False, lora_request=loras["attn8"])


def test_removing_an_adapter_lets_its_running_requests_finish_with_it(adapters):
    """remove_lora between steps: no new request may use the adapter, the running one ends
    with exactly that adapter's tokens, and only then are its slot and host copy freed."""
    base, loras = adapters["llama"]
    engine = llm_for(base, max_loras=1).engine
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request("r", PROMPTS[0], greedy, lora_request=loras["attn8"])
    engine.step()  # the prompt, and its first token
    assert engine.remove_lora(loras["attn8"].lora_int_id)
    with pytest.raises(InvalidRequestError, match="being unloaded"):
        engine.add_request("late", PROMPTS[1], greedy, lora_request=loras["attn8"])
    assert engine.lora_manager.resident == {loras["attn8"].lora_int_id: 0}  # still in use
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert list(outputs[-1].outputs[0].token_ids) == reference_tokens(
        base, loras["attn8"].lora_path, PROMPTS[0]
    )
    assert engine.lora_manager.resident == {} and engine.list_loras() == []


def test_an_adapter_on_smollm2_matches_peft(default_model_path, tmp_path):
    """The default model (SmolLM2-135M, GQA 9/3 heads) with one adapter on q/k/v and the MLP,
    beside a base row, fp32. One transformers model serves both references (the base row's
    with the adapter disabled), made and saved by peft as make_peft_adapter does."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32)
    config = LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "up_proj"]
    )
    peft_model = get_peft_model(hf, config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.15)
    peft_model.save_pretrained(tmp_path / "a")
    llm = llm_for(default_model_path, max_lora_rank=8, num_gpu_blocks_override=16)
    prompt = llm.get_tokenizer()("The capital of France is").input_ids
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    lora = LoRARequest("smol", 1, str(tmp_path / "a"))
    outs = llm.generate([{"prompt_token_ids": prompt}] * 2, greedy, use_tqdm=False,
                        lora_request=[lora, None])  # fmt: skip
    peft_model.eval()
    want_lora = transformers_greedy(peft_model, prompt, 4)
    with peft_model.disable_adapter():
        want_base = transformers_greedy(peft_model, prompt, 4)
    assert list(outs[0].outputs[0].token_ids) == want_lora
    assert list(outs[1].outputs[0].token_ids) == want_base
    assert want_lora != want_base


def test_forked_sequences_keep_their_requests_adapter(adapters):
    """n > 1 forks children after the prompt: each must run with the parent's adapter."""
    base, loras = adapters["llama"]
    llm = llm_for(base, max_loras=1)
    params = SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": PROMPTS[1]}, params, use_tqdm=False,
                       lora_request=loras["qv4"])[0]  # fmt: skip
    want = reference_tokens(base, loras["qv4"].lora_path, PROMPTS[1])
    assert [list(c.token_ids) for c in out.outputs] == [want, want]
