"""Each GGUF architecture's tensor names as transformers' checkpoint names, and what llama.cpp's
converter did to the tensors on the way in, which loading undoes.

The names are llama.cpp's (gguf-py's ``TENSOR_NAMES``: ``blk.{n}.attn_q``, ``ffn_gate_exps``,
...), each mapped onto the module transformers gives that weight, so a model class loads a
GGUF's tensors through the same ``load_weights`` as a folder's. What the converter changed:

- ``permuted_qk`` (``llama``: Llama, Mistral, Mixtral): the rows of Q and K (weights and
  biases) are permuted per head for llama.cpp's rotary layout;
- ``norm_offset`` (Gemma 2/3): RMSNorm weights are stored as ``1 + w``, the value Gemma
  multiplies by; the model's loader adds the one itself, so loading subtracts it;
- ``conv1d`` (GPT-2): the Conv1D weights, ``[in, out]`` in transformers, are stored ``[out,
  in]`` like every other matrix;
- experts (``*_exps``): each projection of all a layer's experts is one 3-D tensor
  ``[experts, out, in]``, split per expert on load;
- DeepSeek's ``kv_b_proj`` is stored as ``attn_k_b`` (each head's key rows, transposed) and
  ``attn_v_b``, for llama.cpp's absorbed attention; older files keep ``attn_kv_b`` whole;
- ``stacked_experts`` (gpt-oss): the checkpoint already stacks each layer's experts, ``[E, in,
  out]`` with the gate and up columns of ``gate_up_proj`` interleaved (gate even, up odd), and
  its biases ``[E, out]`` likewise; the converter transposes them to ``[E, out, in]`` and splits
  gate_up by parity into ``ffn_gate_exps`` and ``ffn_up_exps`` (weights and biases both).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from pagedserve.models.config import ModelLoadError

_TOP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_ATTENTION = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_LLAMA = {**_NORMS, **_ATTENTION, **_MLP, "ffn_gate_inp": "mlp.gate"}
_GEMMA = {
    **_ATTENTION, **_MLP, "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}  # fmt: skip
_QWEN2_MOE = {
    **_LLAMA, "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}  # fmt: skip
_DEEPSEEK2 = {
    **_LLAMA, "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj", "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "exp_probs_b": "mlp.gate.e_score_correction_bias",  # a bias with a name of its own
}  # fmt: skip
_PHI3 = {
    **_NORMS, "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj",
}  # fmt: skip
_GPT2 = {
    "attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
    "ffn_norm": "ln_2", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj",
}  # fmt: skip
_GPT2_TOP = {
    "token_embd": "transformer.wte", "position_embd": "transformer.wpe",
    "output_norm": "transformer.ln_f", "output": "lm_head",
}  # fmt: skip
_GPT_OSS = {
    **_ATTENTION, "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "attn_sinks": "self_attn.sinks", "ffn_gate_inp": "mlp.router",
}  # fmt: skip
_QWEN_EXPERTS = ("mlp.experts", ("gate_proj", "up_proj", "down_proj"))
# transformers' names that are a parameter, not a module holding a weight and a bias
_BARE_PARAMETERS = ("e_score_correction_bias", "sinks")
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(frozen=True)
class TensorNames:
    """One GGUF architecture's names and the converter's changes (module docstring)."""

    layer: dict[str, str]
    top: dict[str, str] = field(default_factory=lambda: _TOP)
    layer_prefix: str = "model.layers"
    # the experts' module, and its gate, up and down projections' names
    experts: tuple[str, tuple[str, str, str]] = _QWEN_EXPERTS
    permuted_qk: bool = False
    norm_offset: float = 0.0
    conv1d: tuple[str, ...] = ()
    stacked_experts: bool = False

    def hf_name(self, name: str) -> str:
        """The transformers name of a GGUF tensor (``blk.3.attn_q.weight`` ->
        ``model.layers.3.self_attn.q_proj.weight``)."""
        stem, _, kind = name.rpartition(".")
        if stem in self.top:
            return f"{self.top[stem]}.{kind}"
        m = _BLOCK.fullmatch(name)
        if m is None or m.group(2) not in self.layer:
            raise ModelLoadError(f"GGUF tensor {name!r} has no counterpart in the model")
        module = self.layer[m.group(2)]
        suffix = "" if module.endswith(_BARE_PARAMETERS) else f".{m.group(3)}"
        return f"{self.layer_prefix}.{m.group(1)}.{module}{suffix}"

    def stacked_expert_name(self, layer: int, projection: str, kind: str) -> str:
        """A stacked checkpoint's tensor (``stacked_experts``): ``projection`` ``gate_up_proj``
        or ``down_proj``, ``kind`` ``weight`` (no suffix) or ``bias`` (``_bias``)."""
        suffix = "_bias" if kind == "bias" else ""
        return f"{self.layer_prefix}.{layer}.{self.experts[0]}.{projection}{suffix}"

    def expert_names(self, layer: int, part: str, count: int) -> list[str]:
        """Each expert's name for one projection (``part``: gate, up or down)."""
        module, projections = self.experts
        proj = projections[("gate", "up", "down").index(part)]
        return [f"{self.layer_prefix}.{layer}.{module}.{e}.{proj}.weight" for e in range(count)]


# GGUF general.architecture -> its names; which are served is the registry's ``gguf``.
TENSOR_NAMES: dict[str, TensorNames] = {
    # llama: Llama and Mistral, and Mixtral (the experts under transformers' Mixtral names)
    "llama": TensorNames(
        {**_LLAMA, "ffn_gate_inp": "block_sparse_moe.gate"},
        experts=("block_sparse_moe.experts", ("w1", "w3", "w2")),
        permuted_qk=True,
    ),
    "qwen2": TensorNames(_LLAMA),
    "qwen3": TensorNames(_LLAMA),
    "qwen2moe": TensorNames(_QWEN2_MOE),
    "qwen3moe": TensorNames(_LLAMA),
    "gemma2": TensorNames(_GEMMA, norm_offset=1.0),
    "gemma3": TensorNames(_GEMMA, norm_offset=1.0),
    "phi3": TensorNames(_PHI3),
    "gpt2": TensorNames(
        _GPT2,
        top=_GPT2_TOP,
        layer_prefix="transformer.h",
        conv1d=("attn_qkv", "attn_output", "ffn_up", "ffn_down"),
    ),  # fmt: skip
    "deepseek2": TensorNames(_DEEPSEEK2),
    "gpt-oss": TensorNames(_GPT_OSS, stacked_experts=True),
}
# Read into the config (gguf_arch_configs.py), not loaded as weights.
CONFIG_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
