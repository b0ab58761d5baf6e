"""One next token per row: greedy, or temperature + top-k + top-p + min-p + a random draw.

Exact semantics (the kernel and the reference keep the same sets; see below for the one
rounding caveat). Per row, with ``x = logits / temperature`` and ``p = softmax(x)``:

- greedy when ``temperature < 1e-5``: ``argmax(logits)`` (first index among equal maxima);
- top-k, on when ``0 < top_k < V``: keep ``x >= x_(k)``, the k-th largest value counted
  with multiplicity, so every token tied with the k-th is kept;
- top-p, on when ``top_p < 1``: over the top-k set K, with ``tau`` the largest value such
  that the mass of ``{v in K: x_v >= tau}`` is ``>= top_p * mass(K)``, keep ``x >= tau``: the
  smallest set of most likely tokens whose renormalised mass reaches top_p, ties kept;
- min-p, on when ``min_p > 0``: keep ``p >= min_p * max(p)``, tested as
  ``x - max(x) >= log(min_p)`` (no exp, so it is exact);
- the token: ``argmax over kept v of x_v - log(noise_v)`` with ``noise ~ Exp(1)``, the
  exponential race (Gumbel-max): exactly a draw from ``p`` renormalised over the kept set.
  The noise is an input so the engine can draw it from per-request seeded generators.

Every comparison is made on the same fp32 values in both implementations (scaling and logs
are done once with torch before either runs), so the kept sets and tokens agree bit for
bit, except that top-p's masses are sums of exps in different orders: when the cumulative
mass at the threshold is within float rounding (~1e-6 relative) of ``top_p * mass(K)``
the two may differ by the tied-at-threshold token(s).

The kernel finds the top-k and top-p thresholds by bisection over the order-preserving
int32 image of the float values (32 halvings pin the exact value), so it needs no sort.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.dispatch import use_triton

GREEDY_TEMPERATURE = 1e-5


@triton.jit
def _chunk(x_ptr, row, start, vocab_size, BLOCK: tl.constexpr):
    """A vocab chunk of a row: values (-inf past V), their order keys, the in-range mask."""
    cols = start + tl.arange(0, BLOCK)
    mask = cols < vocab_size
    x = tl.load(x_ptr + row * vocab_size + cols, mask=mask, other=float("-inf"))
    x = tl.where(x == 0, 0.0, x)  # -0.0 and 0.0 compare equal: give them one key
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # int order == float order
    return x, key, mask, cols


@triton.jit
def _threshold_key(
    x_ptr, row, vocab_size, x_max, floor_key, target, BY_MASS: tl.constexpr, BLOCK: tl.constexpr
):
    """Largest key t with count (or exp-mass) of {key >= max(t, floor_key)} >= target."""
    lo = tl.full([1], -2147483648, tl.int64)
    hi = tl.full([1], 2147483648, tl.int64)
    for _ in range(32):
        mid = lo + (hi - lo) // 2
        total = tl.zeros([1], tl.float32)
        for start in range(0, vocab_size, BLOCK):
            x, key, mask, cols = _chunk(x_ptr, row, start, vocab_size, BLOCK)
            take = mask & (key >= mid) & (key >= floor_key)
            if BY_MASS:
                total += tl.sum(tl.where(take, tl.exp(x - x_max), 0.0), axis=0)
            else:
                total += tl.sum(take.to(tl.float32), axis=0)
        ok = total >= target
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    return lo


@triton.jit
def _argmax_chunks(x_ptr, row, vocab_size, BLOCK: tl.constexpr):
    """(first index of the row maximum, the maximum)."""
    best = tl.full([1], float("-inf"), tl.float32)
    best_idx = tl.zeros([1], tl.int64)
    for start in range(0, vocab_size, BLOCK):
        x, key, mask, cols = _chunk(x_ptr, row, start, vocab_size, BLOCK)
        m = tl.max(x, axis=0)
        idx = tl.min(tl.where(x == m, cols, 2147483647), axis=0).to(tl.int64)
        better = m > best  # strict: an earlier chunk wins ties
        best_idx = tl.where(better, idx, best_idx)
        best = tl.where(better, m, best)
    return best_idx, best


@triton.jit
def _sample_tokens_kernel(
    scaled_ptr, log_noise_ptr, logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr,
    log_min_p_ptr, tokens_ptr, vocab_size, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, 1)
    if tl.load(temperature_ptr + row) < 1e-5:
        # Each branch names what it discards: Triton's code generator needs a name bound in
        # both branches of an `if` to have one type (here fp32 and int64).
        token, _greedy_max = _argmax_chunks(logits_ptr, row, vocab_size, BLOCK)
        tl.store(tokens_ptr + row + offs, token)
    else:
        _argmax_idx, x_max = _argmax_chunks(scaled_ptr, row, vocab_size, BLOCK)
        top_k = tl.load(top_k_ptr + row)
        k_key = tl.full([1], -2147483648, tl.int64)
        if (top_k > 0) & (top_k < vocab_size):
            k_key = _threshold_key(scaled_ptr, row, vocab_size, x_max, k_key, top_k.to(tl.float32), False, BLOCK)  # fmt: skip
        top_p = tl.load(top_p_ptr + row)
        p_key = tl.full([1], -2147483648, tl.int64)
        if top_p < 1.0:
            mass = tl.zeros([1], tl.float32)
            for start in range(0, vocab_size, BLOCK):
                x, key, mask, cols = _chunk(scaled_ptr, row, start, vocab_size, BLOCK)
                mass += tl.sum(tl.where(mask & (key >= k_key), tl.exp(x - x_max), 0.0), axis=0)
            p_key = _threshold_key(scaled_ptr, row, vocab_size, x_max, k_key, top_p * mass, True, BLOCK)  # fmt: skip
        floor_key = tl.maximum(k_key, p_key)
        log_min_p = tl.load(log_min_p_ptr + row)
        best = tl.full([1], float("-inf"), tl.float32)
        best_idx = tl.zeros([1], tl.int64)
        for start in range(0, vocab_size, BLOCK):
            x, key, mask, cols = _chunk(scaled_ptr, row, start, vocab_size, BLOCK)
            log_noise = tl.load(log_noise_ptr + row * vocab_size + cols, mask=mask, other=0.0)
            kept = mask & (key >= floor_key) & (x - x_max >= log_min_p)
            score = tl.where(kept, x - log_noise, float("-inf"))
            m = tl.max(score, axis=0)
            idx = tl.min(tl.where(score == m, cols, 2147483647), axis=0).to(tl.int64)
            better = m > best
            best_idx = tl.where(better, idx, best_idx)
            best = tl.where(better, m, best)
        tl.store(tokens_ptr + row + offs, best_idx)


def _prepare(logits, temperature, min_p, exponential_noise):
    """The fp32 values both implementations compare: scaled logits (greedy rows scaled
    by 1), log(noise) and log(min_p), computed once with torch so they agree bit for bit."""
    greedy = temperature < GREEDY_TEMPERATURE
    scale = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    scaled = logits / scale[:, None]
    return greedy, scaled, exponential_noise.log(), min_p.float().log()


def _check(logits, temperature, top_k, top_p, min_p, exponential_noise) -> None:
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(
            f"sample_tokens: logits must be [B, V] fp32, got {tuple(logits.shape)} {logits.dtype}"
        )
    if exponential_noise.shape != logits.shape:
        raise ValueError("sample_tokens: exponential_noise must be [B, V] like logits")
    for name, t in (
        ("temperature", temperature),
        ("top_k", top_k),
        ("top_p", top_p),
        ("min_p", min_p),
    ):
        if t.shape != (logits.shape[0],):
            raise ValueError(f"sample_tokens: {name} must be [B], got {tuple(t.shape)}")


def sample_tokens_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    exponential_noise: torch.Tensor,
) -> torch.Tensor:
    """Launch wrapper: one program per row walks the vocabulary in chunks."""
    _check(logits, temperature, top_k, top_p, min_p, exponential_noise)
    _, scaled, log_noise, log_min_p = _prepare(logits, temperature, min_p, exponential_noise)
    n_rows, vocab_size = logits.shape
    tokens = torch.empty(n_rows, dtype=torch.int64, device=logits.device)
    if n_rows:
        block = min(4096, triton.next_power_of_2(vocab_size))
        _sample_tokens_kernel[(n_rows,)](
            scaled.contiguous(), log_noise.contiguous(), logits.contiguous(),
            temperature.float().contiguous(), top_k.to(torch.int32).contiguous(),
            top_p.float().contiguous(), log_min_p.contiguous(), tokens, vocab_size, BLOCK=block,
        )  # fmt: skip
    return tokens


def _top_k_floor(scaled: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """[B, 1]: the k-th largest value per row (with multiplicity), -inf where top-k is off."""
    vocab_size = scaled.shape[1]
    on = (top_k > 0) & (top_k < vocab_size)
    floor = torch.full_like(scaled[:, :1], float("-inf"))
    if bool(on.any()):
        k = top_k.long().clamp(1, vocab_size)
        values = scaled.topk(int(k[on].max()), dim=-1).values
        kth = values.gather(1, (k.clamp(max=values.shape[1]) - 1)[:, None])
        floor = torch.where(on[:, None], kth, floor)
    return floor


def _top_p_floor(scaled, x_max, k_floor, top_p) -> torch.Tensor:
    """[B, 1]: top-p's threshold value tau per row (see the module docstring), -inf if off."""
    floor = torch.full_like(k_floor, float("-inf"))
    rows = (top_p < 1.0).nonzero().flatten()
    if rows.numel():
        ordered = scaled[rows].sort(dim=-1, descending=True).values
        in_k = ordered >= k_floor[rows]
        cumulative = torch.where(in_k, torch.exp(ordered - x_max[rows]), 0.0).cumsum(-1)
        # the total is the running sum's last entry: one order per row (a sum() of one row
        # splits it over the threads, of several rows does not: the batch would move it)
        target = top_p[rows].float()[:, None] * cumulative[:, -1:]
        crossing = (cumulative < target).sum(-1, keepdim=True)
        floor[rows] = ordered.gather(1, crossing.clamp(max=ordered.shape[1] - 1))
    return floor


def _kept(scaled, top_k, top_p, log_min_p) -> torch.Tensor:
    """``[B, V]`` bool: the tokens top-k, top-p and min-p keep (the module docstring's sets)."""
    x_max = scaled.max(dim=-1, keepdim=True).values
    k_floor = _top_k_floor(scaled, top_k)
    floor = torch.maximum(k_floor, _top_p_floor(scaled, x_max, k_floor, top_p))
    return (scaled >= floor) & (scaled - x_max >= log_min_p[:, None])


def sample_tokens_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    exponential_noise: torch.Tensor,
) -> torch.Tensor:
    """Reference: whole-batch masks (one topk, one sort for top-p rows), one argmax."""
    _check(logits, temperature, top_k, top_p, min_p, exponential_noise)
    greedy, scaled, log_noise, log_min_p = _prepare(logits, temperature, min_p, exponential_noise)
    kept = _kept(scaled, top_k, top_p, log_min_p)
    sampled = torch.where(kept, scaled - log_noise, float("-inf")).argmax(dim=-1)
    return torch.where(greedy, logits.argmax(dim=-1), sampled)


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    exponential_noise: torch.Tensor,
) -> torch.Tensor:
    """Next token per row of ``logits [B, V]`` as int64 ``[B]``; rules in the module docstring."""
    args = (logits, temperature, top_k, top_p, min_p, exponential_noise)
    if use_triton(logits):
        return sample_tokens_triton(*args)
    return sample_tokens_ref(*args)


def sampling_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """``[B, V]`` fp32: the distribution ``sample_tokens`` draws each row from, written out.

    ``softmax(logits / temperature)`` renormalised over the kept set (the same top-k, top-p
    and min-p sets as the reference's); a greedy row is one-hot at its argmax. Speculative
    decoding's rejection sampler compares proposals with it.
    """
    noise = torch.ones_like(logits)
    _check(logits, temperature, top_k, top_p, min_p, noise)
    greedy, scaled, _, log_min_p = _prepare(logits, temperature, min_p, noise)
    kept = _kept(scaled, top_k, top_p, log_min_p)
    probs = torch.softmax(torch.where(kept, scaled, float("-inf")), dim=-1)
    one_hot = torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[1]).to(probs.dtype)
    return torch.where(greedy[:, None], one_hot, probs)
