"""pdserve's engine: one process, one device, no Ray."""

from engine.block_manager import BlockManager, OutOfBlocksError
from engine.config import EngineConfig
from engine.errors import EngineConfigError, InvalidRequestError, PromptTooLongError
from engine.llm_engine import LLMEngine, StepStats
from engine.offline import LLM
from engine.request import RequestOutput, RequestStatus
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "RequestStatus", "StepStats",
    "BlockManager", "OutOfBlocksError", "InvalidRequestError", "PromptTooLongError", "EngineConfigError",
]
