"""The draft-model proposer: a small model sharing the target's tokenizer guesses the next k tokens.

Its paged KV cache follows the target's. The block manager knows one set of blocks; the draft
has a second set of KV tensors (sized for its own layers and heads) indexed by the same block
ids, so a sequence's block table and slot mapping address both caches alike, a fork's
copy-on-write copies both, and a block freed or rewound is freed or rewound in both.

One rule keeps the two caches consistent: **in every step the draft writes exactly the slots
the target writes, with the same tokens.** ``propose`` runs at the start of each step, after
the scheduler allocated its slots and before the target's forward:

1. one forward over the whole step (the catch-up): every prefill chunk and plain decode runs
   through the draft as through the target (same chunk, same slots), and every speculative
   decode runs its last known token at position p, whose logits give draft token 1;
2. k - 1 single-token forwards, feeding draft token j at p + j to get draft token j + 1;
3. one more forward feeding draft token k at p + k, for its KV only (no logits).

The verify step then runs ``[t_p, d_1, ..., d_k]`` through the target at p..p + k: the same
tokens at the same slots. Rejected positions are overwritten later in both caches (or their
blocks freed by ``free_blocks_beyond``); accepted ones hold the draft's correct KV. So the draft
never lags: a fully accepted run leaves no hole to fill at the next step (vLLM feeds the
missing bonus-adjacent tokens at the next proposal instead; here step 3 costs one forward
without the LM head), and every block the prefix cache registers holds both models' KV.

Draft tokens are drawn as the request would draw them: greedy rows take the argmax (q one-hot);
sampling rows draw from the draft's distribution under the request's temperature, top-k, top-p
and min-p, with the request's own seeded generator, and that distribution q goes to the
rejection sampler, which needs only that the proposal was drawn from q for the emitted tokens
to follow the target exactly. Logit bias, penalties and min_tokens are not applied to the
draft: q may be any distribution (a worse one only lowers acceptance).
"""

from __future__ import annotations

import logging

import torch

from pagedserve.blockmgr.slot_mapping import build_paged_batch
from pagedserve.engine.input_batch import (
    InputBatch,
    SamplingState,
    attention_metadata,
    token_slice,
)
from pagedserve.engine.kv_cache import (
    allocate_kv_caches,
    bytes_per_block,
    copy_cache_blocks,
    kv_cache_torch_dtype,
    warm_up_attention,
)
from pagedserve.engine.sampler import SamplingMetadata, exponential_noise, sampling_columns
from pagedserve.engine.spec_decode.config import SpeculativeConfig, SpeculativeConfigError
from pagedserve.kernels.sampling import sample_tokens, sampling_probs
from pagedserve.models import ModelConfig, kv_cache_spec, load_model, load_tokenizer
from pagedserve.models.config import ModelLoadError
from pagedserve.scheduler import ScheduledRequest, SchedulerOutput

logger = logging.getLogger("pagedserve.engine")

# A proposal slot the scheduler budgets and allocates for, filled by ``propose`` before the
# target's forward (never fed to a model: an embedding lookup of -1 fails loudly).
PLACEHOLDER_TOKEN_ID = -1


def load_draft_config(path: str, target: ModelConfig, target_tokenizer) -> ModelConfig:
    """The draft's ModelConfig in the target's dtype and on its device, after the checks that
    make its proposals usable: the same vocabulary and token -> id map as the target, room for
    the target's longest sequence, and (where the target frees blocks behind a sliding window)
    no layer that attends further back. Each refusal names ``speculative_config.model``."""
    try:
        draft = ModelConfig(
            model=path,
            dtype=target.torch_dtype,
            device=str(target.torch_device),
            max_model_len=target.max_model_len,
            generation_config="vllm",
            batch_invariant=target.batch_invariant,  # its draft probabilities steer the target's
        )
        draft_tokenizer = load_tokenizer(path)
    except (ModelLoadError, OSError, ValueError) as e:
        raise SpeculativeConfigError("model", f"cannot load the draft model {path!r}: {e}") from e
    if draft.vocab_size != target.vocab_size:
        raise SpeculativeConfigError(
            "model",
            f"the draft's vocabulary has {draft.vocab_size} tokens, the target's "
            f"{target.vocab_size}: a draft must share the target's tokenizer",
        )
    if draft_tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise SpeculativeConfigError(
            "model", "the draft's tokenizer maps tokens to other ids than the target's"
        )
    window = target.kv_cache_window
    if window is not None and any(w is None or w > window for w in draft.sliding_windows):
        raise SpeculativeConfigError(
            "model",
            f"the target frees KV blocks behind its {window}-token window, and the draft "
            "attends further back: use a draft with windows no wider than the target's",
        )
    return draft


class DraftModelProposer:
    """The draft model, its KV tensors, and one step's proposals (see the module docstring).

    ``cache_dtype`` is the engine's ``CacheConfig.cache_dtype``: the draft's cache stores what
    the target's stores (a 16-bit cache under an fp32 model halves both caches' bytes), so the
    memory budget's split and the attention paths are the same for both."""

    def __init__(
        self,
        config: SpeculativeConfig,
        target: ModelConfig,
        target_tokenizer: object,
        cache_dtype: str = "auto",
    ) -> None:
        self.k = config.num_speculative_tokens
        self.model_config = load_draft_config(config.model, target, target_tokenizer)
        self.device = self.model_config.torch_device
        self.kv_cache_dtype = kv_cache_torch_dtype(cache_dtype, self.model_config.torch_dtype)
        self.model = load_model(self.model_config)
        self.kv_cache_spec = kv_cache_spec(self.model_config)
        self.kv_caches: list[tuple[torch.Tensor, ...]] = []
        self.block_size = 0
        # per request verified this step: the draft distributions of its proposals [n, V]
        # (sampling rows only; a greedy row's q is one-hot at its proposal)
        self.draft_probs: dict[str, torch.Tensor] = {}

    def block_bytes(self, block_size: int) -> int:
        """KV bytes one block takes in the draft's cache (the budget split counts them)."""
        return bytes_per_block(self.kv_cache_spec, block_size, self.kv_cache_dtype)

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> None:
        """The draft's KV tensors: as many blocks as the target's pool, the same block size."""
        mc = self.model_config
        self.block_size = block_size
        self.kv_caches = allocate_kv_caches(
            self.kv_cache_spec, num_blocks, block_size, self.kv_cache_dtype, self.device
        )
        logger.info(
            "draft model %s: %d layers, KV cache of %d %s blocks beside the target's",
            mc.model, mc.num_layers, num_blocks, str(self.kv_cache_dtype).removeprefix("torch."),
        )  # fmt: skip
        warm_up_attention(  # on a GPU: the draft's attention variants compiled now
            mc, self.kv_cache_spec, mc.num_attention_heads, block_size, self.kv_cache_dtype,
            self.device,
        )  # fmt: skip

    def placeholders(self, room: int) -> list[int]:
        """The proposal slots to ask the scheduler for: ``min(k, room)`` of them."""
        return [PLACEHOLDER_TOKEN_ID] * min(self.k, room)

    @torch.inference_mode()
    def propose(self, scheduled: SchedulerOutput, input_batch: InputBatch) -> None:
        """Write this step's tokens into the draft's cache and fill every speculative decode's
        placeholders with draft tokens (``SchedulerOutput.spec_token_ids``), drawn with each
        sequence's sampling state (``input_batch``)."""
        self.draft_probs = {}
        if scheduled.blocks_to_copy:
            pairs = torch.tensor(scheduled.blocks_to_copy, dtype=torch.long, device=self.device)
            copy_cache_blocks(self.kv_caches, pairs)
        every = scheduled.scheduled
        items = [item for item in every if item.spec_token_ids]
        logits = self._catch_up(every, items)
        if items:
            states = [input_batch.states[item.request.request_id] for item in items]
            for item, tokens in zip(items, self._draft(items, states, logits), strict=True):
                scheduled.spec_token_ids[item.request.request_id] = tokens

    def _forward(
        self, items: list[ScheduledRequest], tokens: list[int], starts: list[int], counts: list[int]
    ) -> torch.Tensor:
        """One draft forward over a flat varlen batch; the hidden states of every token."""
        tables = [item.block_table for item in items]
        batch = build_paged_batch(tables, starts, counts, self.block_size)
        dev = self.device
        return self.model(
            torch.tensor(tokens, dtype=torch.long, device=dev),
            torch.from_numpy(batch.positions).to(dev),
            self.kv_caches,
            attention_metadata(batch, dev),
        )

    def _catch_up(
        self, scheduled: list[ScheduledRequest], items: list[ScheduledRequest]
    ) -> torch.Tensor | None:
        """Step 1: the step's chunks as the target runs them, and each speculative decode's
        last known token; the logits of those last tokens (in ``items`` order)."""
        tokens, starts, counts, last_rows = [], [], [], []
        for item in scheduled:
            start = item.num_computed_tokens
            count = 1 if item.spec_token_ids else item.num_new_tokens
            tokens.extend(token_slice(item.request, start, count))
            starts.append(start)
            counts.append(count)
            if item.spec_token_ids:
                last_rows.append(len(tokens) - 1)
        hidden = self._forward(scheduled, tokens, starts, counts)  # a step is never empty
        if not items:
            return None
        rows = torch.tensor(last_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[rows])

    def _draft(
        self, items: list[ScheduledRequest], states: list[SamplingState], logits: torch.Tensor
    ) -> list[list[int]]:
        """Steps 2 and 3: draw draft token j + 1 from the logits after token j, feed it back;
        each item's draft tokens."""
        wanted = [len(item.spec_token_ids) for item in items]
        drafts: list[list[int]] = [[] for _ in items]
        probs: list[list[torch.Tensor]] = [[] for _ in items]
        active = list(range(len(items)))  # items still drafting, in order
        for j in range(max(wanted)):
            active_states = [states[i] for i in active]
            tokens, q = draw_draft_tokens(logits, active_states)
            for row, i in enumerate(active):
                drafts[i].append(tokens[row])
                if q is not None and not active_states[row].greedy:
                    probs[i].append(q[row])
            feed = active  # every active item feeds its new token: its KV is needed
            active = [i for i in active if wanted[i] > j + 1]
            starts = [items[i].num_computed_tokens + 1 + j for i in feed]
            hidden = self._forward(
                [items[i] for i in feed], [drafts[i][-1] for i in feed], starts, [1] * len(feed)
            )
            if not active:
                break
            keep = torch.tensor(
                [row for row, i in enumerate(feed) if wanted[i] > j + 1], device=self.device
            )
            logits = self.model.compute_logits(hidden[keep])
        for item, rows in zip(items, probs, strict=True):
            if rows:
                self.draft_probs[item.request.request_id] = torch.stack(rows)
        return drafts


def draw_draft_tokens(
    logits: torch.Tensor, states: list[SamplingState]
) -> tuple[list[int], torch.Tensor | None]:
    """Draft tokens for rows of ``logits`` under each sequence's sampling params and generator:
    the argmax for greedy rows; for sampling rows a draw from ``sampling_probs`` (the
    exponential race, noise from the request's generator). Returns the tokens and the
    distributions they were drawn from (None when every row is greedy: q is one-hot)."""
    meta = SamplingMetadata(states)
    if meta.all_greedy:
        return logits.argmax(dim=-1).tolist(), None
    temperature, top_k, top_p, min_p = sampling_columns(meta, logits.device)
    noise = exponential_noise(logits, meta.generators, meta.greedy)
    tokens = sample_tokens(logits, temperature, top_k, top_p, min_p, noise)
    return tokens.tolist(), sampling_probs(logits, temperature, top_k, top_p, min_p)
