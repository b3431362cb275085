"""Per-request sampling parameters, validated when built."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError
from engine.structured import StructuredSpec

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
MAX_PENALTY = 2.0  # presence/frequency: OpenAI's [-2, 2]; repetition: (0, 2]
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit
MAX_LOGIT_BIAS = 100.0
MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit


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
    # OpenAI penalties, on the tokens generated so far: logit -= presence * (count > 0) + frequency * count.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # transformers/vLLM semantics, over prompt and output tokens: a seen token's logit is divided by it
    # when positive, multiplied when negative (1: off).
    repetition_penalty: float = 1.0
    min_p: float = 0.0  # drop tokens whose probability is below min_p x the top token's (after temperature)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    # Raw logprobs (log_softmax of the model's fp32 logits, before any of the above): per generated token
    # its own and the top `logprobs` alternatives; per prompt token (the first has none) with `prompt_logprobs`.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: StructuredSpec | None = None  # the output must match this grammar (engine.structured)

    def __post_init__(self) -> None:
        self._check_stops()
        self._check_features()
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

    def _check_features(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -MAX_PENALTY <= v <= MAX_PENALTY:
                raise InvalidRequestError(name, f"must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {v!r}")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= MAX_PENALTY:
            raise InvalidRequestError("repetition_penalty", f"must be a number in (0, {MAX_PENALTY:g}], "
                                                            f"got {self.repetition_penalty!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidRequestError("min_p", f"must be a number in [0, 1], got {self.min_p!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    _is_int(k) and k >= 0 and _is_number(v) and -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS
                    for k, v in self.logit_bias.items()):
                raise InvalidRequestError("logit_bias", f"must map token ids (integers >= 0) to numbers in "
                                                        f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
            if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
                raise InvalidRequestError("logit_bias", f"at most {MAX_LOGIT_BIAS_ENTRIES} entries, "
                                                        f"got {len(self.logit_bias)}")
            self.logit_bias = {k: float(v) for k, v in self.logit_bias.items()} or None
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise InvalidRequestError(name, f"must be an integer in [0, {MAX_LOGPROBS}] (or None), got {v!r}")
        if self.structured is not None and not isinstance(self.structured, StructuredSpec):
            raise InvalidRequestError("structured", "must be an engine.structured.StructuredSpec")

    @property
    def has_penalties(self) -> bool:
        """Whether this request's logits change with the tokens seen so far (penalties) or by a fixed bias."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or self.logit_bias is not None)

    @property
    def can_speculate(self) -> bool:
        """Speculative decoding applies only to requests whose rows need no per-position state: logprobs,
        grammars and penalties are computed one token at a time."""
        return (self.speculative and self.logprobs is None and self.prompt_logprobs is None
                and self.structured is None and not self.has_penalties)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    def check_token_ids(self, vocab_size: int) -> None:
        """Every id this request names must be a token of the model (`vocab_size` ids)."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise InvalidRequestError("stop_token_ids", f"ids must be in [0, {vocab_size}), got {bad[:4]}")
        bad = [t for t in (self.logit_bias or {}) if t >= vocab_size]
        if bad:
            raise InvalidRequestError("logit_bias", f"token ids must be in [0, {vocab_size}), got {bad[:4]}")


MAX_CACHE_SALT_CHARS = 1024


def check_cache_salt(cache_salt: str | None) -> None:
    """A request's `cache_salt` (kept beside its sampling parameters: both are checked at the door and
    again by the engine that runs it)."""
    if cache_salt is not None and (not isinstance(cache_salt, str) or not 0 < len(cache_salt) <= MAX_CACHE_SALT_CHARS):
        raise InvalidRequestError("cache_salt", f"must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters")


def check_tenant(tenant: str | None, weight: float) -> None:
    """A request's tenant (its API key's name) and that tenant's weight in the fair queueing."""
    if tenant is not None and (not isinstance(tenant, str) or not 0 < len(tenant) <= MAX_CACHE_SALT_CHARS):
        raise InvalidRequestError("tenant", f"must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight < float("inf"):
        raise InvalidRequestError("tenant_weight", f"must be a positive finite number, got {weight!r}")
