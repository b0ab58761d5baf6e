"""sample_tokens, apply_penalties and copy_blocks: the Triton kernel (or the implementation
given with --impl) against the reference (tokens and copies exactly)."""

import importlib

import pytest
import torch
from contracts import implementation
from suite_grid import DEVICE, DTYPES, pick
from tolerances import assert_close

from pagedserve.kernels.penalties import apply_penalties_ref
from pagedserve.kernels.sampling import sample_tokens_ref

copy_blocks = importlib.import_module("pagedserve.kernels.copy_blocks")

VOCABS = pick([100, 300], [32000, 128256, 151936])
ROWS = [  # temperature, top_k, top_p, min_p: greedy, each filter alone, combinations, "off" edges
    (0.0, 0, 1.0, 0.0),
    (1.0, 0, 1.0, 0.0),
    (0.8, 20, 1.0, 0.0),
    (1.2, 0, 0.9, 0.0),
    (1.0, 0, 1.0, 0.1),
    (0.7, 50, 0.8, 0.05),
    (1.0, 1, 1.0, 0.0),
    (1.0, -1, 0.5, 0.0),
    (1e-6, 5, 0.5, 0.5),
    (2.0, 10**9, 0.3, 0.0),
]


def _params():
    t, k, p, m = zip(*ROWS)
    return [
        torch.tensor(v, dtype=d, device=DEVICE)
        for v, d in zip((t, k, p, m), (torch.float32, torch.int32, torch.float32, torch.float32))
    ]


@pytest.mark.contract("sample_tokens")
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("seed", [0, 1])
def test_sample_tokens_same_token_on_the_same_noise(vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(ROWS), vocab, generator=gen) * 4
    logits[3, : vocab // 4] = logits[3].max()  # a block of ties at the top
    logits[5] = logits[5].round()  # many ties everywhere
    logits[6, 7] = float("-inf")
    noise = torch.empty(len(ROWS), vocab).exponential_(generator=gen)
    args = (logits.to(DEVICE), *_params(), noise.to(DEVICE))
    tokens = implementation("sample_tokens")(*args)
    assert tokens.dtype == torch.int64
    assert torch.equal(tokens.cpu(), sample_tokens_ref(*args).cpu())


@pytest.mark.contract("apply_penalties")
@pytest.mark.parametrize("vocab", VOCABS)
def test_apply_penalties(vocab):
    gen = torch.Generator().manual_seed(0)
    n = 4
    logits = torch.randn(n, vocab, generator=gen)
    prompt_mask = torch.rand(n, vocab, generator=gen) < 0.2
    counts = (torch.rand(n, vocab, generator=gen) * 5).int() * (
        torch.rand(n, vocab, generator=gen) < 0.2
    )
    penalties = [
        torch.tensor(v)
        for v in ([1.0, 1.2, 0.8, 2.0], [0.0, 0.5, -0.3, 1.0], [0.0, 0.1, 0.4, -0.2])
    ]
    args = [t.to(DEVICE) for t in (logits, prompt_mask, counts, *penalties)]
    assert_close(implementation("apply_penalties")(*args), apply_penalties_ref(*args))


@pytest.mark.contract("copy_blocks")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_shape", [(8, 2, 32), (16, 8, 128)], ids=str)
def test_copy_blocks(block_shape, dtype):
    gen = torch.Generator().manual_seed(0)
    layers = pick(2, 8)
    caches = [
        torch.randn(10, *block_shape, generator=gen).to(dtype).to(DEVICE) for _ in range(2 * layers)
    ]
    expect = [c.clone() for c in caches]
    pairs = torch.tensor([[1, 4], [9, 0], [1, 7], [3, 2]], device=DEVICE)
    implementation("copy_blocks")(caches[:layers], caches[layers:], pairs)
    copy_blocks.copy_blocks_ref(expect[:layers], expect[layers:], pairs)
    assert all(torch.equal(a, b) for a, b in zip(caches, expect))


@pytest.mark.contract("copy_blocks")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_blocks_of_layers_without_values(dtype):
    """MLA's layers cache one latent tensor each: they come as key caches, no value caches,
    and every other block stays as it was."""
    gen = torch.Generator().manual_seed(1)
    caches = [torch.randn(10, 8, 1, 48, generator=gen).to(dtype).to(DEVICE) for _ in range(3)]
    expect = [c.clone() for c in caches]
    pairs = torch.tensor([[1, 4], [9, 0], [3, 2]], device=DEVICE)
    implementation("copy_blocks")(caches, [], pairs)
    for cache in expect:
        cache[pairs[:, 1]] = cache[pairs[:, 0]]
    assert all(torch.equal(a, b) for a, b in zip(caches, expect))
