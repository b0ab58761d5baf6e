"""pagedserve.engine: sampling parameters, the model runner, the sampler, LLMEngine, LLM, AsyncLLM.

Also everything a front end (the server, the CLI) needs from the layers below, so that it
imports this package alone: the errors a request can meet (``pagedserve.engine.errors``), the
chat template, the default model, and the block manager's chained prefix hash (the cluster's
prefix-aware routing hashes a prompt's first blocks the way the prefix cache does).
"""

from pagedserve.blockmgr import extend_block_hashes
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.client import EngineClient
from pagedserve.engine.config import EngineArgs
from pagedserve.engine.errors import (
    DistributedError,
    EngineDeadError,
    EngineError,
    InvalidRequestError,
    RequestRejectedError,
    SchedulerOverloadedError,
)
from pagedserve.engine.llm import LLM
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.lora import LoRARequest
from pagedserve.engine.metrics import EngineStats, FinishedRequestStats
from pagedserve.engine.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    RequestMetrics,
    RequestOutput,
)
from pagedserve.engine.pooling_params import PoolingParams
from pagedserve.engine.sampling_params import RequestOutputKind, SamplingParams
from pagedserve.models import apply_chat_template
from pagedserve.models.default_model import DEFAULT_MODEL_NAME, ensure_default_model

__all__ = [
    "DEFAULT_MODEL_NAME",
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "EngineClient",
    "EngineArgs",
    "EngineDeadError",
    "EngineError",
    "EngineStats",
    "FinishedRequestStats",
    "InvalidRequestError",
    "LLMEngine",
    "Logprob",
    "LoRARequest",
    "PoolingOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "RequestRejectedError",
    "SamplingParams",
    "SchedulerOverloadedError",
    "DistributedError",
    "apply_chat_template",
    "ensure_default_model",
    "extend_block_hashes",
]
