"""gpt-oss from a GGUF file, as llama.cpp's files hold it: experts in ggml's MXFP4 blocks (17
bytes per 32 weights, decoded at load by pagedserve's own decoder, held here to gguf's), the
rest in F32 or Q8_0, the metadata of llama.cpp's converter.

The reference is transformers on the Hugging Face folder the file was written from, each
quantized weight replaced by what gguf's own decoder reads from its blocks
(test_gguf_architectures.weights_decoded): the file's model. Its tokens are served with chunked
prefill and prefix caching on, over prompts three sliding windows long, as the folder's are in
test_moe_and_mla_serving.py. test_gguf_architectures.py holds the F32 file to llama.cpp's own
converter byte for byte, and a file that converter makes from OpenAI's MXFP4 release to the
release.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from test_gguf_architectures import CASES, weights_decoded
from test_quantization import (
    assert_two_ranks_serve_as_one_process,
    prompt_token_logprobs,
    transformers_token_logprobs,
)
from transformers import AutoModelForCausalLM

from pagedserve.engine import LLM, SamplingParams
from pagedserve.models import ModelConfig, ModelLoadError
from pagedserve.models.gguf_testing import write_gguf
from pagedserve.models.mxfp4 import dequantize_gguf_mxfp4
from pagedserve.models.testing import transformers_greedy

DESCRIBABLE = CASES["gpt_oss"][1]  # the SwiGLU limit llama.cpp assumes, reached
LONG = [(i * 37) % 500 + 3 for i in range(50)]  # 50 tokens: seven blocks of 8, three windows
PROMPTS = [LONG, list(range(30, 70)), LONG[:21] + [7, 8, 9], [11, 12, 13]]
DENSE = ("attn_q", "attn_k", "attn_v", "attn_output", "token_embd", "output")


def mxfp4_experts_q8_0_dense(name: str) -> str:
    """What ``convert_hf_to_gguf.py --outtype q8_0`` makes of OpenAI's release: the experts
    stay MXFP4, the attention projections, embedding and head are Q8_0, the router F32."""
    if name.endswith("_exps.weight"):
        return "MXFP4"
    return "Q8_0" if name.split(".")[-2] in DENSE else "F32"


def file_model(name: str) -> str | None:
    """The same choice under transformers' names (weights_decoded's ``type_of``)."""
    if ".experts." in name and "bias" not in name:
        return "MXFP4"
    dense = ("_proj.weight", "embed_tokens.weight", "lm_head.weight")
    return "Q8_0" if name.endswith(dense) and ".experts." not in name else None


def test_the_mxfp4_decoder_is_ggufs():
    """Every code under scales from E8M0's smallest (0 and 1: ggml halves them specially) up,
    and the blocks gguf's own quantizer writes: bit for bit what gguf.quants decodes."""
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (16, 8, 17), dtype=np.uint8)
    blocks[..., 0] = rng.integers(0, 200, (16, 8))
    blocks[0, :, 0] = np.arange(8)  # the smallest scales
    blocks[1, :, 1:] = np.arange(256, dtype=np.uint8)[:128].reshape(8, 16)  # each nibble pair
    written = gguf.quants.quantize(
        rng.standard_normal((16, 256)).astype(np.float32), gguf.GGMLQuantizationType.MXFP4
    )
    for rows in (blocks.reshape(16, -1), written):
        theirs = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType.MXFP4)
        ours = dequantize_gguf_mxfp4(torch.from_numpy(rows), torch.float32)
        assert torch.equal(ours, torch.from_numpy(theirs))


def test_the_file_describes_the_folders_model(tiny_checkpoint, tmp_path):
    """Four layers, windowed and full alternating; every size, the experts, YaRN unrounded,
    the SwiGLU limit: the config read from the file is the folder's."""
    layers = ["sliding_attention", "full_attention"] * 2
    folder = tiny_checkpoint("gpt_oss", num_hidden_layers=4, layer_types=layers, **DESCRIBABLE)
    path = write_gguf(folder, tmp_path / "four.gguf", lambda name: "F32")
    ours, theirs = ModelConfig(model=str(path)), ModelConfig(model=folder)
    assert ours.hf_architecture == "GptOssForCausalLM"
    assert ours.sliding_windows == theirs.sliding_windows == [16, None, 16, None]
    assert ours.has_attention_sinks
    config = json.loads((Path(folder) / "config.json").read_text())
    for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "num_local_experts", "num_experts_per_tok", "intermediate_size", "vocab_size",
                "max_position_embeddings", "tie_word_embeddings", "swiglu_limit",
                "attention_bias", "sliding_window", "layer_types"):  # fmt: skip
        assert ours.hf_config[key] == config[key], key
    assert ours.hf_config["rms_norm_eps"] == pytest.approx(config["rms_norm_eps"])
    rope = dict(ours.hf_config["rope_scaling"], rope_theta=ours.hf_config["rope_theta"])
    assert rope == config["rope_parameters"]


def test_mxfp4_experts_serve_the_files_model(tiny_checkpoint, tmp_path):
    """MXFP4 experts decoded into fp32 at load, Q8_0 projections multiplied in their blocks:
    the prompt's log-probabilities and 32 greedy tokens of four prompts, split into chunks
    and hitting the prefix cache, are transformers' on the file's model, which the
    unquantized folder is not. The log-probabilities (up to 18 in size here) within 1e-3 of
    their size, not fp32's 1e-4: the Q8_0 dots round activations to 16 bits per 32
    (cpu/integer_dot.py; measured 6e-3 at most, against 3.3 from the unquantized folder)."""
    folder = tiny_checkpoint("gpt_oss", **DESCRIBABLE)
    path = write_gguf(folder, tmp_path / "gpt-oss.gguf", mxfp4_experts_q8_0_dense)
    llm = LLM(
        model=str(path), block_size=8, max_num_batched_tokens=16, long_prefill_token_threshold=12,
        enable_prefix_caching=True,
    )  # fmt: skip
    experts = llm.engine.runner.model.model.layers[1].mlp.experts
    assert experts.w13_weight.dtype == experts.w2_weight.dtype == torch.float32
    hf = AutoModelForCausalLM.from_pretrained(
        weights_decoded(folder, tmp_path / "decoded", file_model), dtype=torch.float32
    ).eval()
    ours = prompt_token_logprobs(llm, LONG)
    torch.testing.assert_close(ours, transformers_token_logprobs(hf, LONG), atol=1e-3, rtol=1e-3)
    unquantized = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert (ours - transformers_token_logprobs(unquantized, LONG)).abs().max() > 0.1
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = [  # LONG first, alone: the others come once its blocks are in the prefix cache
        *llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False),
        *llm.generate([{"prompt_token_ids": p} for p in PROMPTS[1:]], params, use_tqdm=False),
    ]
    assert outs[2].num_cached_tokens == 16  # two whole blocks of LONG's
    tokens = [out.outputs[0].token_ids for out in outs]
    assert tokens == [transformers_greedy(hf, prompt, 32) for prompt in PROMPTS]


def test_a_dense_mxfp4_layer_is_refused_by_name(tiny_checkpoint, tmp_path):
    """No kernel multiplies MXFP4 blocks: outside the experts the file is refused at load."""
    recipe = lambda name: "MXFP4" if "attn_q." in name or "_exps." in name else "F32"  # noqa: E731
    path = write_gguf(tiny_checkpoint("gpt_oss", **DESCRIBABLE), tmp_path / "q.gguf", recipe)
    with pytest.raises(ModelLoadError, match=r"'blk\.0\.attn_q\.weight' is of type MXFP4"):
        ModelConfig(model=str(path))


@pytest.mark.slow
def test_two_ranks_serve_the_file_as_one_process(tiny_checkpoint, tmp_path):
    """The file's experts (decoded one at a time) split over two ranks as the folder's are:
    each rank's intermediate features of gate, up and down, the down bias on rank 0."""
    folder = tiny_checkpoint("gpt_oss", **DESCRIBABLE)
    path = write_gguf(folder, tmp_path / "m.gguf", mxfp4_experts_q8_0_dense)
    assert_two_ranks_serve_as_one_process(str(path), LONG, block_size=8, kv_cache_memory=1 << 22)
