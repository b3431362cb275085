"""Per-request sampling parameters, validated when built."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError

# Documented bounds (README, "Parameters and their bounds"). A request outside them is refused with
# an error naming the field; inside them, sampling cannot fail for numeric reasons.
MAX_TEMPERATURE = 100.0
# Below this a temperature is greedy: dividing logits by it would overflow fp32 (vLLM does the same).
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_TOP_K = 1 << 20
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # what torch.Generator.manual_seed takes
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 512
MAX_STOP_TOKEN_IDS = 64


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request. temperature == 0 (or below GREEDY_TEMPERATURE_EPS) means greedy.

    Every invalid value raises `InvalidRequestError` naming the field. Token ids are checked against
    the vocabulary where the vocabulary is known (`LLMEngine.add_request`).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    # False: never speculate for this request (the engine's `speculative_method` applies otherwise).
    # A seeded sampled request then draws exactly as without speculation.
    speculative: bool = True

    def __post_init__(self) -> None:
        self._check_stops()
        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            raise InvalidRequestError("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidRequestError("temperature", f"must be a number in [0, {MAX_TEMPERATURE:g}], got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError("top_p", f"must be a number in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_TOP_K:
            raise InvalidRequestError("top_k", f"must be -1 or 0 (off) or an integer up to {MAX_TOP_K}, got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise InvalidRequestError("seed", f"must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError("ignore_eos", f"must be a boolean, got {self.ignore_eos!r}")
        if not isinstance(self.speculative, bool):
            raise InvalidRequestError("speculative", f"must be a boolean, got {self.speculative!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise InvalidRequestError("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError("min_tokens", "must not exceed max_tokens")

    def _check_stops(self) -> None:
        if self.stop is None:
            self.stop = []
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise InvalidRequestError("stop", "must be a string or a list of strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(s == "" or len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise InvalidRequestError("stop", f"stop strings must be 1 to {MAX_STOP_STRING_CHARS} characters")
        self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if not isinstance(self.stop_token_ids, (list, tuple)) or \
                not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise InvalidRequestError("stop_token_ids", "must be a list of non-negative integers")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    def check_token_ids(self, vocab_size: int) -> None:
        """Every id this request names must be a token of the model (`vocab_size` ids)."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise InvalidRequestError("stop_token_ids", f"ids must be in [0, {vocab_size}), got {bad[:4]}")
