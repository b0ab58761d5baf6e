"""AsyncLLM does all of its engine's torch work on one thread: built, stepped and (on a CPU)
reading LoRA adapters there, never on the caller's thread.

Why it matters (``AsyncLLM.__init__``): each thread that runs a parallel torch op on a CPU gets an
OpenMP pool of its own, and with more OpenMP threads than cores libgomp stops spin-waiting, so a
decode step of a model loaded on one thread and stepped on another ran ~2x slower.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from pagedserve.engine import AsyncLLM, EngineArgs, LoRARequest, SamplingParams, async_llm
from pagedserve.engine.lora.manager import LoRAManager
from pagedserve.models.testing import make_peft_adapter

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture
def thread_log(monkeypatch) -> dict[str, set[int]]:
    """Which threads built the engine, stepped it and read adapters."""
    log: dict[str, set[int]] = {"built": set(), "stepped": set(), "read": set()}

    class RecordingEngine(async_llm.LLMEngine):
        def __init__(self, args):
            log["built"].add(threading.get_ident())
            super().__init__(args)

        def step(self):
            log["stepped"].add(threading.get_ident())
            return super().step()

    real_read = LoRAManager.read

    def recording_read(self, lora_request):
        log["read"].add(threading.get_ident())
        return real_read(self, lora_request)

    monkeypatch.setattr(async_llm, "LLMEngine", RecordingEngine)
    monkeypatch.setattr(LoRAManager, "read", recording_read)
    return log


def test_the_engine_is_built_stepped_and_reads_adapters_on_its_own_thread(
    tiny_checkpoint, tmp_path, thread_log
):
    path = tiny_checkpoint("llama")
    adapter = make_peft_adapter(path, tmp_path / "a", ["q_proj"], 8, seed=1)
    args = EngineArgs(model=path, block_size=8, enable_lora=True, max_lora_rank=8)

    async def main():
        llm = AsyncLLM(args)
        try:
            await llm.add_lora(LoRARequest("a", 1, str(adapter)))
            async for _ in llm.generate([3, 4, 5], GREEDY, "r0"):
                pass
            return llm.engine_thread.ident
        finally:
            await llm.shutdown()

    engine_thread = asyncio.run(main())
    assert thread_log["built"] == {engine_thread}
    assert thread_log["stepped"] == {engine_thread}
    assert thread_log["read"] == {engine_thread}  # a CPU engine: its torch stays on one thread
    assert engine_thread != threading.get_ident()


def test_a_construction_error_raises_in_the_caller(tiny_checkpoint):
    with pytest.raises(ValueError, match="num_cpu_threads"):
        AsyncLLM(EngineArgs(model=tiny_checkpoint("llama"), num_cpu_threads=0))
