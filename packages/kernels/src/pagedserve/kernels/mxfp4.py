"""MXFP4 expert weights as the fused MoE reads them, packed: gpt-oss's experts on a GPU.

MXFP4 (OCP microscaling, FP4 E2M1): per block of 32 input features one E8M0 scale byte (the
power of two ``2^(byte - 127)``) and 32 four-bit codes, two a byte, low nibble first, each code
one of 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives. OpenAI's gpt-oss release stores its
experts so: ``blocks [E, out, in / 32, 16]`` and ``scales [E, out, in / 32]``, a quarter of the
bf16 bytes (gpt-oss-120b's experts: ~61 GB instead of ~229 GB).

``MXFP4Experts`` holds both and stands where ``fused_moe`` takes a ``[E, out, in]`` weight
tensor: the Triton grouped GEMM decodes each tile's codes and scales in registers
(``decode_mxfp4`` below, inlined in fused_moe's kernel); the reference decodes the experts it
needs with ``dequantize_mxfp4_ref``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MXFP4_BLOCK = 32  # weights per scale
FP4_E2M1_VALUES = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip


def dequantize_mxfp4_ref(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype):
    """``blocks [..., G, 16]`` uint8 and ``scales [..., G]`` uint8 -> ``[..., G * 32]`` in
    ``dtype``: each code's value times its block's power of two (exact in fp32)."""
    codes = blocks.to(torch.uint8)
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack([lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]], dim=-1)
    exponents = scales.to(torch.int32) - 127
    values = torch.ldexp(values.flatten(-2), exponents[..., None])  # [..., G, 32]
    return values.flatten(-2).to(dtype)


@dataclass
class MXFP4Experts:
    """A layer's experts' projection in MXFP4: ``blocks [E, out, in / 32, 16]`` and ``scales
    [E, out, in / 32]`` (uint8, contiguous). ``shape`` is the weight's, ``[E, out, in]``;
    ``experts[e]`` decodes one expert's ``[out, in]`` in fp32 (the reference's use, and a
    model's that loads its experts dequantized)."""

    blocks: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        self.blocks, self.scales = self.blocks.contiguous(), self.scales.contiguous()
        e, n, g, half = self.blocks.shape
        if half != MXFP4_BLOCK // 2 or self.scales.shape != (e, n, g):
            raise ValueError(
                f"MXFP4 experts: blocks {tuple(self.blocks.shape)} and scales "
                f"{tuple(self.scales.shape)} do not pair ([E, out, G, 16] beside [E, out, G])"
            )
        if self.blocks.dtype != torch.uint8 or self.scales.dtype != torch.uint8:
            raise ValueError("MXFP4 experts: blocks and scales are uint8")

    @property
    def shape(self) -> torch.Size:
        e, n, g, _ = self.blocks.shape
        return torch.Size((e, n, g * MXFP4_BLOCK))

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, expert: int) -> torch.Tensor:
        return dequantize_mxfp4_ref(self.blocks[expert], self.scales[expert], torch.float32)


@triton.jit
def decode_mxfp4(byte, scale, k):
    """The weight at input feature ``k`` (a tensor of them) from the byte holding its code and
    its block's scale byte: the E2M1 code's value (sign, two exponent bits, one mantissa bit:
    subnormal 0 / 0.5 at exponent 0, else ``(1 + m / 2) * 2^(e - 1)``) times ``2^(scale - 127)``,
    built from its bits (exact; a scale byte of 0 gives 0 where the format says 2^-127)."""
    code = (byte.to(tl.int32) >> ((k % 2) * 4)) & 0xF
    exponent = (code >> 1) & 3
    mantissa = (code & 1).to(tl.float32)
    power = (1 << tl.maximum(exponent - 1, 0)).to(tl.float32)  # 2^(e - 1) for e = 1..3
    magnitude = tl.where(exponent == 0, mantissa * 0.5, (1.0 + mantissa * 0.5) * power)
    value = tl.where(code >= 8, -magnitude, magnitude)
    two_to_the = (scale.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    return value * two_to_the
