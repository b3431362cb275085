"""Structured outputs: a request's output constrained to a grammar (JSON, a JSON schema, a regex, a choice
list or an EBNF grammar), with xgrammar.

    add_request:  StructuredSpec --GrammarCache.compile (LRU)--> CompiledGrammar --> GrammarState (a matcher)
    each step:    GrammarState.fill_mask -> the row's logits masked (sampler) -> the token drawn
                  -> GrammarState.accept(token); once the grammar is terminated the request stops ("stop")

xgrammar is imported on first use: it takes seconds to import, and most engines never see a grammar.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
# The request field each kind comes from (OpenAI's response_format, vLLM's guided_* extensions).
_FIELDS = {"json_object": "response_format", "json_schema": "response_format", "regex": "guided_regex",
           "choice": "guided_choice", "grammar": "guided_grammar"}
MAX_SPEC_CHARS = 1 << 18
# NOTE: JSON whitespace is bounded per run: unbounded, a sampled request can spend all of max_tokens
# on spaces (any token made only of whitespace stays allowed), and a pretty-printed object needs far fewer.
MAX_JSON_WHITESPACE = 16
_ANY_OBJECT_OR_ARRAY = '{"type": ["object", "array"]}'


@dataclass(frozen=True, slots=True)
class StructuredSpec:
    """What a request's output must match. `value`: the schema as a JSON string (json_schema), the pattern
    (regex), a JSON list of strings (choice), EBNF in xgrammar's (GBNF) syntax (grammar), "" (json_object)."""

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidRequestError("structured", f"kind must be one of {', '.join(STRUCTURED_KINDS)}, "
                                                    f"got {self.kind!r}")
        if not isinstance(self.value, str) or len(self.value) > MAX_SPEC_CHARS:
            raise InvalidRequestError(self.field, f"must be a string of at most {MAX_SPEC_CHARS} characters")

    @property
    def field(self) -> str:
        """The request parameter an error in this spec names."""
        return _FIELDS[self.kind]


def _string_lengths_as_patterns(schema: Any) -> Any:
    """`schema` with each `{"type": "string", "minLength"/"maxLength"}` (no pattern) given as a pattern.

    NOTE: xgrammar 0.2.8 turns a string's length bounds into a character class that lets raw control
    characters through (it excludes only the quote, backslash, CR and LF): the output then is not JSON.
    A pattern of plain characters (no escapes, no control characters) bounded the same way is a subset
    of what the schema allows."""
    if isinstance(schema, list):
        return [_string_lengths_as_patterns(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _string_lengths_as_patterns(v) for k, v in schema.items()}
    lo, hi = out.get("minLength"), out.get("maxLength")
    if out.get("type") == "string" and (lo is not None or hi is not None) and "pattern" not in out \
            and all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in (lo or 0, hi or 0)):
        out.pop("minLength", None)
        out.pop("maxLength", None)
        out["pattern"] = f'^[^"\\\\\\x00-\\x1f]{{{lo or 0},{"" if hi is None else hi}}}$'
    return out


def _ebnf_literal(text: str) -> str:
    """`text` as an EBNF string literal (JSON's escapes are a subset of what xgrammar reads)."""
    return json.dumps(text, ensure_ascii=False)


def _choice_grammar(value: str) -> str:
    try:
        choices = json.loads(value)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError("guided_choice", f"must be a JSON list of strings: {exc}") from None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequestError("guided_choice", "must be a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


class GrammarCache:
    """Compiles specs for one tokenizer and keeps the last `max_entries` compiled grammars (LRU)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], max_entries: int = 64,
                 max_threads: int = 2):
        self._tokenizer, self._vocab_size, self._stop_ids = tokenizer, vocab_size, sorted(stop_token_ids)
        self._max_entries, self._max_threads = max_entries, max_threads
        self._compiler = None
        self._cache: OrderedDict[StructuredSpec, Any] = OrderedDict()
        self._lock = threading.Lock()  # a serving layer may compile from another thread than the step loop
        self.num_compiled = 0  # cache misses, for tests and metrics

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar as xgr

            # The model's vocab_size, not the tokenizer's: the logits rows are that wide, and ids the
            # tokenizer lacks (padding rows of the embedding) are never allowed.
            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                      stop_token_ids=self._stop_ids)
            self._compiler = xgr.GrammarCompiler(info, max_threads=self._max_threads, cache_enabled=False)
        return self._compiler

    def compile(self, spec: StructuredSpec):
        """The compiled grammar of `spec`; InvalidRequestError naming the spec's field if it does not compile."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
            compiled = self._compile(spec)
            self.num_compiled += 1
            self._cache[spec] = compiled
            if len(self._cache) > self._max_entries:
                self._cache.popitem(last=False)
            return compiled

    def _compile(self, spec: StructuredSpec):
        compiler = self._get_compiler()
        try:
            if spec.kind == "json_object":  # any object or array, whitespace bounded as below
                return compiler.compile_json_schema(_ANY_OBJECT_OR_ARRAY, strict_mode=False,
                                                    max_whitespace_cnt=MAX_JSON_WHITESPACE)
            if spec.kind == "json_schema":
                schema = _string_lengths_as_patterns(json.loads(spec.value))
                return compiler.compile_json_schema(json.dumps(schema), max_whitespace_cnt=MAX_JSON_WHITESPACE)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.value)
            if spec.kind == "choice":
                return compiler.compile_grammar(_choice_grammar(spec.value))
            return compiler.compile_grammar(spec.value)
        except InvalidRequestError:
            raise
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar reports parse errors as RuntimeError
            message = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            raise InvalidRequestError(spec.field, f"does not compile: {message[:300]}") from None

    def new_state(self, spec: StructuredSpec, output_token_ids: list[int] = ()) -> "GrammarState":
        """A fresh matcher for one request, advanced over `output_token_ids` (tokens already sampled
        elsewhere: a prefill worker's first token, a migrated sequence)."""
        state = GrammarState(self.compile(spec))
        for i, tok in enumerate(output_token_ids):
            if not state.accept(tok):
                raise InvalidRequestError("output_token_ids", f"token {tok} at position {i} does not match "
                                                              f"the request's {spec.field}")
        return state


    def state_for(self, params: Any, output_token_ids: list[int] = ()) -> "GrammarState | None":
        """`new_state` for a request with these SamplingParams; None when it has no `structured` spec."""
        if params.structured is None:
            return None
        state = self.new_state(params.structured, output_token_ids)
        state.bans_stops = params.min_tokens > 0
        return state


class GrammarState:
    """One request's position in its grammar."""

    __slots__ = ("matcher", "bans_stops")

    def __init__(self, compiled) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        # The request bans its stop tokens for a while (min_tokens): its mask can then leave no token.
        self.bans_stops = False

    def fill_mask(self, bitmask: "torch.Tensor", index: int) -> None:
        """Write the tokens allowed next into row `index` of `bitmask` (xgrammar's packed int32 layout)."""
        self.matcher.fill_next_token_bitmask(bitmask, index)

    def accept(self, token_id: int) -> bool:
        """Advance over `token_id`; False (state unchanged) if the grammar does not allow it."""
        return self.matcher.accept_token(token_id)

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: the request is done."""
        return self.matcher.is_terminated()


def apply_masks(logits: "torch.Tensor", rows: list[int], states: list[GrammarState]) -> list[int]:
    """Mask `logits[rows[i]]` to what `states[i]` allows, for each i; returns the positions i whose
    matcher failed (those rows are left as they were). Only constrained rows are filled and touched."""
    import xgrammar as xgr

    # NOTE: xgrammar's `indices` address the same row of the logits and of the bitmask, so the bitmask
    # has a row per logits row; only the constrained ones are filled (the rest stay all-allowed, unread).
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])
    failed, ok_rows, banning = [], [], []
    for i, (row, state) in enumerate(zip(rows, states)):
        try:
            state.fill_mask(bitmask, row)
        except (RuntimeError, ValueError):  # one request's matcher: its own failure
            failed.append(i)
            continue
        ok_rows.append(row)
        if state.bans_stops:
            banning.append((row, state))
    if ok_rows:
        bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, indices=ok_rows)
        if banning:
            _give_back_the_end(logits, bitmask, banning)
    return failed


def _give_back_the_end(logits: "torch.Tensor", bitmask: "torch.Tensor", rows: list[tuple[int, GrammarState]]) -> None:
    """A row left with no token at all, because its grammar allows only its end and min_tokens banned the
    stop tokens, gets the grammar's stop tokens back: the grammar decides where a constrained answer
    ends (min_tokens keeps it going only while the grammar allows more)."""
    import torch
    import xgrammar as xgr

    index = torch.tensor([row for row, _ in rows], device=logits.device)
    dead = (logits.index_select(0, index).amax(dim=-1) == float("-inf")).tolist()
    for (row, state), is_dead in zip(rows, dead):
        if is_dead and state.matcher.is_completed():
            logits[row, state.matcher.stop_token_ids] = 0.0
            xgr.apply_token_bitmask_inplace(logits, bitmask, indices=[row])  # only the stops it allows
