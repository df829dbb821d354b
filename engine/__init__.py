"""prefixgate's inference engine: paged KV cache with automatic prefix caching."""
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig, HashAlgo, SchedulingPolicy
from engine.llm import LLM
from engine.outputs import CompletionOutput, FinishReason, RequestOutput
from engine.sampling import SamplingParams

__all__ = ["LLM", "AsyncEngine", "CompletionOutput", "EngineConfig", "FinishReason", "HashAlgo",
           "RequestOutput", "SamplingParams", "SchedulingPolicy"]
