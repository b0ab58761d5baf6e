"""fused_moe (the Triton grouped GEMMs, or --impl) and its reference against a literal
per-token, per-slot loop, over expert counts 4-64, top-k 1-8, skewed routing and experts that
no token chose; gpt-oss's experts (biases on both projections, the clamped SwiGLU); and
moe_align's layout itself."""

import contracts
import pytest
import torch
import torch.nn.functional as F
from suite_grid import DEVICE, DTYPES, pick
from tolerances import assert_close

from pagedserve.kernels.fused_moe import fused_moe_ref, fused_moe_triton, moe_align
from pagedserve.kernels.mxfp4 import MXFP4Experts, dequantize_mxfp4_ref

contract = pytest.mark.contract("fused_moe")


def spec(hidden, w13, w2, topk_weights, topk_ids, w13_bias=None, w2_bias=None, oai=None):
    """The definition, one (token, slot) at a time, in fp32 (the first projection's output
    and the activation rounded to the input dtype, as the kernels store them between
    launches). ``oai``: (alpha, limit) of gpt-oss's clamped SwiGLU, else silu(gate) * up."""
    inter = w2.shape[2]
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for t in range(hidden.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate_up = w13[e].float() @ hidden[t].float()
            if w13_bias is not None:
                gate_up = gate_up + w13_bias[e].float()
            gate_up = gate_up.to(hidden.dtype).float()  # the first projection's output dtype
            gate, up = gate_up[:inter], gate_up[inter:]
            if oai is None:
                act = F.silu(gate) * up
            else:
                alpha, limit = oai
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
                act = (up + 1) * gate * torch.sigmoid(alpha * gate)
            down = w2[e].float() @ act.to(hidden.dtype).float()
            if w2_bias is not None:
                down = down + w2_bias[e].float()
            out[t] += float(topk_weights[t, j]) * down
    return out.to(hidden.dtype)


def routing(n_tokens, n_experts, top_k, skew, gen):
    """Top-k of random logits; ``skew`` pushes most tokens onto the first experts and leaves
    the last quarter of the experts unchosen (an expert with no tokens)."""
    logits = torch.randn(n_tokens, n_experts, generator=gen)
    if skew:
        logits += torch.linspace(4.0, 0.0, n_experts)
        logits[:, n_experts - max(1, n_experts // 4) :] = -1e9
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return weights, ids


def case(n_experts, top_k, n_tokens, dtype, skew, hidden=32, inter=48, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(n_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(n_experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    weights, ids = routing(n_tokens, n_experts, top_k, skew, gen)
    return [t.to(DEVICE) for t in (x, w13, w2, weights, ids)]


# (experts, top-k): the tiny grid keeps both ends and Mixtral's top-2
GRID = pick([(4, 1), (8, 2), (64, 8)], [(4, 1), (4, 2), (8, 2), (16, 4), (32, 6), (64, 8)])


@contract
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("skew", [False, True], ids=["even", "skewed"])
@pytest.mark.parametrize("experts_top_k", GRID, ids=lambda g: f"e{g[0]}k{g[1]}")
def test_fused_moe(experts_top_k, skew, dtype):
    n_experts, top_k = experts_top_k
    args = case(n_experts, top_k, pick(19, 200), dtype, skew)
    if skew:
        assert not set(range(n_experts)) <= set(args[4].flatten().tolist())  # some expert empty
    out = contracts.implementation("fused_moe")(*args)
    assert_close(out, spec(*[a.cpu() for a in args]).to(DEVICE))


@pytest.mark.parametrize("experts_top_k", GRID, ids=lambda g: f"e{g[0]}k{g[1]}")
def test_reference_matches_the_specification(experts_top_k):
    args = case(*experts_top_k, 23, torch.float32, skew=True, seed=1)
    assert_close(fused_moe_ref(*args), spec(*args))


@contract
def test_one_token_and_all_tokens_on_one_expert():
    """A decode of one token (every tile but k padded), and every pair on one expert (its
    group spans several tiles, every other expert empty)."""
    for n_tokens, ids in ((1, torch.tensor([[2, 0]])), (40, torch.full((40, 1), 3))):
        x, w13, w2, _, _ = case(4, ids.shape[1], n_tokens, torch.float32, False, seed=2)
        weights = torch.rand(ids.shape, device=DEVICE)
        ids = ids.to(DEVICE)
        out = contracts.implementation("fused_moe")(x, w13, w2, weights, ids)
        assert_close(out, spec(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu()).to(DEVICE))


def test_moe_align_groups_pairs_by_expert_in_padded_tiles():
    ids = torch.tensor([[1, 3], [1, 0], [3, 1]])  # pairs 0..5; expert 2 chosen by none
    sorted_ids, block_expert = moe_align(ids, num_experts=4, block_m=2)
    tiles = sorted_ids.view(-1, 2).tolist()
    pad = ids.numel()
    # expert 0: pair 3; expert 1: pairs 0, 2, 5; expert 3: pairs 1, 4; tiles padded with 6
    used = [(e, t) for e, t in zip(block_expert.tolist(), tiles, strict=True) if e >= 0]
    assert used == [(0, [3, pad]), (1, [0, 2]), (1, [5, pad]), (3, [1, 4])]
    assert all(t == [pad, pad] for e, t in zip(block_expert.tolist(), tiles, strict=True) if e < 0)


def gpt_oss_case(n_experts, top_k, n_tokens, dtype, seed=3):
    """Biased experts whose first projection's outputs reach past the clamp (limit 2 on
    outputs of spread ~3): both ends of both clamps are met."""
    x, w13, w2, weights, ids = case(n_experts, top_k, n_tokens, dtype, True, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    w13 = (w13.float() * 3).to(dtype)
    biases = dict(
        w13_bias=torch.randn(n_experts, w13.shape[1], generator=gen).to(dtype).to(DEVICE),
        w2_bias=torch.randn(n_experts, w2.shape[1], generator=gen).to(dtype).to(DEVICE),
    )
    return (x, w13, w2, weights, ids), biases


@contract
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("experts_top_k", GRID[:2], ids=lambda g: f"e{g[0]}k{g[1]}")
def test_gpt_oss_experts_biases_and_clamped_swiglu(experts_top_k, dtype):
    args, biases = gpt_oss_case(*experts_top_k, pick(19, 200), dtype)
    options = dict(activation="swigluoai", swiglu_alpha=1.702, swiglu_limit=2.0, **biases)
    out = contracts.implementation("fused_moe")(*args, **options)
    cpu = [a.cpu() for a in args]
    expect = spec(*cpu, biases["w13_bias"].cpu(), biases["w2_bias"].cpu(), oai=(1.702, 2.0))
    assert_close(out, expect.to(DEVICE))
    unclamped = spec(*cpu, biases["w13_bias"].cpu(), biases["w2_bias"].cpu(), oai=(1.702, 1e9))
    assert not torch.allclose(expect, unclamped, atol=1e-2)  # the clamp bends this case


def test_reference_with_biases_and_clamped_swiglu_matches_the_specification():
    args, biases = gpt_oss_case(8, 2, 23, torch.float32, seed=4)
    options = dict(activation="swigluoai", swiglu_alpha=1.702, swiglu_limit=2.0, **biases)
    expect = spec(*args, biases["w13_bias"], biases["w2_bias"], oai=(1.702, 2.0))
    assert_close(fused_moe_ref(*args, **options), expect)


def mxfp4_experts(n_experts: int, rows: int, cols: int, gen) -> MXFP4Experts:
    """Random MXFP4 experts: every code byte, scales 2^-9 .. 2^0 (a real checkpoint's range)."""
    blocks = torch.randint(0, 256, (n_experts, rows, cols // 32, 16), generator=gen)
    scales = torch.randint(118, 128, (n_experts, rows, cols // 32), generator=gen)
    return MXFP4Experts(blocks.to(torch.uint8).to(DEVICE), scales.to(torch.uint8).to(DEVICE))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mxfp4_experts_are_decoded_in_the_tile(dtype):
    """gpt-oss's experts held packed (kernels/mxfp4.py), with their biases and clamped SwiGLU:
    the grouped GEMMs decode codes and scales in registers and equal the specification on the
    decoded weights; so does the reference, which decodes the experts it needs."""
    gen = torch.Generator().manual_seed(5)
    n_experts, hidden, inter = 8, 32, 64  # the inputs of both projections in blocks of 32
    x = torch.randn(pick(19, 200), hidden, generator=gen).to(dtype).to(DEVICE)
    weights, ids = (t.to(DEVICE) for t in routing(x.shape[0], n_experts, 2, True, gen))
    w13 = mxfp4_experts(n_experts, 2 * inter, hidden, gen)
    w2 = mxfp4_experts(n_experts, hidden, inter, gen)
    biases = dict(
        w13_bias=torch.randn(n_experts, 2 * inter, generator=gen).to(dtype).to(DEVICE),
        w2_bias=torch.randn(n_experts, hidden, generator=gen).to(dtype).to(DEVICE),
    )
    options = dict(activation="swigluoai", swiglu_alpha=1.702, swiglu_limit=2.0, **biases)
    decoded = [dequantize_mxfp4_ref(w.blocks, w.scales, dtype).cpu() for w in (w13, w2)]
    cpu = [t.cpu() for t in (x, weights, ids, biases["w13_bias"], biases["w2_bias"])]
    expect = spec(cpu[0], *decoded, *cpu[1:], oai=(1.702, 2.0)).to(DEVICE)
    assert_close(fused_moe_triton(x, w13, w2, weights, ids, **options), expect)
    if dtype == torch.float32:  # the reference keeps the first projection in fp32, the spec not
        assert_close(fused_moe_ref(x, w13, w2, weights, ids, **options), expect)
