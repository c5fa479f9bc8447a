"""slofleet's engine: paged KV cache, continuous batching, sampling, and the offline API."""
from .config import EngineConfig
from .engine import LLMEngine, RequestOutput
from .llm import LLM, CompletionOutput
from .sampling_params import SamplingParams
from .scheduler import AdmissionError

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams", "AdmissionError"]
