"""What AsyncLLM's callers and its engine thread hand each other.

Callers never touch the engine: they queue commands (add a request, abort some, call a function
between steps) that the engine thread applies between steps, and each request's outputs come
back through a ``RequestStream``, from the engine thread into the caller's event loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedserve.engine.lora import LoRARequest
from pagedserve.engine.outputs import RequestOutput
from pagedserve.engine.pooling_params import PoolingParams
from pagedserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedserve.engine.llm_engine import LLMEngine


@dataclass
class AddCommand:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams
    prompt: str | None
    priority: int
    arrival_time: float
    done: concurrent.futures.Future
    lora_request: LoRARequest | None = None
    token_type_ids: list[int] | None = None
    multi_modal_data: dict | None = None
    images: tuple = ()  # the images of multi_modal_data, processed (multimodal.py)


@dataclass
class AbortCommand:
    request_ids: list[str]


@dataclass
class CallCommand:
    """Run ``fn(engine)`` on the engine thread between steps (LoRA adapters in and out)."""

    fn: Callable[[LLMEngine], Any]
    done: concurrent.futures.Future


SHUTDOWN = object()


class RequestStream:
    """One request's outputs, carried from the engine thread into its caller's event loop.

    ``aggregate``: the outputs are deltas (``RequestOutputKind.DELTA``), so outputs collapsed
    into one must be merged (``RequestOutput.add``), not replaced by the newest.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, aggregate: bool = False) -> None:
        self.loop = loop
        self.aggregate = aggregate
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Thread-safe: hand ``item`` to the consumer's loop (dropped if that loop is gone)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            pass  # the consumer's event loop is closed: nobody is listening any more

    async def get(self) -> RequestOutput | BaseException:
        """Everything queued, as one item: cumulative outputs waiting behind the newest are
        skipped, deltas are merged into one (a slow consumer gets fewer, larger outputs)."""
        item = await self.queue.get()
        while not self.queue.empty() and isinstance(item, RequestOutput) and not item.finished:
            newer = self.queue.get_nowait()
            if self.aggregate and isinstance(newer, RequestOutput):
                item.add(newer, aggregate=True)
            else:
                item = newer
        return item
