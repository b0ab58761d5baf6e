"""Writing your own Triton kernel: RMSNorm, from the reference to the kernel to the test.

Every kernel in pagedserve is written the same way, in three parts: a plain-PyTorch reference that
is obviously right, a Triton kernel, and a launch wrapper that checks its inputs and picks the
grid — then a test that holds the kernel to the reference over a grid of shapes and dtypes. This
lesson writes RMSNorm that way from scratch, runs it in Triton's interpreter (no GPU needed), and
checks it against both our reference and transformers' own LlamaRMSNorm.
"""

import os

# Triton reads TRITON_INTERPRET when a @triton.jit function is defined: set it first. Without it,
# on a machine with a GPU, the very same code compiles to a GPU kernel.
os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402

from pagedserve.kernels import rms_norm as pagedserve_rms_norm  # noqa: E402

# ## 1. The reference: what the kernel must compute
#
# RMSNorm scales each row of x by the inverse of its root mean square, then by a learned weight:
# out = x / sqrt(mean(x^2) + eps) * weight. The reference is written for clarity, in fp32, and
# follows transformers' numerics exactly (normalise in fp32, cast to x's dtype, then multiply by
# the weight), because the engine must match transformers token for token.


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed.to(x.dtype).float() * weight.float()).to(x.dtype)


# ## 2. The kernel: one program per row
#
# A Triton program works on tiles, blocks of values loaded into registers at once. A row of a
# hidden state (576 values for SmolLM2) fits in one tile, so each program normalises one row:
# load it (masked, because the tile is a power of two and may be wider than the row), reduce, scale,
# store. program_id(0) says which row this program owns; the grid launches one per row.


@triton.jit
def rms_norm_kernel(x_ptr, weight_ptr, out_ptr, hidden, row_stride, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride can exceed 2^31 on big batches
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / hidden  # masked lanes are 0: they add nothing
    normed = (x / tl.sqrt(mean_square + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * hidden + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask
    )


# ## 3. The launch wrapper: check, then pick the grid
#
# The wrapper is where wrong inputs become clear errors instead of silent garbage: the kernel
# trusts that the last dimension is contiguous and that the weight matches it. It flattens every
# leading dimension into rows and launches one program per row, with a tile the next power of two
# above the hidden size.


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"rms_norm: weight has shape {tuple(weight.shape)}, expected ({hidden},)")
    rows = x.reshape(-1, hidden)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    grid = (rows.shape[0],)
    rms_norm_kernel[grid](
        rows, weight, out, hidden, rows.stride(0), eps, BLOCK=triton.next_power_of_2(hidden)
    )
    return out.view(x.shape)


# ## 4. The test: the kernel against the reference, over a grid
#
# Shapes are chosen to catch the usual bugs: a hidden size that is not a power of two (the mask),
# a single row, a 3-D input (the reshape), a strided input (the stride argument). Tolerances are
# PyTorch's allclose defaults per dtype, the same table the project's kernel suite uses.

TOLERANCES = {torch.float32: (1e-5, 1.3e-6), torch.float16: (1e-3, 1e-3)}
shapes = [(1, 64), (7, 576), (3, 5, 100), (16, 2048)]
print("== The kernel against the reference ==")
for dtype, (atol, rtol) in TOLERANCES.items():
    for shape in shapes:
        x = torch.randn(shape, dtype=dtype)
        weight = torch.rand(shape[-1], dtype=dtype) + 0.5
        torch.testing.assert_close(
            rms_norm_triton(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), atol=atol, rtol=rtol
        )
    print(f"  {str(dtype):14s} shapes {shapes}: equal within atol {atol}, rtol {rtol}")

strided = torch.randn(8, 1152)[:, ::2]  # every other column: row stride 1152, not contiguous
weight = torch.rand(576) + 0.5
torch.testing.assert_close(
    rms_norm_triton(strided, weight, 1e-6), rms_norm_ref(strided, weight, 1e-6)
)
print("  a non-contiguous input: equal")

try:
    rms_norm_triton(torch.randn(4, 64), torch.ones(32), 1e-6)
except ValueError as error:
    print(f"  a wrong weight is refused: {error}")

# ## 5. Against an independent implementation
#
# A reference we wrote ourselves could share our misunderstanding. transformers' LlamaRMSNorm is
# what the real models were trained and evaluated with; our kernel, and pagedserve's production
# rms_norm (the same idea, with the residual add fused in), must give the same numbers.

hidden = 576
hf_norm = LlamaRMSNorm(hidden, eps=1e-5)
with torch.no_grad():
    hf_norm.weight.copy_(torch.rand(hidden) + 0.5)
x = torch.randn(9, hidden)
expected = hf_norm(x).detach()
ours = rms_norm_triton(x, hf_norm.weight.detach(), 1e-5)
production = pagedserve_rms_norm(x, hf_norm.weight.detach(), 1e-5)  # dispatches to Triton here
print("\n== Against transformers' LlamaRMSNorm ==")
print(f"  max |our kernel - LlamaRMSNorm|          = {(ours - expected).abs().max():.2e}")
print(f"  max |pagedserve.kernels.rms_norm - ours| = {(production - ours).abs().max():.2e}")
torch.testing.assert_close(ours, expected)
torch.testing.assert_close(production, expected)

# ## 6. Where this goes in the project
#
# pagedserve's version lives in packages/kernels/src/pagedserve/kernels/rms_norm.py in the same
# three parts, plus a dispatch function that picks Triton on a CUDA tensor (or under the
# interpreter) and the reference on a CPU, where the reference is the engine's real path. Its test
# is in kernels/test_triton_elementwise.py; `make test-kernels` runs the whole suite in the
# interpreter, and the same command on a GPU compiles every kernel and runs the full grid.
print("\nThe same three parts, for every kernel: packages/kernels/src/pagedserve/kernels/*.py")
