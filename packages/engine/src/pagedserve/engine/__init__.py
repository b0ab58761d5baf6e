"""pagedserve.engine: sampling parameters, the model runner, the sampler, LLMEngine, LLM, AsyncLLM."""

from pagedserve.engine.async_llm import AsyncLLM, EngineDeadError
from pagedserve.engine.client import EngineClient
from pagedserve.engine.config import EngineArgs
from pagedserve.engine.llm import LLM
from pagedserve.engine.llm_engine import EngineError, LLMEngine
from pagedserve.engine.metrics import EngineStats, FinishedRequestStats
from pagedserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedserve.engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "EngineClient",
    "EngineArgs",
    "EngineDeadError",
    "EngineError",
    "EngineStats",
    "FinishedRequestStats",
    "LLMEngine",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
]
