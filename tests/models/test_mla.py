"""Multi-head latent attention's two paths, and DeepSeek's routers and latent cache.

- The absorbed decode path (query folded into the latent space, attention over the cached
  latents as they are) and the expanded prefill path (latents up-projected to per-head keys
  and values) both equal ``mla_attention_literal``, MLA as the paper writes it, on the same
  NaN-padded paged cache; and the layer's split sends each row where it belongs.
- DeepSeek-V2's group-limited greedy router and V3's noaux_tc router (correction bias, groups
  ranked by their two best experts) choose transformers' experts with transformers' weights.
- The engine caches one latent per token and layer (no values) and sizes the cache by it.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

from pagedserve.engine import LLM
from pagedserve.kernels.mla_attention_literal import mla_attention_literal
from pagedserve.kernels.testing import make_paged_batch
from pagedserve.models import AttentionMetadata, ModelConfig, kv_cache_spec
from pagedserve.models.layers.mla import MultiHeadLatentAttention
from pagedserve.models.moe_routing import GroupLimitedRouter, NoAuxRouter

# (seq_len, q_len): decodes, a whole prompt, a chunk over a cached prefix, a prefix hit's last
SEQS = [(9, 1), (21, 21), (30, 7), (1, 1), (17, 1), (12, 2)]


@pytest.fixture(scope="module")
def attention(tmp_path_factory) -> MultiHeadLatentAttention:
    """The tiny DeepSeek-V3's attention (kv_lora_rank 32, rope 16, nope 16, v 24, 4 heads),
    with random weights."""
    from pagedserve.models.testing import make_tiny_checkpoint

    path = make_tiny_checkpoint("deepseek_v3", tmp_path_factory.mktemp("dsv3"))
    attn = MultiHeadLatentAttention(ModelConfig(model=str(path)), _one_rank())
    gen = torch.Generator().manual_seed(0)
    for param in attn.parameters():
        param.data.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return attn


def _one_rank():
    from pagedserve.models import ParallelContext

    return ParallelContext()


def _case(attn: MultiHeadLatentAttention, seqs, seed=1):
    """A paged latent cache (unused slots NaN), the new tokens' q_nope / q_pe, the metadata."""
    width = attn.kv_lora_rank + attn.rope_dim
    batch = make_paged_batch(seqs, attn.num_heads, 1, width, 8, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    n_tokens = batch.query.shape[0]
    q_nope = torch.randn(n_tokens, attn.num_heads, attn.nope_dim, generator=gen)
    q_pe = torch.randn(n_tokens, attn.num_heads, attn.rope_dim, generator=gen)
    meta = AttentionMetadata(
        slot_mapping=torch.full((n_tokens,), -1),
        block_tables=batch.block_tables,
        seq_lens=batch.seq_lens,
        query_start_loc=batch.query_start_loc,
    )
    return q_nope, q_pe, batch.k_cache, meta


def _literal(attn, q_nope, q_pe, cache, meta):
    w_uk, w_uv = attn.kv_b_proj.per_head()
    return mla_attention_literal(
        q_nope, q_pe, cache, w_uk, w_uv, meta.block_tables, meta.seq_lens,
        meta.query_start_loc, attn.scale,
    )  # fmt: skip


def test_the_layer_splits_a_mixed_step_between_its_paths(attention):
    q_nope, q_pe, cache, meta = _case(attention, SEQS)
    out = attention.attend(q_nope, q_pe, cache, meta)
    torch.testing.assert_close(out, _literal(attention, q_nope, q_pe, cache, meta))
    assert meta.decode_split.num_decodes == 3 and len(meta.decode_split.prefills) == 3


def test_absorbed_decode_equals_the_literal_mla(attention):
    decodes = [(n, 1) for n in (9, 1, 17, 64, 33)]
    q_nope, q_pe, cache, meta = _case(attention, decodes, seed=2)
    out = attention.absorbed_decode(q_nope, q_pe, cache, meta.block_tables, meta.seq_lens)
    torch.testing.assert_close(out, _literal(attention, q_nope, q_pe, cache, meta))


def test_expanded_prefill_equals_the_literal_mla_on_every_kind_of_row(attention):
    """Whole prompts, chunks over a cached prefix, and single rows too: the expanded path is
    MLA itself, whatever the row; only its cost makes the layer keep it for prefills."""
    q_nope, q_pe, cache, meta = _case(attention, SEQS, seed=3)
    expected = _literal(attention, q_nope, q_pe, cache, meta)
    bounds = meta.query_start_loc.tolist()
    for b, (seq_len, _) in enumerate(SEQS):
        rows = slice(bounds[b], bounds[b + 1])
        out = attention.expanded_prefill(
            q_nope[rows], q_pe[rows], cache, meta.block_tables[b], seq_len
        )
        torch.testing.assert_close(out, expected[rows])


def test_a_pure_decode_step_takes_the_absorbed_path_whole(attention):
    q_nope, q_pe, cache, meta = _case(attention, [(5, 1), (40, 1), (8, 1)], seed=4)
    assert meta.decode_split.decode_rows is None
    out = attention.attend(q_nope, q_pe, cache, meta)
    torch.testing.assert_close(out, _literal(attention, q_nope, q_pe, cache, meta))


def _routers(version: int, n_group: int, topk_group: int, method: str = "greedy"):
    kw = dict(
        hidden_size=32, n_routed_experts=16, num_experts_per_tok=3, n_group=n_group,
        topk_group=topk_group, routed_scaling_factor=1.7,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(version)
    weight = torch.randn(16, 32, generator=gen)
    if version == 2:
        theirs = DeepseekV2TopkRouter(DeepseekV2Config(topk_method=method, **kw))
        ours = GroupLimitedRouter(16, 3, 32, n_group if method != "greedy" else 1,
                                  topk_group if method != "greedy" else 1, 1.7)  # fmt: skip
    else:
        theirs = DeepseekV3TopkRouter(DeepseekV3Config(norm_topk_prob=True, **kw))
        ours = NoAuxRouter(16, 3, 32, n_group, topk_group, True, 1.7)
        bias = torch.randn(16, generator=gen) * 0.3
        theirs.e_score_correction_bias.copy_(bias)
        ours.e_score_correction_bias.data.copy_(bias)
    theirs.weight.data.copy_(weight)
    ours.weight.data.copy_(weight)
    return ours, theirs


@pytest.mark.parametrize(
    "version, n_group, topk_group, method",
    [(2, 1, 1, "greedy"), (2, 4, 2, "group_limited_greedy"), (3, 4, 2, "noaux_tc"),
     (3, 8, 3, "noaux_tc")],
)  # fmt: skip
def test_deepseek_routers_choose_transformers_experts(version, n_group, topk_group, method):
    ours, theirs = _routers(version, n_group, topk_group, method)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(7))
    weights, ids = ours(x)
    _, their_weights, their_ids = theirs(x)
    order, their_order = ids.argsort(-1), their_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), their_ids.gather(1, their_order))
    torch.testing.assert_close(weights.gather(1, order), their_weights.gather(1, their_order))
    if version == 3:  # the bias moved some choice (else this test would not test it)
        unbiased = NoAuxRouter(16, 3, 32, n_group, topk_group, True, 1.7)
        unbiased.weight.data.copy_(ours.weight)
        unbiased.e_score_correction_bias.data.zero_()
        assert not torch.equal(unbiased(x)[1].sort(-1).values, ids.sort(-1).values)


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v3"])
def test_the_engine_caches_one_latent_per_token_and_layer(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    budget = 1 << 20
    llm = LLM(model=path, block_size=8, kv_cache_memory=budget)
    runner = llm.engine.runner
    latent = 32 + 16  # the tiny models' kv_lora_rank + qk_rope_head_dim
    assert [len(layer) for layer in runner.kv_caches] == [1, 1]  # no value caches
    assert runner.kv_caches[0][0].shape == (runner.num_blocks, 8, 1, latent)
    assert runner.num_blocks == budget // (2 * 8 * latent * 4)  # 2 layers, fp32
    spec = kv_cache_spec(llm.engine.model_config, tp_size=2)
    assert (spec.num_kv_heads, spec.head_size, spec.is_latent) == (1, latent, True)


def test_forks_copy_their_shared_latent_block_on_write(tiny_checkpoint):
    """n=2: both sequences start on the prompt's last, partial block; the first write into it
    copies it (copy_blocks over caches without values). Each fork must still continue exactly
    as transformers does."""
    from transformers import AutoModelForCausalLM

    from pagedserve.engine import SamplingParams
    from pagedserve.models.testing import transformers_greedy

    path = tiny_checkpoint("deepseek_v2")
    prompt = list(range(40, 61))  # 21 tokens: the third block is shared and partial
    llm = LLM(model=path, block_size=8)
    params = SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = transformers_greedy(hf, prompt, 12)
    assert [c.token_ids for c in out.outputs] == [expected, expected]
