"""The sampler: from a batch of logits to one next token per row, with every SamplingParams knob.

Per row, in vLLM's order:

1. logit processors: ``logit_bias`` is added; while a request has fewer than ``min_tokens``
   output tokens its stop tokens (EOS included unless ``ignore_eos``) are masked to -inf;
2. penalties (repetition on every token seen in prompt or output, then frequency and presence
   on output tokens), through ``pagedserve.kernels.apply_penalties``;
3. temperature, top-k, top-p, min-p and the draw, through ``pagedserve.kernels.sample_tokens``
   (the Triton kernels on a GPU, their references on CPU).

Randomness comes from each request's own torch.Generator, drawn as exponential noise over the
vocabulary (the exponential race: ``argmax(x - log(noise))`` samples from ``softmax(x)``). A row
draws its noise only from its own generator, so a seeded request draws the same tokens alone or
in any batch.

Two seams for later features: an optional per-row token mask (structured outputs: tokens the
grammar forbids get -inf before anything else), and ``score_proposed_tokens`` (speculative
decoding: the target model's probabilities of k proposed tokens per row).

The host cost is kept out of the plain path: the per-row settings are gathered in one pass into
one tensor, every decision (greedy? penalties? bias? logprobs?) is read from it, and a batch of
greedy rows with nothing else to apply is one argmax. Rows the engine already knows to be plain
(decisions.py ``PlainRequests``: a temperature and nothing else) come with
``PlainSamplingMetadata`` instead and skip even that: one argmax, or one temperature draw.

Logprobs are those of the model's raw distribution (log_softmax of the logits before any
processing; vLLM's default ``raw_logprobs``): the sampled token's, and the top-N.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import torch

from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.kernels.penalties import apply_penalties
from pagedserve.kernels.sampling import GREEDY_TEMPERATURE, sample_tokens
from pagedserve.kernels.token_bitmask import apply_token_bitmask
from pagedserve.kernels.token_bitmask import unpack_token_bitmask as unpack_token_bitmask


@dataclass
class SamplingMetadata:
    """Per-row inputs of one sampling step. Row i of the logits belongs to entry i of each list.

    ``masked_token_ids[i]``: tokens that row i must not pick now (stop tokens under min_tokens).
    ``allowed_token_mask``: when given, what each row may pick at all (structured outputs): a
    bool ``[rows, vocab]`` (True = allowed), or the packed int32 bitmask ``[rows, ceil(vocab /
    32)]`` that grammar backends (xgrammar) fill, bit ``t % 32`` of word ``t // 32`` = token t.
    ``allowed_token_rows``: the rows a packed mask constrains (None: every row).
    """

    params: list[SamplingParams]
    generators: list[torch.Generator]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]
    masked_token_ids: list[frozenset[int] | set[int]]
    allowed_token_mask: torch.Tensor | None = None
    allowed_token_rows: list[int] | None = None


@dataclass
class PlainSamplingMetadata:
    """The plain path's inputs (decisions.py ``PlainRequests``): rows with no penalty, bias,
    mask, top-k/top-p/min-p or logprobs. ``temperature`` None: every row is greedy (one
    argmax); else row i is drawn at ``temperature[i]`` from ``generators[i]`` (greedy below
    ``GREEDY_TEMPERATURE``, drawing nothing). The general path gives the same tokens for these
    rows; this one only skips building what they do not use.

    ``general``: the rest of a mixed step, drawn in the same call by the general path from the
    logits rows ``general_rows`` (its SamplingMetadata entry i describes row general_rows[i]).
    """

    temperature: list[float] | None = None
    generators: list[torch.Generator | None] | None = None
    general_rows: list[int] = field(default_factory=list)
    general: SamplingMetadata | None = None


@dataclass
class SamplerOutput:
    """``token_ids [B]``; when any row asked for logprobs: the sampled tokens' raw logprobs
    ``[B]`` and the top-``K`` ``[B, K]`` (K = the largest ``logprobs`` in the batch).

    A mixed plain + general call (``PlainSamplingMetadata.general``): ``plain_token_ids`` is
    the plain pass's token for every logits row, the rest is the general rows' output."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None
    top_token_ids: torch.Tensor | None = None
    plain_token_ids: torch.Tensor | None = None
    _host: tuple[list, list, list, list] | None = field(default=None, init=False, repr=False)

    def row_logprobs(self, row: int, num: int) -> dict[int, float]:
        """Row ``row``'s logprobs as {token id: logprob}: its top ``num``, then the sampled token.

        The tensors come to the host once per step, on the first call (one transfer each, not
        one per element read)."""
        assert self.logprobs is not None and self.top_logprobs is not None
        if self._host is None:
            tensors = (self.token_ids, self.logprobs, self.top_token_ids, self.top_logprobs)
            self._host = tuple(t.tolist() for t in tensors)
        tokens, logprobs, top_ids, top_values = self._host
        result = dict(zip(top_ids[row][:num], top_values[row][:num]))
        result.setdefault(tokens[row], logprobs[row])
        return result


class BatchSettings:
    """What a batch needs, found in a few short passes over the rows' params.

    The flags (all greedy? any penalty, bias, logprobs?) are plain ``all``/``any`` scans that
    stop at the first row that decides them; the per-row sampling values are gathered only when
    some row samples, into one tensor moved to the device in one copy. (A table of every value,
    built for every batch, was measured slower: building a 256 x 9 tensor from Python tuples
    costs more than the scans it replaces.)
    """

    def __init__(self, params: list[SamplingParams]) -> None:
        self.params = params
        self.greedy = [p.temperature < GREEDY_TEMPERATURE for p in params]
        self.all_greedy = all(self.greedy)
        self.any_penalty = any(
            p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            for p in params
        )
        self.any_bias = any(p.logit_bias for p in params)
        self.max_logprobs = max(
            (p.logprobs for p in params if p.logprobs is not None), default=None
        )

    def columns(self, names: tuple[str, ...], device: torch.device) -> torch.Tensor:
        """``[len(names), B]`` float32 of the named SamplingParams fields, in one transfer."""
        table = torch.tensor([[getattr(p, n) for p in self.params] for n in names])
        return table.to(device=device, dtype=torch.float32)


def select_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``logits[rows]`` without copying the matrix when ``rows`` is ``0, 1, ..., n - 1`` (every
    sampled row in order, the common case): a view of the first n rows then, else one gather."""
    n = len(rows)
    if n <= logits.shape[0] and rows == list(range(n)):
        return logits[:n]
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    return logits.index_select(0, index)


def apply_token_mask(
    logits: torch.Tensor, mask: torch.Tensor, rows: list[int] | None = None
) -> torch.Tensor:
    """Tokens outside each row's allowed set to -inf, on a copy (``mask``: see SamplingMetadata).

    A packed bitmask goes through the ``apply_token_bitmask`` kernel, on ``rows`` only when
    given (the constrained rows; the others share the batch untouched)."""
    num_rows, vocab = logits.shape
    if mask.dtype == torch.bool:
        if mask.shape != (num_rows, vocab):
            raise ValueError(
                f"allowed_token_mask must be [{num_rows}, {vocab}], got {tuple(mask.shape)}"
            )
        return logits.masked_fill(~mask.to(logits.device), float("-inf"))
    if mask.shape != (num_rows, -(-vocab // 32)):
        raise ValueError(
            f"allowed_token_mask (packed) must be [{num_rows}, {-(-vocab // 32)}], "
            f"got {tuple(mask.shape)}"
        )
    logits = logits.clone()
    device = logits.device
    indices = None if rows is None else torch.tensor(rows, dtype=torch.int32, device=device)
    apply_token_bitmask(logits, mask.to(device=device, dtype=torch.int32), indices)
    return logits


def apply_logit_processors(
    logits: torch.Tensor, meta: SamplingMetadata, settings: BatchSettings | None = None
) -> torch.Tensor:
    """The structured-output mask, logit_bias and the min_tokens stop-token mask, on a copy of
    ``logits`` (the input itself when none applies)."""
    settings = settings or BatchSettings(meta.params)
    masked = [(row, t) for row, ids in enumerate(meta.masked_token_ids) if ids for t in ids]
    if meta.allowed_token_mask is not None:
        logits = apply_token_mask(logits, meta.allowed_token_mask, meta.allowed_token_rows)
    elif settings.any_bias or masked:
        logits = logits.clone()
    if settings.any_bias:
        rows, cols, bias = [], [], []
        for row, params in enumerate(meta.params):
            for token, value in (params.logit_bias or {}).items():
                rows.append(row)
                cols.append(int(token))
                bias.append(float(value))
        index = (torch.tensor(rows), torch.tensor(cols))
        values = torch.tensor(bias, dtype=logits.dtype)
        logits.index_put_(tuple(i.to(logits.device) for i in index), values.to(logits.device), True)
    if masked:
        r, c = zip(*masked, strict=True)
        logits[torch.tensor(r, device=logits.device), torch.tensor(c, device=logits.device)] = (
            float("-inf")
        )
    return logits


def _scatter_index(token_lists: list[list[int]], device: torch.device):
    """(row, token) index tensors of every token of every row, built in one pass."""
    lengths = torch.tensor([len(ids) for ids in token_lists], dtype=torch.long)
    tokens = torch.tensor(list(chain.from_iterable(token_lists)), dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(token_lists)), lengths)
    return rows.to(device), tokens.to(device)


def penalise(
    logits: torch.Tensor, meta: SamplingMetadata, settings: BatchSettings | None = None
) -> torch.Tensor:
    """Repetition, frequency and presence penalties (skipped when no row uses any)."""
    settings = settings or BatchSettings(meta.params)
    if not settings.any_penalty:
        return logits
    batch, vocab = logits.shape
    device = logits.device
    prompt_mask = torch.zeros(batch, vocab, dtype=torch.bool, device=device)
    prompt_mask[_scatter_index(meta.prompt_token_ids, device)] = True
    output_counts = torch.zeros(batch, vocab, dtype=torch.int32, device=device)
    rows, tokens = _scatter_index(meta.output_token_ids, device)
    ones = torch.ones_like(tokens, dtype=torch.int32)
    output_counts.index_put_((rows, tokens), ones, accumulate=True)
    names = ("repetition_penalty", "presence_penalty", "frequency_penalty")
    repetition, presence, frequency = settings.columns(names, device)
    return apply_penalties(logits, prompt_mask, output_counts, repetition, presence, frequency)


def exponential_noise(
    logits: torch.Tensor, generators: list[torch.Generator], greedy: list[bool]
) -> torch.Tensor:
    """Exp(1) noise like ``logits``: row i drawn from ``generators[i]`` only (greedy rows: ones,
    drawing nothing, so a greedy step does not move a generator)."""
    noise = torch.ones_like(logits)
    for row, (generator, is_greedy) in enumerate(zip(generators, greedy, strict=True)):
        if not is_greedy:
            noise[row].exponential_(generator=generator)
    return noise


class Sampler:
    def __call__(
        self, logits: torch.Tensor, meta: SamplingMetadata | PlainSamplingMetadata
    ) -> SamplerOutput:
        """Next token ids ``[B]`` (and logprobs) for ``logits [B, V]`` (float32)."""
        if isinstance(meta, PlainSamplingMetadata):
            plain = self.sample_plain(logits, meta)
            if meta.general is None:
                return SamplerOutput(plain)
            output = self(select_rows(logits, meta.general_rows), meta.general)
            output.plain_token_ids = plain
            return output
        raw = logits
        settings = BatchSettings(meta.params)
        logits = penalise(apply_logit_processors(logits, meta, settings), meta, settings)
        device = logits.device
        if settings.all_greedy:
            tokens = logits.argmax(dim=-1)
        else:
            names = ("temperature", "top_k", "top_p", "min_p")
            temperature, top_k, top_p, min_p = settings.columns(names, device)
            noise = exponential_noise(logits, meta.generators, settings.greedy)
            tokens = sample_tokens(logits, temperature, top_k.int(), top_p, min_p, noise)
        return self._with_logprobs(raw, tokens, settings.max_logprobs)

    @staticmethod
    def sample_plain(logits: torch.Tensor, meta: PlainSamplingMetadata) -> torch.Tensor:
        """The general path's draw for plain rows, without its per-row settings: the same
        argmax, or the same ``sample_tokens`` call with top-k/top-p/min-p off."""
        if meta.temperature is None:
            return logits.argmax(dim=-1)
        num_rows, device = logits.shape[0], logits.device
        greedy = [t < GREEDY_TEMPERATURE for t in meta.temperature]
        noise = exponential_noise(logits, meta.generators, greedy)
        temperature = torch.tensor(meta.temperature, dtype=torch.float32).to(device)
        off = torch.zeros(num_rows, dtype=torch.float32, device=device)
        top_k, top_p = off.int(), torch.ones_like(off)
        return sample_tokens(logits, temperature, top_k, top_p, off, noise)

    @staticmethod
    def _with_logprobs(
        raw: torch.Tensor, tokens: torch.Tensor, max_logprobs: int | None
    ) -> SamplerOutput:
        if max_logprobs is None:
            return SamplerOutput(tokens)
        logprobs = torch.log_softmax(raw.float(), dim=-1)
        top = logprobs.topk(max(max_logprobs, 1), dim=-1)
        return SamplerOutput(
            token_ids=tokens,
            logprobs=logprobs.gather(1, tokens[:, None]).squeeze(1),
            top_logprobs=top.values,
            top_token_ids=top.indices,
        )


@dataclass
class ProposalScores:
    """The target model's view of k proposed tokens per row (speculative decoding's verify).

    ``probs [R, k]``: the probability of proposed token j under the row's target distribution
    (softmax of logits / temperature; greedy rows: 1 where it is the argmax, else 0), what a
    rejection sampler compares with the proposer's probability. ``logprobs [R, k]``: its raw
    logprob (log_softmax of the logits, as the sampler reports). ``bonus_logits [R, V]``: the
    last position's logits, which give the extra token when all k are accepted.
    """

    probs: torch.Tensor
    logprobs: torch.Tensor
    bonus_logits: torch.Tensor


def score_proposed_tokens(
    logits: torch.Tensor, proposed_token_ids: torch.Tensor, params: list[SamplingParams]
) -> ProposalScores:
    """Score ``proposed_token_ids [R, k]`` against ``logits`` for k + 1 positions per row.

    ``logits`` is ``[R, k + 1, V]`` or its flat ``[R * (k + 1), V]`` (each row's positions in
    order, as the runner returns them): position j's logits give the distribution of proposed
    token j, position k's the bonus token's. Top-k/top-p/min-p and penalties are the rejection
    sampler's to apply when it comes; this is the seam it scores through.
    """
    num_rows, k = proposed_token_ids.shape
    if len(params) != num_rows:
        raise ValueError(f"{num_rows} rows of proposed tokens, {len(params)} sampling params")
    logits = logits.reshape(num_rows, k + 1, -1).float()
    scored, index = logits[:, :k], proposed_token_ids.long().to(logits.device)[:, :, None]
    logprobs = torch.log_softmax(scored, dim=-1).gather(2, index).squeeze(2)
    settings = BatchSettings(params)
    greedy = torch.tensor(settings.greedy, device=logits.device)
    (temperature,) = settings.columns(("temperature",), logits.device)
    temperature = torch.where(greedy, torch.ones_like(temperature), temperature)
    sampled = torch.softmax(scored / temperature[:, None, None], dim=-1).gather(2, index).squeeze(2)
    is_argmax = (scored.argmax(dim=-1) == index.squeeze(2)).float()
    probs = torch.where(greedy[:, None], is_argmax, sampled)
    return ProposalScores(probs=probs, logprobs=logprobs, bonus_logits=logits[:, k])
