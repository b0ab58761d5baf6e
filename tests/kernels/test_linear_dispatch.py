"""On CPU, the dense linear layers' GEMM goes to the numba decode kernel for fp32 batches of up
to MAX_ROWS rows and to MKL (``F.linear``) otherwise, or always when the references are forced;
the model's projections and its lm_head both go through it."""

import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu import dense_linear as dense
from pagedserve.kernels.linear import linear


def _count_numba_calls(monkeypatch) -> list:
    calls, inner = [], dense.dense_linear_numba
    monkeypatch.setattr(
        dense, "dense_linear_numba", lambda *a: calls.append(a[0].shape) or inner(*a)
    )
    return calls


def test_decode_rows_take_numba_and_the_rest_mkl(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("PAGEDSERVE_KERNELS", raising=False)
    calls = _count_numba_calls(monkeypatch)
    w, b = torch.randn(10, 32), torch.randn(10)
    for rows in (1, dense.MAX_ROWS, dense.MAX_ROWS + 1):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b))
    linear(torch.randn(2, 32).bfloat16(), w.bfloat16())  # 16-bit: MKL
    assert calls == [(1, 32), (dense.MAX_ROWS, 32)]
    monkeypatch.setenv("PAGEDSERVE_KERNELS", "ref")
    linear(torch.randn(1, 32), w)
    assert len(calls) == 2


def test_a_models_decode_step_runs_its_gemms_on_numba(monkeypatch, tiny_checkpoint):
    """Module by module (the CPU runner's fused layers turned off): every projection and the
    lm_head through ``linear``'s numba path. Fused (as shipped): the layers' GEMMs run inside
    the one numba call per layer (tests/engine/test_cpu_runner.py), the lm_head still here."""
    from pagedserve.engine import LLM, SamplingParams

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("PAGEDSERVE_KERNELS", raising=False)
    llm = LLM(model=tiny_checkpoint("llama"), num_gpu_blocks_override=64)
    layers = llm.engine.runner.model_config.num_layers
    greedy = SamplingParams(temperature=0, max_tokens=3)
    with monkeypatch.context() as unfused:
        unfused.setattr(llm.engine.runner, "fused_layers", None)
        calls = _count_numba_calls(unfused)
        llm.generate({"prompt_token_ids": [5, 6, 7]}, greedy)
    rows = [shape[0] for shape in calls]
    # the prefill: qkv, o, gate_up and down of every layer on 3 rows, the lm_head on the last;
    # each of the two decode steps: all of them on one row
    assert rows == [3] * 4 * layers + [1] + [1] * 2 * (4 * layers + 1)
    calls = _count_numba_calls(monkeypatch)
    llm.generate({"prompt_token_ids": [8, 9, 10]}, greedy)
    assert [shape[0] for shape in calls] == [1, 1, 1]  # the lm_head of each step
