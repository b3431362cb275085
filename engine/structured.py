"""Structured outputs: a request's output constrained to a grammar (JSON, a JSON schema, a regex, a choice
list or an EBNF grammar), with xgrammar.

    add_request:  StructuredSpec --GrammarCache.submit--> a GrammarJob (compiled on a worker thread)
    each step:    a finished job --> CompiledGrammar (cached, LRU bounded in bytes) --> GrammarState (a matcher)
                  a job over its time budget or that failed ends its request alone (an InvalidRequestError
                  naming the field); an aborted request drops its interest (a job nobody waits for is
                  cancelled if it has not started)
    each step:    GrammarState.fill_mask -> the row's logits masked (sampler) -> the token drawn
                  -> GrammarState.accept(token); once the grammar is terminated the request stops ("stop")

xgrammar is imported on first use: it takes seconds to import, and most engines never see a grammar.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
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
logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SchemaLimits:
    """What a JSON schema (and a choice list) may ask for before anything compiles it: compiling grows
    with the nesting depth (cubic in xgrammar's parser) and with every string's length bounds (each
    becomes a bounded repetition), so a small body can otherwise cost minutes of CPU."""

    max_depth: int = 32  # nested objects/arrays/combinators, counted in schema nodes
    max_properties: int = 512  # `properties` entries over the whole schema
    max_length_bound: int = 2048  # minLength/maxLength/minItems/maxItems/minProperties/maxProperties
    max_choices: int = 1024  # guided_choice options

    def __post_init__(self) -> None:
        for name in ("max_depth", "max_properties", "max_length_bound", "max_choices"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


_BOUNDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")


def check_schema_limits(schema: Any, field: str, limits: SchemaLimits) -> None:
    """InvalidRequestError naming `field` if `schema` (parsed JSON) goes past `limits`. Iterative: a
    schema of any depth is refused without recursion."""
    stack: list[tuple[Any, int]] = [(schema, 1)]
    num_properties = 0
    while stack:
        node, depth = stack.pop()
        if isinstance(node, list):
            stack.extend((item, depth) for item in node)
            continue
        if not isinstance(node, dict):
            continue
        if depth > limits.max_depth:
            raise InvalidRequestError(field, f"the schema nests deeper than {limits.max_depth} levels")
        props = node.get("properties")
        if isinstance(props, dict):
            num_properties += len(props)
            if num_properties > limits.max_properties:
                raise InvalidRequestError(field, f"the schema has more than {limits.max_properties} properties")
        for key in _BOUNDS:
            bound = node.get(key)
            if isinstance(bound, (int, float)) and not isinstance(bound, bool) and bound > limits.max_length_bound:
                raise InvalidRequestError(field, f"{key} {bound:g} is over this server's limit of "
                                                 f"{limits.max_length_bound}")
        for key, value in node.items():
            if isinstance(value, (dict, list)):
                # a child schema is one level deeper; a map of them (properties, $defs) is not a level itself
                named_map = key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
                if named_map and isinstance(value, dict):
                    stack.extend((v, depth + 1) for v in value.values())
                else:
                    stack.append((value, depth + 1))


def check_choice_limits(num_choices: int, field: str, limits: SchemaLimits) -> None:
    if num_choices > limits.max_choices:
        raise InvalidRequestError(field, f"{num_choices} choices; this server takes at most {limits.max_choices}")


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


# xgrammar's messages start with its source location ("[12:00:00] .../grammar_functor.cc:2340: Check failed:
# (...) is false: "); that stays in the server's log, the client gets the rest.
_XGRAMMAR_PREFIX = re.compile(r"^(\[[^\]]*\]\s*)?\S+\.(cc|h|cpp):\d+:\s*(Check failed: \(.*?\) is false:?\s*)?")
MAX_ERROR_CHARS = 300


def compile_error_text(exc: BaseException) -> str:
    """What a client may read of a compiler error: the last line, without xgrammar's source location."""
    text = str(exc).strip().splitlines()[-1].strip() if str(exc).strip() else ""
    if isinstance(exc, RecursionError):
        return "nests too deeply"
    text = _XGRAMMAR_PREFIX.sub("", text).strip()
    if not text or re.search(r"\.(cc|h|cpp):\d+", text):
        return "is not supported by the grammar compiler"
    return text[:MAX_ERROR_CHARS]


class GrammarJob:
    """One spec's compile on the pool: `future` gets the CompiledGrammar (or an InvalidRequestError);
    `waiters` counts the requests waiting for it (the job is cancelled when the last one leaves before
    it started). `from_cache`: done at once (a cached grammar or a remembered failure); `started_at` /
    `finished_at`: the compile on its thread (`time.monotonic()`), for the requests' grammar waits."""

    __slots__ = ("spec", "future", "waiters", "submitted_at", "started_at", "finished_at", "from_cache")

    def __init__(self, spec: StructuredSpec):
        self.spec, self.future, self.waiters = spec, Future(), 0
        self.submitted_at, self.started_at, self.finished_at = time.monotonic(), None, None
        self.from_cache = False


class GrammarCache:
    """Compiles specs for one tokenizer on a small pool of worker threads and keeps recent compiled
    grammars (LRU, bounded by their size in bytes). xgrammar releases the GIL while it compiles, so the
    thread that steps the engine keeps running meanwhile (docs/guides/structured-outputs.md).

    `submit(spec)` returns at once; `compile(spec)` waits (the offline API, tests). A spec that failed to
    compile, or ran past `timeout_s`, is remembered by its hash and refused at once the next time."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], max_bytes: int = 256 << 20,
                 max_threads: int = 1, workers: int = 2, timeout_s: float = 30.0,
                 limits: SchemaLimits | None = None):
        self._tokenizer, self._vocab_size, self._stop_ids = tokenizer, vocab_size, sorted(stop_token_ids)
        self._max_bytes, self._max_threads, self.timeout_s = max_bytes, max_threads, timeout_s
        self.limits = limits or SchemaLimits()
        self._info = None
        self._local = threading.local()  # one GrammarCompiler per worker thread
        self._cache: OrderedDict[StructuredSpec, tuple[Any, int]] = OrderedDict()
        self._failed: OrderedDict[bytes, str] = OrderedDict()  # spec hash -> why (bounded in count)
        self._jobs: dict[StructuredSpec, GrammarJob] = {}
        self._lock = threading.Lock()
        self._info_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grammar-compile")
        self.num_bytes = 0
        self.num_compiled = 0  # cache misses compiled, for tests and metrics
        self.num_running = 0  # compiles on a worker now (a timed-out one keeps its thread until it ends)

    # ---------------------------------------------------------------- the cache
    def cached(self, spec: StructuredSpec):
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit[0]
            return None

    def _store(self, spec: StructuredSpec, compiled: Any) -> None:
        size = _grammar_bytes(compiled, spec)
        with self._lock:
            if spec in self._cache or size > self._max_bytes:
                return
            self._cache[spec] = (compiled, size)
            self.num_bytes += size
            while self.num_bytes > self._max_bytes:
                _, (_, freed) = self._cache.popitem(last=False)
                self.num_bytes -= freed

    def _remember_failure(self, spec: StructuredSpec, why: str) -> None:
        with self._lock:
            self._failed[_spec_key(spec)] = why
            while len(self._failed) > 1024:
                self._failed.popitem(last=False)

    # ---------------------------------------------------------------- compiling
    def submit(self, spec: StructuredSpec) -> GrammarJob:
        """A job for `spec` (one per spec at a time: requests with the same spec share it), counted as
        one more waiter. Done at once on a cache hit or a remembered failure. Call `release` when the
        waiting request leaves."""
        with self._lock:
            job = self._jobs.get(spec)
            if job is None:
                job = GrammarJob(spec)
                hit = self._cache.get(spec)
                why = self._failed.get(_spec_key(spec))
                if hit is not None:
                    self._cache.move_to_end(spec)
                    job.from_cache = True
                    job.future.set_result(hit[0])
                elif why is not None:
                    job.from_cache = True
                    job.future.set_exception(InvalidRequestError(spec.field, why))
                else:
                    self._jobs[spec] = job
                    self._pool.submit(self._run, job)
            job.waiters += 1
            return job

    def release(self, job: GrammarJob) -> None:
        """One waiter of `job` left (its request was aborted or gave up); the last one cancels a job
        that has not started. A started compile cannot be interrupted: its thread finishes and the
        result is cached (or dropped, past the time budget) with nobody waiting."""
        with self._lock:
            job.waiters -= 1
            if job.waiters <= 0 and job.started_at is None and not job.future.done():
                job.future.cancel()
                self._jobs.pop(job.spec, None)

    def _run(self, job: GrammarJob) -> None:
        with self._lock:
            if job.future.cancelled():
                return
            job.started_at = time.monotonic()
            self.num_running += 1
        try:
            compiled = self._compile(job.spec)
        except InvalidRequestError as exc:
            self._remember_failure(job.spec, exc.message)
            self._finish(job, exc=exc)
        except BaseException as exc:  # noqa: BLE001 - whatever xgrammar raises ends this spec's requests alone
            logger.warning("grammar compile of a %s failed: %r", job.spec.kind, exc)
            self._finish(job, exc=InvalidRequestError(job.spec.field, f"does not compile: {compile_error_text(exc)}"))
        else:
            took = time.monotonic() - job.started_at
            if took > self.timeout_s:  # its requests were refused meanwhile; so is the next one
                self._remember_failure(job.spec, self.too_slow_message)
            else:
                self._store(job.spec, compiled)
            self.num_compiled += 1
            self._finish(job, result=compiled)

    def _finish(self, job: GrammarJob, result: Any = None, exc: BaseException | None = None) -> None:
        with self._lock:
            self.num_running -= 1
            self._jobs.pop(job.spec, None)
            job.finished_at = time.monotonic()
        if exc is not None:
            job.future.set_exception(exc)
        else:
            job.future.set_result(result)

    @property
    def too_slow_message(self) -> str:
        return (f"the grammar took longer than this server's {self.timeout_s:g} s budget to compile; "
                "simplify it (fewer or shorter bounded strings, less nesting)")

    def compile(self, spec: StructuredSpec):
        """The compiled grammar of `spec`, waiting for it up to the time budget; InvalidRequestError
        naming the spec's field if it does not compile in time."""
        job = self.submit(spec)
        try:
            return job.future.result(timeout=self.timeout_s)
        except TimeoutError:
            raise InvalidRequestError(spec.field, self.too_slow_message) from None
        finally:
            self.release(job)

    def _get_compiler(self):
        compiler = getattr(self._local, "compiler", None)
        if compiler is None:
            import xgrammar as xgr

            with self._info_lock:  # NOTE: not `_lock`: building it takes a while, and submit() must not wait
                if self._info is None:
                    # The model's vocab_size, not the tokenizer's: the logits rows are that wide, and ids
                    # the tokenizer lacks (padding rows of the embedding) are never allowed.
                    self._info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self._vocab_size,
                                                                    stop_token_ids=self._stop_ids)
            compiler = xgr.GrammarCompiler(self._info, max_threads=self._max_threads, cache_enabled=False)
            self._local.compiler = compiler
        return compiler

    def _compile(self, spec: StructuredSpec):
        compiler = self._get_compiler()
        try:
            if spec.kind == "json_object":  # any object or array, whitespace bounded as below
                return compiler.compile_json_schema(_ANY_OBJECT_OR_ARRAY, strict_mode=False,
                                                    max_whitespace_cnt=MAX_JSON_WHITESPACE)
            if spec.kind == "json_schema":
                try:
                    schema = json.loads(spec.value)
                except (ValueError, RecursionError):
                    raise InvalidRequestError(spec.field, "the schema is not valid JSON (or nests too deeply)") from None
                check_schema_limits(schema, spec.field, self.limits)
                schema = _string_lengths_as_patterns(schema)
                return compiler.compile_json_schema(json.dumps(schema), max_whitespace_cnt=MAX_JSON_WHITESPACE)
            if spec.kind == "regex":
                return compiler.compile_regex(spec.value)
            if spec.kind == "choice":
                grammar = _choice_grammar(spec.value)
                check_choice_limits(grammar.count(" | ") + 1, spec.field, self.limits)
                return compiler.compile_grammar(grammar)
            return compiler.compile_grammar(spec.value)
        except InvalidRequestError:
            raise
        except (RuntimeError, ValueError, TypeError, RecursionError) as exc:  # xgrammar: RuntimeError
            logger.info("grammar (%s) does not compile: %s", spec.kind, str(exc)[:500])
            raise InvalidRequestError(spec.field, f"does not compile: {compile_error_text(exc)}") from None

    def new_state(self, spec: StructuredSpec, output_token_ids: list[int] = ()) -> "GrammarState":
        """A fresh matcher for one request (compiling `spec` if need be: this waits), advanced over
        `output_token_ids` (tokens already sampled elsewhere: a prefill worker's first token, a migrated
        sequence)."""
        return self.state_from(self.compile(spec), spec, output_token_ids)

    @staticmethod
    def state_from(compiled: Any, spec: StructuredSpec, output_token_ids: list[int] = (),
                   min_tokens: int = 0) -> "GrammarState":
        """A matcher over `compiled` advanced over `output_token_ids`; InvalidRequestError naming
        `output_token_ids` if the grammar does not allow them."""
        state = GrammarState(compiled)
        for i, tok in enumerate(output_token_ids):
            if not state.accept(tok):
                raise InvalidRequestError("output_token_ids", f"token {tok} at position {i} does not match "
                                                              f"the request's {spec.field}")
        state.bans_stops = min_tokens > 0
        return state

    def state_for(self, params: Any, output_token_ids: list[int] = ()) -> "GrammarState | None":
        """`new_state` for a request with these SamplingParams (waits for the compile); None when it has no
        `structured` spec."""
        if params.structured is None:
            return None
        return self.state_from(self.compile(params.structured), params.structured, output_token_ids,
                               params.min_tokens)

    def close(self) -> None:
        """Stop taking compiles; queued ones are cancelled (a running one ends on its own)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _spec_key(spec: StructuredSpec) -> bytes:
    return hashlib.sha256(f"{spec.kind}\0{spec.value}".encode("utf-8", "surrogatepass")).digest()


def _grammar_bytes(compiled: Any, spec: StructuredSpec) -> int:
    """What a compiled grammar holds in memory (xgrammar's own count where it has one)."""
    size = getattr(compiled, "memory_size_bytes", None)
    return int(size) if isinstance(size, int) and size > 0 else 64 * 1024 + 4 * len(spec.value)


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
