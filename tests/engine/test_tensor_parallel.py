"""Tensor parallelism over torch.distributed (gloo on CPU).

- The sharded layers, loaded rank by rank from a safetensors file through lazy slices, combine
  (concatenate column shards, sum row shards) to the unsharded layer's output.
- ``LLM(..., tensor_parallel_size=2)`` gives the single-process greedy tokens on the tiny
  models (MoE and DeepSeek's latent attention among them), including KV-head replication, a
  vocabulary that does not divide, chunked prefill and prefix caching; with 3 ranks it does on
  SmolLM2 (9 heads, 3 KV heads).
- A worker that dies or stops answering fails the engine with a clear error, never a hang; an
  idle engine keeps its workers alive past the collective timeout.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.errors import DistributedError
from pagedserve.models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.models.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedserve.models.weights import CheckpointTensor

PROMPTS = [list(range(5, 22)), [100, 200, 300], list(range(30, 70)), [7]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


# ---- layers, one process, every rank's shard in turn -----------------------------------------


@pytest.fixture
def checkpoint(tmp_path):
    """Write tensors to a safetensors file; yield a getter of lazy handles while it is open."""

    @contextmanager
    def open_with(tensors: dict[str, torch.Tensor]):
        path = tmp_path / "w.safetensors"
        save_file(tensors, path)
        with safe_open(str(path), framework="pt") as f:
            yield lambda name: CheckpointTensor.open(f.get_slice(name))

    return open_with


def test_checkpoint_tensor_reads_narrowed_transposed_chunks(checkpoint):
    full = torch.randn(6, 10)
    with checkpoint({"w": full}) as handle:
        h = handle("w")
        assert h.shape == (6, 10)
        torch.testing.assert_close(h.narrow(1, 2, 5).narrow(0, 1, 3).read(), full[1:4, 2:7])
        q, k, v = h.t().chunk(3, dim=0)  # GPT-2's fused c_attn: [in, 3*out] -> q, k, v
        torch.testing.assert_close(k.narrow(0, 1, 2).read(), full.t()[5:7])
        torch.testing.assert_close(v.to(torch.float64).read(), full.t()[8:10].double())
        with pytest.raises(ValueError, match="cannot take"):
            h.narrow(0, 4, 3)


@pytest.mark.parametrize("tp_size, num_kv_heads", [(2, 2), (4, 2), (3, 1)])
def test_qkv_shards_hold_their_heads_and_replicate_kv(checkpoint, tp_size, num_kv_heads):
    hidden, head_dim, num_heads = 16, 4, 12 if tp_size == 3 else 8
    q_w = torch.randn(num_heads * head_dim, hidden)
    k_w, v_w = (torch.randn(num_kv_heads * head_dim, hidden) for _ in range(2))
    x = torch.randn(5, hidden)
    group = num_heads // num_kv_heads
    with checkpoint({"q": q_w, "k": k_w, "v": v_w}) as handle:
        for rank in range(tp_size):
            layer = QKVParallelLinear(
                hidden, head_dim, num_heads, num_kv_heads, False, rank, tp_size
            )
            for part in "qkv":
                layer.weight.weight_loader(layer.weight, handle(part), part)
            q, k, v = layer(x).split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
            heads = range(rank * layer.num_heads, (rank + 1) * layer.num_heads)
            kv_heads = sorted({h // group for h in heads})  # the KV heads these queries read
            assert layer.num_kv_heads == len(kv_heads)
            rows = [r for h in heads for r in range(h * head_dim, (h + 1) * head_dim)]
            kv_rows = [r for h in kv_heads for r in range(h * head_dim, (h + 1) * head_dim)]
            torch.testing.assert_close(q, x @ q_w[rows].T)
            torch.testing.assert_close(k, x @ k_w[kv_rows].T)
            torch.testing.assert_close(v, x @ v_w[kv_rows].T)


def test_column_then_row_shards_sum_to_the_unsharded_mlp(checkpoint):
    hidden, inter, tp_size = 12, 18, 3
    gate, up, down = (
        torch.randn(inter, hidden),
        torch.randn(inter, hidden),
        torch.randn(hidden, inter),
    )
    bias = torch.randn(hidden)
    x = torch.randn(4, hidden)
    with checkpoint({"gate": gate, "up": up, "down": down, "bias": bias}) as handle:
        partials = []
        for rank in range(tp_size):
            gate_up = MergedColumnParallelLinear(
                hidden, [inter, inter], tp_rank=rank, tp_size=tp_size
            )
            gate_up.weight.weight_loader(gate_up.weight, handle("gate"), 0)
            gate_up.weight.weight_loader(gate_up.weight, handle("up"), 1)
            row = RowParallelLinear(inter, hidden, bias=True, tp_rank=rank, tp_size=tp_size)
            row.weight.weight_loader(row.weight, handle("down"))
            row.bias.weight_loader(row.bias, handle("bias"))
            g, u = gate_up(x).chunk(2, dim=-1)
            partials.append(F.linear(F.silu(g) * u, row.weight))
            torch.testing.assert_close(row.bias.data, bias)  # whole on every rank
    ref = F.linear(F.silu(x @ gate.T) * (x @ up.T), down, bias)
    torch.testing.assert_close(sum(partials) + bias, ref)


def test_vocab_that_does_not_divide_is_padded_and_cut(checkpoint):
    vocab, hidden, tp_size = 10, 6, 4  # 3 rows per rank; rank 3 holds one real row, 2 padding
    weight = torch.randn(vocab, hidden)
    tokens = torch.tensor([0, 3, 9, 5, 9])
    hidden_states = torch.randn(2, hidden)
    embedded, logit_slices = torch.zeros(len(tokens), hidden), []
    with checkpoint({"w": weight}) as handle:
        for rank in range(tp_size):
            embed = VocabParallelEmbedding(vocab, hidden, tp_rank=rank, tp_size=tp_size)
            embed.weight.weight_loader(embed.weight, handle("w"))
            embedded += embed(tokens)  # the all-reduce, by hand
            head = ParallelLMHead(vocab, hidden, tp_rank=rank, tp_size=tp_size)
            head.weight.weight_loader(head.weight, handle("w"))
            logit_slices.append(F.linear(hidden_states, head.weight))
    torch.testing.assert_close(embedded, weight[tokens])
    gathered = torch.cat(logit_slices, dim=-1)
    assert gathered.shape[-1] == 12
    torch.testing.assert_close(gathered[:, :vocab], hidden_states @ weight.T)
    assert not gathered[:, vocab:].any()


def test_unshardable_model_is_refused_before_any_process_starts(tiny_checkpoint):
    path = tiny_checkpoint("llama")  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="4 attention heads cannot be split over 3"):
        LLM(model=path, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        LLM(model=path, tensor_parallel_size=0)


# ---- the engine over real ranks ------------------------------------------------------------


@contextmanager
def tp_llm(path: str, tp_size: int, **kwargs):
    llm = LLM(model=path, tensor_parallel_size=tp_size, **kwargs)
    try:
        yield llm
    finally:
        llm.engine.runner.shutdown()


def _greedy(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    prompts = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in prompts]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


TINY_CASES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),  # qkv bias, tied embeddings
    "qwen3": ("qwen3", {}),  # per-head q/k norm, head_dim != hidden / heads
    "gpt2": ("gpt2", {}),  # fused c_attn, Conv1D weights, row-parallel biases
    "mixtral": ("mixtral", {}),  # every expert's intermediate features split over the ranks
    "qwen2_moe": ("qwen2_moe", {}),  # the gated shared expert's partial sums join the experts'
    # MLA: heads split, the latent cache whole on each rank; shared experts; V2's and V3's routers
    "deepseek_v2": ("deepseek_v2", {}),
    "deepseek_v3": ("deepseek_v3", {}),
    # sinks split with their heads; the experts' gate/up bias split, the down bias on rank 0
    "gpt_oss": ("gpt_oss", {}),
    # one KV head replicated on both ranks; 509 tokens: the second rank's slice is padded
    "llama-1kv-odd-vocab": ("llama", {"num_key_value_heads": 1, "vocab_size": 509}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(TINY_CASES))
def test_two_ranks_equal_one_process_on_tiny_models(tiny_checkpoint, one_thread, case):
    arch, overrides = TINY_CASES[case]
    path = tiny_checkpoint(arch, **overrides)
    # a small token budget: prefills go in chunks, some steps sample nothing
    engine_args = dict(block_size=8, max_num_batched_tokens=24, kv_cache_memory=8 << 20)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    prompts.append({"prompt_token_ids": PROMPTS[2] + [9, 9]})  # a prefix-cache hit on PROMPTS[2]
    expected = _greedy(LLM(model=path, **engine_args), prompts)
    with tp_llm(path, 2, **engine_args) as llm:
        assert _greedy(llm, prompts) == expected
        workers = list(llm.engine.runner.workers.procs.values())
        driver = llm.engine.runner.driver
        heads = driver.kv_caches[0][0].shape[2]
        if arch.startswith("deepseek"):  # one latent a layer, no values; half the heads a rank
            assert heads == 1 and len(driver.kv_caches[0]) == 1
            assert driver.model.model.layers[0].self_attn.num_heads == 2
        else:
            assert heads == max(1, llm.engine.model_config.num_kv_heads // 2)
    assert [p.returncode for p in workers] == [0]  # a clean stop, not a kill


@pytest.mark.slow
def test_three_ranks_equal_one_process_on_smollm2(default_model_path, one_thread):
    prompts = [
        "The capital of France is",
        "Once upon a time, in a small village by the sea, there lived an old fisherman who",
        "def fibonacci(n):",
        "List three colours:",
        "The theory of relativity changed how physicists think about space and time because",
        "Q: What is 12 times 12?\nA:",
        "Paged attention is",
        "In Python, a list comprehension",
    ]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = dict(kv_cache_memory=64 << 20)
    expected = _greedy(LLM(model=default_model_path, **kw), prompts, params)
    with tp_llm(default_model_path, 3, **kw) as llm:
        runner = llm.engine.runner
        assert runner.driver.kv_caches[0][0].shape[2] == 1  # 3 KV heads: one per rank
        assert runner.driver.model.model.layers[0].self_attn.num_heads == 3
        assert runner.driver.model.lm_head.weight.shape[0] == 49152 // 3
        assert _greedy(llm, prompts, params) == expected


@pytest.mark.slow
def test_dead_worker_fails_the_step_at_once(tiny_checkpoint, one_thread):
    path = tiny_checkpoint("llama")
    with tp_llm(path, 2, block_size=8) as llm:
        _greedy(llm, PROMPTS[:1])
        worker = llm.engine.runner.workers.procs[1]
        worker.kill()
        worker.wait()
        with pytest.raises(DistributedError, match="rank 1 exited with code -9"):
            _greedy(llm, PROMPTS[:1])
        with pytest.raises(DistributedError, match="rank 1 exited"):  # stays failed
            _greedy(llm, PROMPTS[:1])


@pytest.mark.slow
def test_idle_engine_outlives_the_timeout_and_a_stuck_worker_times_out(
    tiny_checkpoint, one_thread, monkeypatch
):
    # 4 s: short enough to keep the test quick, long enough that a busy 2-core machine still
    # answers a healthy step within it.
    monkeypatch.setenv("PAGEDSERVE_TP_TIMEOUT_S", "4")
    path = tiny_checkpoint("llama")
    with tp_llm(path, 2, block_size=8) as llm:
        expected = _greedy(llm, PROMPTS[:2])
        time.sleep(10)  # idle for 2.5 timeouts: keep-alive messages hold the workers
        assert _greedy(llm, PROMPTS[:2]) == expected
        worker = llm.engine.runner.workers.procs[1]
        os.kill(worker.pid, signal.SIGSTOP)  # alive but silent
        try:
            with pytest.raises(DistributedError, match="no worker has exited.*= 4 s"):
                _greedy(llm, PROMPTS[:1])
        finally:
            if worker.poll() is None:
                worker.kill()
        assert worker.wait() == -signal.SIGKILL  # the failed engine killed it


@pytest.mark.slow
def test_worker_that_crashes_while_starting_is_reported_at_once(
    tiny_checkpoint, one_thread, monkeypatch, tmp_path
):
    """The worker's interpreter exits with code 3 before it reaches the rendezvous (a
    sitecustomize that only rank 1 runs); rank 0 must say so instead of waiting it out."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os\nif os.environ.get('RANK') == '1':\n    os._exit(3)\n"
    )
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("PAGEDSERVE_TP_STARTUP_TIMEOUT_S", "600")
    path = tiny_checkpoint("llama")
    start = time.monotonic()
    with pytest.raises(DistributedError, match="while starting.*rank 1 exited with code 3"):
        LLM(model=path, tensor_parallel_size=2)
    assert time.monotonic() - start < 120  # far from the 600 s start-up timeout


@pytest.mark.slow
def test_bad_checkpoint_is_a_model_load_error_and_leaves_no_worker(
    tiny_checkpoint, one_thread, tmp_path
):
    from safetensors.torch import load_file

    from pagedserve.models import ModelLoadError

    src = tiny_checkpoint("llama")
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors")
    before = set(_worker_pids())
    with pytest.raises(ModelLoadError, match="up_proj"):
        LLM(model=str(broken), tensor_parallel_size=2)
    assert set(_worker_pids()) <= before


def _worker_pids() -> list[int]:
    """Live pagedserve worker processes started by this process."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
            cmdline = (proc / "cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if (
            int(fields[1]) == os.getpid()
            and fields[0] != "Z"
            and b"pagedserve.engine.distributed.worker" in cmdline
        ):
            pids.append(int(proc.name))
    return pids
