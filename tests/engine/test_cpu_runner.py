"""The CPU runner's forward, each plain Llama layer as one numba call (engine/cpu_runner.py,
kernels/cpu/decoder_layer.py), against the same step run module by module (the base
``ModelRunner.forward``), bit for bit; and the steps and layers it must leave to the modules.

Equality is exact, not within a tolerance: the fused call runs the very kernels the modules
call, so a step may switch between the two paths (16 rows fused, 17 not) without changing any
output. The modules themselves are held to transformers elsewhere
(tests/models/test_models_vs_transformers.py, which now runs its decodes through this path).
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.cpu_runner import MAX_FUSED_ROWS, CPUModelRunner, fused_layer_weights
from pagedserve.engine.model_runner import ModelRunner
from pagedserve.kernels.cpu import decoder_layer, dense_linear
from pagedserve.models.gguf_testing import write_gguf
from pagedserve.models.registry import ARCHITECTURES
from pagedserve.models.testing import TINY_ARCHS, make_tiny_checkpoint
from pagedserve.models.testing_quantized import Int4Layout, quantize_int4_checkpoint


def _gguf_mixture(name: str) -> str:
    """A GGUF of mixed block types: fused qkv of three types (one of them F32) and of two,
    gate_up of two and of one (stacked), every layer's projections in blocks."""
    layer0 = name.startswith("blk.0.")
    kind = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
    return {
        "attn_q": "Q4_K", "attn_k": "Q4_K" if layer0 else "Q5_K",
        "attn_v": "Q6_K" if layer0 else "F32", "attn_output": "Q4_0",
        "ffn_gate": "Q5_0", "ffn_up": "Q8_0" if layer0 else "Q5_0",
        "ffn_down": "Q6_K" if layer0 else "IQ4_XS", "token_embd": "Q8_0", "output": "Q6_K",
    }[kind]  # fmt: skip


WIDE = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=2)
LONG = dict(max_position_embeddings=1024)
CASES = {
    "llama": ("llama", {}, [17, 3, 9]),
    "qwen2 (qkv bias)": ("qwen2", {}, [17, 3]),
    "phi3 (window, longrope)": ("phi3", {}, [40, 5]),
    # every weight from PARALLEL_FROM_WEIGHTS up: the GEMMs shared over the threads
    "llama, wide": ("llama", WIDE, [17, 3, 9, 30]),
    # one decode over 600 positions: the attention splits its KV axis and merges
    "llama, long context": ("llama", LONG, [600]),
    # 16-bit caches: the store rounds as torch does, the attention widens what it reads
    "llama, fp16 cache": ("llama", {}, [17, 3, 9], "float16"),
    "qwen2, bf16 cache": ("qwen2", {}, [17, 3], "bfloat16"),
    # an fp8 cache: the store saturates and rounds to e4m3, the attention widens its bytes
    "llama, fp8 cache": ("llama", {}, [17, 3, 9], "fp8"),
    # a q8_0 cache: int8 rows and a scale per 32 (heads of 32: two per 64 features)
    "llama, q8_0 cache": ("llama", {"num_attention_heads": 2}, [17, 3, 9], "q8_0"),
    # Qwen3's per-head q/k RMSNorms, before the rotary
    "qwen3 (q/k norms)": ("qwen3", {}, [17, 3]),
    # a GGUF file's layers read their blocks: every GEMM shared over the threads
    "llama gguf, mixed block types": ("llama", WIDE, [17, 3, 9], "auto", _gguf_mixture),
    # 8-bit weights quantized at load: one-byte rows, each feature scaled after its dot
    "llama int8, wide": ("llama", WIDE, [17, 3, 9], "auto", None, "int8"),
    "qwen2 fp8 (qkv bias)": ("qwen2", {}, [17, 3], "auto", None, "fp8"),
    # AWQ / GPTQ checkpoints: each layer held as rows of 4-bit groups
    "llama awq, wide": ("llama", WIDE, [17, 3, 9], "auto", None, Int4Layout("awq", 128)),
    "qwen2 gptq act-order (qkv bias)": (
        "qwen2",
        {},
        [17, 3],
        "auto",
        None,
        Int4Layout("gptq", 32, act_order=True),
    ),
}


@pytest.fixture(autouse=True)
def _numba_path(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("PAGEDSERVE_KERNELS", raising=False)


def _decoding_engine(
    tmp_path,
    arch: str,
    overrides: dict,
    prompt_lens: list[int],
    kv_cache_dtype: str = "auto",
    gguf_recipe=None,
    quantization: str | None = None,
):
    path = make_tiny_checkpoint(arch, tmp_path / arch, **overrides)
    if gguf_recipe is not None:
        path = write_gguf(path, tmp_path / f"{arch}.gguf", gguf_recipe)
    if isinstance(quantization, Int4Layout):  # a checkpoint stored quantized
        path, quantization = quantize_int4_checkpoint(path, tmp_path / "q", quantization), None
    llm = LLM(
        model=str(path), block_size=8, enable_prefix_caching=False,
        kv_cache_dtype=kv_cache_dtype, quantization=quantization,
    )  # fmt: skip
    engine = llm.engine
    torch.manual_seed(0)
    for name, param in engine.runner.model.named_parameters():
        if name.endswith(".bias"):  # transformers starts biases at 0: make them count
            param.data.normal_(std=0.5)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for i, n in enumerate(prompt_lens):
        engine.add_request(f"r{i}", [(7 * i + j) % 500 + 3 for j in range(n)], params)
    while engine.scheduler.waiting or any(
        r.num_output_tokens == 0 for r in engine.scheduler.running
    ):
        engine.step()
    for _ in range(2):
        engine.step()
    return engine


def _forward(engine, model_input, monkeypatch, fused: bool):
    """The model's hidden states and KV caches after one forward over copies of the caches
    (the CPU runner's, or the modules' alone); how many layers ran as one numba call."""
    runner = engine.runner
    assert isinstance(runner, CPUModelRunner)
    caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    calls = []
    real = decoder_layer.decoder_layer_numba
    own_caches = runner.kv_caches
    with monkeypatch.context() as patch, torch.inference_mode():
        patch.setattr(decoder_layer, "decoder_layer_numba", lambda *a: calls.append(1) or real(*a))
        runner.kv_caches = caches
        try:
            forward = runner.forward if fused else lambda x: ModelRunner.forward(runner, x)
            hidden = forward(model_input)
        finally:
            runner.kv_caches = own_caches
    return hidden, caches, len(calls)


def _assert_same_forward(engine, model_input, monkeypatch) -> int:
    hidden, caches, fused_layers = _forward(engine, model_input, monkeypatch, fused=True)
    ref_hidden, ref_caches, none = _forward(engine, model_input, monkeypatch, fused=False)
    assert none == 0
    assert torch.equal(hidden, ref_hidden)
    for (k, v), (ref_k, ref_v) in zip(caches, ref_caches, strict=True):
        assert k.dtype == engine.runner.kv_cache_dtype
        assert torch.equal(k, ref_k) and torch.equal(v, ref_v)
    return fused_layers


@pytest.mark.parametrize("case", list(CASES))
def test_fused_layer_equals_the_modules_bit_for_bit(tmp_path, monkeypatch, case):
    arch, overrides, prompt_lens, *extra = CASES[case]
    engine = _decoding_engine(tmp_path, arch, overrides, prompt_lens, *extra)
    n_layers = len(engine.runner.model.model.layers)
    decode, _ = engine.runner.prepare_input(engine.scheduler.schedule())
    assert decode.input_ids.shape[0] == len(prompt_lens)
    assert _assert_same_forward(engine, decode, monkeypatch) == n_layers


def test_a_short_prefill_chunk_among_decodes_is_fused_too(tmp_path, monkeypatch):
    """Decode rows and a new 5-token prompt in one step of 8 rows: the chunk's attention is the
    numba kernel's too (its rows see each other causally)."""
    engine = _decoding_engine(tmp_path, "llama", {}, [17, 3, 9])
    engine.add_request("new", [11, 12, 13, 14, 15], SamplingParams(max_tokens=4))
    step, _ = engine.runner.prepare_input(engine.scheduler.schedule())
    assert step.input_ids.shape[0] == 3 + 5
    assert _assert_same_forward(engine, step, monkeypatch) == 2


def test_steps_and_layers_it_cannot_stand_in_for_run_the_modules(tmp_path, monkeypatch):
    engine = _decoding_engine(tmp_path, "llama", {}, [17])
    decode, _ = engine.runner.prepare_input(engine.scheduler.schedule())
    # more rows than the decode GEMM takes: a 17-token prompt's prefill is module by module
    engine.add_request("long", list(range(3, 20)), SamplingParams(max_tokens=1))
    prefill, _ = engine.runner.prepare_input(engine.scheduler.schedule())
    assert prefill.input_ids.shape[0] > MAX_FUSED_ROWS
    assert _forward(engine, prefill, monkeypatch, fused=True)[2] == 0
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "ref")  # the references asked for
    assert _forward(engine, decode, monkeypatch, fused=True)[2] == 0


@pytest.mark.parametrize("arch", ["mixtral"])
def test_layers_of_other_shapes_are_left_to_their_modules(tmp_path, monkeypatch, arch):
    """Mixtral's experts: the fused call does not stand in for them."""
    engine = _decoding_engine(tmp_path, arch, {}, [9])
    assert engine.runner.fused_layers is None
    decode, _ = engine.runner.prepare_input(engine.scheduler.schedule())
    assert _forward(engine, decode, monkeypatch, fused=True)[2] == 0


def test_fused_rows_limit_is_the_decode_gemms():
    assert MAX_FUSED_ROWS == dense_linear.MAX_ROWS


def test_a_weight_changed_in_place_is_read_by_the_fused_layer(tmp_path, monkeypatch):
    """The fused kernel reads views of the layer's own tensors: a weight updated in place
    (as a checkpoint reload into the same parameters would) changes its output as it changes
    the modules'."""
    engine = _decoding_engine(tmp_path, "llama", {}, [17, 3])
    decode, _ = engine.runner.prepare_input(engine.scheduler.schedule())
    before, _, _ = _forward(engine, decode, monkeypatch, fused=True)
    with torch.no_grad():
        engine.runner.model.model.layers[0].self_attn.o_proj.weight.mul_(2)
    n_layers = len(engine.runner.model.model.layers)
    assert _assert_same_forward(engine, decode, monkeypatch) == n_layers
    after, _, _ = _forward(engine, decode, monkeypatch, fused=True)
    assert not torch.equal(before, after)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_the_registry_says_which_architectures_run_fused(tiny_checkpoint, arch):
    """The README's "CPU fused" column is the registry's ``cpu_fused``, which the runner checks:
    it must be yes exactly where every plain decoder layer could run as one numba call."""
    llm = LLM(model=tiny_checkpoint(arch), block_size=8, kv_cache_memory=2**20)
    declared = ARCHITECTURES[llm.engine.model_config.hf_architecture].cpu_fused
    assert (fused_layer_weights(llm.engine.runner.model) is not None) == declared
    assert (llm.engine.runner.fused_layers is not None) == declared
