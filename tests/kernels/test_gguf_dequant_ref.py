"""The GGUF block decoders (gguf_dequantize_ref, the CPU path and the spec the Triton kernel
is held to) against the ``gguf`` package's own numpy dequantizers, an independent decoder,
bit for bit: on random blocks (every quant and scale bit pattern) and on blocks gguf itself
quantized from real values."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from pagedserve.kernels.gguf_dequant import GGUF_TYPE_IDS, gguf_dequantize_ref, row_bytes
from pagedserve.kernels.gguf_linear import gguf_linear_ref
from pagedserve.kernels.testing import random_gguf_rows

TYPES = list(GGUF_TYPE_IDS)


@pytest.mark.parametrize("name", TYPES)
def test_random_blocks_decode_as_gguf_decodes_them(name):
    qtype = GGUF_TYPE_IDS[name]
    assert GGMLQuantizationType[name] == qtype  # our ids are ggml's
    rows = random_gguf_rows(qtype, 6, 512, seed=7)
    assert rows.shape == (6, row_bytes(qtype, 512))
    expected = quants.dequantize(rows.numpy(), GGMLQuantizationType[name])
    ours = gguf_dequantize_ref(rows, qtype)
    assert ours.dtype == torch.float32 and ours.shape == (6, 512)
    assert np.array_equal(ours.numpy(), expected)


@pytest.mark.parametrize("name", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_blocks_gguf_quantized_decode_close_to_the_values(name):
    values = np.random.default_rng(0).standard_normal((4, 256)).astype(np.float32)
    raw = quants.quantize(values, GGMLQuantizationType[name])
    ours = gguf_dequantize_ref(torch.from_numpy(raw.view(np.uint8)), GGUF_TYPE_IDS[name])
    assert np.array_equal(ours.numpy(), quants.dequantize(raw, GGMLQuantizationType[name]))
    # 4-bit rounding moves a weight by up to half a step of (max - min) / 15 of its block
    assert np.abs(ours.numpy() - values).max() < (0.5 if name[:2] in ("Q4", "Q5") else 0.05)


def test_the_reference_linear_is_x_times_the_decoded_weight():
    qtype = GGUF_TYPE_IDS["Q4_K"]
    rows = random_gguf_rows(qtype, 8, 256, seed=1)
    x = torch.randn(3, 256)
    weight = torch.from_numpy(quants.dequantize(rows.numpy(), GGMLQuantizationType.Q4_K))
    torch.testing.assert_close(gguf_linear_ref(x, rows, qtype), x @ weight.T)


def test_a_row_that_is_not_whole_blocks_is_refused():
    with pytest.raises(ValueError, match="multiple of 256"):
        row_bytes(GGUF_TYPE_IDS["Q6_K"], 576)
    with pytest.raises(ValueError, match="not supported"):
        gguf_dequantize_ref(torch.zeros(1, 66, dtype=torch.uint8), 16)  # IQ2_XXS
