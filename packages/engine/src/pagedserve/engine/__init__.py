"""pagedserve.engine: sampling parameters, the model runner, the sampler, LLMEngine and LLM."""

from pagedserve.engine.config import EngineArgs
from pagedserve.engine.llm import LLM
from pagedserve.engine.llm_engine import EngineError, LLMEngine
from pagedserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedserve.engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "EngineError",
    "LLMEngine",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
]
