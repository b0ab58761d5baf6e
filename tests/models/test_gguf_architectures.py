"""Every architecture with a GGUF form (the registry's ``gguf``) served from a GGUF file.

Each file is written from a tiny random checkpoint as llama.cpp's converter writes it
(gguf_testing_converter.py, held to the real converter below where it is on this machine),
in F32, and served by pagedserve. The reference is the Hugging Face folder it came from, run
by transformers: the prompt's log-probabilities (fp32, 1e-4) and 16 greedy tokens. Where
transformers' own GGUF loader reads the architecture faithfully (llama and mistral here, qwen2
in test_gguf.py), the model it builds from the same file must agree too. For the others it
does not: it ignores Qwen3's ``attention.key_length`` (a head_dim other than hidden / heads,
as Qwen3's are), maps no expert or shared-expert sizes (qwen2moe, qwen3moe), reads a
Mixtral file as a dense Llama, leaves Gemma's soft caps, query scale and local rope base and
Phi-3's LongRoPE factors at their defaults, refuses GPT-2's and DeepSeek's files, and fails
on gpt-oss's (its reader takes each rope key's length field for its value).

Each tiny checkpoint is one a GGUF can describe: what llama.cpp's format has no key for is
set to what llama.cpp assumes (Qwen3-MoE: every layer sparse, top-k renormalised; Gemma 2:
tied head, query scale ``head_dim ** -0.5``; Gemma 3: a 5 local : 1 global layer pattern, a
vocabulary the size of its tokenizer; DeepSeek-V2: YaRN's ``mscale == mscale_all_dim``;
gpt-oss: the SwiGLU limit 7, its weights drawn wide enough that the activations reach it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from test_quantization import prompt_token_logprobs, transformers_token_logprobs
from transformers import AutoModelForCausalLM

from pagedserve.engine import LLM, SamplingParams
from pagedserve.models import ModelConfig, ModelLoadError
from pagedserve.models.gguf_config import served_gguf_architectures
from pagedserve.models.gguf_testing import write_gguf
from pagedserve.models.registry import ARCHITECTURES
from pagedserve.models.testing import make_mxfp4_checkpoint, transformers_greedy

PROMPT = list(range(5, 45))  # past Gemma's 16-token and Phi-3's 24-token windows
_YARN = dict(
    rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
    beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707,
)  # fmt: skip
CASES = {  # id: (tiny arch, config overrides)
    "llama (q/k/v/o biases)": ("llama", {"attention_bias": True}),
    "mistral": ("mistral", {}),
    "qwen3": ("qwen3", {}),
    "mixtral": ("mixtral", {}),
    "qwen2_moe": ("qwen2_moe", {}),
    "qwen3_moe": ("qwen3_moe", {"mlp_only_layers": [], "norm_topk_prob": True}),
    "gemma2": ("gemma2", {"tie_word_embeddings": True, "query_pre_attn_scalar": 16}),
    "gemma3": ("gemma3", {"query_pre_attn_scalar": 16, "num_hidden_layers": 6,
                          "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}),
    "phi3 (LongRoPE, window)": ("phi3", {}),
    "gpt2": ("gpt2", {}),
    "deepseek_v2": ("deepseek_v2", {"rope_parameters": _YARN}),
    "deepseek_v3": ("deepseek_v3", {}),
    "gpt_oss": ("gpt_oss", {"swiglu_limit": 7.0, "initializer_range": 0.4}),
}  # fmt: skip
TRANSFORMERS_READS = {"llama (q/k/v/o biases)", "mistral"}


def _f32(name: str) -> str:
    return "F32"


@pytest.fixture(scope="module")
def folder(tiny_checkpoint):
    """``folder(case) -> path``: the case's tiny checkpoint (Gemma 3's vocabulary cut to its
    tokenizer's, as the converter cuts the embedding)."""

    def make(case: str) -> str:
        arch, overrides = CASES[case]
        if arch == "gemma3":
            tok = json.loads((Path(tiny_checkpoint(arch)) / "tokenizer.json").read_text())
            vocab = len(tok["model"]["vocab"]) + len(tok["added_tokens"])
            overrides = dict(overrides, vocab_size=vocab)
        return tiny_checkpoint(arch, **overrides)

    return make


@pytest.fixture(scope="module")
def gguf_file(folder, tmp_path_factory):
    made: dict[str, str] = {}

    def make(case: str) -> str:
        if case not in made:
            path = tmp_path_factory.mktemp("gguf") / "model.gguf"
            made[case] = str(write_gguf(folder(case), path, _f32))
        return made[case]

    return make


def _class_of(path: str) -> str:
    return json.loads((Path(path) / "config.json").read_text())["architectures"][0]


def test_every_declared_gguf_architecture_has_a_case(folder):
    """The README's GGUF column is the registry's ``gguf``: each class that declares it is
    served from a file here (Qwen2 in test_gguf.py), and the files' architectures are the
    ones loading accepts."""
    declared = {name for name, a in ARCHITECTURES.items() if a.gguf}
    tested = {_class_of(folder(case)) for case in CASES} | {"Qwen2ForCausalLM"}
    assert tested == declared
    assert {ARCHITECTURES[name].gguf for name in declared} == set(served_gguf_architectures())


@pytest.mark.parametrize("case", list(CASES))
def test_a_gguf_serves_the_model_of_its_folder(folder, gguf_file, case):
    path = gguf_file(case)
    llm = LLM(model=path, block_size=8, kv_cache_memory=2**22)
    served_as = {"MistralForCausalLM": "LlamaForCausalLM"}  # llama.cpp's Mistral is a Llama
    cls = _class_of(folder(case))
    assert llm.engine.model_config.hf_architecture == served_as.get(cls, cls)
    hf = AutoModelForCausalLM.from_pretrained(folder(case), dtype=torch.float32).eval()
    ours = prompt_token_logprobs(llm, PROMPT)
    torch.testing.assert_close(ours, transformers_token_logprobs(hf, PROMPT), atol=1e-4, rtol=1e-4)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    assert out.outputs[0].token_ids == transformers_greedy(hf, PROMPT, 16)
    if case in TRANSFORMERS_READS:
        p = Path(path)
        theirs = AutoModelForCausalLM.from_pretrained(
            str(p.parent), gguf_file=p.name, dtype=torch.float32
        )
        torch.testing.assert_close(
            ours, transformers_token_logprobs(theirs.eval(), PROMPT), atol=1e-4, rtol=1e-4
        )


# llama.cpp's converter, run on a tiny checkpoint. The tiny tokenizer is a byte-level BPE the
# converter does not recognise (it knows a tokenizer by a hash of its pre-tokenizer's output),
# and Gemma's and Phi-3's converters want a SentencePiece model: every architecture writes the
# BPE as GPT-2's. Only the vocabulary is patched, no tensor and no hyperparameter.
_CONVERT = """
import runpy, sys
from pathlib import Path
source = Path(sys.argv[1])
sys.argv = [str(source / "convert_hf_to_gguf.py"), *sys.argv[2:]]
sys.path.insert(0, str(source))
import conversion, conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
model_class = conversion.get_model_class
def gpt2_vocabulary(*args, **kwargs):
    cls = model_class(*args, **kwargs)
    cls.set_vocab = lambda self: self._set_vocab_gpt2()
    return cls
conversion.get_model_class = gpt2_vocabulary
runpy.run_path(str(source / "convert_hf_to_gguf.py"), run_name="__main__")
"""


def _llama_cpp_convert(src: Path, out: Path) -> Path:
    """``src`` converted to ``out`` (F32 where the converter chooses) by llama.cpp's own
    converter, where tools/llamacpp_build.py put it and its imports; the test skips without
    them (it never downloads)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import llamacpp_build

    cache = llamacpp_build.cache_dir()
    source, deps = llamacpp_build.source_dir(cache), cache / "convert-deps"
    if not (source / "conversion").is_dir() or not (deps / "sentencepiece").is_dir():
        pytest.skip("llama.cpp's converter is not here (python tools/llamacpp_build.py)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(source / "gguf-py"), str(deps)]))
    command = [sys.executable, "-c", _CONVERT, str(source), str(src), "--outtype", "f32",
               "--outfile", str(out)]  # fmt: skip
    subprocess.run(command, check=True, env=env, capture_output=True)
    return out


def _same_file(ours: str, theirs: str) -> None:
    a, b = gguf.GGUFReader(ours), gguf.GGUFReader(theirs)
    arch = a.fields["general.architecture"].contents()
    assert arch == b.fields["general.architecture"].contents()
    keys = {r: {k: f.contents() for k, f in r.fields.items() if k.startswith(arch + ".")}
            for r in (a, b)}  # fmt: skip
    assert keys[a].keys() == keys[b].keys()
    for key, value in keys[a].items():
        other = keys[b][key]
        assert value == (pytest.approx(other, rel=1e-6) if isinstance(other, float) else other), key
    tensors = [{t.name: t for t in r.tensors} for r in (a, b)]
    assert tensors[0].keys() == tensors[1].keys()
    for name, t in tensors[0].items():
        other = tensors[1][name]
        assert list(t.shape) == list(other.shape), name
        assert np.asarray(t.data).tobytes() == np.asarray(other.data).tobytes(), name


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_the_files_are_what_llama_cpps_converter_writes(folder, gguf_file, case, tmp_path):
    """Byte for byte, every tensor, and every ``{arch}.*`` key, against the real converter."""
    src = Path(folder(case))
    if CASES[case][0] == "gpt2":  # transformers 5 no longer writes the n_ctx it reads
        src = Path(shutil.copytree(src, tmp_path / "gpt2"))
        config = json.loads((src / "config.json").read_text())
        (src / "config.json").write_text(json.dumps(dict(config, n_ctx=config["n_positions"])))
    theirs = _llama_cpp_convert(src, tmp_path / "converted.gguf")
    _same_file(gguf_file(case), str(theirs))


@pytest.mark.slow
def test_llama_cpps_file_of_gpt_oss_as_released_holds_the_release(folder, tmp_path):
    """OpenAI releases gpt-oss's experts in MXFP4 (``_blocks`` / ``_scales``); llama.cpp's
    converter moves those bits into ggml's MXFP4 blocks without rounding again, as every
    gpt-oss GGUF in circulation was made. Served from its file, the experts are the folder's
    bit for bit and the model is transformers' on the folder."""
    release = make_mxfp4_checkpoint(folder("gpt_oss"), tmp_path / "release")
    path = _llama_cpp_convert(release, tmp_path / "converted.gguf")
    types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors if "_exps.w" in t.name}
    assert types == {"MXFP4"}
    ours, theirs = (LLM(model=str(m), block_size=8, kv_cache_memory=2**22) for m in (path, release))
    for layer in (0, 1):
        mine, other = (
            llm.engine.runner.model.model.layers[layer].mlp.experts for llm in (ours, theirs)
        )
        assert torch.equal(mine.w13_weight, other.w13_weight)
        assert torch.equal(mine.w2_weight, other.w2_weight)
    hf = AutoModelForCausalLM.from_pretrained(str(release), dtype=torch.float32).eval()
    logprobs = prompt_token_logprobs(ours, PROMPT)
    torch.testing.assert_close(
        logprobs, transformers_token_logprobs(hf, PROMPT), atol=1e-4, rtol=1e-4
    )
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    (out,) = ours.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    assert out.outputs[0].token_ids == transformers_greedy(hf, PROMPT, 16)


def weights_decoded(folder: str, out: Path, type_of: Callable[[str], str | None]) -> str:
    """``folder`` with each weight that ``type_of(name)`` gives a block type replaced by what
    that type's blocks hold, decoded by gguf's own decoder: the model a GGUF with those blocks
    describes. Blocks run along the input features: gpt-oss's stacked ``[E, in, out]`` experts
    are quantized transposed."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out, ignore=shutil.ignore_patterns("model.safetensors"))
    tensors = load_file(Path(folder) / "model.safetensors")
    for name, t in tensors.items():
        if type_of(name) is None:
            continue
        kind = gguf.GGMLQuantizationType[type_of(name)]
        stacked = name.endswith(("experts.gate_up_proj", "experts.down_proj"))
        rows = t.transpose(-1, -2).contiguous() if stacked else t
        decoded = torch.from_numpy(
            gguf.quants.dequantize(gguf.quants.quantize(rows.numpy(), kind), kind).copy()
        )
        tensors[name] = decoded.transpose(-1, -2).contiguous() if stacked else decoded
    save_file(tensors, out / "model.safetensors")
    return str(out)


def experts_only(qtype: str) -> Callable[[str], str | None]:
    """``weights_decoded``'s choice for a file whose experts' weights (not biases) are ``qtype``."""
    return lambda name: qtype if ".experts." in name and "bias" not in name else None


@pytest.mark.parametrize(
    ("case", "qtype"), [("mixtral", "Q4_0"), ("qwen2_moe", "Q8_0"), ("gpt_oss", "MXFP4")]
)
def test_quantized_experts_are_decoded_at_load(folder, tmp_path, case, qtype):
    """Stacked experts in blocks (``ffn_*_exps``) load decoded into the model's dtype: there
    is no quantized MoE kernel (nor an MXFP4 one: gpt-oss's files). The served model is the one
    gguf's decoder describes."""
    recipe = lambda name: qtype if name.endswith("_exps.weight") else "F32"  # noqa: E731
    path = write_gguf(folder(case), tmp_path / "experts.gguf", recipe)
    types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors if "_exps.w" in t.name}
    assert types == {qtype}
    llm = LLM(model=str(path), block_size=8, kv_cache_memory=2**22)
    experts = llm.engine.runner.model.model.layers[1].mlp.experts
    assert experts.w13_weight.dtype == experts.w2_weight.dtype == torch.float32
    ours = prompt_token_logprobs(llm, PROMPT)
    decoded = weights_decoded(folder(case), tmp_path / "decoded", experts_only(qtype))
    hf = AutoModelForCausalLM.from_pretrained(decoded, dtype=torch.float32).eval()
    torch.testing.assert_close(ours, transformers_token_logprobs(hf, PROMPT), atol=1e-4, rtol=1e-4)
    unquantized = AutoModelForCausalLM.from_pretrained(folder(case), dtype=torch.float32).eval()
    assert (ours - transformers_token_logprobs(unquantized, PROMPT)).abs().max() > 1e-4
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    assert out.outputs[0].token_ids == transformers_greedy(hf, PROMPT, 16)


def _file_of(path: Path, arch: str, keys: dict[str, int]) -> str:
    """A GGUF of ``arch`` with ``keys`` (``{arch}.``-less) and an embedding, nothing else."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in keys.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((32, 64), np.float32))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file,
                 writer.write_tensors_to_file, writer.close):  # fmt: skip
        step()
    return str(path)


def test_what_a_gguf_does_not_say_or_we_do_not_serve_is_refused_by_name(tmp_path):
    sizes = {"block_count": 1, "embedding_length": 64, "feed_forward_length": 128,
             "attention.head_count": 4}  # fmt: skip
    partial = _file_of(
        tmp_path / "partial.gguf",
        "llama",
        dict(sizes, **{"rope.dimension_count": 8, "attention.key_length": 16}),
    )
    with pytest.raises(ModelLoadError, match="rope over 8 of 16 head dimensions"):
        ModelConfig(model=partial)
    routing = {"expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 32,
               "rope.dimension_count": 16, "attention.key_length_mla": 32}  # fmt: skip
    deepseek = _file_of(tmp_path / "deepseek.gguf", "deepseek2", dict(sizes, **routing))
    with pytest.raises(ModelLoadError, match="deepseek.gguf: the GGUF key deepseek2.attention"):
        ModelConfig(model=deepseek)
