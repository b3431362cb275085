"""pdserve's engine: one process, one device, no Ray.

The engine proper (`LLMEngine`, `LLM`) loads torch when first named; the settings, request types and
errors do not, so the processes that only route or parse requests (the router, the HTTP door) start
without importing torch."""

from engine.config import EngineConfig
from engine.errors import EngineConfigError, InvalidRequestError, PromptTooLongError
from engine.sampling_params import SamplingParams

_LAZY = {"LLMEngine": "engine.llm_engine", "StepStats": "engine.llm_engine", "LLM": "engine.offline",
         "BlockManager": "engine.block_manager", "OutOfBlocksError": "engine.block_manager",
         "RequestOutput": "engine.request", "RequestStatus": "engine.request"}

__all__ = [
    "LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "RequestStatus", "StepStats",
    "BlockManager", "OutOfBlocksError", "InvalidRequestError", "PromptTooLongError", "EngineConfigError",
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
