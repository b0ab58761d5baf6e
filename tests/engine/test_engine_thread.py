"""AsyncLLM does all of its engine's torch work on one thread: built, stepped and (on a CPU)
reading LoRA adapters there, never on the caller's thread.

Why it matters (``AsyncLLM.__init__``): each thread that runs a parallel torch op on a CPU gets an
OpenMP pool of its own, and with more OpenMP threads than cores libgomp stops spin-waiting, so a
decode step of a model loaded on one thread and stepped on another ran ~2x slower.
"""

from __future__ import annotations

import asyncio
import gc
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


def test_a_refusal_after_its_caller_gave_up_is_not_reported_as_never_retrieved(
    tiny_checkpoint, monkeypatch
):
    """A caller cancelled while the engine thread has its request queued (a /v1/embeddings
    body whose other input was refused first): the late refusal is consumed, not left for the
    garbage collector to log "Future exception was never retrieved" (whose traceback
    formatting, run from a finalizer, broke an unrelated ``ast.parse`` in CI)."""
    entered, release = threading.Event(), threading.Event()

    class GatedEngine(async_llm.LLMEngine):
        def add_request(self, *args, **kwargs):
            entered.set()
            release.wait(10)
            return super().add_request(*args, **kwargs)

    monkeypatch.setattr(async_llm, "LLMEngine", GatedEngine)
    reported: list[dict] = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: reported.append(ctx))
        llm = AsyncLLM(EngineArgs(model=tiny_checkpoint("llama"), max_model_len=16))
        try:

            async def consume():
                async for _ in llm.generate(list(range(3, 40)), GREEDY, "too-long"):
                    pass

            task = asyncio.create_task(consume())
            while not entered.is_set():
                await asyncio.sleep(0.01)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            release.set()
            for _ in range(50):  # the refusal reaches the loop by call_soon_threadsafe
                await asyncio.sleep(0.01)
            del task
            gc.collect()
        finally:
            release.set()
            await llm.shutdown()

    asyncio.run(main())
    assert not [ctx for ctx in reported if "never retrieved" in ctx.get("message", "")]
