"""EngineClient: everything the server may ask of the engine, and nothing more.

The OpenAI server talks to one online engine (``AsyncLLM``) through this Protocol, so that what
the server depends on is written down in one place: streams of outputs per request (a pooling
model's one output per request: ``encode``), abort,
LoRA adapters in and out, health, metrics, shutdown, the tokenizer for callers, and the two configs whose limits the server
checks requests against (``model_config.vocab_size``, ``scheduler_config.max_model_len``). A
test double, or another engine (a remote one, a data-parallel front), serves the same server by
satisfying it. ``runtime_checkable`` lets a test check the members' presence; their signatures
are the contract.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pagedserve.engine.metrics import EngineStats
from pagedserve.engine.outputs import PoolingRequestOutput, RequestOutput
from pagedserve.engine.pooling_params import PoolingParams
from pagedserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedserve.engine.lora import LoRARequest
    from pagedserve.models import ModelConfig
    from pagedserve.scheduler import SchedulerConfig


@runtime_checkable
class EngineClient(Protocol):
    """The online engine as the server sees it (``AsyncLLM`` satisfies it)."""

    tokenizer: Any  # a transformers tokenizer, safe to use from the server's thread
    model_config: ModelConfig
    scheduler_config: SchedulerConfig
    lora_enabled: bool  # whether LoRA adapters can be loaded (``enable_lora``)
    image_placeholder: str | None  # the text of one image in a prompt; None: no images
    max_image_tokens: int  # the most placeholder rows one image expands to (0: no images)
    args: Any  # the EngineArgs (image limits, the folder local images may come from)

    def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str,
        prompt: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        multi_modal_data: dict | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request (cumulative, deltas or the final one, as its
        ``output_kind`` asks); the last has ``finished=True``. A request the engine refuses
        raises from the first ``__anext__``; a caller that stops iterating aborts its request.
        ``lora_request``: the adapter it runs with (None: the base). ``multi_modal_data``:
        ``{"image": [PIL images]}``, one per placeholder in the prompt."""
        ...

    def encode(
        self,
        prompt_token_ids: list[int],
        pooling_params: PoolingParams,
        request_id: str,
        prompt: str | None = None,
        priority: int = 0,
        token_type_ids: list[int] | None = None,
    ) -> AsyncIterator[PoolingRequestOutput]:
        """A pooling model's one output for one prompt (an embedding, class probabilities, a
        score); ``token_type_ids``: a sentence pair's segments. Refusals raise from the first
        ``__anext__``, as ``generate``'s do."""
        ...

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Load a LoRA adapter while requests run; a bad one raises ``InvalidRequestError``."""
        ...

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter: new requests may not use it, its in-flight requests finish."""
        ...

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with a finished output (finish_reason "abort")."""
        ...

    async def check_health(self) -> None:
        """Raise ``EngineDeadError`` once the engine can no longer serve."""
        ...

    def get_stats(self, drain: bool = True) -> EngineStats:
        """Gauges, cumulative counters and finished-request latencies, for /metrics."""
        ...

    async def shutdown(self) -> None:
        """Stop the engine; requests still pending end with ``EngineDeadError``."""
        ...
