"""``LLM(model="x.gguf")``: GGUF files served in their blocks, nothing converted to disk.

The files are written here (pagedserve.models.gguf_testing) from the tiny random checkpoints,
each tensor in the type a recipe picks, laid out as llama.cpp's converter lays them out (Q/K
rows permuted, its names, its metadata, the tokenizer in ``tokenizer.ggml.*``). The
reference is transformers loading the same file: its GGUF loader dequantizes every tensor
with the ``gguf`` package's decoders and undoes the permutation itself, so the config
mapping, the decoders and the permutation are each checked against an independent
implementation. Our engine must compute that model's prompt log-probabilities (fp32
tolerance) and its greedy tokens, and differ from the unquantized checkpoint (so the blocks
really were the lossy ones).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_quantization import prompt_token_logprobs, transformers_token_logprobs
from transformers import AutoModelForCausalLM

from pagedserve.engine import LLM, SamplingParams
from pagedserve.models.gguf_testing import write_gguf
from pagedserve.models.quantization_gguf import GGUFLinearMethod
from pagedserve.models.testing import transformers_greedy

PROMPT = list(range(5, 45))


def smollm2_like(name: str) -> str:
    """The shipped default model's recipe: Q4_1 projections, a Q8_0 embedding tied to the head."""
    return "Q8_0" if name == "token_embd.weight" else "Q4_1"


def k_quant_mixture(name: str) -> str:
    """A Q4_K_M-like mixture: fused qkv and gate_up of mixed types, an untied Q6_K head."""
    layer0 = name.startswith("blk.0.")
    return {
        "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_0",
        "ffn_gate": "Q4_K" if layer0 else "Q8_0", "ffn_up": "Q4_K", "ffn_down": "Q6_K",
        "token_embd": "Q4_K", "output": "Q6_K",
    }[name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]]  # fmt: skip


def float_types(name: str) -> str:
    kind = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
    return {"attn_q": "F16", "attn_k": "BF16", "attn_v": "F32", "ffn_down": "BF16"}.get(kind, "F16")


CASES = {  # id: (tiny arch, config overrides, recipe, lossy?)
    "llama-q4_1-tied": ("llama", {"tie_word_embeddings": True}, smollm2_like, True),
    "llama-k-quants": (
        "llama",
        {"hidden_size": 256, "intermediate_size": 512},
        k_quant_mixture,
        True,
    ),
    "llama-float-types": ("llama", {}, float_types, True),
    "qwen2-q8_0": ("qwen2", {}, lambda name: "Q8_0", True),
}


@pytest.fixture(scope="module")
def gguf_file(tiny_checkpoint, tmp_path_factory):
    made: dict[str, tuple[str, str]] = {}

    def make(case: str) -> tuple[str, str]:
        if case not in made:
            arch, overrides, recipe, _ = CASES[case]
            folder = tiny_checkpoint(arch, **overrides)
            path = tmp_path_factory.mktemp("gguf") / f"{case}.gguf"
            made[case] = (folder, str(write_gguf(folder, path, recipe)))
        return made[case]

    return make


@pytest.mark.parametrize("case", list(CASES))
def test_served_gguf_computes_transformers_dequantized_model(gguf_file, case):
    folder, path = gguf_file(case)
    llm = LLM(model=path, block_size=8)
    ours = prompt_token_logprobs(llm, PROMPT)
    p = Path(path)
    hf = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    torch.testing.assert_close(
        ours, transformers_token_logprobs(hf.eval(), PROMPT), atol=1e-4, rtol=1e-4
    )
    unquantized = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert (ours - transformers_token_logprobs(unquantized, PROMPT)).abs().max() > 1e-4
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    assert out.outputs[0].token_ids == transformers_greedy(hf, PROMPT, 16)


def test_weights_stay_in_their_blocks(gguf_file):
    _, path = gguf_file("llama-k-quants")
    llm = LLM(model=path, block_size=8)
    model = llm.engine.runner.model
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj.linear_method, GGUFLinearMethod)
    assert attn.qkv_proj.weight_parts is not None  # Q4_K, Q4_K, Q6_K: kept apart
    assert attn.o_proj.weight.dtype == torch.uint8 and attn.o_proj.weight_type == 2  # Q4_0
    assert model.lm_head.weight.gguf_type == 14 and model.model.embed_tokens.weight.gguf_type == 12
    # Q4_K is 4.5 bits a weight: a 256 x 256 projection is 36 KiB of blocks, not 256 KiB of fp32
    assert model.model.layers[0].self_attn.o_proj.weight.numel() == 256 * 256 // 256 * 18 * 8


def test_tokenizer_and_chat_template_come_from_the_file(gguf_file, tiny_checkpoint):
    folder, path = gguf_file("llama-q4_1-tied")
    llm = LLM(model=path, block_size=8)
    ours, theirs = llm.get_tokenizer(), LLM(model=folder, block_size=8).get_tokenizer()
    text = "Paged attention reads keys and values. 你好 🙂"
    assert ours(text).input_ids == theirs(text).input_ids
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(
        chat, tokenize=False
    )
    assert llm.engine.model_config.eos_token_ids == [2]
