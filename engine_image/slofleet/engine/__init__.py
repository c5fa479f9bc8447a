"""slofleet's engine: paged KV cache, continuous batching, sampling, and the offline API."""
from .config import EngineConfig
from .engine import LLMEngine, RequestOutput
from .errors import AdmissionError, InvalidRequest, UpstreamError
from .llm import LLM, CompletionOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams", "AdmissionError",
           "InvalidRequest", "UpstreamError"]
