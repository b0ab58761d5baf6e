"""The round-to-nearest GGUF encoders the test files are written with (gguf_encode.py), read
back by the ``gguf`` package's own decoders: each type's blocks hold values close to what was
encoded, so a layout written wrongly (a misplaced bit plane, a scale in the wrong nibble)
fails here rather than as a model that merely disagrees with itself."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType, quants

from pagedserve.models.gguf_config import SUPPORTED_TENSOR_TYPES
from pagedserve.models.gguf_encode import encode

# Largest error in units of the largest |value|: about a step of the type's levels (2-bit
# weights under 4-bit scales are coarse, 8-bit ones are not).
BOUNDS = {"Q2": 0.35, "Q3": 0.35, "Q4": 0.15, "IQ": 0.15, "Q5": 0.08}


@pytest.mark.parametrize("name", [t for t in SUPPORTED_TENSOR_TYPES if t != "F32"])
def test_every_served_type_encodes_values_gguf_decodes_back(name):
    values = np.random.default_rng(1).standard_normal((4, 512)).astype(np.float32) * 0.05
    data, qtype = encode(values, name)
    assert qtype == GGMLQuantizationType[name]
    back = quants.dequantize(data, qtype)
    assert back.shape == values.shape
    error = np.abs(back - values).max() / np.abs(values).max()
    assert error < BOUNDS.get(name[:2], 0.05), error
    assert np.corrcoef(back.ravel(), values.ravel())[0, 1] > 0.95
