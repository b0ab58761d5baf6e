"""KV offloading through the engine (tiny Llama, fp32, greedy): host-memory and disk tiers.

- A multi-turn workload with more conversations than the KV pool holds gives exactly the
  outputs it gives without offloading, while the later turns load their evicted prefixes back
  from the tiers (counted per tier).
- A restarted engine with the same --kv-offload-dir serves a prefix it saw from disk: the hit
  is counted, and the output is the one computed cold.
- A block file that is corrupted, or that holds another model's block, is skipped and
  counted, deleted, and never loaded; the answer is still right (and the recomputed block is
  saved again).
- A temporary file left by a killed writer is removed at start and never served.
"""

from __future__ import annotations

import random

import pytest

from pagedserve.blockmgr import extend_block_hashes
from pagedserve.engine import LLM, SamplingParams

BLOCK = 8
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


def _generate(llm: LLM, prompts: list[list[int]]):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)


def _llm(model: str, num_blocks: int = 24, **options) -> LLM:
    return LLM(model=model, block_size=BLOCK, num_gpu_blocks_override=num_blocks, **options)


def multi_turn(llm: LLM, num_conversations: int, num_turns: int, seed: int = 0):
    """Each turn appends the last answer and a new user message to every conversation, all
    conversations in one batch; returns every turn's outputs and cached-token counts."""
    rng = random.Random(seed)
    histories = [_tokens(rng, 20) for _ in range(num_conversations)]
    answers, cached = [], []
    for _ in range(num_turns):
        outputs = _generate(llm, histories)
        answers.append([o.outputs[0].token_ids for o in outputs])
        cached.append([o.num_cached_tokens for o in outputs])
        histories = [h + list(a) + _tokens(rng, 10) for h, a in zip(histories, answers[-1])]
    return answers, cached


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def baseline(model):
    """The workload on a pool of 24 blocks (192 tokens) without offloading."""
    return multi_turn(_llm(model), num_conversations=12, num_turns=3)


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_multi_turn_outputs_equal_with_and_without_offloading(model, baseline, tier, tmp_path):
    options = {"kv_offload_memory": 64 << 20} if tier == "ram" else {"kv_offload_dir": tmp_path}
    llm = _llm(model, **options)
    answers, cached = multi_turn(llm, num_conversations=12, num_turns=3)
    assert answers == baseline[0]
    stats = llm.engine.get_stats().kv_connector
    # 12 conversations of 30+ tokens cannot all stay in 24 blocks of 8: later turns reload
    assert stats.hit_tokens[tier] > 0 and stats.failed_loads == 0
    assert sum(map(sum, cached[1:])) > sum(map(sum, baseline[1][1:]))
    llm.engine.shutdown()


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "q8_0"])
def test_an_8_bit_cache_offloads_and_reloads_its_bytes(tiny_checkpoint, kv_cache_dtype, tmp_path):
    """fp8 blocks and q8_0 rows (their scales inside) move as their bytes (a record's dtype is
    ``fp8e4m3`` or ``q8_0``), through the disk tier and back: the same answers as an engine
    with that cache that recomputes."""
    model = tiny_checkpoint("llama", num_attention_heads=2)  # heads of 32: q8_0's groups
    want = multi_turn(_llm(model, kv_cache_dtype=kv_cache_dtype), num_conversations=12, num_turns=3)
    llm = _llm(model, kv_cache_dtype=kv_cache_dtype, kv_offload_dir=tmp_path)
    answers, _ = multi_turn(llm, num_conversations=12, num_turns=3)
    assert answers == want[0]
    stats = llm.engine.get_stats().kv_connector
    assert stats.hit_tokens["disk"] > 0 and stats.failed_loads == 0
    llm.engine.shutdown()


def _block_file(folder, prompt: list[int], index: int):
    """The file of block ``index`` of ``prompt``: named by the prefix hash chain rooted at the
    folder's own hash root, under the engine's layout folder."""
    root = (folder / "hash_root").read_bytes()
    key = extend_block_hashes([], prompt, BLOCK, root=root)[index]
    (layout,) = [p for p in folder.iterdir() if p.is_dir()]
    return layout / (key.hex() + ".kv")


def _seen(model: str, folder, prompts):
    """Serve ``prompts`` once on an engine with ``folder`` as its disk tier, then stop it."""
    llm = _llm(model, kv_offload_dir=folder)
    outputs = _generate(llm, prompts)
    llm.engine.shutdown()  # the writer's queue is written out
    return [o.outputs[0].token_ids for o in outputs]


def test_a_restarted_engine_serves_a_seen_prefix_from_disk(model, tmp_path):
    prompt = _tokens(random.Random(1), 41)  # 5 full blocks before the last token
    cold = _seen(model, tmp_path, [prompt])
    llm = _llm(model, kv_offload_dir=tmp_path)
    (warm,) = _generate(llm, [prompt])
    stats = llm.engine.get_stats().kv_connector
    assert warm.outputs[0].token_ids == cold[0]
    assert warm.num_cached_tokens == 40 and stats.hit_tokens["disk"] == 40
    assert stats.loaded_bytes["disk"] > 0 and stats.loads["disk"] == 1


def test_a_corrupted_block_file_is_skipped_counted_and_deleted(model, tmp_path):
    prompt = _tokens(random.Random(2), 41)
    cold = _seen(model, tmp_path, [prompt])
    third = _block_file(tmp_path, prompt, 2)
    data = bytearray(third.read_bytes())
    data[-3] ^= 0xFF  # one flipped byte in the payload
    third.write_bytes(bytes(data))
    llm = _llm(model, kv_offload_dir=tmp_path)
    (warm,) = _generate(llm, [prompt])
    stats = llm.engine.get_stats().kv_connector
    assert warm.outputs[0].token_ids == cold[0]
    assert stats.rejected_blocks == {"corrupt": 1}
    assert stats.hit_tokens["disk"] == 16  # the two blocks before it; the rest recomputed
    assert stats.failed_loads == 1
    llm.engine.shutdown()
    assert third.read_bytes() != bytes(data)  # deleted, and saved again once recomputed


def test_another_models_block_file_is_refused(model, tiny_checkpoint, tmp_path):
    """Engines of two models can share a folder; a block file of one copied where the other
    looks (same prompt, same hash) is refused by its header, not loaded."""
    other = tiny_checkpoint("llama", seed=1)
    prompt = _tokens(random.Random(3), 41)
    _seen(other, tmp_path, [prompt])
    own = _seen(model, tmp_path, [_tokens(random.Random(4), 9)])  # makes its own layout folder
    assert own
    files = {p.parent.name: p for p in tmp_path.glob(f"*/{_block_file_name(tmp_path, prompt)}")}
    (theirs,) = files.values()
    ours_folder = next(p for p in tmp_path.iterdir() if p.is_dir() and p.name not in files)
    (ours_folder / theirs.name).write_bytes(theirs.read_bytes())
    alone = _llm(model)
    expected = _generate(alone, [prompt])[0].outputs[0].token_ids
    llm = _llm(model, kv_offload_dir=tmp_path)
    (out,) = _generate(llm, [prompt])
    stats = llm.engine.get_stats().kv_connector
    assert out.outputs[0].token_ids == expected
    assert stats.rejected_blocks == {"mismatch": 1} and stats.hit_tokens["disk"] == 0


def _block_file_name(folder, prompt: list[int]) -> str:
    root = (folder / "hash_root").read_bytes()
    return extend_block_hashes([], prompt, BLOCK, root=root)[0].hex() + ".kv"


def test_a_killed_writers_temporary_file_is_removed_and_never_served(model, tmp_path):
    prompt = _tokens(random.Random(5), 41)
    cold = _seen(model, tmp_path, [prompt])
    first = _block_file(tmp_path, prompt, 0)
    torn = first.with_name(f".{first.stem}.999999999.tmp")  # a pid no process has
    torn.write_bytes(first.read_bytes()[:100])
    first.unlink()  # only the torn write is left of block 0
    llm = _llm(model, kv_offload_dir=tmp_path)
    (warm,) = _generate(llm, [prompt])
    assert not torn.exists()
    assert warm.outputs[0].token_ids == cold[0] and warm.num_cached_tokens == 0
    assert llm.engine.get_stats().kv_connector.rejected_blocks == {}


def test_abort_while_blocks_load_from_disk_leaks_no_block(model, tmp_path):
    prompt = _tokens(random.Random(6), 41)
    _seen(model, tmp_path, [prompt])
    llm = _llm(model, kv_offload_dir=tmp_path)
    engine = llm.engine
    engine.add_request("r", prompt, PARAMS)
    engine.step()  # admitted: its blocks held, the disk load started
    assert engine.kv_cache_manager.num_free_blocks < 24
    engine.abort_request("r")
    for _ in range(5):
        engine.step()
    assert engine.kv_cache_manager.num_free_blocks == 24
    assert not engine.has_unfinished_requests()
