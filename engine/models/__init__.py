"""Model forwards over the paged KV cache (one module per architecture family)."""

from engine.models.linear import Linear, can_prepack
from engine.models.llama import LlamaModel

__all__ = ["Linear", "LlamaModel", "can_prepack"]
