"""copy_blocks: the reference against a per-pair loop, and the Triton kernel (interpreted on
CPU, compiled on CUDA) against the reference."""

import importlib

import pytest
import torch

# By module path: the package's __init__ may re-export the function under the same name.
copy_blocks_module = importlib.import_module("pagedserve.kernels.copy_blocks")


def _caches(n_layers=2, num_blocks=6, shape=(4, 2, 8), dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = [torch.randn(num_blocks, *shape, generator=gen).to(dtype) for _ in range(n_layers)]
    v = [torch.randn(num_blocks, *shape, generator=gen).to(dtype) for _ in range(n_layers)]
    return k, v


PAIRS = torch.tensor([[0, 3], [2, 5], [0, 1]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_matches_per_pair_loop(dtype):
    k, v = _caches(dtype=dtype)
    expect_k, expect_v = [c.clone() for c in k], [c.clone() for c in v]
    for src, dst in PAIRS.tolist():
        for cache in (*expect_k, *expect_v):
            cache[dst] = cache[src]
    copy_blocks_module.copy_blocks_ref(k, v, PAIRS)
    assert all(torch.equal(a, b) for a, b in zip(k + v, expect_k + expect_v))


def test_empty_pairs_and_no_layers_are_no_ops():
    k, v = _caches()
    before = [c.clone() for c in k + v]
    copy_blocks_module.copy_blocks(k, v, torch.empty(0, 2, dtype=torch.int64))
    copy_blocks_module.copy_blocks([], [], PAIRS)
    assert all(torch.equal(a, b) for a, b in zip(k + v, before))


def test_rejects_bad_pairs_shape():
    k, v = _caches()
    with pytest.raises(ValueError, match=r"\[N, 2\]"):
        copy_blocks_module.copy_blocks_ref(k, v, torch.tensor([1, 2]))


@pytest.fixture
def triton_copy_blocks(monkeypatch):
    """The kernel runs compiled on CUDA; on CPU it needs Triton's interpreter, which is
    chosen when @triton.jit runs, so the module is reloaded with TRITON_INTERPRET=1 unless
    its kernel is interpreted already. It stays so afterwards: harmless, since dispatch
    still picks the reference on CPU whenever TRITON_INTERPRET is unset."""
    if torch.cuda.is_available():
        return copy_blocks_module.copy_blocks_triton, "cuda"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if type(copy_blocks_module._copy_blocks_kernel).__name__ != "InterpretedFunction":
        importlib.reload(copy_blocks_module)
    return copy_blocks_module.copy_blocks_triton, "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_matches_ref(triton_copy_blocks, dtype):
    copy_triton, device = triton_copy_blocks
    k, v = _caches(n_layers=3, shape=(8, 2, 16), dtype=dtype)
    k, v = [c.to(device) for c in k], [c.to(device) for c in v]
    expect_k, expect_v = [c.clone() for c in k], [c.clone() for c in v]
    copy_blocks_module.copy_blocks_ref(expect_k, expect_v, PAIRS)
    copy_triton(k, v, PAIRS.to(torch.int32))
    assert all(torch.equal(a, b) for a, b in zip(k + v, expect_k + expect_v))


def test_layers_without_value_caches_copy_their_one_tensor():
    """MLA's latent cache: one tensor per layer, passed as the key caches with no values."""
    k, _ = _caches(n_layers=2, shape=(4, 1, 24))
    expect = [c.clone() for c in k]
    for src, dst in PAIRS.tolist():
        for cache in expect:
            cache[dst] = cache[src]
    copy_blocks_module.copy_blocks(k, [], PAIRS)
    assert all(torch.equal(a, b) for a, b in zip(k, expect))
    with pytest.raises(ValueError, match="2 key caches but 1 value caches"):
        copy_blocks_module.copy_blocks_ref(k, k[:1], PAIRS)
