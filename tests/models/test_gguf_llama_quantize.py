"""The files llama.cpp's users have: the default model quantized by llama.cpp's own
``llama-quantize`` at every common type, served in their blocks, greedy tokens equal to
transformers' on the same file (its GGUF loader dequantizes every tensor with the ``gguf``
package's decoders: an independent reference).

``llama-quantize`` picks a type per tensor: Q4_K_M keeps some rows at Q6_K and falls back to
Q5_0 / Q8_0 where a row is not whole 256-weight blocks (SmolLM2's 576-wide rows), Q3_K_M mixes
Q3_K, Q4_K, Q5_K, Q4_0, Q5_0 and Q5_1, Q2_K writes Q3_K and Q4_0 beside it: these files hold
every type pagedserve multiplies from its blocks. The files are made once by
tools/llamacpp_build.py (cached under ``$PAGEDSERVE_HOME/llamacpp``); the test skips where
llama.cpp was never built here (it never downloads or builds).
"""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.engine import LLM, SamplingParams
from pagedserve.models.testing import transformers_greedy

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import llamacpp_build  # noqa: E402

# Between them these three files hold every block type (Q2_K: Q3_K, Q4_0; Q3_K_M: Q3_K, Q4_K,
# Q5_K, Q4_0, Q5_0, Q5_1; Q4_K_M: Q4_K, Q5_0, Q6_K, Q8_0). Q4_0, Q5_K_M, Q6_K and Q8_0 files
# passed too (2026-12-07, the AMD VM); each file costs the suite ~20 s of transformers' loader.
TYPES = ["Q2_K", "Q3_K_M", "Q4_K_M"]
PROMPTS = [list(range(200, 216)), [5, 77, 900, 12, 3000, 41, 8]]


@pytest.fixture(scope="module")
def quantized(default_model_path):
    cache = llamacpp_build.cache_dir()
    tools_built = llamacpp_build.quantize_binary(cache).exists()
    converter = (cache / "convert-deps" / "sentencepiece").is_dir()
    if not (tools_built and converter):
        pytest.skip("llama.cpp's llama-quantize is not built here (tools/llamacpp_build.py)")
    return lambda qtype: llamacpp_build.quantize_gguf(Path(default_model_path), qtype, cache)


@pytest.mark.parametrize("qtype", TYPES)
def test_llama_quantize_files_serve_transformers_greedy_tokens(quantized, qtype):
    path = quantized(qtype)
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert kinds - {"F32", "Q8_0"} or qtype == "Q8_0"  # the file holds the type's blocks
    llm = LLM(model=str(path), block_size=16, kv_cache_memory=64 << 20)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == transformers_greedy(hf.eval(), prompt, 8)
