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
from test_quantization import (
    assert_two_ranks_serve_as_one_process,
    prompt_token_logprobs,
    transformers_token_logprobs,
)
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


def the_other_block_types(name: str) -> str:
    """The types llama.cpp's Q2_K..Q5_K_M and IQ4 files add: Q5_0 / Q5_1 (its fallback for
    rows that are not whole 256-weight blocks), Q2_K, Q3_K, Q5_K, IQ4_NL, IQ4_XS."""
    layer0 = name.startswith("blk.0.")
    return {
        "attn_q": "Q5_K", "attn_k": "Q3_K", "attn_v": "Q5_0", "attn_output": "Q2_K",
        "ffn_gate": "Q5_1" if layer0 else "IQ4_XS", "ffn_up": "IQ4_NL", "ffn_down": "Q5_K",
        "token_embd": "Q5_0", "output": "Q3_K",
    }[name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]]  # fmt: skip


def float_types_and_q8_0(name: str) -> str:
    """The float types a GGUF can hold, around Q8_0 (qkv fuses F16, BF16 and F32 parts)."""
    kind = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
    return {"attn_q": "F16", "attn_k": "BF16", "attn_v": "F32", "ffn_down": "BF16"}.get(
        kind, "Q8_0"
    )


CASES = {  # id: (tiny arch, config overrides, recipe)
    "llama-q4_1-tied": ("llama", {"tie_word_embeddings": True}, smollm2_like),
    "llama-k-quants": (
        "llama",
        {"hidden_size": 256, "intermediate_size": 512},
        k_quant_mixture,
    ),
    "llama-other-block-types": (
        "llama",
        {"hidden_size": 256, "intermediate_size": 512},
        the_other_block_types,
    ),
    "qwen2-float-types-q8_0": ("qwen2", {}, float_types_and_q8_0),
}


@pytest.fixture(scope="module")
def gguf_file(tiny_checkpoint, tmp_path_factory):
    made: dict[str, tuple[str, str]] = {}

    def make(case: str) -> tuple[str, str]:
        if case not in made:
            arch, overrides, recipe = CASES[case]
            folder = tiny_checkpoint(arch, **overrides)
            path = tmp_path_factory.mktemp("gguf") / f"{case}.gguf"
            made[case] = (folder, str(write_gguf(folder, path, recipe)))
        return made[case]

    return make


@pytest.fixture(scope="module")
def served(gguf_file):
    """``served(case) -> (folder, gguf path, LLM over the gguf)``, one engine per case."""
    engines: dict[str, LLM] = {}

    def serve(case: str) -> tuple[str, str, LLM]:
        folder, path = gguf_file(case)
        if case not in engines:
            engines[case] = LLM(model=path, block_size=8)
        return folder, path, engines[case]

    return serve


@pytest.mark.parametrize("case", list(CASES))
def test_served_gguf_computes_transformers_dequantized_model(served, case):
    folder, path, llm = served(case)
    ours = prompt_token_logprobs(llm, PROMPT)
    p = Path(path)
    hf = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    torch.testing.assert_close(
        ours, transformers_token_logprobs(hf.eval(), PROMPT), atol=1e-4, rtol=1e-4
    )
    unquantized = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert (ours - transformers_token_logprobs(unquantized, PROMPT)).abs().max() > 1e-4
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    assert out.outputs[0].token_ids == transformers_greedy(hf, PROMPT, 8)


def test_multiplying_from_the_blocks_gives_the_reference_paths_tokens(gguf_file, monkeypatch):
    """On a CPU each GGUF layer multiplies from its blocks (numba: a decoded weight row per
    output feature for decode rows, decoded tiles and MKL for a prefill); the reference path
    (``PAGEDSERVE_KERNELS=ref``) dequantizes every layer whole on each call. Three prompts
    decoded together, every block type: the same greedy tokens."""
    _, path = gguf_file("llama-other-block-types")
    prompts = [{"prompt_token_ids": PROMPT[i:]} for i in (0, 7, 21)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = []
    for kernels in ("", "ref"):
        monkeypatch.setenv("PAGEDSERVE_KERNELS", kernels)
        outs = LLM(model=path, block_size=8).generate(prompts, params, use_tqdm=False)
        tokens.append([o.outputs[0].token_ids for o in outs])
    assert tokens[0] == tokens[1]


def test_weights_stay_in_their_blocks(served):
    _, _, llm = served("llama-k-quants")
    model = llm.engine.runner.model
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj.linear_method, GGUFLinearMethod)
    assert attn.qkv_proj.weight_parts is not None  # Q4_K, Q4_K, Q6_K: kept apart
    assert attn.o_proj.weight.dtype == torch.uint8 and attn.o_proj.weight_type == 2  # Q4_0
    assert model.lm_head.weight.gguf_type == 14 and model.model.embed_tokens.weight.gguf_type == 12
    # Q4_K is 4.5 bits a weight: a 256 x 256 projection is 36 KiB of blocks, not 256 KiB of fp32
    assert model.model.layers[0].self_attn.o_proj.weight.numel() == 256 * 256 // 256 * 18 * 8


def test_a_loaded_model_lets_go_of_the_file(gguf_file):
    """The reader (its records, and the map that holds every page the load read) is dropped
    once the weights are copied out: the loaded model's memory is its blocks, not the file
    twice over. The engine still serves after."""
    import gc
    import weakref

    from pagedserve.models.gguf_config import open_gguf

    _, path = gguf_file("qwen2-float-types-q8_0")
    reader = weakref.ref(open_gguf(path))
    llm = LLM(model=path, block_size=8)
    gc.collect()
    assert reader() is None
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


def test_tokenizer_and_chat_template_come_from_the_file(served):
    from pagedserve.models import load_tokenizer

    folder, _, llm = served("llama-q4_1-tied")
    ours, theirs = llm.get_tokenizer(), load_tokenizer(folder)
    text = "Paged attention reads keys and values. 你好 🙂"
    assert ours(text).input_ids == theirs(text).input_ids
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(
        chat, tokenize=False
    )
    assert llm.engine.model_config.eos_token_ids == [2]


def test_the_shipped_smollm2_gguf_served_in_blocks_matches_its_converted_folder(
    default_model_path,
):
    """The default model's Q4_1 GGUF, served natively, against the fp32 folder setup made
    from it (transformers dequantized those same blocks): one prompt's log-probabilities
    and 6 greedy tokens (each costs the CPU path a decode of every block: ~1 s). Measured
    (tools/bench_gguf.py): 32 greedy tokens identical on 4 prompts. The log-probabilities
    differ by up to 6e-4 (not the fp32 path's 1e-5): the CPU's integer dots round each 32
    activations to 16 bits (cpu/integer_dot.py), and a group that holds one of SmolLM2's
    large activations rounds its small ones coarsely."""
    from pagedserve.models.default_model import find_default_gguf

    small = dict(block_size=16, max_model_len=256, max_num_batched_tokens=256, max_num_seqs=2)
    gguf, folder = (LLM(model=m, **small) for m in (str(find_default_gguf()), default_model_path))
    prompt = gguf.get_tokenizer()(
        "The capital of France is Paris. The capital of Italy is"
    ).input_ids
    torch.testing.assert_close(
        prompt_token_logprobs(gguf, prompt),
        prompt_token_logprobs(folder, prompt),
        atol=2e-3,
        rtol=1e-4,
    )
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    ours, theirs = (
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].token_ids
        for llm in (gguf, folder)
    )
    assert ours == theirs
    gguf_bytes = sum(p.numel() * p.element_size() for p in gguf.engine.runner.model.parameters())
    assert gguf_bytes < 100 * 2**20  # 92 MiB of blocks, against 513 MiB of fp32


def _truncated(path: str, tmp_path) -> str:
    data = Path(path).read_bytes()
    out = tmp_path / "truncated.gguf"
    out.write_bytes(data[: len(data) * 3 // 4])
    return str(out)


def test_bad_gguf_files_are_refused_at_load_naming_the_file(gguf_file, tiny_checkpoint, tmp_path):
    import gguf

    from pagedserve.models import ModelConfig, ModelLoadError

    _, path = gguf_file("llama-q4_1-tied")
    cut = _truncated(path, tmp_path)
    with pytest.raises(ModelLoadError, match="truncated") as e:
        ModelConfig(model=cut)
    assert cut in str(e.value)
    mxfp4 = write_gguf(tiny_checkpoint("llama"), tmp_path / "mxfp4.gguf", lambda name: "MXFP4")
    with pytest.raises(ModelLoadError, match="type MXFP4, which pagedserve does not serve"):
        ModelConfig(model=str(mxfp4))
    writer = gguf.GGUFWriter(str(tmp_path / "phi2.gguf"), "phi2")
    writer.add_tensor("token_embd.weight", torch.zeros(8, 32).numpy())
    for step in (
        writer.write_header_to_file,
        writer.write_kv_data_to_file,
        writer.write_tensors_to_file,
        writer.close,
    ):
        step()
    with pytest.raises(ModelLoadError, match="architecture 'phi2' is not supported"):
        ModelConfig(model=str(tmp_path / "phi2.gguf"))
    with pytest.raises(ModelLoadError, match="does not exist"):
        ModelConfig(model=str(tmp_path / "absent.gguf"))
    with pytest.raises(ModelLoadError, match="already quantized"):
        LLM(model=path, quantization="int8")


def test_a_row_parallel_shard_must_fall_on_block_boundaries():
    from pagedserve.kernels.testing import random_gguf_rows
    from pagedserve.models import ModelLoadError
    from pagedserve.models.quantization_gguf import GGUFTensor

    rows = random_gguf_rows(12, 4, 512).numpy()  # Q4_K: blocks of 256 inputs
    tensor = GGUFTensor(rows, 12, (4, 512), "blk.0.ffn_down.weight")
    assert tensor.narrow(1, 256, 256).dequantize().equal(tensor.dequantize()[:, 256:])
    assert tensor.narrow(0, 1, 2).dequantize().equal(tensor.dequantize()[1:3])
    with pytest.raises(ModelLoadError, match="block boundaries"):
        tensor.narrow(1, 128, 256)


@pytest.mark.slow
def test_two_ranks_serve_a_gguf_as_one_process(gguf_file):
    """Output rows shard as unquantized rows do; a row-parallel shard is whole Q4_1 blocks
    (32 weights) here, so each rank multiplies its own run of the blocks."""
    _, path = gguf_file("llama-q4_1-tied")
    assert_two_ranks_serve_as_one_process(path, PROMPT, block_size=8, kv_cache_memory=4 * 2**20)
